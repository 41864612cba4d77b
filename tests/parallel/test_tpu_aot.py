"""SimpleFSDP compiled ahead of time for a TPU v5p:2x2x2 (8 chips) on this CPU, with libtpu.

The TPU compiler is the one that matters for the reduce dtype: it is free to move a rounding to
bf16 across an all-reduce (it did, before the jit path reduced per-shard fp32 gradients).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import re
from typing import Any

import jax
import numpy as np
import pytest
from parallel_helpers import GLOBAL_BATCH, SEQ_LEN, TINY, preset_overrides, tiny_config

from titan_jax.planner import hlo_cost, inspect_step
from titan_jax.planner.topology import CHIPS
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)

_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")
_REDUCTION = re.compile(r"\s(all-reduce|all-reduce-start|reduce-scatter)\((.*?)\)")


def compiled_hlo(preset: str, implementation: str, *overrides: str) -> str:
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    config = tiny_config(
        *preset_overrides(preset),
        "--training.mixed_precision_param",
        "bfloat16",
        "--parallelism.fsdp_implementation",
        implementation,
        *overrides,
    )
    trainer = build_trainer(config, list(topology.devices), model_args=TINY)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    return lowered.compile().as_text()


def bf16_reductions(hlo: str) -> list[str]:
    """bf16 operands of all-reduce / reduce-scatter, except small all-gathers that the TPU
    compiler rewrites as an all-reduce of zero-padded shards (operands: dynamic-update-slice)."""
    defs = {m[1]: m[2] for line in hlo.splitlines() if (m := _DEF.match(line))}
    bad = []
    for line in hlo.splitlines():
        if not (m := _DEF.match(line)) or not (r := _REDUCTION.search(m[2])):
            continue
        result_type = m[2][: r.start()]
        dtypes = re.findall(r"\b([a-z]+[0-9]*)\[", result_type)
        operands = [o.strip() for o in r[2].split(",")]
        for dtype, operand in zip(dtypes, operands, strict=False):
            if dtype == "bf16" and "dynamic-update-slice(" not in _source(defs, operand):
                bad.append(line.strip()[:200])
    return bad


def _source(defs: dict[str, str], name: str) -> str:
    """The definition of `name`, looking through copies (TPU moves buffers between memories)."""
    for _ in range(8):
        definition = defs.get(name, "")
        copy = re.search(r"\s(?:copy-done|copy-start|copy|bitcast)\((%[\w.\-]+)", definition)
        if not copy:
            return definition
        name = copy[1]
    return ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, implementation",
    [
        ("fsdp8", "jit"),
        ("ddp8", "jit"),
        ("fsdp8", "shard_map"),
        ("hsdp2x4", "jit"),  # the vocabulary tables gathered there (rules.table_for_vocab)
    ],
)
def test_v5p_fsdp_gathers_bf16_and_reduces_fp32(preset, implementation):
    # one compile shared with the tests below (the shard_map twin's: at 1024 tokens)
    args = SHARD_MAP_1K if implementation == "shard_map" else (preset, implementation, VOCAB)
    hlo, _ = compiled_tiny(*args)
    found = inspect_step.collective_counts(hlo)
    gathers = {t for op, t in _collectives(hlo) if op == "all-gather"}
    # Weights travel in bf16; the vocabulary split's token ids (s32) and hidden states (f32
    # rows of the model dim, so that their gradient is reduced in fp32). DDP gathers nothing.
    if preset == "ddp8":
        assert not gathers, found
    else:
        assert any(t.startswith("bf16") for t in gathers), gathers
        rows = re.compile(rf"f32\[(1,)*\d+,{TINY.dim}\]")  # (tokens, dim) hidden states
        assert {t for t in gathers if t.startswith("f32") and not rows.fullmatch(t)} == set(), (
            gathers
        )
    fp32_bytes = sum(
        c["bytes"]
        for c in found
        if c["op"] in ("all-reduce", "reduce-scatter") and c["dtype"] == "f32"
    )
    assert fp32_bytes > 100_000, found  # the gradients (the tiny model is ~0.4 MB in fp32)
    # Except the vocabulary-parallel embedding's rows (all tokens x dim): one shard contributes
    # each row, so XLA:TPU's narrowing of that sum to bf16 is exact.
    embedding = f"bf16[{GLOBAL_BATCH * SEQ_LEN},{TINY.dim}]"
    assert [r for r in bf16_reductions(hlo) if embedding not in r] == []


def test_auto_precision_follows_the_target_devices_not_the_host():
    """`mixed_precision_param = "auto"` on a CPU host: bf16 for a TPU mesh compiled ahead of
    time, fp32 for the host's own CPU devices."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    config = tiny_config(*preset_overrides("fsdp8"), "--training.mixed_precision_param", "auto")
    tpu = build_trainer(config, list(topology.devices), model_args=TINY)
    cpu = build_trainer(config, jax.devices(), model_args=TINY)
    assert tpu.options.param_dtype == jnp.bfloat16
    assert cpu.options.param_dtype == jnp.float32


