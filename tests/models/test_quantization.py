"""Low-precision matmuls (models/quantization.py): each scaling recipe is the matmul of qwix's
own quantize-dequantize of the operands, in both modes, for the dense and grouped forms; the
backward quantizes the incoming gradient in the mode's gradient type."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from titan_jax.models.quantization import QTYPES, PrequantizedWeight, Quantization, dot, ragged_dot
from titan_jax.models.qwen3.moe import EXPERT_KERNELS

DIMS = (((1,), (0,)), ((), ()))


def _operands(m: int = 64, k: int = 256, n: int = 96) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    w = 0.02 * jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    # Rows and columns of very different sizes, so one scale per operand and one per row differ.
    return x * jnp.linspace(0.1, 10, m)[:, None], w * jnp.linspace(0.1, 10, n)[None, :]


def _fake_quantized(a: jax.Array, qtype, **how) -> jax.Array:
    return qwix.dequantize(qwix.quantize(a, qtype, **how))


# How each recipe scales x (rows, contracted) and w (contracted, columns), in qwix's terms.
RECIPES = {
    "rowwise": ({"channelwise_axes": [0]}, {"channelwise_axes": [1]}),
    "tensorwise": ({}, {}),
    "blockwise": (
        {"channelwise_axes": [0], "tiled_axes": {1: 64}},
        {"channelwise_axes": [1], "tiled_axes": {0: 64}},
    ),
}


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("scaling", sorted(RECIPES))
def test_a_quantized_matmul_is_the_matmul_of_qwix_quantized_operands(mode, scaling):
    x, w = _operands()
    config = Quantization(mode, ("mlp",), scaling, block_size=64).dot_config("mlp")
    got = jax.jit(lambda x, w: dot(x, w, DIMS, config))(x, w)
    qtype = QTYPES[mode][0]
    x_how, w_how = RECIPES[scaling]
    # Both jitted: XLA may turn a division by the scale into a product with its inverse, which
    # moves a value lying on a rounding boundary by one step.
    want = jax.jit(
        lambda x, w: _fake_quantized(x, qtype, **x_how) @ _fake_quantized(w, qtype, **w_how)
    )(x, w)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))
    exact = x @ w
    error = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
    assert 1e-4 < error < (0.05 if mode == "fp8" else 0.02)  # quantized, and not garbage


def test_scales_follow_the_recipe():
    """Rows of very different sizes: one scale per row keeps the small rows, one per tensor
    rounds them away."""
    x, w = _operands()
    errors = {}
    for scaling in ("rowwise", "tensorwise"):
        config = Quantization("int8", ("mlp",), scaling).dot_config("mlp")
        got, exact = dot(x, w, DIMS, config), x @ w
        errors[scaling] = float(jnp.linalg.norm((got - exact)[:8]) / jnp.linalg.norm(exact[:8]))
    assert errors["rowwise"] * 10 < errors["tensorwise"]


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_the_backward_quantizes_the_gradient_in_the_modes_gradient_type(mode):
    x, w = _operands()
    config = Quantization(mode, ("mlp",)).dot_config("mlp")
    g = jax.random.normal(jax.random.key(2), (x.shape[0], w.shape[1]), jnp.float32)
    _, vjp = jax.vjp(lambda x, w: dot(x, w, DIMS, config), x, w)
    dx, dw = vjp(g)
    exact_dx, exact_dw = g @ w.T, x.T @ g
    for got, exact in ((dx, exact_dx), (dw, exact_dw)):
        error = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
        assert 1e-4 < error < (0.1 if mode == "fp8" else 0.03)
    hlo = (
        jax.jit(jax.grad(lambda x, w: jnp.sum(dot(x, w, DIMS, config) * g), (0, 1)))
        .lower(x, w)
        .as_text()
    )
    forward, gradient = (jnp.dtype(t).name for t in QTYPES[mode])
    names = {"float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2", "int8": "i8"}
    assert names[forward] in hlo and names[gradient] in hlo


def test_no_quantization_is_the_plain_matmul():
    x, w = _operands()
    assert Quantization().dot_config("mlp") is None
    assert Quantization("int8", ("attention",)).dot_config("mlp") is None
    np.testing.assert_array_equal(dot(x, w, DIMS, None), jax.lax.dot_general(x, w, DIMS))


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_grouped_matmuls_scale_per_row_and_per_output_column(mode):
    x, _ = _operands(k=64)
    w_EKN = 0.02 * jax.random.normal(jax.random.key(3), (4, 64, 48), jnp.float32)
    sizes = jnp.array([10, 30, 0, 24], jnp.int32)
    config = Quantization(mode, ("experts",)).ragged_config()
    got = jax.jit(lambda x, w: ragged_dot(x, w, sizes, config))(x, w_EKN)
    qtype = QTYPES[mode][0]
    want = jax.jit(
        lambda x, w: jax.lax.ragged_dot(
            _fake_quantized(x, qtype, channelwise_axes=[0]),
            _fake_quantized(w, qtype, channelwise_axes=[2]),
            sizes,
        )
    )(x, w_EKN)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))


def _on_a_tpu_target(fn, *args):
    """Runs `fn` on CPU with its TPU kernels interpreted: traced for a TPU target (tokamax asks
    the target's chip for its tiling and checks the device unless cross-compiling), lowered
    for the CPU."""
    from jax._src.mesh import AbstractDevice, AbstractMesh
    from tokamax._src import config as tokamax_config

    tpu = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    mesh = AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=tpu)
    with jax.sharding.use_abstract_mesh(mesh), tokamax_config.cross_compile(True):
        compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).compile()
    return compiled(*args)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_tpu_experts_stay_within_quantization_error_and_zero_the_padding_rows(mode):
    """The TPU experts' quantized kernel (tokamax's, interpreted) through the SwiGLU: output
    and gradients within quantization error of bf16's, and the exchange buffer's padding rows
    zero both ways."""
    from titan_jax.models.qwen3.megablox import megablox_swiglu

    m, d, f, e = 512, 256, 256, 4
    keys = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(keys[0], (m, d), jnp.float32).astype(jnp.bfloat16)
    w1, w3 = (0.05 * jax.random.normal(k, (e, d, f), jnp.float32) for k in keys[1:3])
    w2 = 0.05 * jax.random.normal(keys[3], (e, f, d), jnp.float32)
    w1, w3, w2 = (w.astype(jnp.bfloat16) for w in (w1, w3, w2))
    sizes = jnp.array([100, 200, 0, 150], jnp.int32)  # 62 padding rows
    qdtype = Quantization(mode, ("experts",)).kernel_qtype()

    def out_and_grads(kernel, *a):
        y, vjp = jax.vjp(lambda *a: kernel(*a, sizes), *a)
        return y, vjp(jnp.cos(y))

    quantized = _on_a_tpu_target(
        functools.partial(
            out_and_grads, functools.partial(megablox_swiglu, interpret=True, qdtype=qdtype)
        ),
        x,
        w1,
        w3,
        w2,
    )
    exact = jax.jit(functools.partial(out_and_grads, EXPERT_KERNELS["ragged"]))(x, w1, w3, w2)
    (y, grads), (y0, grads0) = quantized, exact
    assert not np.any(np.asarray(y[450:], np.float32)) and not np.any(
        np.asarray(grads[0][450:], np.float32)
    )

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    bound = 0.1 if mode == "fp8" else 0.03
    assert all(1e-4 < rel(a, b) < bound for a, b in zip((y, *grads), (y0, *grads0), strict=True))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_one_quantized_tpu_expert_matmul_is_that_of_qwix_quantized_operands(mode):
    """fp32 in and out, so nothing but the quantization separates the kernel from qwix's
    per-row (tokens) and per-expert, per-column (weights) quantize-dequantize."""
    from titan_jax.models.qwen3.megablox import _quantized_gmm

    x = jax.random.normal(jax.random.key(5), (512, 256), jnp.float32)
    w = 0.05 * jax.random.normal(jax.random.key(6), (4, 256, 384), jnp.float32)
    sizes = jnp.array([100, 200, 0, 150, 62], jnp.int32)  # the last: padding rows
    qdtype = Quantization(mode, ("experts",)).kernel_qtype()
    got = _on_a_tpu_target(lambda x, w: _quantized_gmm(x, w, sizes, qdtype, True), x, w)
    qtype = QTYPES[mode][0]
    want = jax.lax.ragged_dot(
        _fake_quantized(x, qtype, channelwise_axes=[0]),
        _fake_quantized(w, qtype, channelwise_axes=[0, 2]),
        sizes[:-1],
    )
    np.testing.assert_allclose(
        got[:450], want[:450], rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want)))
    )
    assert not np.any(np.asarray(got[450:]))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_tpu_experts_gathered_as_codes_run_as_the_kernel_quantizes_them(mode):
    """tokamax's kernel (interpreted) on experts arriving as codes (`Quantization.expert_weight`,
    per expert and output column): the output the kernel gives quantizing the weight itself,
    the rows' and the weight's (the port's) gradients within quantization error of exact
    ones, and the padding rows zero both ways."""
    from titan_jax.models.qwen3.megablox import _quantized_gmm

    x = jax.random.normal(jax.random.key(7), (256, 128), jnp.float32)
    w = 0.05 * jax.random.normal(jax.random.key(8), (2, 128, 128), jnp.float32)
    sizes = jnp.array([100, 120, 36], jnp.int32)  # the last: padding rows
    quantization = Quantization(mode, ("experts",))
    qdtype = quantization.kernel_qtype()
    read = quantization.expert_weight("megablox")
    assert read is not None

    def codes_and_own(x, w):
        codes = read.quantize(w, lambda m: m)
        y, vjp = jax.vjp(
            lambda x, port: _quantized_gmm(x, PrequantizedWeight(codes, port), sizes, qdtype, True),
            x,
            jnp.zeros_like(w),
        )
        return y, vjp(jnp.cos(y)), _quantized_gmm(x, w, sizes, qdtype, True)

    y, grads, y_own = _on_a_tpu_target(codes_and_own, x, w)
    np.testing.assert_array_equal(y, y_own)
    assert not np.any(np.asarray(y[220:])) and not np.any(np.asarray(grads[0][220:]))
    y0, vjp0 = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes[:-1]), x, w)
    grads0 = vjp0(jnp.cos(y))

    def rel(a, b):
        return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))

    bound = 0.1 if mode == "fp8" else 0.03
    assert 1e-4 < rel(y[:220], y0[:220]) < bound
    assert all(1e-4 < rel(a, b) < bound for a, b in zip(grads, grads0, strict=True))


def test_experts_arrive_as_codes_only_where_their_kernel_takes_them():
    """Gathered as codes under `quantize.gather = "auto"` (scales per output column, and per
    expert for tokamax's kernel), not where tokamax's kernel runs under tp (it scales each tp
    shard's slice of w2's hidden dim on its own), nor with `gather = "param_dtype"`."""
    auto = Quantization("int8", ("experts",))
    assert auto.expert_weight("ragged").scaled_dims(3) == (2,)
    assert auto.expert_weight("megablox").scaled_dims(3) == (0, 2)
    assert auto.expert_weight("ragged", mlp_split=2) is not None
    assert auto.expert_weight("megablox", mlp_split=2) is None
    assert dataclasses.replace(auto, gather="param_dtype").expert_weight("ragged") is None
    assert Quantization("int8", ("mlp",)).expert_weight("ragged") is None


@pytest.mark.parametrize("mode, scaling", [("fp8", "rowwise"), ("int8", "tensorwise")])
def test_a_weight_quantized_in_halves_is_read_as_the_matmul_quantizes_it(mode, scaling):
    """A weight quantized in two halves of its contracted dim with the whole weight's scales
    (what an FSDP shard does, `WeightQuantization`) and handed to `dot` quantized: the output,
    x's gradient and the weight's (through the port) equal `dot` quantizing the weight."""
    x, w = _operands()
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    quantized = Quantization(mode, ("mlp",), scaling).quantized_dot("mlp")
    read = quantized.weight(1)

    def quantizing(x, w):
        return jnp.sum(jnp.sin(dot(x, w, DIMS, quantized.config).astype(jnp.float32)))

    def prequantized(x, port):
        halves = jnp.split(w, 2)
        # Each half's absmax per scale, taken to the whole weight's (its columns' or its own).
        axis = 0 if read.rowwise else None
        whole_max = lambda m: jnp.maximum(m, jnp.max(jnp.abs(w), axis, keepdims=True))  # noqa: E731
        codes = [read.quantize(h, whole_max) for h in halves]
        codes = jax.tree.map(lambda *a: jnp.concatenate(a) if a[0].shape[0] > 1 else a[0], *codes)
        y = dot(x, PrequantizedWeight(codes, port), DIMS, quantized.config)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    want = jax.jit(jax.value_and_grad(quantizing, (0, 1)))(x, w)
    got = jax.jit(jax.value_and_grad(prequantized, (0, 1)))(x, jnp.zeros_like(w))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
