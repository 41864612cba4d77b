"""HF safetensors <-> titan-jax params: config mapping, layouts, sharded loading, round trips,
and every bad input named in the error."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from hf_fixtures import random_hf_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from tiny_model import TIED, UNTIED

from titan_jax.cli import main
from titan_jax.models import safetensors_io
from titan_jax.models.qwen3 import QWEN3, Qwen3Args, build_model_def, hf, hf_config
from titan_jax.models.qwen3.args import YarnScaling
from titan_jax.models.qwen3.model import rope_frequencies
from titan_jax.models.safetensors_io import HFCheckpointError
from titan_jax.train.checkpoint import CheckpointError
from titan_jax.train.model_io import ARGS_FILE, load_orbax, save_orbax

try:  # the `parity` extra; CI installs it, so there a missing one is a failure, not a skip
    import torch
    import transformers
except ImportError as e:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"needs the parity extra: {e}", allow_module_level=True)

# GQA 2, head_dim (16) != dim / heads (8), untied: every layout the mapping has.


hf_model = random_hf_model


def save_hf_model(args: Qwen3Args, path, **kwargs):
    hf_model(args).save_pretrained(str(path), **kwargs)
    return path


def tensors(path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_config_roundtrip_and_hf_reads_ours():
    for args in (UNTIED, TIED):
        config = hf_config.hf_config_from_args(args)
        assert hf_config.args_from_hf_config(config) == args
        theirs = transformers.Qwen3Config.from_dict(config)
        assert theirs.rope_parameters["rope_theta"] == args.rope_theta
        assert theirs.head_dim == args.head_dim
        assert theirs.tie_word_embeddings == args.tie_embeddings


def test_config_defaults_and_old_rope_theta():
    config = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "vocab_size": 100,
        "rope_theta": 1000000,
    }  # transformers 4 layout: rope_theta at the top level
    args = hf_config.args_from_hf_config(config)
    assert (args.head_dim, args.n_kv_heads, args.rope_theta) == (16, 4, 1e6)
    assert not args.tie_embeddings  # HF's default for Qwen3Config
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    assert hf_config.args_from_hf_config(config).rope_theta == 5e6  # transformers 5 wins


YARN = dataclasses.replace(
    UNTIED,
    max_seq_len=1024,
    yarn=YarnScaling(
        factor=8.0, original_max_position_embeddings=128, beta_fast=16.0, beta_slow=2.0
    ),
)


@pytest.mark.parametrize(
    "yarn", [YARN.yarn, dataclasses.replace(YARN.yarn, truncate=False, attention_factor=1.25)]
)
def test_yarn_config_roundtrip_and_hf_computes_our_frequencies(yarn):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = dataclasses.replace(YARN, yarn=yarn)
    config = hf_config.hf_config_from_args(args)
    assert config["rope_parameters"]["rope_type"] == "yarn" and "rope_scaling" not in config
    assert hf_config.args_from_hf_config(config) == args
    theirs = transformers.Qwen3Config.from_dict(config)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    ours = rope_frequencies(args.head_dim, args.rope_theta, args.yarn)
    np.testing.assert_array_equal(np.asarray(ours), inv_freq.numpy())
    assert yarn.cos_sin_scale == pytest.approx(attention_factor, rel=1e-12)
    plain = rope_frequencies(args.head_dim, args.rope_theta)
    assert ours[0] == plain[0] and ours[-1] == pytest.approx(plain[-1] / 8)  # kept, interpolated


def test_yarn_from_an_older_rope_scaling_file():
    config = {
        k: v for k, v in hf_config.hf_config_from_args(UNTIED).items() if k != "rope_parameters"
    }
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0}
    args = hf_config.args_from_hf_config(config)
    assert args.yarn.original_max_position_embeddings == UNTIED.max_seq_len  # HF's default
    assert (args.yarn.beta_fast, args.yarn.beta_slow, args.yarn.truncate) == (32, 1, True)
    m = lambda s: 0.1 * s * np.log(4.0) + 1  # noqa: E731
    assert args.yarn.attention_factor == pytest.approx(m(0.707) / m(1.0))
    assert (
        hf_config.hf_config_from_args(args)["rope_parameters"]["attention_factor"]
        == args.yarn.attention_factor
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen3_moe"}, "expected ['Qwen3MoeForCausalLM']"),
        (
            {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
            "missing field 'num_local_experts'",
        ),
        (
            {
                "model_type": "qwen3_moe",
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 8,
                "mlp_only_layers": [0],
            },
            "only all-MoE layers",
        ),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type='llama'"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures="),
        ({"hidden_size": None}, "missing field 'hidden_size'"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers='2' is not of type int"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings=1 is not of type bool"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5}}, "factor=0.5 must be >= 1"),
        ({"rope_scaling": {"type": "yarn", "factor": "4"}}, "rope_scaling.factor='4' is not a"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "n_kv_heads=3"),
        # Sizes and numbers are range-checked where they are read, before anything is built.
        ({"num_hidden_layers": 2**64}, "num_hidden_layers=18446744073709551616 must be in [1, "),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0 must be in [1, 2147483647]"),
        ({"max_position_embeddings": 10**15}, "max_position_embeddings=1000000000000000 must be"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan must be a finite number >= 0"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be > 0"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
            "rope_theta=inf must be a finite number > 1",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "beta_fast": 1,
                    "beta_slow": 32,
                }
            },
            "rope_parameters.beta_fast=1.0 must be > beta_slow",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_slow": -1}},
            "rope_parameters.beta_slow=-1.0 must be > 0",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 1e300}},
            "rope_parameters.factor=1e.300 times original_max_position_embeddings=128 exceeds",
        ),
    ],
)
def test_bad_config_fields_are_named(change, message):
    config = {**hf_config.hf_config_from_args(UNTIED), **change}
    with pytest.raises(HFCheckpointError, match=message.replace("[", r"\[")):
        hf_config.args_from_hf_config({k: v for k, v in config.items() if v is not None})


def test_missing_and_malformed_config_json(tmp_path):
    with pytest.raises(HFCheckpointError, match="no config.json"):
        hf.load_hf_params(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="config.json: not valid JSON"):
        hf.load_hf_params(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(HFCheckpointError, match="expected a JSON object"):
        hf_config.read_hf_config(tmp_path)


@pytest.mark.parametrize("args", [UNTIED, TIED], ids=["untied", "tied"])
def test_hf_to_titan_to_hf_is_bitwise(tmp_path, args):
    src = save_hf_model(args, tmp_path / "src")
    assert hf_config.read_hf_config(src) == args
    params = hf.load_hf_params(src)
    hf.save_hf(tmp_path / "dst", params, args)
    a, b = tensors(src), tensors(tmp_path / "dst")
    assert sorted(a) == sorted(b)
    assert "lm_head.weight" in b or args.tie_embeddings
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    assert hf_config.read_hf_config(tmp_path / "dst") == args


def test_layouts_match_the_hf_modules(tmp_path):
    model = hf_model(UNTIED)
    model.save_pretrained(str(tmp_path))
    p = hf.load_hf_params(tmp_path)
    layer = model.model.layers[1]
    x = torch.randn(3, UNTIED.dim)
    # q_proj(x) == x @ wq, read per head.
    q = layer.self_attn.q_proj(x).detach().numpy().reshape(3, UNTIED.n_heads, UNTIED.head_dim)
    ours = np.einsum("td,dnh->tnh", x.numpy(), np.asarray(p["layers"]["attention"]["wq"][1]))
    np.testing.assert_allclose(ours, q, atol=1e-5)
    h = torch.randn(3, UNTIED.n_heads * UNTIED.head_dim)
    o = layer.self_attn.o_proj(h).detach().numpy()
    wo = np.asarray(p["layers"]["attention"]["wo"][1])
    ours = np.einsum("tnh,nhd->td", h.numpy().reshape(3, UNTIED.n_heads, -1), wo)
    np.testing.assert_allclose(ours, o, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(p["layers"]["ffn_norm"]["weight"][1]),
        layer.post_attention_layernorm.weight.detach().numpy(),
    )
    np.testing.assert_array_equal(np.asarray(p["lm_head"]), model.lm_head.weight.detach().T)


def test_sharded_files_bf16_and_hf_loads_our_export(tmp_path):
    src = save_hf_model(UNTIED, tmp_path / "src", max_shard_size="20KB")
    assert (src / safetensors_io.INDEX_FILE).is_file()
    params = hf.load_hf_params(src)
    files = hf.save_hf(tmp_path / "bf16", params, UNTIED, dtype="bfloat16", max_shard_size="8KB")
    index = json.loads((tmp_path / "bf16" / safetensors_io.INDEX_FILE).read_text())
    shards = sorted(f.name for f in files if f.suffix == ".safetensors")
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    for file in shards:  # each file within the limit unless a single tensor is larger
        data = load_file(str(tmp_path / "bf16" / file))
        assert all(v.dtype == ml_dtypes.bfloat16 for v in data.values())
        assert sum(v.nbytes for v in data.values()) <= 8000 or len(data) == 1
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # bf16 -> fp32 params -> bf16 is exact.
    again = hf.load_hf_params(tmp_path / "bf16")
    hf.save_hf(tmp_path / "bf16_again", again, UNTIED, dtype="bfloat16")
    a, b = tensors(tmp_path / "bf16"), tensors(tmp_path / "bf16_again")
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    # transformers reads our fp32 export and computes the same logits as the original.
    hf.save_hf(tmp_path / "fp32", params, UNTIED)
    original = hf_model(UNTIED)
    ours = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path / "fp32")).eval()
    tokens = torch.randint(0, UNTIED.vocab_size, (1, 40))
    with torch.no_grad():
        assert torch.equal(original(tokens).logits, ours(tokens).logits)


def test_loads_straight_into_shardings_reading_only_slices(tmp_path, monkeypatch):
    src = save_hf_model(UNTIED, tmp_path)
    reference = hf.load_hf_params(src)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    specs = {  # shard every matrix over both axes, head_dim included (the hardest read)
        "tok_embeddings": P("fsdp", "tp"),
        "lm_head": P("fsdp", "tp"),
        "norm": {"weight": P()},
        "layers": {
            "attention": {
                "wq": P(None, "fsdp", None, "tp"),
                "wk": P(None, "fsdp", "tp"),
                "wv": P(None, "tp", None, "fsdp"),
                "wo": P(None, "tp", "fsdp"),
                "q_norm": {"weight": P()},
                "k_norm": {"weight": P(None, "tp")},
            },
            "feed_forward": {
                "w1": P(None, "fsdp", "tp"),
                "w2": P(None, "tp", "fsdp"),
                "w3": P("tp", None, "fsdp"),
            },
            "attention_norm": {"weight": P()},
            "ffn_norm": {"weight": P(None, "fsdp")},
        },
    }
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    largest_read = {}
    read = hf._Reader.read

    def spy(self, name, index):
        out = read(self, name, index)
        largest_read[name] = max(largest_read.get(name, 0), out.size)
        return out

    monkeypatch.setattr(hf._Reader, "read", spy)
    params = hf.load_hf_params(src, UNTIED, shardings)
    for (path, x), ref, sharding in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(reference),
        jax.tree.leaves(shardings),
        strict=True,
    ):
        assert x.sharding == sharding, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(ref))
    # Saving gathers one layer at a time from the sharded arrays: bitwise the source again.
    hf.save_hf(tmp_path / "out", params, UNTIED)
    a, b = tensors(src), tensors(tmp_path / "out")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    # A shard reads only its rows/cols: 1/8 of a matrix sharded 8 ways. When head_dim itself
    # is sharded a shard reads its heads' rows whole (q_proj: 1/4, v_proj: 1/2).
    total = {name: x.size for name, x in tensors(src).items()}
    assert set(largest_read) == set(total)
    for name, size in largest_read.items():
        if name.endswith(
            (
                "k_proj.weight",
                "gate_proj.weight",
                "down_proj.weight",
                "embed_tokens.weight",
                "lm_head.weight",
            )
        ):
            assert size * 8 == total[name], name
        elif name.endswith("q_proj.weight"):
            assert size * 4 == total[name], name
        elif name.endswith("v_proj.weight"):
            assert size * 2 == total[name], name


def test_compiled_layer_take_matches_the_host_path(tmp_path):
    # Accelerator / multi-process arrays take a layer with one compiled dynamic index; CPU
    # arrays are copied out of their shards. Both give the same bytes.
    src = save_hf_model(UNTIED, tmp_path)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    abstract = build_model_def(UNTIED).abstract_params
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, P(None, "fsdp") if len(s.shape) > 2 else P()), abstract
    )
    params = hf.load_hf_params(src, UNTIED, shardings)
    for i in range(UNTIED.n_layers):
        compiled = safetensors_io._take_layer(params["layers"], i)
        host = safetensors_io._layer(params["layers"], i)
        for a, b in zip(jax.tree.leaves(compiled), jax.tree.leaves(host), strict=True):
            assert np.asarray(a).tobytes() == b.tobytes()


def _rewrite(path, drop=(), change=None):
    data = tensors(path)
    for name in drop:
        del data[name]
    data.update(change or {})
    for file in path.glob("*.safetensors"):
        file.unlink()
    save_file(data, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_wrong_shape_and_unexpected_tensor_are_named(tmp_path):
    src = save_hf_model(UNTIED, tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(src, drop=[name])
    with pytest.raises(HFCheckpointError, match=f"missing tensor '{name}'"):
        hf.load_hf_params(src)
    _rewrite(src, change={name: np.zeros((48, 31), np.float32)})
    with pytest.raises(
        HFCheckpointError, match=rf"'{name}' has shape \(48, 31\), expected \(48, 32\)"
    ):
        hf.load_hf_params(src)
    _rewrite(
        src,
        change={
            name: np.zeros((48, 32), np.float32),
            "model.layers.2.mlp.up_proj.weight": np.zeros((48, 32), np.float32),
        },
    )
    with pytest.raises(HFCheckpointError, match="unexpected tensors.*layers.2.mlp.up_proj"):
        hf.load_hf_params(src)
    _rewrite(src, drop=["model.layers.2.mlp.up_proj.weight", "lm_head.weight"])
    with pytest.raises(HFCheckpointError, match="missing tensor 'lm_head.weight'"):
        hf.load_hf_params(src)


def test_a_weight_of_a_non_floating_dtype_is_refused_naming_file_tensor_and_dtype(tmp_path):
    """A header's dtype is read as declared: float bits relabelled I32 would load as integers
    cast to floats, a bool or an fp8 tensor likewise; every float dtype loads as before."""
    src = save_hf_model(UNTIED, tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    weight = tensors(src)[name]
    for changed in (
        weight.astype(np.float16),
        weight.astype(np.float64),
        weight.astype(ml_dtypes.bfloat16),
    ):
        _rewrite(src, change={name: changed})
        loaded = hf.load_hf_params(src)["layers"]["feed_forward"]["w3"][1]
        np.testing.assert_array_equal(loaded, changed.astype(np.float32).T)
    for changed, dtype in ((weight.view(np.int32), "I32"), (weight > 0, "BOOL")):
        _rewrite(src, change={name: changed})
        with pytest.raises(
            HFCheckpointError,
            match=rf"^{src}/model.safetensors: tensor '{name}' "
            rf"has dtype {dtype}; a weight loads from a floating-point tensor of "
            r"dtype F32, F16, BF16, F64$",
        ):
            hf.load_hf_params(src)
    # fp8, which numpy's safetensors reader cannot decode: its header written by hand
    data = {k: v.astype(np.float32) for k, v in tensors(src).items() if k != name}
    _rewrite(src, drop=[name], change=data)
    blob = (src / "model.safetensors").read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header, body = json.loads(blob[8 : 8 + size]), blob[8 + size :]
    header[name] = {
        "dtype": "F8_E4M3",
        "shape": list(weight.shape),
        "data_offsets": [len(body), len(body) + weight.size],
    }
    encoded = json.dumps(header).encode()
    (src / "model.safetensors").write_bytes(
        len(encoded).to_bytes(8, "little") + encoded + body + bytes(weight.size)
    )
    with pytest.raises(HFCheckpointError, match=f"tensor '{name}' has dtype F8_E4M3; "):
        hf.load_hf_params(src)


def test_a_layer_count_the_files_do_not_hold_is_refused_before_anything_is_built(tmp_path):
    """A tampered num_hidden_layers would build a list of 10**9 expected tensors (23 GB
    before the first shape comparison): the count is checked against the files first."""
    src = save_hf_model(UNTIED, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    with pytest.raises(
        HFCheckpointError,
        match=rf"num_hidden_layers=1000000000, but the "
        rf"safetensors files hold {UNTIED.n_layers} layers$",
    ):
        hf.load_hf_params(src)


def test_stored_model_args_are_range_checked(tmp_path):
    path = tmp_path / "model"
    save_orbax(path, build_model_def(UNTIED).init(jax.random.key(0)), UNTIED)
    stored = json.loads((path / ARGS_FILE).read_text())
    for value, shown in ((0, "0"), (2.5, "2.5"), ("2", "'2'")):
        (path / ARGS_FILE).write_text(json.dumps({**stored, "n_layers": value}))
        with pytest.raises(
            CheckpointError, match=rf"model_args.json: n_layers={shown} must be an integer in"
        ):
            load_orbax(path, QWEN3)


def test_an_orbax_model_this_user_may_not_read_is_named_so(tmp_path, monkeypatch):
    """Not "corrupt": root (the tests' user) reads anything, so the read is refused here."""
    path = tmp_path / "model"
    save_orbax(path, build_model_def(UNTIED).init(jax.random.key(0)), UNTIED)
    real = type(path).read_text

    def read_text(self, *args, **kwargs):
        if self.name == ARGS_FILE:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "read_text", read_text)
    with pytest.raises(CheckpointError) as error:
        load_orbax(path, QWEN3)
    assert str(error.value) == (
        f"orbax model {path} cannot be read: Permission denied "
        f"({path / ARGS_FILE}); make it readable by this user"
    )


