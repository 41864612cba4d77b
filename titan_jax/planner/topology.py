"""TPU slices by their Cloud names (`v5p-128`, `v6e-8`, ...): chip constants, and compile-only
devices from libtpu, so a pod job can be compiled and measured on a CPU host.

Cloud names count chips for v5e/v6e but TensorCores for v4/v5p/tpu7x (two per chip): v5p-8 is
4 chips. JAX sees a v4/v5p chip as one (megacore) device, an Ironwood (tpu7x) chip as two, one
per TensorCore: tpu7x-8 is 4 chips, 8 devices. A `Chip` row holds one JAX device's figures (for
tpu7x half a chip's); they feed `titan-jax compile`'s estimate (planner/hlo_cost.py) and
roofline bound only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import re
from typing import Any

from titan_jax.errors import TitanJaxError

GiB = 2**30


class TopologyError(TitanJaxError):
    """An unknown TPU slice name, or no libtpu to compile for one."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published figures of one TPU generation, per JAX device (the chip, or for tpu7x one of
    its two TensorCores)."""

    generation: str
    peak_bf16_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bytes_per_s: float  # HBM bandwidth
    ici_bytes_per_s: float  # bidirectional inter-chip interconnect bandwidth, all ports
    dcn_bytes_per_s: float  # data-centre network bandwidth per chip (host NICs / chips per host)
    cores_per_chip: int  # TensorCores per chip, as counted in Cloud slice names
    source: str
    ici_ports: int = 2  # ICI links per chip (4 on a 2-D torus, 6 on a 3-D one)
    mxu_dim: int = 0  # the MXU's systolic array is mxu_dim x mxu_dim (0: shapes not priced)
    peak_int8_ops: float = 0.0  # dense int8 OP/s (0: none published; priced at bf16's)
    peak_fp8_flops: float = 0.0  # dense fp8 FLOP/s (0: none faster than bf16)
    devices_per_chip: int = 1  # JAX devices a chip is (tpu7x: one per TensorCore)

    @property
    def mxu_time_factors(self) -> dict[str, float]:
        """Time per FLOP over bf16's, by HLO operand element type: where quantized matmuls
        (`[quantize]`) run faster than bf16. MFU stays quoted against the bf16 peak."""
        factors = {"s8": self.peak_bf16_flops / self.peak_int8_ops} if self.peak_int8_ops else {}
        if self.peak_fp8_flops:
            factors |= dict.fromkeys(
                ("f8e4m3fn", "f8e5m2"), self.peak_bf16_flops / self.peak_fp8_flops
            )
        return factors

    def ring_bytes_per_s(self, dims: int = 1, wraparound: bool = True) -> float:
        """Bytes per second one chip sends in a ring collective laid over `dims` torus
        dimensions. With a wraparound link closing each ring, it sends one way on each of the
        two links to its neighbours: one link's bidirectional figure per dimension (the chip's
        figure over its ports), at most all ports one way. Without one (a dimension shorter
        than the torus it is cut from) the ring runs as a line and the data from its ends
        crosses every link one way: one link's one-way figure, half ("How to Scale Your
        Model", part 2: a slice without wraparounds "typically doubles the time of most
        communication"; part 3 works a v5e all-gather over an open axis of 4 this way, 560 us,
        against 680 us in a profile of it)."""
        per_link = self.ici_bytes_per_s / self.ici_ports * (1.0 if wraparound else 0.5)
        return per_link * min(max(dims, 1), self.ici_ports // 2)


# Cloud TPU system-architecture pages (docs.cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e},
# read 2026-12-02), one row per generation: bf16 FLOP/s, HBM GiB, HBM B/s, bidirectional ICI
# B/s per chip, DCN B/s per chip, cores per chip, ICI ports, MXU size, and the pages' words.
# ICI: the pages now give the bidirectional figure per chip (v5e 400 GBps, v5p 1200, v6e 800)
# where they used to give one direction in Gbps (v5e 1600, v5p 4800, v6e 3200: half of each);
# v4's page gives none now: its former 2400 Gbps one way is read as 600 GBps both ways. Ports:
# 4 per chip on the 2-D tori (v5e/v6e pages), 6 on the 3-D ones (a link per neighbour). MXU:
# "128 x 128 multiply-accumulators" (system-architecture page); v6e: "two 256x256" MXUs.
_CHIP_TABLE = (
    (
        "v4",
        275e12,
        32,
        1200e9,
        600e9,
        6.25e9,
        2,
        6,
        128,
        "275 TFLOP/s bf16, 32 GiB HBM at 1200 GBps, 2400 Gbps ICI one way (former page), 3-D torus",
    ),
    (
        "v5e",
        197e12,
        16,
        819e9,
        400e9,
        3.125e9,
        1,
        4,
        128,
        "197 TFLOP/s bf16, 16 GB HBM at 819 GBps, 400 GBps bidirectional ICI per chip, 4 ICI "
        "ports, 2 x 100 Gbps NIC per 8-chip host",
    ),
    (
        "v5p",
        459e12,
        95,
        2765e9,
        1200e9,
        6.25e9,
        2,
        6,
        128,
        "459 TFLOP/s bf16, 95 GiB HBM at 2765 GBps, 1200 GBps bidirectional ICI per chip, 3-D "
        "torus, 50 Gbps DCN per chip",
    ),
    (
        "v6e",
        918e12,
        32,
        1638e9,
        800e9,
        12.5e9,
        1,
        4,
        256,
        "918 TFLOP/s bf16, 32 GB HBM at 1638 GBps, 800 GBps bidirectional ICI per chip, 4 ICI "
        "ports, two 256x256 MXUs, 4 x 200 Gbps NIC per 8-chip host",
    ),
    # Ironwood, per TensorCore (JAX's device: "JAX exposes each Ironwood chip as two separate
    # devices", one per chiplet with 96 GB of the chip's HBM); its ICI links are the chip's,
    # shared by its two cores (a 3-D torus: 6 links; the page gives no port count). MXU: 256x256
    # (MaxText's v7x optimisation guide).
    (
        "tpu7x",
        2307e12 / 2,
        96,
        7380e9 / 2,
        1200e9 / 2,
        12.5e9 / 2,
        2,
        6,
        256,
        "2307 TFLOP/s bf16 and 4614 fp8 per chip, 192 GiB HBM at 7380 GBps, 1200 GBps "
        "bidirectional ICI, 100 Gbps DCN per chip; two TensorCores per chip, each a JAX device",
    ),
)
# int8 OP/s: the v5e and v6e pages (393 and 1836 TOPS, twice bf16); v5p's page gives none,
# Google's launch post 918 TOPS (twice bf16); v4 and tpu7x: none published. fp8: tpu7x only
# (v5p/v6e list fp8 at their bf16 rate, v5e none).
_INT8_OPS = {"v5e": 393e12, "v5p": 918e12, "v6e": 1836e12}
_FP8_FLOPS = {"tpu7x": 4614e12 / 2}
_DEVICES_PER_CHIP = {"tpu7x": 2}  # v4/v5p: one megacore device for both TensorCores
CHIPS = {
    gen: Chip(
        gen,
        flops,
        hbm_gib * GiB,
        hbm_bw,
        ici,
        dcn,
        cores,
        f"docs.cloud.google.com/tpu/docs/{gen}: {words}",
        ports,
        mxu,
        _INT8_OPS.get(gen, 0.0),
        _FP8_FLOPS.get(gen, 0.0),
        _DEVICES_PER_CHIP.get(gen, 1),
    )
    for gen, flops, hbm_gib, hbm_bw, ici, dcn, cores, ports, mxu, words in _CHIP_TABLE
}

# Chips -> physical shape of the single-slice topologies Cloud offers (3-D torus for v4/v5p/
# tpu7x, 2-D for v5e/v6e), as libtpu names them ("v5p:2x2x1").
_TORUS_3D = ("v4", "v5p", "tpu7x")
_SHAPES_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
_SHAPES_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_NAME = re.compile(r"^(v4|v5e|v5p|v6e|tpu7x)-(\d+)$")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    name: str  # as Cloud names it, e.g. "v5p-8"
    chip: Chip
    chips: int  # per slice
    num_slices: int

    @property
    def libtpu_name(self) -> str:
        return f"{self.chip.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def shape(self) -> tuple[int, ...]:
        """The chips' physical arrangement, e.g. (2, 4) for v6e-8."""
        shapes = _SHAPES_3D if self.chip.generation in _TORUS_3D else _SHAPES_2D
        return tuple(int(d) for d in shapes[self.chips].split("x"))

    @property
    def wrapped_lengths(self) -> tuple[int, ...]:
        """The lengths of the dimensions a wraparound link closes into a ring. v4/v5p/tpu7x:
        every dimension of a slice of whole 4x4x4 cubes (the optical switches close them; the
        v5p page: "All 4x4x4 and larger slices (one cube) have full 3D torus"; tpu7x's: slices
        larger than 64 chips "are made up of 4x4x4 cubes"), none below. v5e/v6e:
        a dimension spanning the pod's 16 ("How to Scale Your Model", part 2: smaller slices
        come "without wraps on dims < 16"; an 8x16 wraps its long axis)."""
        if self.chip.generation in _TORUS_3D:
            return self.shape if all(d % 4 == 0 for d in self.shape) else ()
        return tuple(d for d in self.shape if d == 16)

    def ring_wraps(self, sizes: tuple[int, ...]) -> bool:
        """Whether a ring collective over rings of `sizes` chips (0: a size the compiler did not
        name) runs on closed rings: each ring spans a wrapped dimension, or, on a slice whose
        dimensions all wrap, a product of them (a ring snaking over a torus plane)."""
        wrapped = self.wrapped_lengths
        torus = len(wrapped) == len(self.shape)
        spans = {
            math.prod(c)
            for r in range(1, len(self.shape) + 1)
            for c in itertools.combinations(self.shape, r)
        }
        return all(
            size in wrapped or (torus and (size == 0 or size in spans))
            for size in sizes
            if size != 1
        )


