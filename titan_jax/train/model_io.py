"""Model-only weight files: the orbax model directory `titan-jax convert` writes, and the HF
export at the end of a run.

The orbax side is a model-only checkpoint directory:

    DST/model_args.json   the model's args fields (its family's `ModelSpec.args_class`)
    DST/params/           orbax `StandardCheckpointer` of the params pytree: fp32, titan-jax
                          layout and names, layers stacked (params["layers"]["attention"]["wq"])
    DST/checksums.json    each array's checksum (train/checksums.py), checked when it is read:
                          orbax restores overwritten bytes without a word (older directories
                          have none, and are read unchecked)

Read are that, or one step folder of a training run (`{dump_folder}/checkpoint/{step}`, its
params only; a LoRA run's with its adapters when asked, `run_lora`). Restores go straight onto
target shardings (orbax reads each device's slice).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from titan_jax.atomic_dir import atomic_dir
from titan_jax.config import JobConfig
from titan_jax.config import Lora as LoraSection
from titan_jax.errors import quiet_closed_loop_callbacks, quiet_unstarted_reads
from titan_jax.models import BuildOptions, ModelArgs, ModelSpec, spec_of_args
from titan_jax.models.lora import NO_LORA, Lora, merged
from titan_jax.models.spec import Params
from titan_jax.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    first_line,
    is_checkpoint_dir,
    permission_denied,
)
from titan_jax.train.checksums import checksums
from titan_jax.train.plan_decisions import resolve_lora
from titan_jax.train.run_folder import run_paths
from titan_jax.train.run_plan import resolve_param_dtype
from titan_jax.train.trainer import Trainer

ARGS_FILE = "model_args.json"
PARAMS_DIR = "params"
CHECKSUMS_FILE = "checksums.json"


def save_orbax(
    path: str | Path,
    params: Params,
    args: ModelArgs,
    *,
    overwrite: bool = False,
    source: str | Path | None = None,
) -> None:
    """Writes the model-only orbax checkpoint described in the module docstring, whole or not at
    all (`atomic_dir`: a non-empty `path` is replaced only with `overwrite`, never the source)."""
    writer = jax.process_index() == 0
    sums = checksums(params)[0]  # every process: the sums add up its share
    with atomic_dir(path, overwrite=overwrite, source=source, writer=writer) as tmp:
        if writer:
            (tmp / ARGS_FILE).write_text(json.dumps(dataclasses.asdict(args), indent=2) + "\n")
            (tmp / CHECKSUMS_FILE).write_text(json.dumps(sums, indent=1) + "\n")
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / PARAMS_DIR, params)
        checkpointer.wait_until_finished()


def read_orbax_args(path: str | Path, spec: ModelSpec) -> Any:
    """The args in an orbax model directory's model_args.json, as `spec`'s args class."""
    file = Path(path) / ARGS_FILE
    try:
        fields = json.loads(file.read_text())
    except FileNotFoundError:
        what = (
            "does not exist"
            if not Path(path).exists()
            else f"has no {ARGS_FILE} (not a titan-jax orbax model directory)"
        )
        raise CheckpointError(f"{path} {what}") from None
    except PermissionError as e:
        raise CheckpointError(
            f"orbax model {path} cannot be read: {e.strerror} ({file}); "
            "make it readable by this user"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from None
    known = {f.name for f in dataclasses.fields(spec.args_class)}
    if not isinstance(fields, dict) or set(fields) - known:
        unknown = sorted(set(fields) - known) if isinstance(fields, dict) else fields
        raise CheckpointError(
            f"{file}: unknown fields {unknown}; valid: {', '.join(sorted(known))}"
        )
    return _checked_args(spec, fields, str(file))


def _checked_args(spec: ModelSpec, fields: dict[str, Any], where: str) -> Any:
    """`spec`'s args from stored fields, range-checked (the args class's `validate`) before any
    shape is built from them."""
    try:
        args = spec.args_class(**fields)
        args.validate()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    return args


def checkpoint_args(ckpt: Checkpointer, step: int, spec: ModelSpec) -> Any:
    """The model args a training run's checkpoint `step` was saved with."""
    return _checked_args(
        spec, ckpt.meta(step)["model_args"], f"checkpoint {ckpt.directory / str(step)} (model_args)"
    )


def newest_step(path: Path) -> Path | None:
    """The newest step folder of a run's checkpoint folder `path`; None if it holds none."""
    steps = [p for p in path.iterdir() if is_checkpoint_dir(p)] if path.is_dir() else []
    return max(steps, key=lambda p: int(p.name), default=None)


def orbax_source(path: Path) -> Path:
    """`path` as the orbax readers take it: a run's checkpoint folder means its newest step;
    anything else (a step folder, an orbax model directory) is `path` itself."""
    if is_checkpoint_dir(path) or (path / ARGS_FILE).is_file():
        return path
    return newest_step(path) or path


