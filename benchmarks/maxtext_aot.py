"""MaxText's own ahead-of-time compile of the recipes `make plans` compiles for titan-jax, for the
MaxText column of the table in docs/TPU.md (`benchmarks/tpu_plans.py`).

Runs MaxText's `train_compile` from `.venv-maxtext` (`make bench-deps`: MaxText 0.2.5 on the
same jax and libtpu as ours) as a subprocess, one recipe at a time, and reads the compiled
program's `memory_analysis()` from what it prints. Nothing executes on a TPU.

`--price` also has XLA dump MaxText's compiled step and prices it with titan-jax's estimator
(`planner/hlo_cost.py`, as `titan-jax compile` prices ours: its rings from the codegen dump, a
MoE step at balanced routing), with MFU from the same analytic FLOPs as ours (the recipes are
the same Qwen3 models): two systems' programs for one slice under one cost model.

`--calibrate` compiles MaxText's published recipes (tpu-recipes `training/ironwood/`,
`training/trillium/` and `training/v5p/`, each with the model keys and libtpu flags its recipe
sets) and prices each with the same estimator against the step time its authors measured on
the hardware: the estimator's calibration on programs someone else ran (docs/TPU.md,
"Calibration"; its table is `titan_jax/planner/calibration.py`). `--keep DIR` keeps each
compile's program; a recipe already compiled there is re-priced without compiling.

    .venv/bin/python benchmarks/maxtext_aot.py [--only NAME ...] [--price] [--json FILE]
    .venv/bin/python benchmarks/maxtext_aot.py --calibrate [--only NAME ...] [--json FILE]
                                               [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from maxtext_bench import HOW_TO_ADD, base_config, maxtext_python  # noqa: E402

# The recipe of each `make plans` row with a MaxText column: fp32 weights, bf16 compute, full
# remat, AdamW, synthetic data (MaxText keys; NOTES.md).
COMMON = (
    "dataset_type=synthetic",
    "packing=false",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "steps=5",
    "opt_type=adamw",
    "weight_dtype=float32",
    "dtype=bfloat16",
    "remat_policy=full",
    "max_target_length=4096",
)
DENSE_8B = ("model_name=qwen3-8b", "per_device_batch_size=2", "ici_fsdp_parallelism=-1")
MOE = ("sparse_matmul=true", "per_device_batch_size=1")
RECIPES = {
    "8B v5p-8": ("compile_topology=v5p-8", *DENSE_8B),
    "8B v6e-8": ("compile_topology=v6e-8", *DENSE_8B),
    "30B-A3B v5p-16 fsdp8": (
        "compile_topology=v5p-16",
        "model_name=qwen3-30b-a3b",
        *MOE,
        "ici_fsdp_parallelism=-1",
    ),
    "30B-A3B v5p-16 ep8": (
        "compile_topology=v5p-16",
        "model_name=qwen3-30b-a3b",
        *MOE,
        "ici_fsdp_parallelism=-1",
        "ici_expert_parallelism=8",
    ),
    "235B-A22B v5p-256": (
        "compile_topology=v5p-256",
        "model_name=qwen3-235b-a22b",
        *MOE,
        "ici_fsdp_parallelism=16",
        "ici_expert_parallelism=8",
    ),
    "235B-A22B v5p-256 ep16": (
        "compile_topology=v5p-256",
        "model_name=qwen3-235b-a22b",
        *MOE,
        "ici_fsdp_parallelism=8",
        "ici_expert_parallelism=16",
    ),
    "235B-A22B v5p-256 ep32": (
        "compile_topology=v5p-256",
        "model_name=qwen3-235b-a22b",
        *MOE,
        "ici_fsdp_parallelism=4",
        "ici_expert_parallelism=32",
    ),
}
FIELDS = ("argument_size_in_bytes", "temp_size_in_bytes")


@dataclasses.dataclass(frozen=True)
class Published:
    """A MaxText recipe its authors measured on hardware (tpu-recipes' training/ironwood/README:
    step time and MaxText's TFLOP/s per chip), with what its `run_recipe.sh` sets that shapes
    the compiled program: MaxText keys (profiling, logging and data paths left out) and libtpu
    flags."""

    topology: str
    keys: tuple[str, ...]
    libtpu_flags: tuple[str, ...]
    step_s: float
    tflops_per_chip: float
    top_k: int | None  # experts per token (None: dense)
    source: str


_TPU_RECIPES = "AI-Hypercomputer/tpu-recipes training/ironwood/"
_TRILLIUM = "AI-Hypercomputer/tpu-recipes training/trillium/"
_SPLASH_2048 = tuple(
    f"sa_{block}=2048"
    for block in (
        "block_q",
        "block_kv",
        "block_kv_compute",
        "block_q_dkv",
        "block_kv_dkv",
        "block_kv_dkv_compute",
        "block_q_dq",
        "block_kv_dq",
    )
)
_OFFLOAD_QKVO = (
    "remat_policy=custom",
    "decoder_layer_input=offload",
    "out_proj=offload",
    "query_proj=offload",
    "key_proj=offload",
    "value_proj=offload",
)
# The Mixtral recipes: token dropping at capacity 1.25 through dense einsums (no megablox).
_MIXTRAL_DROPPED = (
    *_OFFLOAD_QKVO,
    "attention=flash",
    "use_iota_embed=True",
    "reuse_example_batch=1",
    "sa_block_q=2048",
    "sa_block_q_dkv=2048",
    "sa_block_q_dq=2048",
    "megablox=False",
    "sparse_matmul=False",
    "capacity_factor=1.25",
)
# maxtext `benchmarks/xla_flags_library.py` (tpu-recipes-v0.1.2/v0.1.4), the groups the v6e and
# v5p model configs combine.
_DENSE_VMEM = ("--xla_tpu_scoped_vmem_limit_kib=98304",)
_MOE_VMEM = ("--xla_tpu_scoped_vmem_limit_kib=81920",)
_LAYOUT_FOR_RS = (
    "--xla_tpu_use_minor_sharding_for_major_trivial_input=true",
    "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1",
    "--xla_tpu_assign_all_reduce_scatter_layout=true",
)
_DP_OVERLAP = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)
_CF_FOR_ALL_GATHER = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)
_SC_ALL_REDUCE = (
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false",
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_enable_all_reduce_offload_tracing=true",
    "--xla_tpu_use_tc_device_shape_on_sc=true",
    "--xla_sc_enable_instruction_fusion=false",
    "--xla_sc_disjoint_spmem=false",
    "--xla_sc_disable_megacore_partitioning=true",
)
_HOST_OFFLOAD = (
    "--xla_tpu_enable_all_experimental_scheduler_features=true",
    "--xla_tpu_enable_scheduler_memory_pressure_tracking=true",
    "--xla_tpu_host_transfer_overlap_limit=24",
    "--xla_tpu_aggressive_opt_barrier_removal=ENABLED",
    "--xla_lhs_prioritize_async_depth_over_stall=ENABLED",
    "--xla_tpu_enable_ag_backward_pipelining=true",
    "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED",
    "--xla_should_add_loop_invariant_op_in_chain=ENABLED",
    "--xla_max_concurrent_host_send_recv=100",
    "--xla_tpu_scheduler_percent_shared_memory_limit=100",
    "--xla_latency_hiding_scheduler_rerun=2",
)
_NO_COLLECTIVE_MATMUL = ("--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000",)
_REFUSED_FUSED_GATHER = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"


def _modern(flags: tuple[str, ...]) -> tuple[str, ...]:
    """A 2024-25 recipe's flags on libtpu 0.0.50, which refuses the fused all-gather
    continuation on every chip but v5e (docs/TPU.md): MaxText's newer recipes get the same
    asynchronous FSDP gathers from the SparseCore offload flags titan-jax sets by default."""
    if _REFUSED_FUSED_GATHER not in flags:
        return flags
    from titan_jax.jax_platform import SPARSECORE_OFFLOAD_FLAGS

    kept = tuple(f for f in flags if f != _REFUSED_FUSED_GATHER)
    return (*kept, _REFUSED_FUSED_GATHER.replace("=true", "=false"), *SPARSECORE_OFFLOAD_FLAGS)


_SPLASH_SEQ_MINOR = ("attention=flash", "use_tokamax_splash=True", "sa_use_fused_bwd_kernel=True")
CALIBRATION = {
    "llama3.1-70b 8K bf16, 64 chips": Published(
        "tpu7x-128",
        (
            "model_name=llama3.1-70b",
            "dtype=bfloat16",
            "per_device_batch_size=2",
            "max_target_length=8192",
            "use_iota_embed=True",
            "remat_policy=custom",
            "decoder_layer_input=device",
            "context=device",
            "query_proj=device",
            "key_proj=device",
            "value_proj=device",
            "qkv_proj=device",
            "ici_fsdp_parallelism=-1",
            "opt_type=adamw",
            "mu_dtype=bfloat16",
            *_SPLASH_SEQ_MINOR,
            "sa_block_q=2048",
            "sa_block_kv=2048",
            "sa_block_kv_compute=2048",
            "sa_block_q_dkv=2048",
            "sa_block_kv_dkv=2048",
            "sa_block_kv_dkv_compute=2048",
            "sa_q_layout=SEQ_MINOR",
            "sa_k_layout=SEQ_MINOR",
            "sa_v_layout=HEAD_DIM_MINOR",
        ),
        (
            "--xla_tpu_scoped_vmem_limit_kib=61440",
            "--xla_tpu_bf16_emission_mode=NATIVE_EMISSION",
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true",
        ),
        12.20,
        1207.05,
        None,
        _TPU_RECIPES + "llama3.1-70b/8k-bf16-tpu7x-4x4x4",
    ),
    "gpt-oss-120b 8K bf16, 64 chips": Published(
        "tpu7x-128",
        (
            "model_name=gpt-oss-120b",
            "per_device_batch_size=10.0",
            "max_target_length=8192",
            "dtype=bfloat16",
            "weight_dtype=float32",
            "use_custom_sort_vjp=True",
            "shard_exp_on_fsdp=True",
            "use_tokamax_gmm=True",
            "use_random_routing=False",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "mlpwo=offload",
            "opt_type=adamw",
            "megablox=True",
            "sparse_matmul=True",
            *_SPLASH_SEQ_MINOR,
            "sa_block_q=1024",
            "sa_block_kv=1024",
            "sa_block_kv_compute=1024",
            "sa_block_q_dkv=2048",
            "sa_block_kv_dkv=2048",
            "sa_block_kv_dkv_compute=2048",
            "sa_block_q_dq=2048",
            "sa_block_kv_dq=2048",
            "sa_q_layout=SEQ_MINOR",
            "sa_k_layout=SEQ_MINOR",
            "sa_v_layout=SEQ_MINOR",
            "ici_fsdp_parallelism=64",
            "ici_data_parallelism=2",
            "use_gmm_v2=True",
            "wi_tile_fwd_batch_seq=256",
            "wi_tile_fwd_embed_dim=2880",
            "wi_tile_fwd_mlp_dim=2944",
            "wi_tile_dlhs_batch_seq=256",
            "wi_tile_dlhs_mlp_dim=2880",
            "wi_tile_dlhs_embed_dim=2944",
            "wi_tile_drhs_batch_seq=512",
            "wi_tile_drhs_embed_dim=2880",
            "wi_tile_drhs_mlp_dim=1536",
            "wo_tile_fwd_batch_seq=256",
            "wo_tile_fwd_mlp_dim=2880",
            "wo_tile_fwd_embed_dim=2944",
            "wo_tile_dlhs_batch_seq=256",
            "wo_tile_dlhs_embed_dim=2880",
            "wo_tile_dlhs_mlp_dim=2944",
            "wo_tile_drhs_batch_seq=512",
            "wo_tile_drhs_mlp_dim=2880",
            "wo_tile_drhs_embed_dim=1536",
        ),
        (
            "--xla_tpu_scoped_vmem_limit_kib=65536",
            "--xla_tpu_bf16_emission_mode=NATIVE_EMISSION",
            "--xla_tpu_enable_sparse_core_reduce_scatter_v2=true",
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
            "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
            "--xla_tpu_enable_all_gather_offload_tracing=true",
            "--xla_tpu_use_tc_device_shape_on_sc=True",
            "--xla_sc_disable_megacore_partitioning=True",
            "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
            "--xla_enable_async_all_gather=true",
            "--xla_tpu_prefer_async_allgather_to_allreduce=true",
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
            "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
            "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true",
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true",
            "--xla_tpu_enable_concurrent_sparse_core_offloading=true",
            "--xla_max_concurrent_async_all_gathers=2",
            "--xla_max_concurrent_async_reduce_scatters=2",
            "--xla_tpu_aggressive_opt_barrier_removal=true",
            "--xla_tpu_enable_offloading_gather_to_sparsecore=true",
            "--xla_tpu_sparse_core_all_gather_latency_multiplier=1",
            "--xla_tpu_sparse_core_reduce_scatter_latency_multiplier=3",
            "--xla_tpu_enable_sparse_core_collective_aggregator=true",
            "--xla_tpu_enable_latency_hiding_layer_scheduler=false",
            "--xla_tpu_rerun_latency_hiding_scheduler_post_sc_assignment=true",
            "--xla_tpu_enable_offloading_copy_to_sparsecore=false",
            "--xla_tpu_scheduler_percent_shared_memory_limit=150",
            "--xla_tpu_enable_layer_scheduler_for_dependent_collectives=true",
            "--xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter=true",
            "--xla_tpu_pcie_bandwidth_multiplier=0.03",
            "--xla_tpu_enable_multi_compute_overlap_in_layer_scheduler=true",
        ),
        14.93,
        378.90,
        4,
        _TPU_RECIPES + "gpt-oss-120b/8k-bf16-tpu7x-4x4x4",
    ),
    "qwen3-235b-a22b 4K bf16, 256 chips": Published(
        "tpu7x-512",
        (
            "model_name=qwen3-235b-a22b",
            "per_device_batch_size=16.0",
            "max_target_length=4096",
            "dtype=bfloat16",
            "weight_dtype=float32",
            "opt_type=adamw",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "use_custom_sort_vjp=True",
            # The recipe sets use_random_routing=True, which MaxText 0.2.5 refuses without
            # expert parallelism; the estimate prices balanced routing either way.
            "use_random_routing=False",
            "shard_exp_on_fsdp=False",
            "megablox=False",
            "sparse_matmul=True",
            "use_tokamax_gmm=True",
            *_SPLASH_SEQ_MINOR,
            "sa_block_q=1024",
            "sa_block_kv=1024",
            "sa_block_kv_compute=512",
            "sa_block_q_dkv=2048",
            "sa_block_kv_dkv=2048",
            "sa_block_kv_dkv_compute=1024",
            "sa_block_q_dq=1024",
            "sa_block_kv_dq=1024",
            "sa_q_layout=HEAD_DIM_MINOR",
            "sa_k_layout=SEQ_MINOR",
            "sa_v_layout=HEAD_DIM_MINOR",
            "ici_fsdp_parallelism=-1",
        ),
        (
            "--xla_tpu_dvfs_p_state=3",
            "--xla_tpu_scoped_vmem_limit_kib=61440",
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true",
            *_HOST_OFFLOAD,
        ),
        30.87,
        629.79,
        8,
        _TPU_RECIPES + "qwen3-235b-a22b/4k-bf16-tpu7x-4x8x8",
    ),
    # tpu-recipes' v6e and v5p recipes name a MaxText model config (maxtext
    # `benchmarks/maxtext_{trillium,v5p}_model_configs.py` at the tag or commit their README
    # gives): its tuning keys (profiler, GCS and tokenizer paths left out) and libtpu flags.
    "mistral-7b 8K bf16, v6e-8": Published(
        "v6e-8",
        (
            "model_name=mistral-7b",
            "per_device_batch_size=6",
            "max_target_length=8192",
            "ici_fsdp_parallelism=-1",
            *_OFFLOAD_QKVO,
            "attention=flash",
            "use_iota_embed=True",
            *_SPLASH_2048,
            "sa_use_fused_bwd_kernel=True",
        ),
        _modern(
            _DENSE_VMEM
            + _LAYOUT_FOR_RS
            + _DP_OVERLAP
            + _CF_FOR_ALL_GATHER
            + _SC_ALL_REDUCE
            + _HOST_OFFLOAD
            + _NO_COLLECTIVE_MATMUL
        ),
        6.320,
        431.981,
        None,
        _TRILLIUM + "Mistral-7B-MaxText (maxtext tpu-recipes-v0.1.2 mistral_7b)",
    ),
    "llama3.1-70b 8K bf16, v6e-32": Published(
        "v6e-32",
        (
            "model_name=llama3.1-70b",
            "per_device_batch_size=2",
            "max_target_length=8192",
            "ici_fsdp_parallelism=-1",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "query_proj=offload",
            "key_proj=offload",
            "value_proj=offload",
            "attention=flash",
            "use_iota_embed=True",
            *_SPLASH_2048,
            "sa_use_fused_bwd_kernel=True",
            "weight_dtype=bfloat16",
        ),
        _modern(
            _DENSE_VMEM
            + _LAYOUT_FOR_RS
            + _DP_OVERLAP
            + _CF_FOR_ALL_GATHER
            + _HOST_OFFLOAD
            + _NO_COLLECTIVE_MATMUL
        ),
        17.790,
        443.385,
        None,
        _TRILLIUM + "Llama3.1-70B-MaxText/v6e-32 (maxtext "
        "tpu-recipes-v0.1.4 llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul)",
    ),
    "mixtral-8x7b 4K bf16 dropping, v6e-256": Published(
        "v6e-256",
        (
            "model_name=mixtral-8x7b",
            "per_device_batch_size=12",
            "max_target_length=4096",
            "ici_fsdp_parallelism=-1",
            *_MIXTRAL_DROPPED,
        ),
        _modern(_MOE_VMEM + _CF_FOR_ALL_GATHER + _DP_OVERLAP),
        13.484,
        302.311,
        None,
        _TRILLIUM + "Mixtral-8x7B-MaxText (maxtext tpu-recipes-v0.1.2 mixtral_8x7b_dropped)",
    ),
    "mixtral-8x22b 4K bf16 dropping, v6e-256": Published(
        "v6e-256",
        (
            "model_name=mixtral-8x22b",
            "per_device_batch_size=8",
            "max_target_length=4096",
            "ici_fsdp_parallelism=64",
            "ici_expert_parallelism=4",
            *_MIXTRAL_DROPPED,
            "dtype=bfloat16",
            "weight_dtype=bfloat16",
            "allow_split_physical_axes=True",
            "custom_mesh=hybrid_ring_64x4",
        ),
        _modern(_MOE_VMEM + _CF_FOR_ALL_GATHER + _DP_OVERLAP),
        24.706,
        332.463,
        None,
        _TRILLIUM + "Mixtral-8x22B-MaxText (maxtext tpu-recipes-v0.1.2 mixtral_8x22b_dropped)",
    ),
    "llama4-scout 8K bf16, v5p-256": Published(
        "v5p-256",
        (
            "model_name=llama4-17b-16e",
            "per_device_batch_size=8",
            "max_target_length=8192",
            "ici_fsdp_parallelism=-1",
            "dtype=bfloat16",
            "weight_dtype=float32",
            "megablox=True",
            "sparse_matmul=True",
            "opt_type=adamw",
            "remat_policy=custom",
            "decoder_layer_input=offload",
            "reuse_example_batch=1",
            *_SPLASH_2048,
        ),
        _modern(_MOE_VMEM + _CF_FOR_ALL_GATHER + _DP_OVERLAP + _LAYOUT_FOR_RS + _HOST_OFFLOAD),
        31.652,
        225.491,
        1,
        "AI-Hypercomputer/tpu-recipes training/v5p/"
        "Llama4-Scout-17B-16E-Maxtext (maxtext 3eb77db llama4_scout_dropless_v5p_256)",
    ),
}


def memory_of(log: str) -> dict[str, int]:
    """The sizes of the `Memory analysis: ...` line `train_compile` prints."""
    line = next((x for x in log.splitlines() if x.startswith("Memory analysis:")), None)
    if line is None:
        raise RuntimeError(f"MaxText printed no memory analysis; its last lines:\n{log[-3000:]}")
    return {f: int(m[1]) for f in FIELDS if (m := re.search(rf"{f}=(\d+)", line))}


def _key(keys: tuple[str, ...], key: str) -> str:
    return next(a.split("=", 1)[1] for a in keys if a.startswith(key + "="))


def routed_rows(keys: tuple[str, ...], top_k: int | None) -> float | None:
    """Expert rows a device computes at balanced routing (None: a dense model)."""
    tokens = float(_key(keys, "per_device_batch_size")) * int(_key(keys, "max_target_length"))
    return tokens * top_k if top_k else None


def estimate_dump(dump: Path, topology: str, routed: float | None) -> dict[str, Any]:
    """A MaxText compiled step (`dump`: its XLA dump) priced by our estimator, as `titan-jax
    compile` prices ours: rings from the codegen dump, a MoE step at `routed` rows a device
    (balanced routing)."""
    from titan_jax.planner import hlo_cost
    from titan_jax.planner.topology import compile_only_devices, parse_slice

    optimized = sorted(dump.glob("*jit_train_step*after_optimizations.txt"))
    codegen = sorted(dump.glob("*jit_train_step*after_codegen.txt"))
    if not optimized:
        raise RuntimeError(f"MaxText's compile for {topology} dumped no optimized train step")
    tpu = parse_slice(topology)
    cost = hlo_cost.estimate(
        optimized[-1].read_text(),
        tpu.chip,
        len(compile_only_devices(tpu)),
        hlo_cost.rings(codegen[-1].read_text()) if codegen else None,
        tpu.ring_wraps,
        routed,
    )
    return {
        "est_step_time_s": cost["step_s"],
        "est_compute_s": cost["compute_s"],
        "est_exposed_collective_s": cost["exposed_collective_s"],
        "est_hbm_bytes_per_chip": cost["hbm_bytes_per_chip"],
        "est_seconds_by_class": cost["seconds_by_class"],
    }


def _folder_name(run_name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", run_name)


def train_compile(
    python: Path,
    run_name: str,
    keys: tuple[str, ...],
    libtpu_flags: tuple[str, ...] = (),
    price: Callable[[Path], dict[str, Any]] | None = None,
    keep: Path | None = None,
) -> dict[str, Any]:
    """MaxText's `train_compile` of `keys` (its compiled step's memory and compile time), and
    `price(dump)` of its XLA dump when asked. `keep`: a folder that keeps each recipe's output,
    log and XLA dump in a subfolder named for it; a recipe whose subfolder already holds a
    finished compile is re-priced from it, not recompiled (`--reprice`, or delete it)."""
    kept = keep / _folder_name(run_name) if keep else None
    if kept and (kept / "compile.json").exists():
        row = json.loads((kept / "compile.json").read_text())
        return row | (price(kept / "xla_dump") if price else {})
    with tempfile.TemporaryDirectory(delete=kept is None) as temporary:
        out = kept or Path(temporary)
        out.mkdir(parents=True, exist_ok=True)
        command = [
            str(python),
            "-m",
            "maxtext.trainers.pre_train.train_compile",
            # tokamax's kernels refuse to trace for a TPU from a CPU host without it.
            "--tokamax_cross_compile=true",
            str(base_config(python)),
            f"run_name={_folder_name(run_name)}",
            f"base_output_directory={out}",
            "compile_topology_num_slices=1",
            *keys,
        ]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        if libtpu_flags:
            env["LIBTPU_INIT_ARGS"] = " ".join(libtpu_flags)
        dump = out / "xla_dump"
        if price:
            env["XLA_FLAGS"] = (
                f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                "--xla_dump_hlo_module_re=jit_train_step"
            ).strip()
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        log = done.stdout + done.stderr
        if kept:
            (out / "compile.log").write_text(log)
        if done.returncode:
            raise RuntimeError(f"MaxText's compile of {run_name} failed:\n{log[-3000:]}")
        row = {
            "recipe": run_name,
            "compile_s": round(seconds, 1),
            **{f: v / 1e9 for f, v in memory_of(log).items()},
        }
        if kept:
            (out / "compile.json").write_text(json.dumps(row))
        return row | (price(dump) if price else {})


def compile_recipe(
    python: Path, name: str, priced: bool = False, keep: Path | None = None
) -> dict[str, Any]:
    """One `make plans` recipe compiled by MaxText; priced: with MFU from the same analytic
    FLOPs as ours (the recipes are the same Qwen3 models)."""
    from titan_jax.models.qwen3 import get_flavor
    from titan_jax.models.qwen3.flops import flops_per_token
    from titan_jax.planner.topology import compile_only_devices, parse_slice

    keys = COMMON + RECIPES[name]
    topology = _key(keys, "compile_topology")
    args = get_flavor(name.split()[0])
    seq, per_device = int(_key(keys, "max_target_length")), int(_key(keys, "per_device_batch_size"))

    def price(dump: Path) -> dict[str, Any]:
        row = estimate_dump(
            dump, topology, routed_rows(keys, args.top_k if args.num_experts else None)
        )
        tpu = parse_slice(topology)
        n = len(compile_only_devices(tpu))  # JAX's devices (tpu7x: two a chip)
        analytic = flops_per_token(args, seq) * per_device * seq * n
        return row | {
            "est_mfu_pct": 100 * analytic / (n * tpu.chip.peak_bf16_flops * row["est_step_time_s"])
        }

    return train_compile(python, name, keys, price=price if priced else None, keep=keep)


def calibrate(python: Path, name: str, keep: Path | None = None) -> dict[str, Any]:
    """A published recipe compiled by MaxText, priced, beside its authors' hardware figures.
    Both MFUs count FLOPs as MaxText does (its TFLOP/s per chip): the estimate's is the
    published one scaled by the measured over the estimated step time."""
    from titan_jax.planner.topology import parse_slice

    recipe = CALIBRATION[name]
    keys = (
        f"compile_topology={recipe.topology}",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        "enable_tensorboard=false",
        "steps=5",
        *recipe.keys,
    )
    routed = routed_rows(keys, recipe.top_k)
    row = train_compile(
        python,
        name,
        keys,
        recipe.libtpu_flags,
        lambda dump: estimate_dump(dump, recipe.topology, routed),
        keep,
    )
    chip = parse_slice(recipe.topology).chip
    chip_peak = chip.peak_bf16_flops * chip.devices_per_chip
    measured_mfu = 100 * recipe.tflops_per_chip * 1e12 / chip_peak
    estimated_mfu = measured_mfu * recipe.step_s / row["est_step_time_s"]
    return row | {
        "source": recipe.source,
        "measured_step_s": recipe.step_s,
        "measured_mfu_pct": measured_mfu,
        "est_mfu_pct": estimated_mfu,
        # measured over estimated step time, less one: calibration.Point.residual
        "residual_pct": 100 * (recipe.step_s / row["est_step_time_s"] - 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(RECIPES | CALIBRATION))
    parser.add_argument(
        "--price",
        action="store_true",
        help="also price MaxText's compiled step with titan-jax's estimator",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="the published recipes (Ironwood, v6e, v5p) against their measurements",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="keep each compile's output and XLA dump in a folder under DIR; "
        "a recipe already compiled there is re-priced, not recompiled",
    )
    opts = parser.parse_args()
    python = maxtext_python()
    if python is None:
        print(HOW_TO_ADD)
        return 2
    rows = []
    if opts.keep:
        opts.keep.mkdir(parents=True, exist_ok=True)
    names = opts.only or (CALIBRATION if opts.calibrate else RECIPES)
    for name in names:
        row = (
            calibrate(python, name, opts.keep)
            if name in CALIBRATION
            else compile_recipe(python, name, opts.price, opts.keep)
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
