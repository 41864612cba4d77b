"""The run checks that need more than the config alone: each refuses in one line, and its hint
is bounded work whatever number a user gives."""

import contextlib
import dataclasses
import signal

import jax
import pytest
from tiny_model import TINY

from titan_jax.config import ConfigError, load_config
from titan_jax.parallel.mesh import MeshDegrees
from titan_jax.train.plan_decisions import resolve_quantization
from titan_jax.train.run_checks import check_expert_chunks, check_moe_knobs, divisor_below

TINY_MOE = dataclasses.replace(TINY, num_experts=8, top_k=2, moe_inter_dim=32)


@contextlib.contextmanager
def within(seconds: int):
    """Fails the block if it runs longer than `seconds` (a hang fails, it does not hang CI)."""

    def expire(*_):
        raise AssertionError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("chunks", [3, 10**9, 2**31 - 1])
def test_expert_chunks_hint_is_bounded_work_and_divides_every_batch(chunks):
    config = load_config(
        None,
        [
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "8",
            "--parallelism.expert_parallel_chunks",
            str(chunks),
        ],
    )
    with within(5), pytest.raises(ConfigError, match="must divide each device's 32 picks") as e:
        check_expert_chunks(config, TINY_MOE, MeshDegrees(1, 4, 1, ep=2))
    hint = int(str(e.value).rsplit("use ", 1)[1])
    assert 32 % hint == 0 and hint < chunks and hint == (2 if chunks == 3 else 32)


def test_divisor_below_is_the_largest_and_bounded_for_huge_numbers():
    assert [divisor_below(36, b) for b in (2, 5, 7, 13, 19, 36, 37)] == [1, 4, 6, 12, 18, 18, 36]
    with within(5):
        huge = (2**61 - 1) * 6  # a prime cofactor far past any search
        assert divisor_below(huge, 2**31 - 1) == 6
        found = divisor_below(2**62, 2**31)  # past the search's square: a divisor, not the largest
        assert 2**62 % found == 0 and found < 2**31


@pytest.mark.parametrize(
    "args, modules, message",
    [
        (
            TINY,
            "experts",
            "model.flavor=debugmodel is dense and has no experts, so nothing would run "
            "in int8; name some of attention,mlp, or set quantize.mode=none",
        ),
        (
            TINY_MOE,
            "mlp",
            "model.flavor=debugmodel is MoE and has no dense mlp (its feed-forward is "
            "the experts), so nothing would run in int8; name some of attention,experts, or set "
            "quantize.mode=none",
        ),
    ],
)
def test_quantizing_only_groups_the_model_lacks_is_refused(args, modules, message):
    config = load_config(None, ["--quantize.mode", "int8", "--quantize.modules", modules])
    with pytest.raises(ConfigError) as e:
        resolve_quantization(config, args, MeshDegrees(1, 1, 1), jax.devices()[:1])
    assert str(e.value) == f"quantize.modules={modules!r}: {message}"
    config = load_config(None, ["--quantize.mode", "int8"])  # the default groups: what exists
    assert resolve_quantization(config, args, MeshDegrees(1, 1, 1), jax.devices()[:1]).modules


def test_the_expert_gather_turned_off_on_a_dense_model_is_refused():
    """Its default (true) on a dense model changes nothing and is not told apart from unset."""
    config = load_config(None, ["--parallelism.fsdp_expert_gather_before_router", "false"])
    with pytest.raises(
        ConfigError,
        match=r"^parallelism.fsdp_expert_gather_before_router=false "
        "applies to MoE flavours only; model.flavor=debugmodel is dense",
    ):
        check_moe_knobs(config, TINY)
    check_moe_knobs(config, TINY_MOE)
    check_moe_knobs(
        load_config(None, ["--parallelism.fsdp_expert_gather_before_router", "true"]), TINY
    )
