"""FSDP gathers of the weights of quantized matmuls (`quantize.gather = "auto"`): quantized on
their shards with the whole weight's scales and gathered as codes, the loss and the reduced
gradient are those of gathering the weight and quantizing it after (`param_dtype`), on both
SimpleFSDP implementations, for scales that span the gathered dim (`w1`: one per output
column, its rows split) and scales split along it (`w2`: its output columns split)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parallel_helpers import make_batches, preset_overrides, run_losses, tiny_trainer

from titan_jax.models.quantization import Quantization
from titan_jax.models.qwen3.model import project
from titan_jax.models.qwen3.moe import MoE
from titan_jax.parallel.mesh import MeshDegrees, build_mesh
from titan_jax.parallel.rules import ShardingRules
from titan_jax.parallel.simple_fsdp import IMPLEMENTATIONS

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

AXES = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}


def loss_and_grads(implementation: str, quantization: Quantization, dtype: jnp.dtype):
    """((summed loss, gradients), the compiled HLO) of x -> w2(w1 x) on fsdp8 (fsdp4 x tp2
    under jit), the weights read through `project` as the model reads them."""
    tp = 2 if implementation == "jit" else 1
    mesh = build_mesh(MeshDegrees(1, 8 // tp, tp))
    rules = ShardingRules(mesh)
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(keys[0], (64, 32), jnp.float32),
        "w2": jax.random.normal(keys[1], (32, 64), jnp.float32) * 0.1,
    }
    x = jax.random.normal(keys[2], (16, 4, 64), jnp.float32).astype(dtype)
    target = jax.random.normal(keys[3], (16, 4, 64), jnp.float32)
    specs = rules.storage_specs(params, AXES)
    fsdp = IMPLEMENTATIONS[implementation](rules, specs)
    qt = quantization.quantized_dot("mlp")

    def summed(params, buffers, x, labels):
        w1, w2 = (nnx.Param(params[k], logical_axes=AXES[k]) for k in ("w1", "w2"))
        y = project(jax.nn.silu(project(x, w1, 1, qt)), w2, 1, qt)
        return jnp.sum(jnp.square(y.astype(jnp.float32) - labels)), {}

    def step(params, x, target):
        with fsdp.installed():
            return jax.value_and_grad(lambda p: fsdp.loss_map(summed)(p, {}, x, target)[0])(params)

    return run_compiled(step, rules, specs, params, x, target)


def run_compiled(step, rules: ShardingRules, specs, params, x, target):
    """(`step(params, x, target)` compiled and run on `rules`' mesh, params stored as `specs`
    say and rows split over the data axes, its compiled HLO)."""
    mesh = rules.mesh
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        rows = NamedSharding(mesh, P(rules.data_axes))
        args = (params, jax.device_put(x, rows), jax.device_put(target, rows))
        compiled = jax.jit(step).lower(*args).compile()
        return compiled(*args), compiled.as_text()


def gathered_weights(hlo: str) -> list[str]:
    """Element types of the compiled program's all-gathers of 2-D arrays wider than a
    scale row (the weights' codes or values)."""
    found = re.findall(r"= (\w+)\[(\d+),(\d+)\][^ ]* all-gather(?:-start)?\(", hlo)
    return [dtype for dtype, rows, cols in found if min(int(rows), int(cols)) > 1]


@pytest.mark.parametrize("implementation", ["jit", "shard_map"])
@pytest.mark.parametrize(
    "mode, scaling, dtype",
    [("fp8", "rowwise", jnp.bfloat16), ("int8", "tensorwise", jnp.float32)],
)
def test_quantized_gathers_equal_quantizing_after_the_gather(implementation, mode, scaling, dtype):
    results = {
        gather: loss_and_grads(
            implementation, Quantization(mode, ("mlp",), scaling, gather=gather), dtype
        )
        for gather in ("auto", "param_dtype")
    }
    ((loss, grads), hlo), ((ref_loss, ref_grads), ref_hlo) = results["auto"], results["param_dtype"]
    np.testing.assert_array_equal(loss, ref_loss)
    for k in grads:
        assert grads[k].dtype == jnp.float32
        np.testing.assert_array_equal(grads[k], ref_grads[k])
    # The weights travel as codes: s8, and fp8 as XLA:CPU widens it (f16; TPU moves f8e4m3fn:
    # tests/parallel/test_tpu_aot.py); the reference's as the compute dtype (f32).
    assert gathered_weights(ref_hlo) == ["f32", "f32"]
    assert gathered_weights(hlo) == ["s8" if mode == "int8" else "f16"] * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "implementation, mode, scaling",
    [("jit", "fp8", "rowwise"), ("shard_map", "int8", "tensorwise")],
)
def test_fsdp8_training_with_quantized_gathers_follows_quantizing_after_the_gather(
    tiny_init_state, implementation, mode, scaling
):
    """10 steps of the tiny model (fp32 weights: XLA:CPU has no bf16 x bf16 -> f32 dot for
    the quantize-after-gather path's backward on 8 devices) on fsdp8. Not bitwise: the two
    programs fuse differently, and a last-bit difference in an activation can round it to
    another code (fsdp8 against one device, both quantizing after the gather, differ by up to
    3e-4 of the loss over these steps); a gather with wrong scales or no gradient is off by
    percents."""
    batches = make_batches(10)
    losses = {
        gather: run_losses(
            tiny_trainer(
                *preset_overrides("fsdp8"),
                "--parallelism.fsdp_implementation",
                implementation,
                "--quantize.mode",
                mode,
                "--quantize.scaling",
                scaling,
                "--quantize.modules",
                "attention,mlp",
                "--quantize.gather",
                gather,
            ),
            tiny_init_state,
            batches,
        )
        for gather in ("auto", "param_dtype")
    }
    assert losses["auto"][-1] < losses["auto"][0] - 0.2  # it learns
    np.testing.assert_allclose(losses["auto"], losses["param_dtype"], rtol=1e-3)


