import os
import re

import pytest

from titan_jax.config import ConfigError, load_config


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_toml_and_overrides(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[checkpoint]\nenable = true\n")
    config = load_config(
        path,
        [
            "--training.steps",
            "9",
            "--optimizer.lr=3e-4",
            "--checkpoint.enable",
            "false",
            "--lr_scheduler.decay_ratio",
            "none",
        ],
    )
    assert config.training.steps == 9
    assert config.training.seq_len == 64
    assert config.optimizer.lr == 3e-4
    assert config.checkpoint.enable is False
    assert config.lr_scheduler.decay_ratio is None


def test_defaults_follow_torchtitan():
    config = load_config()
    assert (config.optimizer.beta1, config.optimizer.beta2, config.optimizer.eps) == (
        0.9,
        0.95,
        1e-8,
    )
    assert config.optimizer.weight_decay == 0.1
    assert config.training.max_norm == 1.0
    assert config.training.global_batch_size == -1


def test_unknown_key_suggests_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"training.stpes.*did you mean steps"):
        load_config(write(tmp_path, "[training]\nstpes = 3\n"))
    with pytest.raises(ConfigError, match=r"\[trainig\].*did you mean training"):
        load_config(None, ["--trainig.steps", "3"])


@pytest.mark.parametrize(
    "override,message",
    [
        (["--training.steps", "ten"], "training.steps='ten' is not an integer"),
        (["--checkpoint.enable", "yes"], "checkpoint.enable='yes' is not a boolean"),
        (["--lr_scheduler.decay_type", "exp"], "expected one of linear, sqrt, cosine"),
        (["--training.local_batch_size", "0"], "training.local_batch_size=0 must be >= 1"),
        (["--optimizer.lr", "-1"], "optimizer.lr=-1.0 must be > 0"),
        (["--training.steps"], "has no value"),
        (
            ["--model.yarn_factor", "8"],
            "model.yarn_factor=8.0 applies with model.rope_type=yarn only",
        ),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(None, override)


def test_wrong_type_in_toml(tmp_path):
    with pytest.raises(ConfigError, match="training.seq_len='long' is not an integer"):
        load_config(write(tmp_path, '[training]\nseq_len = "long"\n'))


def test_print_config_round_trips(tmp_path):
    config = load_config(None, ["--training.steps", "5", "--job.description", 'a "quoted" x'])
    again = load_config(write(tmp_path, config.to_toml()))
    assert again == config


@pytest.mark.parametrize("path", sorted(__import__("glob").glob("configs/*.toml")))
def test_shipped_recipes_load_and_name_real_flavours(path):
    from titan_jax.models.qwen3 import get_flavor

    config = load_config(path)
    args = get_flavor(config.model.flavor)
    assert config.training.seq_len <= args.max_seq_len


@pytest.mark.parametrize(
    "override,message",
    [
        # Each passed validation before and failed later, far from the field that caused it.
        (
            ["--training.steps", "3000000000"],
            "training.steps=3000000000 is out of range; at most 2147483647 (int32)",
        ),
        (["--optimizer.lr", "inf"], "optimizer.lr=inf must be a finite number"),
        (["--optimizer.eps", "nan"], "optimizer.eps=nan must be a finite number"),
        (["--training.max_norm", "inf"], "training.max_norm=inf must be a finite number"),
        (["--checkpoint.interval", "9999999999"], "checkpoint.interval=9999999999 is out of range"),
        (["--training.seed", "-1"], "training.seed=-1 must be in [0, 2**31)"),
        (
            ["--checkpoint.folder", "../elsewhere"],
            "checkpoint.folder='../elsewhere' must name a folder inside job.dump_folder",
        ),
        (["--checkpoint.folder", "a/../../b"], "checkpoint.folder='a/../../b' must name"),
        (["--checkpoint.folder", "."], "checkpoint.folder='.' must name"),
        (
            ["--metrics.save_tb_folder", "../../tb"],
            "metrics.save_tb_folder='../../tb' must name a folder inside job.dump_folder",
        ),
        (
            ["--profiling.save_traces_folder", "x/../../.."],
            "profiling.save_traces_folder='x/../../..' must name a folder inside job.dump_folder",
        ),
    ],
)
def test_numbers_the_step_cannot_represent_and_escaping_folders(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, override)
    assert message in str(error.value)


def test_an_absolute_checkpoint_folder_is_allowed(tmp_path):
    assert load_config(None, ["--checkpoint.folder", str(tmp_path)]).checkpoint.folder == str(
        tmp_path
    )


def test_config_file_errors_name_the_file(tmp_path):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"[training]\nsteps = 3\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"config file .*binary.toml is not UTF-8 text"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"config file .*empty.toml is empty"):
        load_config(write(tmp_path, "").rename(tmp_path / "empty.toml"))
    with pytest.raises(ConfigError, match=r"config file .* is not a regular file"):
        load_config(tmp_path)  # a directory
    fifo = tmp_path / "recipe.toml"
    os.mkfifo(fifo)  # reading it would block until a writer came: refused at once
    with pytest.raises(ConfigError, match=r"config file .*recipe.toml is not a regular file"):
        load_config(fifo)


@pytest.mark.parametrize(
    "override,message",
    [
        (
            ["--distributed.num_processes", "2"],
            "distributed.coordinator_address='' must be host:port (process 0's) with "
            "distributed.num_processes=2",
        ),
        (
            ["--distributed.num_processes", "2", "--distributed.coordinator_address", "h:1"],
            "distributed.process_id=-1 must be in [0, 2) with distributed.num_processes=2",
        ),
        (
            ["--distributed.process_id", "1"],
            "distributed.process_id=1 needs distributed.num_processes > 1",
        ),
        (
            ["--distributed.initialization_timeout", "0"],
            "distributed.initialization_timeout=0 must be >= 1 seconds",
        ),
        (["--distributed.num_processes", "-2"], "distributed.num_processes=-2 must be >= 1, or -1"),
        (
            ["--distributed.num_processes", "0"],
            "distributed.num_processes=0 must be >= 1, or -1 to "
            "auto-detect (-1 means auto in every key)",
        ),
    ],
)
def test_bad_distributed_settings_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, override)


def test_training_mixture_tables_parse_validate_and_print(tmp_path):
    import tomllib

    recipe = tmp_path / "mix.toml"
    recipe.write_text(
        '[[training.mixture]]\npath = "gs://b/web-*"\nweight = 3\n'
        '[[training.mixture]]\npath = "/data/code"\n'
    )
    config = load_config(recipe)
    assert [(m.path, m.weight) for m in config.training.mixture] == [
        ("gs://b/web-*", 3.0),
        ("/data/code", 1.0),
    ]
    assert tomllib.loads(config.to_toml())["training"]["mixture"] == [
        {"path": "gs://b/web-*", "weight": 3.0},
        {"path": "/data/code", "weight": 1.0},
    ]
    recipe.write_text('[[training.mixture]]\npath = "x"\nshare = 3\n')
    with pytest.raises(ConfigError, match=r"unknown key training.mixture\[0\].share"):
        load_config(recipe)
    recipe.write_text('[[training.mixture]]\npath = "x"\nweight = 0\n')
    with pytest.raises(ConfigError, match=r"training.mixture\[0\].weight=0.0 must be a number > 0"):
        load_config(recipe)
    with pytest.raises(ConfigError, match="training.mixture must be TOML tables"):
        load_config(None, ["--training.mixture", "x"])
    with pytest.raises(ConfigError, match="training.dataset='tokens' needs training.dataset_path"):
        load_config(None, ["--training.dataset", "tokens"])


def test_a_store_listed_twice_in_a_mixture_is_refused(tmp_path):
    recipe = write(
        tmp_path,
        '[[training.mixture]]\npath = "/data/web"\nweight = 2\n'
        '[[training.mixture]]\npath = "/data/web"\n',
    )
    with pytest.raises(
        ConfigError,
        match=r"training.mixture\[1\].path='/data/web' is also "
        r"training.mixture\[0\]'s; list it once, with the weights summed",
    ):
        load_config(recipe)


@pytest.mark.parametrize(
    "override,message",
    [
        (["--checkpoint.local_interval", "0"], "checkpoint.local_interval=0 must be >= 1"),
        (
            ["--checkpoint.local_folder", "/dev/shm/run"],
            "checkpoint.local_folder=/dev/shm/run needs checkpoint.enable=true (or leave "
            "local_folder empty)",
        ),
        (
            ["--checkpoint.enable", "true", "--checkpoint.local_folder", "local"],
            "checkpoint.local_folder=local must be an absolute path on each host's own storage "
            "(a RAM disk or local SSD, e.g. /dev/shm/NAME)",
        ),
        (
            ["--checkpoint.enable", "true", "--checkpoint.local_folder", "gs://b/local"],
            "checkpoint.local_folder=gs://b/local must be an absolute path",
        ),
        (
            [
                *("--checkpoint.enable", "true", "--job.dump_folder", "/runs/a"),
                *("--checkpoint.local_folder", "/runs/a/checkpoint/local"),
            ],
            "checkpoint.local_folder=/runs/a/checkpoint/local overlaps the persistent "
            "checkpoints in /runs/a/checkpoint; give the local tier a folder of its own outside "
            "checkpoint.folder",
        ),
        (
            [
                *("--checkpoint.enable", "true", "--checkpoint.folder", "/ckpt/a"),
                *("--checkpoint.local_folder", "/ckpt"),
            ],
            "checkpoint.local_folder=/ckpt overlaps the persistent checkpoints in /ckpt/a",
        ),
    ],
)
def test_bad_local_tier_settings_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, override)


def test_a_local_tier_beside_the_run_folder_is_allowed():
    c = load_config(
        None,
        [
            *("--checkpoint.enable", "true", "--job.dump_folder", "/runs/a"),
            *("--checkpoint.local_folder", "/dev/shm/a", "--checkpoint.local_interval", "5"),
        ],
    ).checkpoint
    assert (c.local_folder, c.local_interval) == ("/dev/shm/a", 5)
