"""SimpleFSDP on a JAX mesh: weights stored sharded, gathered at use, grads reduced in fp32.

TorchTitan's SimpleFSDP (`ReplicateComputation`): every parameter lives sharded over the
data-parallel mesh axes; at each use it is cast to the param dtype and all-gathered inside the
traced step, so the compiler can schedule the collectives; its gradient is cast to the reduce
dtype (fp32) and reduce-scattered (FSDP), all-reduced (DDP) or both (HSDP). The three modes need
no separate code: the rules table shards weights over `fsdp` (size 1 under pure DDP) and never
over `dp_replicate`, so gathering to "storage spec minus the data axes" is the right collective
for each. Tensor-parallel dims (`tp`) stay split in compute.

Two implementations share the one rules table and plug into the step the same way (the
`Parallelism` hooks of `titan_jax/models/sharding_hooks.py`: `use_param` for the model's weight
reads, `loss_map` around the summed loss), each a class of its own over a shared base
(`base.py`), chosen once (`choose_implementation`; the run plan holds the class):
- "jit" (`jit.py`, the compiler path): sharding constraints; GSPMD places and schedules the
  collectives.
- "shard_map" (`shard_map.py`, the explicit twin): `jax.shard_map` over the data axes with
  `lax.all_gather`, `lax.psum_scatter` and `lax.psum` written out. It proves the compiler path
  right, and hosts what needs manual axes (expert and context parallelism, Pallas kernels of
  MoE on TPU).

`mixed_precision_reduce = "bfloat16"` (TorchTitan allows it) reduces in bf16 instead: the
stored fp32 weight is first cast to the reduce dtype, whose transpose widens the reduced
gradient back to fp32, so master weights and their update stay fp32.

reshard_after_forward is a remat policy on the layer scan (`titan_jax/models/remat.py`): the
gathered weight, found by its checkpoint name, is recomputed in backward, i.e. re-gathered.
"""

from __future__ import annotations

from titan_jax.config_schema import ConfigError, Parallelism
from titan_jax.models.quantization import NONE, Quantization
from titan_jax.models.spec import ModelArgs
from titan_jax.parallel.mesh import MeshDegrees
from titan_jax.parallel.simple_fsdp.base import SimpleFSDP, only_axes
from titan_jax.parallel.simple_fsdp.jit import REPLICAS, SHARDS, JitSimpleFSDP
from titan_jax.parallel.simple_fsdp.shard_map import ShardMapSimpleFSDP

IMPLEMENTATIONS: dict[str, type[SimpleFSDP]] = {
    "jit": JitSimpleFSDP,
    "shard_map": ShardMapSimpleFSDP,
}


def choose_implementation(
    p: Parallelism,
    degrees: MeshDegrees,
    args: ModelArgs,
    flavor: str,
    platform: str = "cpu",
    quantization: Quantization = NONE,
) -> type[SimpleFSDP]:
    """SimpleFSDP's implementation for a run (`parallelism.fsdp_implementation`, "auto" chosen
    here), with the checks expert and context parallelism need; the one place that compares
    the implementations' names. MoE on TPU/GPU (and quantized experts on CPU) takes shard_map:
    the jit path maps the loss over data shards with vmap, which makes the experts'
    `ragged_dot` a batched op that XLA:TPU rejects ("number of batch dimensions should be 0");
    inside shard_map it stays unbatched."""
    if degrees.cp > 1 and p.fsdp_implementation == "jit":
        raise ConfigError(
            "parallelism.fsdp_implementation=jit cannot host context parallelism (its K/V "
            "gathers run over the manual cp axis of the shard_map implementation); use auto or "
            "shard_map"
        )
    # CPU: the looped kernel, unless the experts are quantized (qwix's ragged_dot)
    moe = args.is_moe
    ragged = moe and (platform != "cpu" or quantization.applies_to("experts"))
    if ragged and degrees.ep == 1:
        if p.fsdp_implementation == "jit":
            raise ConfigError(
                f"parallelism.fsdp_implementation=jit cannot compile MoE experts for {platform} "
                "(ragged_dot under the jit path's per-shard vmap); use auto or shard_map"
            )
        return ShardMapSimpleFSDP
    if degrees.ep > 1:
        if not moe:
            raise ConfigError(
                f"parallelism.expert_parallel_degree={degrees.ep} applies to MoE flavours only; "
                f"model.flavor={flavor} is dense (use 1)"
            )
        if args.num_experts % degrees.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree={degrees.ep} must divide the "
                f"{args.num_experts} experts of model.flavor={flavor}"
            )
        if p.fsdp_implementation == "jit":
            raise ConfigError(
                "parallelism.fsdp_implementation=jit cannot host expert parallelism (its token "
                "all-to-alls need the shard_map implementation); use auto or shard_map"
            )
        return ShardMapSimpleFSDP
    if p.fsdp_implementation == "auto":
        return ShardMapSimpleFSDP if degrees.cp > 1 else JitSimpleFSDP
    return IMPLEMENTATIONS[p.fsdp_implementation]


__all__ = [
    "IMPLEMENTATIONS",
    "choose_implementation",
    "REPLICAS",
    "SHARDS",
    "JitSimpleFSDP",
    "ShardMapSimpleFSDP",
    "SimpleFSDP",
    "only_axes",
]
