"""Typed run configuration: TorchTitan's TOML sections and key names, CLI overrides, validation.

A run is described by one `JobConfig`: dataclass sections whose names and keys follow TorchTitan
(`[job]`, `[model]`, `[training]`, `[parallelism]`, ...) so a TorchTitan user's TOML reads
naturally. `load_config` reads a TOML file, applies `--section.key value` overrides, and validates
everything once; nothing downstream re-reads the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import fsspec

from titan_jax.config_schema import (
    AUTO,
    LORA_TARGETS,
    QUANTIZE_MODULES,
    ActivationCheckpoint,
    Checkpoint,
    ConfigError,
    Distributed,
    Dpo,
    Job,
    JobConfig,
    Lora,
    LRScheduler,
    Metrics,
    Model,
    Moe,
    Optimizer,
    Parallelism,
    Profiling,
    Quantize,
    Training,
    Validation,
)
from titan_jax.yarn import YarnScaling

# The schema's names are part of this module's interface (`from titan_jax.config import ...`).
__all__ = [
    "AUTO",
    "ActivationCheckpoint",
    "Checkpoint",
    "ConfigError",
    "Distributed",
    "Dpo",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Lora",
    "Metrics",
    "Model",
    "Moe",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Quantize",
    "Training",
    "Validation",
    "load_config",
    "parse_overrides",
    "split_overrides",
    "validate",
]


def _suggest(name: str, valid: typing.Iterable[str]) -> str:
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    if close:
        return f"did you mean {' or '.join(close)}?"
    return f"valid: {', '.join(valid)}"


def _sections() -> dict[str, Any]:  # section name -> its dataclass
    return {f.name: f.type for f in dataclasses.fields(JobConfig)}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _number(where: str, value: Any, kind: type) -> int | float:
    """`value` as an int or float field: a TOML number (an int where a float is wanted) or a
    command-line string; never a boolean."""
    if not isinstance(value, bool):
        if isinstance(value, int) or (kind is float and isinstance(value, float)):
            return kind(value)
        if isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                pass
    raise ConfigError(f"{where}={value!r} is not {'an integer' if kind is int else 'a number'}")


def _coerce(where: str, value: Any, hint: Any) -> Any:
    """Converts a TOML or CLI value to the field's type, or raises a ConfigError naming `where`."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(
                f"{where}={value!r} is not valid; expected one of {', '.join(map(str, choices))}"
            )
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(where, value, args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}={value!r} is not a boolean; use true or false")
    if hint in (int, float):
        return _number(where, value, hint)
    if origin is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        return _coerce_tables(where, value, typing.get_args(hint)[0])
    if hint == dict[str, list[str]]:
        return _coerce_name_lists(where, value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} is not a string")
        return value
    raise TypeError(f"unsupported config type {hint} for {where}")


def _coerce_name_lists(where: str, value: Any) -> dict[str, list[str]]:
    """A TOML table of names (`key = "a"` or `key = ["a", "b"]`, `[]` for none), or its
    command-line form `key=a+b,other=` -> {key: [names]}."""
    if isinstance(value, str):
        value = dict(_name_list_item(where, item) for item in value.split(",") if item.strip())
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where} must be a TOML table of names (or key=a+b,other= on the "
            f"command line), not {value!r}"
        )
    out = {}
    for key, names in value.items():
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"{where}.{key}={names!r} must be a name or a list of names")
        out[key] = list(names)
    return out


def _name_list_item(where: str, item: str) -> tuple[str, list[str]]:
    key, eq, names = item.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"{where}: {item.strip()!r} is not key=name+name (or key= for none)")
    return key.strip(), [n.strip() for n in names.split("+") if n.strip()]