def test_tied_checkpoint_with_lm_head_loads_and_ignores_it(tmp_path):
    src = save_hf_model(TIED, tmp_path)
    _rewrite(src, change={"lm_head.weight": np.zeros((48, 32), np.float32)})
    params = hf.load_hf_params(src)
    assert "lm_head" not in params


def test_missing_files_and_bad_index(tmp_path):
    src = save_hf_model(UNTIED, tmp_path, max_shard_size="20KB")
    index = json.loads((src / safetensors_io.INDEX_FILE).read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (src / gone).unlink()
    with pytest.raises(HFCheckpointError, match=f"lists {gone}, which does not exist"):
        hf.load_hf_params(src)
    (src / safetensors_io.INDEX_FILE).write_text("{}")
    with pytest.raises(HFCheckpointError, match="not a safetensors index"):
        hf.load_hf_params(src)
    for file in src.glob("*.safetensors*"):
        file.unlink()
    with pytest.raises(HFCheckpointError, match="no model.safetensors or model.safetensors"):
        hf.load_hf_params(src)


def test_loading_into_a_different_model_names_the_fields(tmp_path):
    src = save_hf_model(UNTIED, tmp_path)
    other = dataclasses.replace(UNTIED, rope_theta=1e4, n_layers=3)
    with pytest.raises(
        HFCheckpointError, match=r"n_layers: checkpoint 2 vs model 3; rope_theta: checkpoint"
    ):
        hf.load_hf_params(src, other)


def test_parse_size():
    assert safetensors_io.parse_size("5GB") == 5 * 10**9
    assert safetensors_io.parse_size("500MiB") == 500 * 2**20
    assert safetensors_io.parse_size(123) == 123
    with pytest.raises(ValueError, match="size '5 gigs'"):
        safetensors_io.parse_size("5 gigs")


def test_convert_cli_hf_orbax_hf_is_bitwise(tmp_path, capsys):
    src = save_hf_model(TIED, tmp_path / "hf")
    assert (
        main(["convert", "--from", "hf", "--to", "orbax", str(src), str(tmp_path / "orbax")]) == 0
    )
    args, params = load_orbax(tmp_path / "orbax", QWEN3)
    assert args == TIED
    assert jax.tree.structure(params) == jax.tree.structure(build_model_def(TIED).abstract_params)
    assert (
        main(
            [
                "convert",
                "--from",
                "orbax",
                "--to",
                "hf",
                str(tmp_path / "orbax"),
                str(tmp_path / "back"),
                "--max-shard-size",
                "10KB",
            ]
        )
        == 0
    )
    a, b = tensors(src), tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert (
        main(["convert", "--from", "hf", "--to", "orbax", str(src), str(tmp_path / "orbax")]) == 2
    )  # refuses to overwrite
    assert "exists and is not empty" in capsys.readouterr().err
    assert (
        main(
            [
                "convert",
                "--from",
                "hf",
                "--to",
                "hf",
                str(tmp_path / "nothing"),
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "HF model directory" in capsys.readouterr().err and not (tmp_path / "x").exists()