@pytest.mark.parametrize(
    "implementation", ["jit", pytest.param("shard_map", marks=pytest.mark.slow)]
)
def test_mixed_precision_reduce_bf16_reduces_gradients_in_bf16(implementation):
    """TorchTitan's `mixed_precision_reduce = "bfloat16"`: every gradient reduction is bf16
    (what is left in fp32 is the scalar loss, grad norm and the loss's softmax sums)."""
    hlo = compiled_hlo("fsdp8", implementation, "--training.mixed_precision_reduce", "bfloat16")
    from titan_jax.planner import hlo_stats

    # Left in fp32 too: the loss's per-token softmax sums over vocabulary shards (tokens x 4 B),
    # and the shard_map twin's staged reductions of the vocabulary split (activations and
    # their gradient, not weight gradients: all tokens' rows, then half of them).
    rows = GLOBAL_BATCH * SEQ_LEN
    vocabulary = {f"f32[{n},{TINY.dim}]" for n in (rows // 2, rows // 8)}
    big = [
        t
        for _, t in _reductions(hlo)
        if t not in vocabulary
        and t[:3] in ("bf1", "f32")
        and sum(hlo_stats.nbytes(*a) for a in hlo_stats.arrays(t)) > 4096
    ]
    assert big and {t.split("[")[0] for t in big} == {"bf16"}, big


def test_offload_follows_the_target_devices_not_the_host(caplog):
    """`activation_checkpoint.mode = "offload"`: kept for a TPU mesh compiled ahead of time,
    selective (with a warning naming the field) on the host's CPU devices, which have no
    separate host memory."""
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    config = tiny_config(*preset_overrides("fsdp8"), "--activation_checkpoint.mode", "offload")
    tpu = build_trainer(config, list(topology.devices), model_args=TINY)
    assert tpu.plan.model.options.remat_mode == "offload"
    assert not caplog.records
    cpu = build_trainer(config, jax.devices(), model_args=TINY)
    assert cpu.plan.model.options.remat_mode == "selective"
    assert "activation_checkpoint.mode=offload" in caplog.text


@pytest.mark.slow
def test_v5p_remat_modes_order_device_memory_and_offload_moves_activations_to_host():
    """Per-chip temporaries of a 16-layer step for v5p: full < selective < none, and offload
    keeps the selective activations in host memory (memory space S(5), host temporaries),
    so its device temporaries drop below selective's; `offload_layer_input` keeps what full
    remat saves, each layer's input, there instead."""
    import dataclasses

    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    args = dataclasses.replace(TINY, n_layers=16, hidden_dim=512, max_seq_len=256)
    memory, hlo = {}, {}
    for mode in ("none", "full", "selective", "offload", "full+input"):
        config = tiny_config(
            *preset_overrides("fsdp8"),
            "--training.seq_len",
            "256",
            "--activation_checkpoint.offload_layer_input",
            str(mode == "full+input").lower(),
            "--training.mixed_precision_param",
            "bfloat16",
            "--activation_checkpoint.mode",
            mode.removesuffix("+input"),
            # the XLA attention, whose saved values are exactly the named ones
            # below (splash's kernel keeps residuals of its own)
            "--model.attention",
            "xla",
        )
        trainer = build_trainer(config, list(topology.devices), model_args=args)
        compiled = trainer.lower_step(
            trainer.abstract_state(), inspect_step.abstract_batch(trainer)
        ).compile()
        memory[mode], hlo[mode] = compiled.memory_analysis(), compiled.as_text()
    temp = {mode: m.temp_size_in_bytes for mode, m in memory.items()}
    assert temp["full"] < temp["selective"] < temp["none"], temp
    assert temp["offload"] < temp["selective"], temp
    # Exactly what selective saves, now on the host: per layer and token (one sequence per
    # chip, bf16) q 64, k 32, v 32, attn_out 64, wo_out 64, ffn_w1 512, ffn_w3 512 values.
    saved_per_layer = 256 * (64 + 32 + 32 + 64 + 64 + 512 + 512) * 2
    assert memory["offload"].host_temp_size_in_bytes == 16 * saved_per_layer, memory["offload"]
    assert memory["selective"].host_temp_size_in_bytes == 0
    assert "S(5)" in hlo["offload"] and "S(5)" not in hlo["selective"]
    # full remat's saved layer inputs (one sequence per chip, the fp32 residual stream), all
    # 16 on the host
    assert memory["full+input"].host_temp_size_in_bytes == 16 * 256 * args.dim * 4
    assert memory["full"].host_temp_size_in_bytes == 0


VOCAB = 8 * 131  # a vocabulary size no other dimension of the tiny model has, split 8 ways


@functools.cache
def compiled_tiny(
    preset: str, implementation: str, vocab: int, *overrides: str
) -> tuple[str, dict[str, Any]]:
    """The per-chip v5p-16 (8 chips) program of the tiny model with `vocab` rows (a size no
    other dimension has), and the abstract state with its shardings; one compile per test
    module run, shared by the tests below."""
    import dataclasses

    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    config = tiny_config(
        *preset_overrides(preset),
        "--training.mixed_precision_param",
        "bfloat16",
        "--parallelism.fsdp_implementation",
        implementation,
        *overrides,
    )
    trainer = build_trainer(
        config, list(topology.devices), model_args=dataclasses.replace(TINY, vocab_size=vocab)
    )
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    return lowered.compile().as_text(), {
        "state": trainer.abstract_state(),
        "shardings": trainer.state_shardings,
    }


def full_vocab_arrays(preset: str, implementation: str, vocab: int) -> list[str]:
    """Arrays of the per-chip program with the whole vocabulary as a dimension."""
    hlo, _ = compiled_tiny(preset, implementation, vocab)
    return sorted(set(re.findall(rf"\b(?:f32|bf16)\[[0-9,]*\b{vocab}\b[0-9,]*\]", hlo)))


@pytest.mark.parametrize(
    "preset, implementation",
    [
        ("fsdp8", "jit"),
        pytest.param("fsdp4_tp2", "shard_map", marks=pytest.mark.slow),
    ],
)
def test_no_chip_holds_a_full_vocabulary_buffer(preset, implementation):
    """The vocabulary tables stay split over the data axes (and tp): their lookup, logits and
    gradients exist only as each chip's slice (8 x 131 = 1048 rows: 131 per chip)."""
    assert full_vocab_arrays(preset, implementation, VOCAB) == []


# The shard_map twin at 16 x 64 tokens: its vocabulary reduce-scatters are big enough (256 KiB)
# for XLA:TPU to choose between an all-reduce and a reduce-scatter.
SHARD_MAP_1K = (
    "fsdp8",
    "shard_map",
    VOCAB,
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "16",
    "--training.local_batch_size",
    "2",
)


@pytest.mark.parametrize(
    "compile_args",
    [
        ("fsdp8", "jit", VOCAB),
        # the look-ahead gather reads the next layer's slice by index: cast there, per layer too
        (
            "fsdp8",
            "jit",
            VOCAB,
            "--activation_checkpoint.mode",
            "full",
            "--parallelism.fsdp_lookahead_gather",
            "true",
        ),
        # (not fsdp4_tp2: its stacked shards' shapes are also activation shapes of this model)
        pytest.param(SHARD_MAP_1K, marks=pytest.mark.slow),
    ],
    ids=["jit", "jit-lookahead", "shard_map"],
)
def test_layer_weights_are_cast_to_bf16_one_layer_at_a_time(compile_args):
    """No bf16 copy of a stacked (all layers) weight shard: XLA:TPU hoists a plain cast of the
    layer loop's weight slice out of the loop (compiler_workarounds.cast_in_loop; measured
    before the fix: every stacked shard had its bf16 twin here, 3.5 GB per chip for 8B on
    v5p-8)."""
    hlo, found = compiled_tiny(*compile_args)
    params = zip(
        jax.tree.leaves(found["state"]["params"]),
        jax.tree.leaves(found["shardings"]["params"]),
        strict=True,
    )
    stacked = {
        "bf16[" + ",".join(map(str, sharding.shard_shape(leaf.shape))) + "]"
        for leaf, sharding in params
        if leaf.ndim >= 2 and leaf.shape[0] == TINY.n_layers
    }
    assert len(stacked) >= 4, stacked  # the layer loop's weights
    assert sorted(s for s in stacked if s in hlo) == []


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result type) of every all-gather, all-reduce and reduce-scatter, one per array of a
    combined (tuple-typed) one, an XLA:TPU reduce-scatter emitter (`all-reduce-scatter`
    fusion) counted as a reduce-scatter (its inner all-reduce not counted)."""
    found = []
    for computation in re.split(r"\n(?=\S)", hlo):
        if computation.startswith("%all-reduce-scatter"):
            continue
        for m in re.finditer(
            r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter)"
            r"(?:-start)?\(",
            computation,
        ):
            found += [(m[2], t) for t in re.findall(r"\b[a-z]+[0-9]*\[[0-9,]*\]", m[1])]
        found += [
            ("reduce-scatter", m[1].split("{")[0])
            for m in re.finditer(r"= (\S+) fusion\([^\n]*calls=%all-reduce-scatter", computation)
        ]
    return found


def _reductions(hlo: str) -> list[tuple[str, str]]:
    return [c for c in _collectives(hlo) if c[0] != "all-gather"]


@pytest.mark.slow
def test_vocabulary_rows_are_reduce_scattered_on_eight_chips():
    """The embedding's looked-up rows and the loss's hidden-state gradient (all 1024 tokens x
    dim, one shard's slice kept) are reduce-scattered in two steps of true reduce-scatters
    (reduce_scatter.staged_psum_scatter), never all-reduced whole: a single psum_scatter over
    a v5p-16's eight chips compiles to an all-reduce (test below)."""
    hlo, _ = compiled_tiny(*SHARD_MAP_1K)
    rows, dim = 16 * 64, TINY.dim
    found = _reductions(hlo)
    assert [r for r in found if r[1].endswith(f"[{rows},{dim}]")] == [], found
    # each of the two: a reduce-scatter to half the rows over pairs, then to an eighth
    for shape in (f"[{rows // 2},{dim}]", f"[{rows // 8},{dim}]"):
        assert sum(op == "reduce-scatter" and t.endswith(shape) for op, t in found) >= 2, found


def test_a_single_psum_scatter_over_eight_v5p_chips_is_an_all_reduce():
    """What the staging works around (libtpu 0.0.42.1): over a v5p:2x2x2's eight chips one
    psum_scatter of 1024 x 64 fp32 rows compiles to an all-reduce of all rows; the staged one
    to reduce-scatters only."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from titan_jax.parallel.reduce_scatter import staged_psum_scatter

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2").devices
    mesh = Mesh(np.array(devices), ("fsdp",))
    x = jax.ShapeDtypeStruct((1024, 64), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    forms = {
        "single": lambda x: lax.psum_scatter(x, "fsdp", scatter_dimension=0, tiled=True),
        "staged": lambda x: staged_psum_scatter(x, ("fsdp",)),
    }
    found = {
        name: _reductions(
            jax.jit(
                jax.shard_map(
                    lambda x, f=f: f(x * 2),
                    mesh=mesh,
                    in_specs=PartitionSpec(),
                    out_specs=PartitionSpec("fsdp"),
                    check_vma=False,
                )
            )
            .lower(x)
            .compile()
            .as_text()
        )
        for name, f in forms.items()
    }
    assert found["single"] == [("all-reduce", "f32[1024,64]")], found
    assert {op for op, _ in found["staged"]} == {"reduce-scatter"}, found


@pytest.mark.slow
def test_the_full_vocabulary_check_can_fail():
    # 1049 does not divide over 8 shards: the tables fall back to FSDP gathers, and the gathered
    # table and its per-shard gradient are full-vocabulary arrays.
    assert full_vocab_arrays("fsdp8", "jit", VOCAB + 1)


# The debug model's layer (dim 256, ffn 3072; 2 of its 8 layers) at 2 x 256 tokens per chip on
# a v5e-4: weights and compute large enough for XLA:TPU to make the in-loop gathers
# asynchronous (the tiny model's are synchronous, 0% covered either way).
DEBUG_LAYERS = dataclasses.replace(TINY, dim=256, hidden_dim=3072, max_seq_len=256)


# The look-ahead covers the gathers with more compute: measured 1.35x (11.8% -> 16.0% of
# their ICI time on the v5e-4's open rings, 2026-12-02, libtpu 0.0.42.1). A ratio, not
# points: the shares scale with the ICI bandwidth the estimate assumes, the ratio does not.
MIN_GAIN = 1.2


def overlap_report(lookahead: str) -> dict[str, Any]:
    from titan_jax.planner.aot_compile import compile_report

    config = tiny_config(
        "--training.mixed_precision_param",
        "bfloat16",
        "--activation_checkpoint.mode",
        "full",
        "--model.attention",
        "xla",
        "--parallelism.fsdp_lookahead_gather",
        lookahead,
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "-1",
    )
    return compile_report(config, "v5e-4", model_args=DEBUG_LAYERS)


@pytest.mark.slow
def test_lookahead_gather_raises_the_compiled_gather_overlap():
    """The compile report's in-loop all-gather overlap with and without the look-ahead: the
    forward's gathers get the previous layer's compute, the backward's are unchanged
    (docs/TPU.md), for one more layer of gathered weights at most. Both compiled here: the
    figure moves with the estimate's costing of the compute under each gather."""
    plain, ahead = overlap_report("false"), overlap_report("true")
    assert ahead["in_loop_all_gathers"] == plain["in_loop_all_gathers"] == 14  # 7 x (fwd, bwd)
    assert ahead["in_loop_all_gather_s"] == pytest.approx(plain["in_loop_all_gather_s"])
    assert 0 < plain["in_loop_all_gather_overlap_pct"] < 100 / MIN_GAIN, plain
    assert (
        ahead["in_loop_all_gather_overlap_pct"]
        >= plain["in_loop_all_gather_overlap_pct"] * MIN_GAIN
    ), (plain, ahead)
    a = DEBUG_LAYERS
    layer_bf16 = 2 * a.dim * (2 * (a.n_heads + a.n_kv_heads) * a.head_dim + 3 * a.hidden_dim)
    temps = [r["memory"]["temp_size_in_bytes"] for r in (plain, ahead)]
    assert temps[1] <= temps[0] + layer_bf16, temps


def _gathered_weight_types(hlo: str) -> collections.Counter:
    """Element types of a compiled program's all-gathers of the projection weights (results
    with every dim > 1: not the embedding's or output's tables, nor scales), counted."""
    return collections.Counter(
        dtype
        for dtype, dims in re.findall(r"= (\w+)\[([\d,]+)\][^ ]* all-gather(?:-start)?\(", hlo)
        if min(int(d) for d in dims.split(",")) > 1
    )


def _matmul_operand_types(hlo: str) -> collections.Counter:
    """(lhs, rhs) element types of every dot and convolution of a compiled program."""
    types = {m[1]: m[2] for m in re.finditer(r"(?m)^\s*(?:ROOT\s+)?(%[\w.\-]+) = (\w+)\[", hlo)}
    return collections.Counter(
        (types.get(m[1]), types.get(m[2]))
        for m in re.finditer(r" (?:dot|convolution)\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)
    )


def test_int8_training_on_v6e_runs_its_matmuls_in_int8_and_is_priced_at_the_int8_peak():
    """`quantize.mode=int8` compiled for v6e-8: the projections' and SwiGLU's matmuls (forward
    and both backward ones) take s8 x s8 operands, attention's score products stay bf16, FSDP
    gathers s8 codes, each chip computes only its own rows (FLOPs per chip as bf16's), and the
    estimate prices the int8 ones at the chip's int8 rate (twice bf16's)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4")
    programs = {}
    for mode in ("none", "int8"):
        config = tiny_config(
            *preset_overrides("fsdp8"),
            "--training.mixed_precision_param",
            "bfloat16",
            "--quantize.mode",
            mode,
        )
        trainer = build_trainer(config, list(topology.devices), model_args=TINY)
        programs[mode] = (
            trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
            .compile()
            .as_text()
        )
    plain, int8 = (_matmul_operand_types(programs[m]) for m in ("none", "int8"))
    assert ("s8", "s8") not in plain
    # Per layer: 4 projections + 3 SwiGLU matmuls, each forward, grad-input and grad-weight.
    assert int8[("s8", "s8")] >= 7 * 3
    assert ("bf16", "bf16") in int8  # attention's own products, the loss's projection
    # FSDP gathers the weights' codes (`quantize.gather = "auto"`), not bf16 weights.
    assert _gathered_weight_types(programs["none"]).keys() == {"bf16"}
    assert _gathered_weight_types(programs["int8"]).keys() == {"s8"}
    chip = CHIPS["v6e"]
    costs = {m: hlo_cost.estimate(programs[m], chip, 8) for m in programs}
    assert costs["int8"]["flops_per_chip"] == pytest.approx(
        costs["none"]["flops_per_chip"], rel=0.05
    )
    no_discount = dataclasses.replace(chip, peak_int8_ops=0.0)
    assert (
        hlo_cost.estimate(programs["int8"], chip, 8)["compute_s"]
        < hlo_cost.estimate(programs["int8"], no_discount, 8)["compute_s"]
    )


def test_fp8_training_on_ironwood_runs_its_matmuls_in_e4m3_forward_and_e5m2_backward():
    """`quantize.mode=fp8` compiled for TPU7x (4 chips, 8 TensorCores): the projections' and
    SwiGLU's forward matmuls take e4m3 x e4m3, the backward ones an e5m2 gradient; FSDP gathers
    the weights as e4m3 codes; the estimate prices them at Ironwood's fp8 rate."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="tpu7x:2x2x1")
    config = tiny_config(
        *preset_overrides("fsdp8"),
        "--training.mixed_precision_param",
        "bfloat16",
        "--quantize.mode",
        "fp8",
    )
    trainer = build_trainer(config, list(topology.devices), model_args=TINY)
    hlo = (
        trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
        .compile()
        .as_text()
    )
    types = _matmul_operand_types(hlo)
    forward = types[("f8e4m3fn", "f8e4m3fn")]
    backward = types[("f8e5m2", "f8e4m3fn")] + types[("f8e4m3fn", "f8e5m2")]
    assert forward >= 7 and backward >= 2 * 7, types
    assert _gathered_weight_types(hlo).keys() == {"f8e4m3fn"}  # the codes travel, one byte each
    chip = CHIPS["tpu7x"]  # fp8 at twice bf16's rate, e5m2 x e4m3 included
    assert chip.mxu_time_factors == {"f8e4m3fn": 0.5, "f8e5m2": 0.5}
    no_discount = dataclasses.replace(chip, peak_fp8_flops=0.0)
    assert (
        hlo_cost.estimate(hlo, chip, 8)["compute_s"]
        < hlo_cost.estimate(hlo, no_discount, 8)["compute_s"]
    )


@pytest.mark.usefixtures("least_compile_effort")
@pytest.mark.parametrize(
    "topology,mode,qtype,ep",
    [("v5p-16", "int8", "s8", 2), ("tpu7x-8", "fp8", "f8e4m3fn", 1)],
)
def test_quantized_experts_compile_to_low_precision_kernels_on_tpu(topology, mode, qtype, ep):
    """MoE with `quantize.modules` including experts: the experts' grouped matmuls (tokamax's
    Mosaic kernels, forward and both backward ones) take `qtype` operands, and FSDP gathers
    the experts as `qtype` codes (`quantize.gather = "auto"`; under ep each chip its own
    experts), where `param_dtype` gathers them in bf16 (the same gathers at twice the bytes);
    each chip's kernels take the same one-byte operands either way (and its FLOPs are
    unchanged)."""
    from titan_jax.planner.topology import compile_only_devices, parse_slice

    moe = dataclasses.replace(TINY, dim=128, num_experts=4, top_k=2, moe_inter_dim=128)
    devices = compile_only_devices(parse_slice(topology))
    programs = {}
    for gather in ("auto", "param_dtype"):
        # 4 x 64 tokens x 2 picks a device: the kernel takes at least 128 rows.
        config = tiny_config(
            *preset_overrides("fsdp8"),
            "--parallelism.expert_parallel_degree",
            str(ep),
            "--training.mixed_precision_param",
            "bfloat16",
            "--quantize.mode",
            mode,
            "--quantize.gather",
            gather,
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--training.global_batch_size",
            "32",
        )
        trainer = build_trainer(config, devices, model_args=moe)
        programs[gather] = (
            trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
            .compile()
            .as_text()
        )
    kernels = {g: _expert_kernels(hlo, qtype) for g, hlo in programs.items()}
    # w1, w3, w2: forward, dlhs, drhs, every one on two `qtype` operands either way
    assert len(kernels["auto"]) >= 3 * 3, kernels["auto"]
    assert all(len(shapes) == 2 for _, shapes in kernels["auto"]), kernels["auto"]
    assert sorted(kernels["auto"]) == sorted(kernels["param_dtype"])
    # the experts' gathers: the same ones, of `qtype` codes where `param_dtype`'s are bf16
    expert_shape = f"[{moe.num_experts // ep},128,128]"
    gathered = {g: _gathers(hlo, expert_shape) for g, hlo in programs.items()}
    assert set(gathered["param_dtype"]) == {("bf16", expert_shape)}, gathered
    assert gathered["auto"] == {
        (qtype, expert_shape): gathered["param_dtype"]["bf16", expert_shape]
    }
    chip = parse_slice(topology).chip
    flops = {g: hlo_cost.estimate(hlo, chip, 8)["flops_per_chip"] for g, hlo in programs.items()}
    assert flops["auto"] == pytest.approx(flops["param_dtype"], rel=0.05)


def _expert_kernels(hlo: str, qtype: str) -> list[tuple[str, tuple[str, ...]]]:
    """Per grouped-matmul kernel of the experts (tokamax's Mosaic calls): its result's type and
    its `qtype` operands' shapes, what it computes on (the others: the scales, as the
    compiler pads them, and the groups' bookkeeping)."""
    types = {m[1]: (m[2], m[3]) for m in re.finditer(_TYPED_DEF, hlo)}
    found = []
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line or "ragged" not in line.lower():
            continue
        result, args = line.split(" = ", 1)[1].split(" custom-call(", 1)
        operands = [types[n] for n in re.findall(r"(%[\w.\-]+)", args) if n in types]
        found.append((result.split("{")[0], tuple(sorted(s for t, s in operands if t == qtype))))
    return found


_TYPED_DEF = r"(?m)^\s*(?:ROOT\s+)?(%[\w.\-]+) = (\w+)(\[[\d,]*\])"


def _gathers(hlo: str, shape: str) -> collections.Counter[tuple[str, str]]:
    """(element type, shape) of a compiled program's all-gathers whose results have `shape`."""
    found = re.findall(r"= (\w+)(\[[\d,]+\])[^ ]* all-gather(?:-start)?\(", hlo)
    return collections.Counter((dtype, s) for dtype, s in found if s == shape)
