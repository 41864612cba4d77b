"""Qwen3 model family: flavours, Flax modules, and the pure-function view used by the trainer."""

from titan_jax.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args, get_flavor
from titan_jax.models.qwen3.build import ModelDef, build_model_def
from titan_jax.models.qwen3.model import Qwen3, RematPolicy

__all__ = ["QWEN3_FLAVORS", "ModelDef", "Qwen3", "Qwen3Args", "RematPolicy", "build_model_def",
           "get_flavor"]
