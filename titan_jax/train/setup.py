"""A run assembled, and checked, before anything is written or allocated on devices.

config (validated once) -> the paths it writes (`preflight.check_outputs`) and the weights it
starts from -> the trainer (mesh, model and shardings from the abstract model; nothing
allocated) -> the tokenizer, loaded once, and every data input (`checked_tokenizer`). The
checks themselves live in `run_checks.py` (and `preflight.py` for paths); every bad-input
error of a run's setup is raised from `assemble_run`, so a refused run leaves nothing behind;
what needs the run's lock (another run's history in the folder, the checkpoints) is checked
next, still before any write (`loop`), and the training stream is opened under that lock.
"""

from __future__ import annotations

import dataclasses

import jax

from titan_jax.config import JobConfig, packs_whole_conversations
from titan_jax.data.packing import ConversationStream
from titan_jax.data.pairs import PairStream
from titan_jax.data.pipeline import holds_pairs, process_barrier, training_sources
from titan_jax.data.tokenizer import Tokenizer, load_tokenizer
from titan_jax.data.windows import WindowStream
from titan_jax.models.spec import ModelArgs
from titan_jax.train.eval import Validator
from titan_jax.train.preflight import check_initial_load_path, check_outputs
from titan_jax.train.resume_shape import keep_saved_batch
from titan_jax.train.run_checks import check_data
from titan_jax.train.trainer import Trainer, build_trainer


@dataclasses.dataclass
class RunSetup:
    trainer: Trainer
    tokenizer: Tokenizer
    validator: Validator | None = None
    shape_note: str | None = None  # a resume on another shape: what changed, what was kept
    # Built under the run's lock (a small source becomes a token store in the dump folder).
    opened_data: WindowStream | None = None

    @property
    def data(self) -> WindowStream:
        """The training stream, once `open_data` has built it."""
        if self.opened_data is None:
            raise RuntimeError("the run's data is read before open_data(setup) built it")
        return self.opened_data


def _progress(message: str) -> None:
    if jax.process_index() == 0:
        print(f"titan-jax: {message}", flush=True)


def checked_tokenizer(trainer: Trainer) -> Tokenizer:
    """The run's tokenizer, loaded once, with every data input checked against it and the
    model (`check_data`)."""
    plan = trainer.plan
    tokenizer = load_tokenizer(plan.config.model.tokenizer_path)
    check_data(plan.config, plan.model.args, plan.attention, tokenizer)
    return tokenizer


def build_data(trainer: Trainer, tokenizer: Tokenizer | None = None) -> WindowStream:
    """The training windows (or preference pairs) of this process's rows (small sources become a
    token store under the dump folder first: data/pipeline.py). `tokenizer`: from
    `checked_tokenizer`, else loaded and checked here."""
    config = trainer.plan.config
    if tokenizer is None:
        tokenizer = checked_tokenizer(trainer)
    t = config.training
    sources = training_sources(
        config,
        tokenizer,
        is_first=jax.process_index() == 0,
        barrier=process_barrier,
        progress=_progress,
    )
    if holds_pairs(config):  # one preference pair a row (DPO)
        return PairStream(
            sources,
            seq_len=t.seq_len,
            global_batch_size=trainer.plan.global_batch_size,
            seed=t.seed,
            rows=trainer.batches.rows(),
        )
    if packs_whole_conversations(t):  # whole conversations a row, then padding (SFT)
        stream = ConversationStream(
            sources,
            seq_len=t.seq_len,
            global_batch_size=trainer.plan.global_batch_size,
            seed=t.seed,
            rows=trainer.batches.rows(),
            spans=trainer.batches.spans(t.seq_len),
        )
        _progress(f"data: {stream.note}")
        return stream
    return WindowStream(
        sources,
        seq_len=t.seq_len,
        global_batch_size=trainer.plan.global_batch_size,
        seed=t.seed,
        rows=trainer.batches.rows(),
        document_mask=t.document_mask,
        document_positions=t.document_positions,
        spans=trainer.batches.spans(t.seq_len),
    )


def assemble_run(
    config: JobConfig, devices: list[jax.Device] | None = None, model_args: ModelArgs | None = None
) -> RunSetup:
    """Everything a run needs before its first write, each input checked (`model_args`: as in
    `build_trainer`)."""
    check_outputs(config)
    check_initial_load_path(config)
    config, shape_note = keep_saved_batch(
        config, len(jax.devices() if devices is None else devices)
    )
    trainer = build_trainer(config, devices, model_args=model_args)
    return RunSetup(trainer, checked_tokenizer(trainer), shape_note=shape_note)


def open_data(setup: RunSetup) -> None:
    """The training stream and the validator (under the run's lock: they may write a store)."""
    setup.opened_data = build_data(setup.trainer, setup.tokenizer)
    if setup.trainer.plan.config.validation.enable:
        setup.validator = Validator(setup.trainer, setup.tokenizer)
