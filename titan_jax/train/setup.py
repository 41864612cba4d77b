"""A run assembled, and checked, before anything is written or allocated on devices.

config (validated once) -> the paths it writes (`preflight.check_outputs`) and the weights it
starts from -> the trainer (mesh, model and shardings from the abstract model; nothing
allocated) -> the tokenizer, loaded once -> the training stream and the validator (documents
read, nothing written). Every bad-input error of a run's setup is raised from here, so a
refused run leaves nothing behind; what needs the run's lock (another run's history in the
folder) and the checkpoints themselves are checked next, still before any write (`loop`).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import multihost_utils

from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.stream import TrainIterator, build_train_iterator
from titan_jax.data.tokenizer import Tokenizer, load_tokenizer
from titan_jax.train.eval import Validator
from titan_jax.train.preflight import check_initial_load_path, check_outputs
from titan_jax.train.trainer import Trainer, build_trainer


@dataclasses.dataclass
class RunSetup:
    trainer: Trainer
    tokenizer: Tokenizer
    data: TrainIterator
    validator: Validator | None


def check_tokenizer(config: JobConfig, tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {config.model.tokenizer_path or '(shipped)'} has vocab size "
            f"{tokenizer.vocab_size}, larger than model.flavor={config.model.flavor}'s "
            f"vocab_size={vocab_size}")


def build_data(config: JobConfig, trainer: Trainer,
               tokenizer: Tokenizer | None = None) -> TrainIterator:
    """This process's rows of the training stream (`tokenizer`: the run's, loaded once)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(config.model.tokenizer_path)
        check_tokenizer(config, tokenizer, trainer.model.args.vocab_size)
    t = config.training
    return build_train_iterator(
        dataset=t.dataset, dataset_path=t.dataset_path, text_field=t.text_field,
        tokenizer=tokenizer, seq_len=t.seq_len, global_batch_size=trainer.global_batch_size,
        seed=t.seed, rows=trainer.batch_rows(),
        all_gather=multihost_utils.process_allgather if jax.process_count() > 1 else None,
    )


def assemble_run(config: JobConfig, devices: list[jax.Device] | None = None) -> RunSetup:
    """Everything a run needs before its first write, each input checked."""
    check_outputs(config)
    check_initial_load_path(config)
    trainer = build_trainer(config, devices)
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    check_tokenizer(config, tokenizer, trainer.model.args.vocab_size)
    data = build_data(config, trainer, tokenizer)
    validator = Validator(config, trainer, tokenizer) if config.validation.enable else None
    return RunSetup(trainer, tokenizer, data, validator)