def valid_names() -> list[str]:
    names = []
    for generation, chip in CHIPS.items():
        shapes = _SHAPES_3D if generation in _TORUS_3D else _SHAPES_2D
        names += [f"{generation}-{chips * chip.cores_per_chip}" for chips in shapes]
    return names


def parse_slice(name: str, num_slices: int = 1) -> TpuSlice:
    """The slice called `name`; a TopologyError listing the valid names otherwise."""
    match = _NAME.match(name.strip().lower())
    if num_slices < 1:
        raise TopologyError(f"--num-slices={num_slices}: must be >= 1")
    if match:
        chip = CHIPS[match[1]]
        cores = int(match[2])
        shapes = _SHAPES_3D if chip.generation in _TORUS_3D else _SHAPES_2D
        if cores % chip.cores_per_chip == 0 and cores // chip.cores_per_chip in shapes:
            return TpuSlice(match[0], chip, cores // chip.cores_per_chip, num_slices)
    raise TopologyError(
        f"--topology {name!r} is not a TPU slice titan-jax knows; valid names (v4, v5p and tpu7x "
        f"count TensorCores, two per chip): {', '.join(valid_names())}"
    )


def require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise TopologyError(
            "compiling for a TPU slice needs libtpu, which is not installed: install the `tpu` "
            "extra with `pip install -e '.[tpu]'` in the titan-jax checkout (`make install` "
            "includes it)"
        )


def compile_only_devices(tpu: TpuSlice) -> list[Any]:
    """The slice's devices, from libtpu, for ahead-of-time compiles (nothing runs on them);
    multislice devices carry `slice_index`. tokamax's kernels (the quantized experts) check
    that the host has the devices they compile for unless told it compiles for others."""
    require_libtpu()
    from absl import flags
    from jax.experimental import topologies
    from tokamax._src import config as tokamax_config

    flags.FLAGS[tokamax_config.cross_compile.flag.name].value = True

    kwargs = {"num_slices": tpu.num_slices} if tpu.num_slices > 1 else {}
    return list(
        topologies.get_topology_desc(
            platform="tpu", topology_name=tpu.libtpu_name, **kwargs
        ).devices
    )
