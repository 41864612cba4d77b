"""Context parallelism: attention over a split sequence equals the unsplit attention (forward and
gradients), training on cp meshes gives the one-device losses, and what cp cannot split is
refused with one line naming the field."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from parallel_helpers import TINY, make_batches, run_losses, single_device_overrides, tiny_config

from titan_jax.config import ConfigError, load_config
from titan_jax.models import ring_attention
from titan_jax.models.attention import attention, causal_gqa_attention
from titan_jax.models.sharding_hooks import Parallelism
from titan_jax.parallel.context_parallel import ContextParallel, load_balanced_order
from titan_jax.parallel.per_shard import manual_per_shard
from titan_jax.train.checkpoint import Checkpointer
from titan_jax.train.plan_decisions import context_parallel_kernel
from titan_jax.train.run_checks import check_context_parallel
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

STEPS = 10


class SplitSequence(Parallelism):
    """Only context parallelism over `cp` ranks (and, with per_shard_kernels, kernels run on
    each rank's shard, manual over `cp`)."""

    def __init__(self, cp, per_shard_kernels=False, method="allgather"):
        self.cp, self.per_shard_kernels, self.method = cp, per_shard_kernels, method

    def sequence_split(self):
        return ContextParallel(self.cp, self.method)

    def run_per_shard(self, kernel, args, in_axes, out_axes):
        if not self.per_shard_kernels:
            return super().run_per_shard(kernel, args, in_axes, out_axes)
        return manual_per_shard(kernel, args, (P(),) * len(args), P(), ("cp",))


def test_load_balanced_order_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i():
    np.testing.assert_array_equal(load_balanced_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    order = load_balanced_order(48, 4)
    assert sorted(order) == list(range(48))
    work = [np.sum(order[r * 12 : (r + 1) * 12] + 1) for r in range(4)]  # keys each query sees
    assert len(set(work)) == 1  # equal causal work on every rank


@pytest.mark.parametrize(
    "method, cp, heads, kv_heads, documents",
    [
        ("allgather", 2, 4, 2, False),
        ("ring", 2, 4, 2, False),
        ("ring", 4, 4, 1, True),
        pytest.param("allgather", 4, 4, 1, False, marks=pytest.mark.slow),
    ],
)  # cp8: the losses
def test_attention_under_cp_equals_unsplit_attention(
    method, cp, heads, kv_heads, documents, monkeypatch
):
    """Forward and gradients (fp32) of each rank's chunks against K/V all-gathered or passed
    around the ring (its query blocks of 4 rows, rematerialised), with and without segment
    ids, equal the unsplit causal attention's."""
    monkeypatch.setattr(ring_attention, "QUERY_BLOCK", 4)
    b, t, h = 2, 32, 8
    keys = jax.random.split(jax.random.key(cp), 4)
    q = jax.random.normal(keys[0], (b, t, heads, h))
    k, v = (jax.random.normal(key, (b, t, kv_heads, h)) for key in keys[1:3])
    w = jax.random.normal(keys[3], (b, t, heads, h))  # a cotangent that weighs every output
    bounds = (np.arange(t)[None] >= [[5], [11]]).astype(int) + (np.arange(t)[None] >= 23)
    ids = jnp.asarray(bounds, jnp.int32) if documents else None
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    order = load_balanced_order(t, cp)
    laid_out = lambda x: None if x is None else x[:, order]  # noqa: E731

    def split_attention(q, k, v, ids):
        with SplitSequence(cp, method=method).installed():
            return attention(q, k, v, h**-0.5, "xla", "cpu", ids)

    split = jax.shard_map(
        split_attention, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp")
    )

    def loss(f, w):
        return lambda q, k, v: jnp.sum(f(q, k, v) * w)

    def split_and_grads(q, k, v):  # one compile for both
        f = lambda *a: split(*a, laid_out(ids))  # noqa: E731
        return f(q, k, v), jax.grad(loss(f, w[:, order]), argnums=(0, 1, 2))(q, k, v)

    def unsplit_and_grads(q, k, v):  # jitted: op by op, the reference took longer than this
        f = lambda *a: causal_gqa_attention(*a, h**-0.5, ids)  # noqa: E731
        return f(q, k, v), jax.grad(loss(f, w), argnums=(0, 1, 2))(q, k, v)

    got, got_grads = jax.jit(split_and_grads)(laid_out(q), laid_out(k), laid_out(v))
    want, want_grads = jax.jit(unsplit_and_grads)(q, k, v)
    np.testing.assert_allclose(got, want[:, order], atol=2e-6)
    for g, want_g in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, want_g[:, order], atol=2e-5)


def cp_overrides(
    cp: int, fsdp: int = 1, tp: int = 1, ep: int = 1, method: str = "allgather"
) -> list[str]:
    return [
        "--parallelism.context_parallel_method",
        method,
        "--parallelism.context_parallel_degree",
        str(cp),
        "--parallelism.data_parallel_shard_degree",
        str(fsdp * ep),
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--parallelism.expert_parallel_degree",
        str(ep),
        "--training.local_batch_size",
        str(8 // (fsdp * ep)),
        "--training.steps",
        str(STEPS),
    ]


@pytest.fixture(scope="module")
def batches():
    return make_batches(STEPS)


def one_device_run(args, batches, init=None):
    trainer = build_trainer(
        tiny_config(*single_device_overrides(), "--training.steps", str(STEPS)),
        jax.devices()[:1],
        model_args=args,
    )
    init = jax.device_get(trainer.init_state()) if init is None else init
    return init, run_losses(trainer, init, batches)


@pytest.fixture(scope="module")
def dense_reference(batches):
    return one_device_run(TINY, batches)


@pytest.mark.parametrize(
    "mesh",
    [
        dict(cp=2, fsdp=4),
        pytest.param(dict(cp=4, tp=2), marks=pytest.mark.slow),
        pytest.param(dict(cp=8), marks=pytest.mark.slow),
        dict(cp=4, fsdp=2, method="ring"),
    ],
    ids=["cp2_fsdp4", "cp4_tp2", "cp8", "ring_cp4_fsdp2"],
)
def test_cp_losses_equal_one_device(dense_reference, batches, mesh):
    init, want = dense_reference
    trainer = build_trainer(tiny_config(*cp_overrides(**mesh)), model_args=TINY)
    assert (
        trainer.parallelism.implementation == "shard_map" and trainer.plan.degrees.cp == mesh["cp"]
    )
    assert trainer.parallelism.sequence_split().method == mesh.get("method", "allgather")
    # The loader's token ranges: devices holding cp rank 0 read chunks 0 and 2cp-1 only.
    seq, names = trainer.plan.config.training.seq_len, list(trainer.plan.mesh.axis_names)
    rank0 = list(np.take(trainer.plan.mesh.devices, 0, axis=names.index("cp")).flat)
    chunk = seq // (2 * mesh["cp"])
    assert trainer.batches.spans(seq) is None  # one process: all of every row
    assert trainer.batches.spans(seq, rank0) == [(0, chunk), (seq - chunk, seq)]
    assert trainer.batches.sharding.spec == P(("dp_replicate", "fsdp", "ep"), "cp")
    embed = trainer.state_shardings["params"]["layers"]["attention"]["wq"].spec[1]
    assert "cp" in (embed if isinstance(embed, tuple) else (embed,))  # weights sharded over cp
    np.testing.assert_allclose(run_losses(trainer, init, batches), want, rtol=1e-5)


def with_documents(batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The batches as packed documents (`training.document_mask`): (id, segment, position) per
    token, 2-3 documents per row, each with its own positions."""
    rng = np.random.default_rng(1)
    out = []
    for batch in batches:
        rows, t = batch["inputs"].shape
        starts = np.sort(rng.integers(1, t, (rows, 2)), axis=1)
        index = np.arange(t)
        segments = (index[None] >= starts[:, :1]).astype(int) + (index[None] >= starts[:, 1:])
        first = np.where(segments == 0, 0, np.where(segments == 1, starts[:, :1], starts[:, 1:]))
        inputs = np.stack([batch["inputs"], segments, index[None] - first], -1)
        out.append({"inputs": inputs.astype(np.int32), "labels": batch["labels"]})
    return out


@pytest.fixture(scope="module")
def documents_reference(dense_reference, batches):
    """One device's losses on the batches as packed documents, from the dense reference's init."""
    init, plain = dense_reference
    docs = with_documents(batches)
    _, want = one_device_run(TINY, docs, init)
    assert np.abs(want - plain).max() > 1e-3  # the masking changes the losses: it is compared
    return init, docs, want


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(cp=2, fsdp=4), dict(cp=8)], ids=["cp2_fsdp4", "cp8"])
def test_cp_losses_with_document_masking_equal_one_device(documents_reference, mesh):
    init, docs, want = documents_reference
    trainer = build_trainer(tiny_config(*cp_overrides(**mesh)), model_args=TINY)
    np.testing.assert_allclose(run_losses(trainer, init, docs), want, rtol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_resumes_across_cp_degrees(dense_reference, batches, tmp_path):
    init, want = dense_reference
    first = build_trainer(tiny_config(*cp_overrides(cp=2, fsdp=4)), model_args=TINY)
    state = jax.device_put(init, first.state_shardings)
    for batch in batches[:5]:
        state, _ = first.step_fn(state, first.batches.put(batch))
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(5, state, data_state={}, tokens_seen=0)
        second = build_trainer(tiny_config(*cp_overrides(cp=4, tp=2)), model_args=TINY)
        state = ckpt.restore(5, second.abstract_state()).state
    losses = []
    for batch in batches[5:]:
        state, metrics = second.step_fn(state, second.batches.put(batch))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want[5:], rtol=1e-5)


@pytest.mark.slow
def test_moe_cp_losses_and_expert_bias_equal_one_device(batches):
    moe = dataclasses.replace(TINY, num_experts=4, top_k=2, moe_inter_dim=32)
    trainer1 = build_trainer(
        tiny_config(*single_device_overrides(), "--training.steps", str(STEPS)),
        jax.devices()[:1],
        model_args=moe,
    )
    init = jax.device_get(trainer1.init_state())
    # A sharp router: near-uniform init probabilities would flip top-k near-ties on rounding.
    init["params"]["layers"]["moe"]["gate"] = init["params"]["layers"]["moe"]["gate"] * 50
    trainer = build_trainer(tiny_config(*cp_overrides(cp=2, ep=2, fsdp=2)), model_args=moe)
    states = []
    for t in (trainer1, trainer):
        state = jax.device_put(init, t.state_shardings)
        losses = []
        for batch in batches:
            state, metrics = t.step_fn(state, t.batches.put(batch))
            losses.append(float(metrics["loss"]))
        states.append((np.array(losses), np.asarray(state["buffers"]["expert_bias"])))
    (want, want_bias), (got, bias) = states
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.abs(want_bias).max() > 0  # the bias moved: the counts were compared
    np.testing.assert_allclose(bias, want_bias, atol=1e-7)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--training.seq_len", "12"],
            r"^training.seq_len=12 must be a multiple of 2 x "
            r"parallelism.context_parallel_degree = 8 ",
        ),
        (
            ["--parallelism.fsdp_implementation", "jit"],
            r"^parallelism.fsdp_implementation=jit "
            r"cannot host context parallelism",
        ),
    ],
)
def test_what_cp_cannot_split_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        build_trainer(tiny_config(*cp_overrides(cp=4, fsdp=2), *overrides), model_args=TINY)
    assert "\n" not in str(e.value)


def test_a_kernel_that_cannot_take_cp_is_refused_naming_the_field():
    with pytest.raises(
        ConfigError,
        match=r"^model.attention=auto \(resolved: cudnn\) cannot "
        r"run with parallelism.context_parallel_degree=2; use xla or splash$",
    ):
        check_context_parallel(2, {"training.seq_len": 64}, "auto", "cudnn")
    with pytest.raises(
        ConfigError,
        match=r"^validation.seq_len=768 must be a multiple of 2 x "
        r"parallelism.context_parallel_degree x 128 = 1024 for model.attention",
    ):
        check_context_parallel(4, {"validation.seq_len": 768}, "splash", "splash")
    check_context_parallel(4, {"training.seq_len": 1024}, "splash", "splash")
    with pytest.raises(
        ConfigError,
        match=r"^model.attention=splash cannot run with "
        r"parallelism.context_parallel_method=ring \(its blocks",
    ):
        check_context_parallel(2, {"training.seq_len": 64}, "splash", "splash", "ring")
    assert context_parallel_kernel("splash", 2, "ring") == "xla"  # the ring's blocks are XLA's
    assert context_parallel_kernel("splash", 2, "allgather") == "splash"
    check_context_parallel(2, {"training.seq_len": 64}, "auto", "xla", "ring")
    check_context_parallel(1, {"training.seq_len": 63}, "auto", "cudnn")  # no cp: no limits


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)
@pytest.mark.parametrize(
    "recipe, topology, mesh",
    [
        ("configs/qwen3_8b_32k.toml", "v6e-8", {"fsdp": 4, "cp": 2}),
        ("configs/qwen3_30b_a3b_32k.toml", "v5p-16", {"fsdp": 1, "ep": 2, "cp": 4}),
    ],
)
def test_32k_recipes_build_for_their_slices(recipe, topology, mesh):
    """Built (not compiled) on the slice's devices: the cp mesh, splash, 32K sequences and the
    global batch the plans fix (`benchmarks/tpu_plans.py` compiles them)."""
    from titan_jax.planner.topology import compile_only_devices, parse_slice

    trainer = build_trainer(load_config(recipe), compile_only_devices(parse_slice(topology)))
    assert {k: v for k, v in trainer.plan.mesh.shape.items() if v > 1} == {
        k: v for k, v in mesh.items() if v > 1
    }
    assert trainer.plan.attention == "splash" and trainer.parallelism.implementation == "shard_map"
    assert trainer.plan.tokens_per_step == trainer.plan.global_batch_size * 32768
    assert trainer.plan.global_batch_size == load_config(recipe).training.global_batch_size
    assert trainer.plan.model.args.yarn is None  # 32K is Qwen3's native window


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["splash", "xla"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_attention_under_cp_as_the_trainer_runs_it(backend, documents):
    """Each rank's two chunks against gathered K/V (splash: the Pallas interpreter on CPU,
    with its query shards of the block tables), run as the shard_map SimpleFSDP runs it
    (`manual_per_shard`, type-checked), with and without segment ids: forward and
    gradients equal the unsplit attention's."""
    cp, b, t, n, kv, h = 2, 1, 512, 2, 1, 128  # chunks of 128: one splash block each
    keys = jax.random.split(jax.random.key(0), 4)
    q, w = (jax.random.normal(key, (b, t, n, h)) for key in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (b, t, kv, h)) for key in keys[1:3])
    ids = jnp.asarray((np.arange(t)[None] >= 200) + (np.arange(t)[None] >= 390), jnp.int32)
    ids = ids if documents else None
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    order = load_balanced_order(t, cp)
    laid_out = lambda x: None if x is None else x[:, order]  # noqa: E731

    def split_attention(q, k, v, ids):
        with SplitSequence(cp, per_shard_kernels=True).installed():
            return attention(q, k, v, h**-0.5, backend, "cpu", ids)

    split = jax.shard_map(
        split_attention, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp")
    )

    def value_and_grads(f, w):  # one compile for both
        return lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(*a))

    got, got_grads = jax.jit(value_and_grads(lambda *a: split(*a, laid_out(ids)), w[:, order]))(
        laid_out(q), laid_out(k), laid_out(v)
    )
    want, want_grads = jax.jit(
        value_and_grads(lambda *a: causal_gqa_attention(*a, h**-0.5, ids), w)
    )(q, k, v)
    np.testing.assert_allclose(got, want[:, order], atol=1e-5)
    for g, want_g in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, want_g[:, order], atol=2e-5)


def test_collectives_are_named_by_the_mesh_axes_they_span():
    from titan_jax.planner.collectives import spanned_mesh_axes

    shape = {"dp_replicate": 1, "fsdp": 4, "cp": 2, "ep": 1, "tp": 1}
    assert spanned_mesh_axes([[0, 1], [2, 3], [4, 5], [6, 7]], shape) == "cp"
    assert spanned_mesh_axes([[0, 2, 4, 6], [1, 3, 5, 7]], shape) == "fsdp"
    assert spanned_mesh_axes([list(range(8))], shape) == "fsdp+cp"
    assert spanned_mesh_axes([], shape) == "-"
