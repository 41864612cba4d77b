"""The decisions `run_plan.plan_run` makes that take more than a line, one function each: each
returns what it decides for this run (the model's args overrides, the microbatches, the
low-precision matmuls, the attention kernel, the LoRA targets, every array's storage layout)
and raises ConfigError where the config cannot be met. The checks that decide nothing are
`run_checks`'.
"""

from __future__ import annotations

from typing import Any

from titan_jax.config import JobConfig, yarn_of
from titan_jax.models import ArgsOverrides, ModelSpec, get_model_spec


def model_choice(config: JobConfig) -> tuple[ModelSpec, Any]:
    """(the family `model.name`, its `model.flavor` args); an unknown name or flavour is a
    ConfigError naming the valid ones."""
    spec = get_model_spec(config.model.name)
    return spec, spec.flavor(config.model.flavor)


def args_overrides(config: JobConfig) -> ArgsOverrides:
    """What the `[model]` RoPE keys and the `[moe]` knobs change in a flavour's args."""
    return ArgsOverrides(
        yarn=yarn_of(config.model) if config.model.rope_type == "yarn" else None,
        load_balance_coeff=config.moe.load_balance_coeff,
        router_aux_loss_coef=config.moe.router_aux_loss_coef,
    )