@dataclasses.dataclass(frozen=True)
class RunLora:
    """A run's LoRA adapters as its checkpoint recorded them (its `[lora]`, resolved for the
    model as training resolved it), and the HF base model it started from, if any."""

    lora: Lora
    base_model: str | None  # checkpoint.initial_load_path, when read as a HF directory


NO_ADAPTERS = RunLora(NO_LORA, None)


def run_lora(path: str | Path, spec: ModelSpec) -> RunLora:
    """The adapters of a run's step folder `path` (NO_LORA for a run without, for a run saved
    before `[lora]` existed, and for an orbax model directory: none of them hold any). Reads
    the step's meta only."""
    path = Path(path).resolve()
    if not is_checkpoint_dir(path):
        return NO_ADAPTERS
    with Checkpointer(path.parent, read_only=True) as ckpt:
        step = int(path.name)
        args = checkpoint_args(ckpt, step, spec)
        recorded = ckpt.meta(step).get("config", {})
    config = JobConfig()
    config.model.flavor = recorded.get("model", {}).get("flavor", config.model.flavor)
    config.lora = LoraSection(**recorded.get("lora", {}))
    c = recorded.get("checkpoint", {})
    base = c.get("initial_load_path") if c.get("initial_load_in_hf") else None
    # `lora.base_dtype=auto` as the run resolved it (a float base: restored exactly in
    # either float dtype).
    param_dtype = resolve_param_dtype(
        recorded.get("training", {}).get("mixed_precision_param", "auto"), jax.devices()
    )
    return RunLora(resolve_lora(config, args, param_dtype), base or None)


def _abstract_params(args: ModelArgs, shardings: Params | None, lora: Lora = NO_LORA) -> Params:
    abstract = spec_of_args(args).build(args, BuildOptions(lora=lora)).abstract_params
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: default, abstract) if shardings is None else shardings
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings
    )


def load_orbax(
    path: str | Path, spec: ModelSpec, shardings: Params | None = None, lora: Lora = NO_LORA
) -> tuple[Any, Params]:
    """(args, params) of a model-only orbax checkpoint, or of one step of a training run's
    checkpoints (its params only, with the adapters `lora` says it holds: `run_lora`),
    restored onto `shardings` (None: the default device)."""
    path = Path(path).resolve()
    if is_checkpoint_dir(path):
        with Checkpointer(path.parent, read_only=True) as ckpt:
            step = int(path.name)
            args = checkpoint_args(ckpt, step, spec)
            target = {"params": _abstract_params(args, shardings, lora)}
            state = ckpt.restore(step, target, model_only=True).state
            assert state is not None  # a restored step always holds its state
            return args, state["params"]
    args = read_orbax_args(path, spec)
    target = _abstract_params(args, shardings)
    if not (path / PARAMS_DIR).is_dir():
        raise CheckpointError(
            f"{path} has no {PARAMS_DIR}/ (not a titan-jax orbax model directory)"
        )
    quiet_closed_loop_callbacks()  # a failed read's one-line error stays one line
    try:
        params = ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)
    except Exception as e:  # orbax and TensorStore raise bare Exception and ValueError
        quiet_unstarted_reads()
        if (denied := permission_denied(e)) is not None:
            raise CheckpointError(
                f"orbax model {path} cannot be read: {denied}; make it readable by this user"
            ) from e
        raise CheckpointError(
            f"orbax model {path} is unreadable (corrupt or truncated): "
            f"{first_line(e)}; convert it again from its source"
        ) from e
    _verify(path, params)
    return args, params


def _verify(path: Path, params: Params) -> None:
    """Every array against the checksum recorded when `path` was written (if it was)."""
    try:
        recorded = json.loads((path / CHECKSUMS_FILE).read_text())
    except FileNotFoundError:
        return
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / CHECKSUMS_FILE}: not valid JSON: {e}") from None
    bad = next((n for n, v in checksums(params)[0].items() if recorded.get(n) != v), None)
    if bad is not None:
        raise CheckpointError(
            f"orbax model {path} is corrupt: {bad} does not match the "
            "checksum recorded when it was written; convert it again from "
            "its source"
        )


def export_hf(trainer: Trainer, params: Any, step: int) -> Path:
    """Writes `params` as a HF safetensors directory `{checkpoint folder}/hf-{step}` (in
    `checkpoint.export_dtype`; a LoRA run's adapters merged into the weights), under a
    temporary name first: the folder is whole or absent."""
    config = trainer.plan.config
    final = run_paths(config).hf_exports / f"hf-{step}"
    if final.exists():
        raise CheckpointSaveError(f"{final} already exists; not overwriting it")
    lora = trainer.plan.model.options.lora  # the plan's
    if lora.rank:  # the adapted model, as one plain HF model
        params = merged(params, lora)
    trainer.plan.model_spec.hf.save(
        final, params, trainer.plan.model.args, dtype=config.checkpoint.export_dtype
    )
    return final
