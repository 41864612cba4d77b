"""Qwen3 model family: flavours, Flax modules, the pure-function view used by the trainer, and
its registration as model.name = "qwen3"."""

import dataclasses

from titan_jax.models.qwen3 import decode, hf
from titan_jax.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args, get_flavor
from titan_jax.models.qwen3.build import Qwen3Def, build_model_def
from titan_jax.models.qwen3.flops import flops_per_token
from titan_jax.models.qwen3.hf_config import read_hf_config
from titan_jax.models.qwen3.model import Qwen3
from titan_jax.models.spec import ArgsOverrides, ModelSpec, register_model


class _HF:
    """HF transformers `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` checkpoints."""

    read_config = staticmethod(read_hf_config)
    load_params = staticmethod(hf.load_hf_params)
    save = staticmethod(hf.save_hf)
    save_peft = staticmethod(hf.save_peft)
    live_tensors = staticmethod(hf.live_hf_tensors)


def configure(args: Qwen3Args, overrides: ArgsOverrides) -> Qwen3Args:
    """The run's RoPE scaling (`[model]` rope_type, yarn_*) and, on a MoE flavour's args, its
    `[moe]` knobs."""
    if overrides.yarn is not None:
        args = dataclasses.replace(args, yarn=overrides.yarn)
    if not args.is_moe:
        return args
    return dataclasses.replace(
        args,
        load_balance_coeff=overrides.load_balance_coeff,
        router_aux_loss_coef=overrides.router_aux_loss_coef,
    )


QWEN3 = ModelSpec(
    name="qwen3",
    args_class=Qwen3Args,
    flavors=QWEN3_FLAVORS,
    build=build_model_def,
    flops_per_token=flops_per_token,
    hf=_HF(),
    generate=decode.generate,
    configure=configure,
    display_name="Qwen3",
)
register_model(QWEN3)

__all__ = [
    "QWEN3",
    "QWEN3_FLAVORS",
    "Qwen3",
    "Qwen3Def",
    "Qwen3Args",
    "build_model_def",
    "get_flavor",
]