def _coerce_tables(where: str, value: Any, cls: type) -> list[Any]:
    """A TOML array of tables (`[[section.key]]`) -> a list of `cls`, each key checked."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(
            f"{where} must be TOML tables ([[{where}]] with "
            f"{', '.join(f.name for f in dataclasses.fields(cls))})"
        )
    hints, out = _field_types(cls), []
    for i, table in enumerate(value):
        item = cls()
        for key, v in table.items():
            if key not in hints:
                raise ConfigError(f"unknown key {where}[{i}].{key}; {_suggest(key, hints)}")
            setattr(item, key, _coerce(f"{where}[{i}].{key}", v, hints[key]))
        out.append(item)
    return out


def _set(config: JobConfig, section: str, key: str, value: Any) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}]; {_suggest(section, sections)}")
    obj = getattr(config, section)
    hints = _field_types(type(obj))
    if key not in hints:
        raise ConfigError(f"unknown config key {section}.{key}; {_suggest(key, hints)}")
    setattr(obj, key, _coerce(f"{section}.{key}", value, hints[key]))


def _scan(argv: list[str]) -> Iterator[tuple[list[str], tuple[str, str, str] | None]]:
    """Each argument with what it takes: (`--section.key value` or `--section.key=value`,
    (section, key, value)), or ([another argument], None). The one reader of overrides: the
    word after `--section.key` is its value even when it starts with `-`."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if "." not in name:
            yield [arg], None
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"override --{name} has no value")
            value = argv[i + 1]
        taken = 1 if eq else 2
        section, _, key = name.partition(".")
        yield argv[i : i + taken], (section, key, value)
        i += taken


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(a command's own arguments, its `--section.key value` overrides), taken out before
    argparse reads the rest so that an override's value is never read as a flag."""
    rest: list[str] = []
    overrides: list[str] = []
    for taken, parsed in _scan(argv):
        (rest if parsed is None else overrides).extend(taken)
    return rest, overrides


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key value` (or `--section.key=value`) pairs -> [(section, key, value)]."""
    out = []
    for taken, parsed in _scan(args):
        if parsed is None:
            raise ConfigError(f"expected an override like --section.key value, got {taken[0]!r}")
        out.append(parsed)
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> JobConfig:
    """Reads TOML `path` (optional), applies `--section.key value` overrides, validates."""
    config = JobConfig()
    if path is not None:
        path = Path(path)
        if path.exists() and not path.is_file():  # a FIFO would block the read for ever
            raise ConfigError(f"config file {path} is not a regular file; give a TOML file")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {path} is not UTF-8 text (byte {e.start}); TOML files are UTF-8"
            ) from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        if not data:  # most likely a truncated or wrong file, not a wish for every default
            raise ConfigError(
                f"config file {path} is empty; give a recipe such as "
                "configs/qwen3_debug.toml, or no --config for the defaults"
            )
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"{path}: top-level key {section!r} must be a [section]; "
                    f"{_suggest(section, _sections())}"
                )
            for key, value in values.items():
                _set(config, section, key, value)
    for section, key, value in parse_overrides(list(overrides)):
        _set(config, section, key, value)
    _localize_run_folders(config)
    validate(config)
    return config


# URL schemes a run folder may have: orbax writes checkpoints to local paths and to gs:// (a
# file:// URL goes through the same mirror and sync as a bucket: train/run_folder.py).
RUN_FOLDER_SCHEMES = ("gs", "file")


def _localize_run_folders(config: JobConfig) -> None:
    """`job.dump_folder` is a path or a gs:// / file:// URL (file:// URLs are kept, unquoted,
    with no host); `checkpoint.folder` is a path (file:// becomes the path it names): for
    checkpoints in a bucket the run folder is the bucket's URL."""
    for section, key in (("job", "dump_folder"), ("checkpoint", "folder")):
        value = getattr(getattr(config, section), key)
        if value.startswith("file:") and "://" not in value:
            # fsspec reads `file:run` as the relative path `run`, pathlib as a folder named
            # "file:run": one meaning for every reader, or the run splits between two folders.
            setattr(getattr(config, section), key, value.removeprefix("file:"))
            continue
        if "://" not in value:
            continue
        parsed = urllib.parse.urlparse(value)
        field = f"{section}.{key}={value!r}"
        if key == "folder" and parsed.scheme != "file":
            raise ConfigError(
                f"{field} is a URL; checkpoint.folder is a path, inside job.dump_folder or "
                "absolute: for checkpoints in a bucket, make the run folder the URL "
                "(--job.dump_folder gs://BUCKET/runs/NAME)"
            )
        if parsed.scheme not in RUN_FOLDER_SCHEMES:
            raise ConfigError(
                f"{field} is a {parsed.scheme}:// URL; a run folder is a local path or a "
                "gs:// or file:// URL (orbax writes checkpoints to no other kind)"
            )
        try:
            fsspec.get_filesystem_class(parsed.scheme)
        except ImportError:
            raise ConfigError(
                f"{field}: {parsed.scheme}:// needs gcsfs, which is not "
                "installed: pip install 'titan-jax[tpu]' (or gcsfs)"
            ) from None
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ConfigError(
                    f"{field} names host {parsed.netloc!r}; a file:// URL names "
                    "a path on this machine (file:///abs/path)"
                )
            path = urllib.parse.unquote(parsed.path)
            setattr(getattr(config, section), key, path if key == "folder" else f"file://{path}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


INT32_MAX = 2**31 - 1  # step counters and shapes inside the compiled step are int32


def _check_numbers(config: JobConfig) -> None:
    """Every int fits the step's int32 counters and every float is finite."""
    for section, values in config.to_dict().items():
        for key, value in values.items():
            where = f"{section}.{key}={value}"
            if isinstance(value, int) and not isinstance(value, bool):
                _require(
                    -INT32_MAX <= value <= INT32_MAX,
                    f"{where} is out of range; at most {INT32_MAX} (int32)",
                )
            elif isinstance(value, float):
                _require(math.isfinite(value), f"{where} must be a finite number")


def _check_run_subfolders(config: JobConfig) -> None:
    """The folders named relative to `job.dump_folder` (checkpoints, TensorBoard events,
    profiler traces) are absolute or stay inside it: a relative path that climbs out writes
    among folders of the user's (and checkpoints would take theirs for its own)."""
    for field, folder in (
        ("checkpoint.folder", config.checkpoint.folder),
        ("metrics.save_tb_folder", config.metrics.save_tb_folder),
        ("profiling.save_traces_folder", config.profiling.save_traces_folder),
    ):
        if Path(folder).is_absolute():
            continue
        _require(
            folder.strip() not in ("", ".") and ".." not in Path(folder).parts,
            f"{field}={folder!r} must name a folder inside job.dump_folder (no '..', not "
            "the dump folder itself) or be an absolute path",
        )


def _check_dump_folder(config: JobConfig) -> None:
    """The dump folder is the run's own: never the current directory, whose files (a
    metrics.jsonl of the user's) the run would rewrite."""
    folder = config.job.dump_folder
    _require(
        folder.strip() != "" and Path(folder).absolute() != Path.cwd().absolute(),
        f"job.dump_folder={folder!r} is the current directory; name a folder of its own "
        "for the run's outputs, e.g. outputs/my_run",
    )


def validate(config: JobConfig) -> None:
    """Checks values that are valid types but impossible; model/mesh checks happen where known."""
    _check_numbers(config)
    _check_dump_folder(config)
    _check_run_subfolders(config)
    _check_training(config.training)
    _check_rest(config)


def _check_training(t: Training) -> None:
    _require(
        t.local_batch_size >= 1, f"training.local_batch_size={t.local_batch_size} must be >= 1"
    )
    _require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        f"training.global_batch_size={t.global_batch_size} must be >= 1 or -1 (local x dp)",
    )
    _require(t.seq_len >= 1, f"training.seq_len={t.seq_len} must be >= 1")
    _require(t.steps >= 1, f"training.steps={t.steps} must be >= 1")
    _require(0 <= t.seed < 2**31, f"training.seed={t.seed} must be in [0, 2**31)")
    _require(t.max_norm >= 0, f"training.max_norm={t.max_norm} must be >= 0 (0 disables)")
    _require(
        t.max_consecutive_bad_steps >= 1,
        f"training.max_consecutive_bad_steps={t.max_consecutive_bad_steps} must be >= 1",
    )
    _check_data(t)


def _check_rest(config: JobConfig) -> None:
    p = config.parallelism
    for name in (
        "data_parallel_replicate_degree",
        "tensor_parallel_degree",
        "expert_parallel_degree",
        "expert_parallel_chunks",
        "context_parallel_degree",
        "pipeline_parallel_degree",
        "pipeline_parallel_virtual_stages",
    ):
        degree = getattr(p, name)
        _require(degree >= 1, f"parallelism.{name}={degree} must be >= 1")
    _require(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"parallelism.data_parallel_shard_degree={p.data_parallel_shard_degree} "
        "must be >= 1 or -1 (fill the remaining devices)",
    )
    _require(
        p.pipeline_parallel_microbatches == -1 or p.pipeline_parallel_microbatches >= 1,
        f"parallelism.pipeline_parallel_microbatches={p.pipeline_parallel_microbatches} "
        "must be >= 1 or -1 (one per stage)",
    )
    _require(
        p.num_slices == -1 or p.num_slices >= 1,
        f"parallelism.num_slices={p.num_slices} must be >= 1 or -1 (from the devices)",
    )
    _require(config.job.cpu_devices >= 0, f"job.cpu_devices={config.job.cpu_devices} must be >= 0")
    o = config.optimizer
    _require(o.lr > 0, f"optimizer.lr={o.lr} must be > 0")
    _require(
        0 <= o.beta1 < 1 and 0 <= o.beta2 < 1,
        f"optimizer betas ({o.beta1}, {o.beta2}) must be in [0, 1)",
    )
    _require(o.eps > 0, f"optimizer.eps={o.eps} must be > 0")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    for key in ("load_balance_coeff", "router_aux_loss_coef"):
        value = getattr(config.moe, key)
        _require(value >= 0, f"moe.{key}={value} must be >= 0 (0 turns it off)")
    s = config.lr_scheduler
    _require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps={s.warmup_steps} must be >= 0")
    _require(
        s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
        f"lr_scheduler.decay_ratio={s.decay_ratio} must be in [0, 1] or none",
    )
    _require(
        0 <= s.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor={s.min_lr_factor} must be in [0, 1]"
    )
    m = config.metrics
    _require(m.log_freq >= 1, f"metrics.log_freq={m.log_freq} must be >= 1")
    _require(
        m.peak_flops is None or m.peak_flops > 0,
        f"metrics.peak_flops={m.peak_flops} must be > 0 FLOP/s, or none to look it up",
    )
    v = config.validation
    _require(v.freq >= 1, f"validation.freq={v.freq} must be >= 1")
    _require(
        v.steps == -1 or v.steps >= 1,
        f"validation.steps={v.steps} must be >= 1 or -1 (the whole validation set)",
    )
    _require(
        v.local_batch_size >= 1, f"validation.local_batch_size={v.local_batch_size} must be >= 1"
    )
    _require(v.seq_len >= 1, f"validation.seq_len={v.seq_len} must be >= 1")
    pr = config.profiling
    _require(pr.profile_freq >= 1, f"profiling.profile_freq={pr.profile_freq} must be >= 1")
    _require(
        1 <= pr.profile_steps <= pr.profile_freq,
        f"profiling.profile_steps={pr.profile_steps} must be in [1, profile_freq="
        f"{pr.profile_freq}]",
    )
    _check_distributed(config.distributed)
    _check_yarn(config.model)
    _check_quantize(config.quantize)
    _check_lora(config.lora)
    _check_dpo(config)
    c = config.checkpoint
    _require(c.interval >= 1, f"checkpoint.interval={c.interval} must be >= 1")
    _require(
        c.keep_latest_k >= 0,
        f"checkpoint.keep_latest_k={c.keep_latest_k} must be >= 0 (0 keeps all)",
    )
    _check_local_tier(config)


def _check_local_tier(config: JobConfig) -> None:
    """The local tier of multi-tier checkpoints: a folder of each host's own, apart from the
    persistent checkpoints."""
    c = config.checkpoint
    _require(c.local_interval >= 1, f"checkpoint.local_interval={c.local_interval} must be >= 1")
    if not c.local_folder:
        return
    field = f"checkpoint.local_folder={c.local_folder}"
    _require(c.enable, f"{field} needs checkpoint.enable=true (or leave local_folder empty)")
    _require(
        "://" not in c.local_folder and Path(c.local_folder).is_absolute(),
        f"{field} must be an absolute path on each host's own storage (a RAM disk or local "
        "SSD, e.g. /dev/shm/NAME)",
    )
    local = Path(os.path.abspath(c.local_folder))
    persistent = Path(c.folder)
    if not persistent.is_absolute():
        if "://" in config.job.dump_folder:
            return  # the persistent tier is in a bucket: apart from any local path
        persistent = Path(config.job.dump_folder) / c.folder
    persistent = Path(os.path.abspath(persistent))
    _require(
        not (local.is_relative_to(persistent) or persistent.is_relative_to(local)),
        f"{field} overlaps the persistent checkpoints in {persistent}; give the local tier a "
        "folder of its own outside checkpoint.folder",
    )


def _check_quantize(q: Quantize) -> None:
    names = q.module_names()
    unknown = [n for n in names if n not in QUANTIZE_MODULES]
    _require(
        not unknown,
        f"quantize.modules={q.modules!r}: {', '.join(map(repr, unknown))} "
        f"is not a group of matmuls; use a comma-separated subset of "
        f"{','.join(QUANTIZE_MODULES)}",
    )
    _require(len(set(names)) == len(names), f"quantize.modules={q.modules!r} names a group twice")
    _require(
        q.mode == "none" or bool(names),
        f"quantize.modules is empty: nothing would run in "
        f"{q.mode}; name some of {','.join(QUANTIZE_MODULES)}, or set quantize.mode=none",
    )
    _require(
        1 <= q.block_size <= 2**16, f"quantize.block_size={q.block_size} must be in [1, 65536]"
    )


def _check_lora(lo: Lora) -> None:
    """A rank of 0 is off, so any other lora key changed then is a mistake (it would do
    nothing); with a rank, the targets are known names and dropout is a rate PEFT accepts."""
    if lo.rank <= 0:
        changed = [
            f"lora.{f.name}={getattr(lo, f.name)!r}"
            for f in dataclasses.fields(Lora)
            if f.name != "rank" and getattr(lo, f.name) != f.default
        ]
        if changed:
            raise ConfigError(
                f"{changed[0]} has no effect with lora.rank={lo.rank}; set "
                "lora.rank >= 1 to train adapters, or leave [lora] out"
            )
        _require(lo.rank == 0, f"lora.rank={lo.rank} must be >= 1, or 0 (off)")
        return
    _require(lo.alpha > 0, f"lora.alpha={lo.alpha} must be > 0")
    _require(0 <= lo.dropout < 1, f"lora.dropout={lo.dropout} must be in [0, 1)")
    _require(lo.base_block_size >= 1, f"lora.base_block_size={lo.base_block_size} must be >= 1")
    _require(
        lo.base_dtype == "nf4" or lo.base_block_size == 64,
        f"lora.base_block_size={lo.base_block_size} has no effect with lora.base_dtype="
        f"{lo.base_dtype}; set lora.base_dtype=nf4, or leave it out",
    )
    names = lo.target_names()
    unknown = [n for n in names if n not in LORA_TARGETS]
    _require(
        not unknown,
        f"lora.target_modules={lo.target_modules!r}: "
        f"{', '.join(map(repr, unknown))} is no target; use a comma-separated subset of "
        f"{','.join(LORA_TARGETS)}",
    )
    _require(bool(names), "lora.target_modules is empty; name some of " + ",".join(LORA_TARGETS))
    _require(
        len(set(names)) == len(names),
        f"lora.target_modules={lo.target_modules!r} names a target twice",
    )
    experts = [p for p in lo.projections() if p.startswith("experts.")]
    _require(
        not (lo.dropout and experts),
        f"lora.dropout={lo.dropout} with adapters on the "
        f"experts ({','.join(experts)}): PEFT's fused-expert adapters take no dropout; set "
        "lora.dropout=0, or leave the experts out of lora.target_modules",
    )


def _check_dpo(config: JobConfig) -> None:
    """DPO and preference data go together; a pair is two documents of one row (masked and
    positioned apart), read whole by one data shard."""
    d, t = config.dpo, config.training
    preference = t.data_format == "preference"
    if not d.enable:
        changed = [
            f"dpo.{f.name}={getattr(d, f.name)!r}"
            for f in dataclasses.fields(Dpo)
            if getattr(d, f.name) != f.default
        ]
        if changed:
            raise ConfigError(
                f"{changed[0]} has no effect with dpo.enable=false; set "
                "dpo.enable=true to train on preference pairs"
            )
        _require(
            not preference,
            "training.data_format='preference' trains with DPO: set "
            "dpo.enable=true ([dpo] beta, loss_type)",
        )
        return
    _require(
        preference,
        f"dpo.enable=true trains on preference pairs, not "
        f"training.data_format={t.data_format!r}: set training.data_format='preference' "
        "(records with prompt, chosen and rejected)",
    )
    _require(math.isfinite(d.beta) and d.beta > 0, f"dpo.beta={d.beta} must be a number > 0")
    _require(
        t.document_mask and t.document_positions,
        "training.data_format='preference' needs training.document_mask=true and "
        "training.document_positions=true (a pair's chosen and rejected sequences are two "
        "documents of one row)",
    )
    _require(
        not t.mixture,
        "training.mixture is not supported with DPO; train on one "
        "preference store (training.dataset_path)",
    )
    _require(
        config.parallelism.context_parallel_degree == 1,
        f"parallelism.context_parallel_degree={config.parallelism.context_parallel_degree}"
        " is not supported with DPO (a pair's log-probabilities are summed over its whole "
        "row); use 1",
    )
    _require(
        config.moe.router_aux_loss_coef == 0,
        f"moe.router_aux_loss_coef={config.moe.router_aux_loss_coef} is not supported with "
        "DPO; use 0 (the aux-loss-free balancing still runs)",
    )


def _check_yarn(m: Model) -> None:
    if m.rope_type != "yarn":  # nothing reads the yarn_* keys then: a changed one is a slip
        for f in dataclasses.fields(YarnScaling):
            value = getattr(m, f"yarn_{f.name}")
            _require(
                value == getattr(YarnScaling, f.name),
                f"model.yarn_{f.name}={value} applies with model.rope_type=yarn only (it "
                f"is {m.rope_type!r}); add --model.rope_type yarn, or leave it out",
            )
        return
    try:
        yarn_of(m).validate(prefix="model.yarn_")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def yarn_of(m: Model) -> YarnScaling:
    """The YaRN scaling the `[model]` yarn_* keys describe."""
    return YarnScaling(
        **{f.name: getattr(m, f"yarn_{f.name}") for f in dataclasses.fields(YarnScaling)}
    )


def packs_whole_conversations(t: Training) -> bool:
    """The run's rows hold whole conversations (data/packing.py), not windows."""
    return t.data_format in ("messages", "prompt_completion") and t.sft_packing == "whole"


def _check_data(t: Training) -> None:
    for i, m in enumerate(t.mixture):
        _require(
            bool(m.path.strip()), f"training.mixture[{i}].path is empty; name a token store folder"
        )
        _require(
            math.isfinite(m.weight) and m.weight > 0,
            f"training.mixture[{i}].weight={m.weight} must be a number > 0",
        )
        # Sources are named by path (metrics, the data state): a path twice is one source.
        first = next(j for j, other in enumerate(t.mixture) if other.path == m.path)
        _require(
            first == i,
            f"training.mixture[{i}].path={m.path!r} is also "
            f"training.mixture[{first}]'s; list it once, with the weights summed",
        )
    total = sum(m.weight for m in t.mixture)
    _require(
        math.isfinite(total),
        f"training.mixture weights sum to {total}; scale them down (only their ratios matter)",
    )
    _require(
        t.dataset != "tokens" or bool(t.dataset_path) or bool(t.mixture),
        "training.dataset='tokens' needs training.dataset_path (token store folders, "
        "written by `titan-jax prepare-data`)",
    )
    _require(
        t.document_mask or not t.document_positions,
        "training.document_positions=true needs training.document_mask=true",
    )
    _require(
        not packs_whole_conversations(t) or (t.document_mask and t.document_positions),
        f"training.data_format={t.data_format!r} packs whole conversations into rows "
        "(training.sft_packing='whole'), each attended and positioned apart: set "
        "training.document_mask=true and training.document_positions=true, or "
        "training.sft_packing='window'",
    )


def _check_distributed(d: Distributed) -> None:
    _require(
        d.initialization_timeout >= 1,
        f"distributed.initialization_timeout={d.initialization_timeout} must be >= 1 seconds",
    )
    _require(
        d.step_timeout >= 0,
        f"distributed.step_timeout={d.step_timeout} must be >= 0 seconds (0 = no limit)",
    )
    _require(
        d.heartbeat_timeout >= 1,
        f"distributed.heartbeat_timeout={d.heartbeat_timeout} must be >= 1 seconds",
    )
    _require(
        d.num_processes >= 1 or d.num_processes == AUTO,
        f"distributed.num_processes={d.num_processes} must be >= 1, or -1 to auto-detect "
        "(-1 means auto in every key)",
    )
    if d.num_processes > 1:
        host, _, port = d.coordinator_address.rpartition(":")
        _require(
            bool(host) and port.isdigit(),
            f"distributed.coordinator_address={d.coordinator_address!r} must be host:port "
            f"(process 0's) with distributed.num_processes={d.num_processes}",
        )
        _require(
            1 <= int(port) <= 65535,
            f"distributed.coordinator_address={d.coordinator_address!r}: port {port} is "
            "not a TCP port (1-65535)",
        )
        _require(
            0 <= d.process_id < d.num_processes,
            f"distributed.process_id={d.process_id} must be in [0, "
            f"{d.num_processes}) with distributed.num_processes={d.num_processes}",
        )
    else:
        explicit = [
            f"{k}={v!r}"
            for k, v in (
                ("coordinator_address", d.coordinator_address),
                ("process_id", d.process_id),
            )
            if v not in ("", -1)
        ]
        _require(
            not explicit,
            f"distributed.{explicit[0] if explicit else ''} needs "
            "distributed.num_processes > 1 (the number of processes in the job)",
        )
