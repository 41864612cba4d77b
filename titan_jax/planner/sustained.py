"""The rates TPU chips sustain, as published by their makers' microbenchmarks: what share of a
chip's peak (`topology.Chip`) a matmul, an HBM transfer or a collective reaches at its size,
and the host link's bandwidth. The step-time estimate (`planner/hlo_cost.py`) prices each
compiled instruction at these rates; nothing here is fitted to a step time.

Each curve is a published sweep, interpolated linearly in log(size) between its points and
held at its end points outside them (no extrapolation). A chip with no published sweep of
its own borrows another's, named beside it (docs/TPU.md, "Sustained rates").
"""

from __future__ import annotations

import bisect
import dataclasses
import math

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Curve:
    """A share of peak by size: `points` (size, share), sizes ascending."""

    points: tuple[tuple[float, float], ...]
    source: str

    def __post_init__(self) -> None:
        sizes = [s for s, _ in self.points]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] <= 0:
            raise ValueError(f"curve sizes must be positive and ascending: {sizes}")

    def __call__(self, size: float) -> float:
        sizes = [s for s, _ in self.points]
        if size <= sizes[0]:
            return self.points[0][1]
        if size >= sizes[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(sizes, size)
        (s0, f0), (s1, f1) = self.points[i - 1], self.points[i]
        return f0 + (f1 - f0) * math.log(size / s0) / math.log(s1 / s0)


# bf16 matmuls, by the side of the cube of equal work: (m x n x k)^(1/3).
_IRONWOOD_GEMM = Curve(
    ((512, 0.091), (1024, 0.303), (2048, 0.589), (4096, 0.774), (16384, 0.824), (32768, 0.829)),
    # per TensorCore, of 1,153.5 TFLOP/s; m=n=k, gemm_multiple_run, libtpu 2025-10-22
    "AI-Hypercomputer/accelerator-microbenchmarks Ironwood/Ironwood_Microbenchmarks_readme.md",
)
_V6E_GEMM = Curve(
    ((8192, 0.901),),  # 827.5 TFLOP/s timed on device, scoped VMEM 64 MiB
    "AI-Hypercomputer/tpu-recipes microbenchmarks/README.md (v6e-1, 8192^3)",
)
_V5E_GEMM = Curve(
    ((4096, 0.843), (8192, 0.923)),  # XLA jnp.matmul; 1024^3 is host-dispatch bound
    "docs.jax.dev Pallas TPU: Matrix Multiplication (v5e, XLA bf16 matmul)",
)

# HBM, by the bytes one instruction reads and writes (a copy of n bytes moves 2n).
_IRONWOOD_HBM = Curve(
    tuple(
        (2 * mib * MiB, share)
        for mib, share in (
            (2, 0.374),
            (4, 0.610),
            (16, 0.747),
            (32, 0.816),
            (64, 0.839),
            (128, 0.861),
            (8192, 0.870),
        )
    ),
    # copy on tpu7x-2x2x1, GB/s per chip of 7,380 (2 MiB 2,759; 32 MiB 6,020; 8 GiB 6,421)
    "AI-Hypercomputer/accelerator-microbenchmarks Ironwood/guides/hbm/hbm.md",
)
_V6E_HBM = Curve(
    ((2 * 32 * MiB, 0.829),),  # 1,359.6 GB/s of 1,640, copy of 32 MiB
    "AI-Hypercomputer/tpu-recipes microbenchmarks/README.md (v6e HBM copy)",
)
_V5P_HBM = Curve(
    ((2 * 65e6, 0.845),),  # 2.29-2.38 TB/s of 2,765 (83-86%): the middle
    "AI-Hypercomputer/maxtext docs/guides/optimization/shard_mode_performance.md "
    "(relayout copies >= 65 MB in v5p profiles)",
)

# Collectives, by the bytes one device sends: the share of the largest transfer's bandwidth
# (178.8 GB/s at 0.40 GB; 174.7 at 0.10; 161.9 at 0.025; 129.2 at 6.3 MB; 71.8 at 1.6 MB).
# Only Ironwood's sweep is published; every chip borrows its shape, applied to the ring
# bandwidth of the links a collective uses (`topology.Chip.ring_bytes_per_s`).
COLLECTIVE = Curve(
    (
        (1.572864e6, 0.401),
        (6.291456e6, 0.723),
        (2.5165824e7, 0.906),
        (1.00663296e8, 0.978),
        (4.02653184e8, 1.0),
    ),
    "AI-Hypercomputer/accelerator-microbenchmarks Ironwood/guides/collectives/all_gather.md "
    "(f32 all-gather, tpu7x 2x2x1 and 2x2x2)",
)

# generation -> curve. Ironwood's collective sweep is the only one published: every chip borrows
# it.
COLLECTIVES = dict.fromkeys(("tpu7x", "v6e", "v5e", "v5p", "v4"), COLLECTIVE)
# generation -> (matmul curve, HBM curve). v5p has no published matmul sweep: it borrows
# v5e's (the same generation's 128 x 128 MXU); v4 too. v5e and v4 have no HBM figure: they
# borrow v6e's.
MATMUL = {
    "tpu7x": _IRONWOOD_GEMM,
    "v6e": _V6E_GEMM,
    "v5e": _V5E_GEMM,
    "v5p": _V5E_GEMM,
    "v4": _V5E_GEMM,
}
HBM = {"tpu7x": _IRONWOOD_HBM, "v6e": _V6E_HBM, "v5p": _V5P_HBM, "v5e": _V6E_HBM, "v4": _V6E_HBM}

# Host link (PCIe) bytes per second one way per chip, for transfers to and from host memory
# (offloaded activations). "How to Scale Your Model", part 2 (jax-ml/scaling-book tpus.md):
# "typically around 1.5e10 bytes / second per chip", Trillium "32GB/s". Ironwood: none
# published; it borrows Trillium's.
HOST_LINK_BYTES_PER_S = {"v4": 1.5e10, "v5e": 1.5e10, "v5p": 1.5e10, "v6e": 3.2e10, "tpu7x": 3.2e10}
HOST_LINK_SOURCE = "jax-ml/scaling-book tpus.md (How to Scale Your Model, part 2)"


def matmul_share(generation: str, flops: float) -> float:
    """The share of the bf16 peak a matmul instruction of `flops` sustains on its chip, read
    on the chip's published m=n=k curve at the cube of equal work ((flops / 2)^(1/3)): a
    kernel or batched matmul pays its pipeline's fill and drain once per instruction."""
    curve = MATMUL.get(generation)
    return curve(max(flops / 2, 1.0) ** (1 / 3)) if curve else 1.0


def hbm_share(generation: str, moved_bytes: float) -> float:
    """The share of peak HBM bandwidth an instruction moving `moved_bytes` sustains."""
    curve = HBM.get(generation)
    return curve(moved_bytes) if curve else 1.0


def collective_share(generation: str, moved_bytes: float) -> float:
    """The share of its links' bandwidth a collective sustains when one device sends
    `moved_bytes` (a small transfer pays its start-up and synchronisation)."""
    curve = COLLECTIVES.get(generation)
    return curve(moved_bytes) if curve else 1.0