MOE_DIMS = {"dim": 64, "num_experts": 8, "inter_dim": 32, "top_k": 2}


def moe_loss_and_grads(implementation: str, ep: int, quantization: Quantization):
    """((summed loss, gradients), the compiled HLO) of a squared error of the MoE layer (the
    qwix `ragged` kernel CPU takes for quantized experts) on fsdp (8 / ep) x ep."""
    mesh = build_mesh(MeshDegrees(1, 8 // ep, 1, ep=ep))
    rules = ShardingRules(mesh)
    moe = MoE(
        **MOE_DIMS,
        norm_topk_prob=True,
        w2_std=0.02,
        expert_kernel="ragged",
        rngs=nnx.Rngs(0),
        quantization=quantization,
    )
    graphdef, state = nnx.split(moe)
    params = nnx.to_pure_dict(state)
    params["gate"] = params["gate"] * 50  # decisive picks: no top-k near-ties to flip
    axes = {k: tuple(getattr(moe, k).logical_axes) for k in params}
    specs = rules.storage_specs(params, axes)
    bias_spec = {"expert_bias": P()}
    fsdp = IMPLEMENTATIONS[implementation](rules, specs, bias_spec, param_axes=axes)
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (16, 4, MOE_DIMS["dim"]), jnp.float32)
    target = jax.random.normal(keys[1], (16, 4, MOE_DIMS["dim"]), jnp.float32)

    def summed(params, buffers, x, labels):
        y, _ = nnx.merge(graphdef, params)(x, buffers["expert_bias"])
        return jnp.sum(jnp.square(y - labels)), {}

    def step(params, x, target):
        buffers = {"expert_bias": jnp.zeros((MOE_DIMS["num_experts"],), jnp.float32)}
        with fsdp.installed():
            loss = lambda p: fsdp.loss_map(summed)(p, buffers, x, target)[0]  # noqa: E731
            return jax.value_and_grad(loss)(params)

    return run_compiled(step, rules, specs, params, x, target)


def gathered_experts(hlo: str) -> list[str]:
    """Element types of the compiled program's all-gathers of arrays shaped as the experts'
    weights as a rank uses them (E, D, F) or (E, F, D), under ep its E / ep experts."""
    e, d, f = MOE_DIMS["num_experts"], MOE_DIMS["dim"], MOE_DIMS["inter_dim"]
    found = re.findall(r"= (\w+)\[(\d+),(\d+),(\d+)\][^ ]* all-gather(?:-start)?\(", hlo)
    shapes = {(d, f), (f, d)}
    return [t for t, n, *dims in found if e % int(n) == 0 and tuple(map(int, dims)) in shapes]


@pytest.mark.parametrize("implementation, ep", [("shard_map", 2), ("jit", 1)])
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_experts_gathered_as_codes_equal_quantizing_after_the_gather(implementation, ep, mode):
    """The MoE layer's w1, w3, w2 quantized on their FSDP shards (under ep, each rank's own
    experts, their model dim gathered over fsdp) and gathered as codes: the loss and the
    reduced gradients are those of gathering them in the compute dtype and quantizing after."""
    results = {
        gather: moe_loss_and_grads(
            implementation, ep, Quantization(mode, ("experts",), gather=gather)
        )
        for gather in ("auto", "param_dtype")
    }
    ((loss, grads), hlo), ((ref_loss, ref_grads), ref_hlo) = results["auto"], results["param_dtype"]
    np.testing.assert_array_equal(loss, ref_loss)
    for k in grads:
        assert grads[k].dtype == jnp.float32
        np.testing.assert_array_equal(grads[k], ref_grads[k], err_msg=k)
    assert np.abs(grads["w1"]).max() > 0  # the experts' gradient arrives
    # s8 codes, fp8 as XLA:CPU widens it (f16); the reference's weights in the compute dtype.
    assert gathered_experts(ref_hlo) == ["f32"] * 3
    assert gathered_experts(hlo) == ["s8" if mode == "int8" else "f16"] * 3
