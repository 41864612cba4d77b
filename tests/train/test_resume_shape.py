"""A resume on another number of devices keeps the checkpoint's global batch (as microbatches,
or as fewer rows per device), says so in one line, and continues the uninterrupted run's
losses (train/resume_shape.py). Across processes: tests/parallel/test_multihost.py."""

import re
import shutil

import jax
import pytest
from cli_args import QUIET_METRICS
from tiny_model import TINY

from titan_jax.config import ConfigError, load_config
from titan_jax.train import loop
from titan_jax.train.checkpoint import Checkpointer
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py


def make_config(folder, *overrides):
    return load_config(
        None,
        [
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "16",
            "--training.steps",
            "4",
            "--lr_scheduler.warmup_steps",
            "1",
            *QUIET_METRICS,
            "--validation.enable",
            "false",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
            "--checkpoint.last_save_model_only",
            "false",
            *overrides,
        ],
    )


def train(config, n_devices):
    return loop.train(config, jax.devices()[:n_devices], model_args=TINY)


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved_on, resumed_on, local, note",
    [
        (8, 4, 1, "global batch 8 kept as 2 microbatch(es) of 1 row(s) x 4 data-parallel ranks"),
        (
            4,
            8,
            2,
            "global batch 8 kept as 1 microbatch(es) of 1 row(s) x 8 data-parallel ranks "
            "(training.local_batch_size 2 -> 1)",
        ),
    ],
)
def test_a_resume_on_other_devices_keeps_the_global_batch(
    tmp_path, capsys, saved_on, resumed_on, local, note
):
    config = make_config(tmp_path / "run", "--training.local_batch_size", str(local))
    reference = train(config, saved_on)
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "4")
    capsys.readouterr()
    resumed = train(config, resumed_on)
    out = capsys.readouterr().out
    line = (
        f"resuming on 1 process x {resumed_on} devices, the checkpoint was saved on 1 "
        f"process x {saved_on}: {note}"
    )
    assert line in out.splitlines(), out
    assert re.search(r"8 x 16 tokens/step", out)
    assert resumed.losses == pytest.approx(
        {s: reference.losses[s] for s in (3, 4)}, rel=1e-5, abs=0
    )


def test_a_global_batch_the_new_devices_cannot_split_is_refused(tmp_path):
    config = make_config(tmp_path / "run", "--training.local_batch_size", "1")
    trainer = build_trainer(config, jax.devices()[:2], model_args=TINY)  # global batch 2
    with Checkpointer.for_run(trainer) as ckpt:
        ckpt.save(2, trainer.init_state(), data_state={}, tokens_seen=0)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "cannot keep the checkpoint's global batch of 2 sequences on this run's 8 "
            "data-parallel ranks (8 devices); set --training.global_batch_size to a multiple "
            "of 8"
        ),
    ):
        train(make_config(tmp_path / "run"), 8)
