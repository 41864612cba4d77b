"""Model families behind one interface (`spec.py`), registered by `model.name`."""

from typing import Any

from titan_jax.models import qwen3  # noqa: F401  (registers "qwen3")
from titan_jax.models.spec import (
    ArgsOverrides,
    BuildOptions,
    ModelArgs,
    ModelDef,
    ModelSpec,
    register_model,
    registered_model,
    spec_of_args,
)


def get_model_spec(name: str) -> ModelSpec[Any]:
    """The family registered as `name` (config `model.name`); a ConfigError lists the valid
    ones."""
    return registered_model(name)


__all__ = [
    "ArgsOverrides",
    "BuildOptions",
    "ModelArgs",
    "ModelDef",
    "ModelSpec",
    "get_model_spec",
    "register_model",
    "spec_of_args",
]
