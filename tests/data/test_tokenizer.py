import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import tokenizers

from titan_jax.cli import main
from titan_jax.data.chat import load_special_tokens
from titan_jax.data.tokenizer import TokenizerError, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "titan_jax/data/assets/tokenizer.json"
TEXTS = [
    "",
    "Hello, world!",
    "def f(x):\n    return x ** 2  # squared\n\n\ttabs\r\nand CRLF",
    "unicode: héllo wörld, 世界, emoji 🙂, digits 1234567890",
]


def test_shipped_tokenizer_vocab_eos_and_round_trip():
    tok = load_tokenizer()
    assert tok.vocab_size == 2048
    assert tok.eos_id == 0
    assert tok.bos_id is None
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # Trained on English prose: common words are single tokens, so text compresses well.
    assert len(tok.encode("the function returns the value")) <= 6
    assert tok.eos_id not in tok.encode("some text")  # encode adds no special tokens


def test_build_tokenizer_is_deterministic():
    spec = importlib.util.spec_from_file_location(
        "build_tokenizer", ROOT / "scripts/build_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first, second = module.build(), module.build()
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 2048
    assert first.token_to_id("<|endoftext|>") == 0


def test_load_from_file_and_directory(tmp_path):
    shutil.copy(ASSET, tmp_path / "tokenizer.json")
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        tok = load_tokenizer(str(path))
        assert (tok.vocab_size, tok.eos_id) == (2048, 0)
        assert tok.encode(TEXTS[2]) == load_tokenizer().encode(TEXTS[2])


def test_eos_and_bos_from_tokenizer_config(tmp_path):
    # A Qwen3-like directory: several special tokens, EOS chosen by tokenizer_config.json.
    raw = tokenizers.Tokenizer.from_file(str(ASSET))
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).eos_id == 0  # well-known name order: <|endoftext|> first

    config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<|im_start|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (2050, 2049, 2048)

    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": None})
    )
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.bos_id) == (0, None)


def _no_eos_tokenizer(path: Path) -> None:
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    raw.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: None, "no tokenizer.json file"),
        (lambda p: (p / "tokenizer.json").write_text("{not json"), "not a valid tokenizer.json"),
        (_no_eos_tokenizer, "has no EOS token"),
        (
            lambda p: (
                shutil.copy(ASSET, p / "tokenizer.json"),
                (p / "tokenizer_config.json").write_text('{"eos_token": "</s>"}'),
            ),
            "eos_token='</s>' is not in the vocab",
        ),
        (
            lambda p: (
                shutil.copy(ASSET, p / "tokenizer.json"),
                (p / "tokenizer_config.json").write_text("[1, 2"),
            ),
            "tokenizer_config.json' is not valid JSON",
        ),
    ],
)
def test_bad_tokenizer_paths_name_the_path(tmp_path, setup, match):
    setup(tmp_path)
    with pytest.raises(ValueError, match=match) as err:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_missing_file_path_is_named(tmp_path):
    missing = str(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(ValueError, match="no tokenizer.json file") as err:
        load_tokenizer(missing)
    assert missing in str(err.value)


HUGE = 10**20
BAD_IDS = [  # tokenizer_config.json beside the shipped tokenizer (2048 ids, EOS <|endoftext|> = 0)
    (
        {"eos_token_id": HUGE},
        f"eos_token_id={HUGE} is not a token id of the tokenizer.json beside it (0 to 2047); give "
        "the id of EOS, or leave eos_token_id out",
    ),
    (
        {"bos_token_id": -1},
        "bos_token_id=-1 is not a token id of the tokenizer.json beside it (0 to 2047); give the "
        "id of BOS, or leave bos_token_id out",
    ),
    ({"eos_token_id": "0"}, 'eos_token_id="0" is not a token id'),
    (
        {"eos_token": HUGE},
        f'eos_token={HUGE} is not a token; give the token\'s text (e.g. "<|im_end|>", or '
        '{"content": "<|im_end|>"}), or null',
    ),
    ({"bos_token": {"content": 7}}, 'bos_token={"content": 7} is not a token'),
    (
        {"eos_token": "<|endoftext|>", "eos_token_id": 5},
        "eos_token_id=5, but eos_token='<|endoftext|>' is id 0; make them agree, or leave "
        "eos_token_id out",
    ),
    (
        {
            "eos_token": "<|endoftext|>",
            "added_tokens_decoder": {str(HUGE): {"content": "<|endoftext|>", "special": True}},
        },
        f"added_tokens_decoder gives '<|endoftext|>' (eos_token) the id \"{HUGE}\", but "
        "tokenizer.json has it at 0; make the two files agree",
    ),
]


@pytest.mark.parametrize("config, message", BAD_IDS)
def test_special_token_ids_outside_the_tokenizer_name_the_file_and_field(tmp_path, config, message):
    shutil.copy(ASSET, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(str(tmp_path))
    assert str(err.value).startswith(f"tokenizer config '{tmp_path}/tokenizer_config.json': ")
    assert message in str(err.value)


def test_special_token_ids_that_agree_are_taken(tmp_path):
    shutil.copy(ASSET, tmp_path / "tokenizer.json")
    config = {
        "eos_token": {"content": "<|endoftext|>"},
        "eos_token_id": 0,
        "bos_token_id": 7,
        "added_tokens_decoder": {"0": {"content": "<|endoftext|>", "special": True}},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.bos_id) == (0, 7)


def test_a_chat_templates_special_token_of_the_wrong_kind_names_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": HUGE}))
    with pytest.raises(
        TokenizerError,
        match=f"tokenizer config '{tmp_path}/tokenizer_config"
        f".json': pad_token={HUGE} is not a token",
    ):
        load_special_tokens(str(tmp_path))


def test_a_huge_eos_id_stops_train_in_one_line_writing_nothing(tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(ASSET, tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token_id": HUGE}))
    before = sorted(tmp_path.rglob("*"))
    code = main(
        [
            "train",
            "--config",
            str(ROOT / "configs" / "qwen3_debug.toml"),
            "--model.tokenizer_path",
            str(tok),
            "--job.dump_folder",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"titan-jax: error: tokenizer config '{tok}/tokenizer_config.json': {BAD_IDS[0][1]}\n"
    )
    assert sorted(tmp_path.rglob("*")) == before
