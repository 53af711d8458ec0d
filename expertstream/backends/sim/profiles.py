"""Simulated device profiles: plain data describing one GPU and its host link.

A profile is chosen by name (a built-in), given as a Profile object, as a dict
(``Profile.from_dict``) or as the path of a JSON file holding such a dict (what
`expertstream tune` writes). The EXPERTSTREAM_SIM_PROFILE environment variable sets the default.

Kernel time is ``flops / rate`` after the launch latency. The rate comes from ``kernel_rates``
where the profile has entries for the kernel (measured per shape and size, interpolated in
log(size) between them), else from ``flops_per_s``.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ...errors import InvalidArgument
from ..base import UNASKED_SHARED_BYTES

PROFILE_ENV = "EXPERTSTREAM_SIM_PROFILE"
DEFAULT_PROFILE = "cuda-h200"

_GIB = 1 << 30
_VENDORS = ("nvidia", "amd")
# What runs a memset of device memory: a fill kernel on the stream's own queue, which shares the
# execution units with other streams' kernels instead of waiting for them, or a copy engine.
MEMSET_ENGINES = ("fill-kernel", "copy-engine")
# Who fills a staging ring's chunks on the machine a profile describes (hostmem.RingFill's values).
RING_FILLS = (None, "threads", "processes")


Shape = tuple[int, ...]

# A drive no one measured: one PCIe Gen4 NVMe SSD read with O_DIRECT in 16 MiB reads, (reads in
# flight, GB/s of all together) as such drives are specified (about 7 GB/s sequential at depth), and
# the time of one 4 KiB read. `expertstream tune` measures the drive of the model it is given.
ASSUMED_NVME_BPS = ((1, 2.5e9), (4, 6.0e9), (16, 6.8e9))
ASSUMED_NVME_LATENCY_S = 80e-6


@dataclass(frozen=True)
class KernelRate:
    """The measured rate of one kernel at one shape and size.

    ``shape`` and ``size`` are what the kernel's twin reports for a launch (``KernelSpec.rate_key``):
    for mul_mat_id the (n_out, n_in) of one expert and the (token, k) pairs per expert; for
    kernels without a key, an empty shape and the launch's flops.
    """

    kernel: str
    shape: Shape
    size: float
    flops_per_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if not (_is_number(self.size) and self.size > 0 and _is_number(self.flops_per_s) and self.flops_per_s > 0):
            raise InvalidArgument(
                f"kernel rate of {self.kernel!r}: size and flops_per_s must be positive numbers, "
                f"got {self.size!r} and {self.flops_per_s!r}"
            )

    @classmethod
    def from_value(cls, value: KernelRate | Mapping[str, Any] | Sequence[Any]) -> KernelRate:
        """A rate from itself, a dict with the field names, or a [kernel, shape, size, flops_per_s] list."""
        if isinstance(value, KernelRate):
            return value
        try:
            if isinstance(value, Mapping):
                kernel, shape, size, rate = (value[k] for k in ("kernel", "shape", "size", "flops_per_s"))
            else:
                kernel, shape, size, rate = value
            shape = tuple(int(n) for n in shape)
        except (KeyError, TypeError, ValueError):
            wanted = "{kernel, shape, size, flops_per_s}"
            raise InvalidArgument(f"a kernel rate must be {wanted}, got {value!r}") from None
        return cls(str(kernel), shape, size, rate)


@dataclass(frozen=True)
class Profile:
    """Rates in bytes (or flops) per second, times in seconds, sizes in bytes."""

    name: str
    vendor_like: str  # "nvidia" or "amd": whose runtime semantics the profile imitates
    device_name: str
    memory_bytes: int
    h2d_pinned_bps: float  # from pinned or registered host memory
    h2d_pageable_bps: float
    d2h_bps: float  # to pinned or registered host memory
    d2h_pageable_bps: float
    d2d_bps: float  # within one device
    peer_bps: float  # between devices with peer access
    memset_bps: float
    flops_per_s: float  # effective rate of the MoE kernels, not the datasheet peak
    matrix_cores: bool  # whether kernels take the matrix-core path (bf16 rounding in the twins)
    launch_latency_s: float  # kernels and memsets: from ready to running
    copy_latency_s: float  # DMA setup: from ready to moving bytes
    enqueue_s: float  # host time spent in one enqueue or query call of the job (its own work between calls included)
    host_memcpy_bps: float  # one host thread copying host -> host
    host_register_bps: float  # page-locking memory in place
    pageable_blocks_host: bool  # a copy from/to pageable memory returns only once it is done
    host_register: bool
    host_register_read_only: bool
    memset_engine: str = "fill-kernel"  # one of MEMSET_ENGINES
    # All host threads copying at once (a shared memory bus); None: each thread gets host_memcpy_bps.
    host_memcpy_total_bps: float | None = None
    # Host seconds of one call by itself, with no work of its caller between calls (back-to-back
    # launches; a staging ring's DMAs and records, inside Host.bare_calls); None: enqueue_s.
    call_s: float | None = None
    # Host seconds a memcpy costs before its bytes move: handing it to the thread or process that
    # does it, and the call. Decode's many small copies through a ring pay it each. Threads pay it
    # for every copy; fill processes only for a copy that wakes an idle one (Host.copy's fixed_cost).
    host_copy_latency_s: float = 0.0
    # Seconds a copy from pageable memory costs beyond copy_latency_s before its bytes move (the
    # runtime's staging). Decode's copies of single experts from a mapping pay it each.
    h2d_pageable_latency_s: float = 0.0
    # A stream's wait on an event recorded before a pageable copy was enqueued behind it resolves
    # at that stream's tail (the reported ROCm behaviour), not at the record.
    pageable_wait_binds_tail: bool = False
    kernel_rates: tuple[KernelRate, ...] = ()
    # whether Q4_0 and Q4_K take the int8 path by default (kernels/layout.INT8_DEFAULT_TYPES)
    int8_matrix_cores: bool = False
    # whether Q4_0, Q4_K, Q6_K and MXFP4 take the direct-decode kernels of direct.cu (NVIDIA sm_80+)
    mma_fragments: bool = False
    # the most shared memory a block may use (Capabilities.max_shared_bytes)
    max_shared_bytes: int = UNASKED_SHARED_BYTES
    # Host threads a staging ring runs on the machine this profile describes (hostmem's default
    # there); None: the default of the machine the simulation runs on.
    ring_threads: int | None = None
    # Who fills the staging ring's chunks there: "threads", or "processes" (timed threads handed
    # each chunk after its last DMA, as hostmem hands chunks to its fill processes); None: threads.
    ring_fill: str | None = None
    # A kernel reading page-locked host memory over the link (Stream.gather_h2d); None: at
    # h2d_pinned_bps, as a DMA would.
    h2d_gather_bps: float | None = None
    # How decode copies the experts a step uses from page-locked memory: True, the device's own gather
    # (Stream.gather_h2d: no host round trip, a step can be replayed from one graph); False, DMAs
    # once the host has read each layer's routing ids back (llama.cpp's way). `expertstream tune`
    # times a decode step of the job each way and keeps the faster (Scheduler.gather).
    decode_gather: bool = True
    # The share of a decode step's predicted experts (the first half of what the next layer's router
    # ranks on this layer's FFN input, copied ahead: the decode lookahead) that its router then
    # chooses: a gather that skips them is booked at the rest. 0.986: the share on the 48-layer
    # qwen3-30b-a3b file make-model writes (4 of 8 predicted), over 12 decode steps of llama.cpp's
    # CPU forward pass.
    lookahead_hit: float = 0.986
    # The drive holding the model's files, read with O_DIRECT (mode disk): (reads in flight, bytes
    # per second of all of them together) for large sequential reads, interpolated in log(reads)
    # between the depths given and clamped at the ends; and the seconds one read costs before its
    # bytes move. A read of n bytes with d in flight takes disk_latency_s + n * d / rate(d). Where a
    # built-in profile did not measure the drive of the model's files, the assumed drive.
    disk_read_bps: tuple[tuple[int, float], ...] = ASSUMED_NVME_BPS
    disk_latency_s: float = ASSUMED_NVME_LATENCY_S

    def __post_init__(self) -> None:
        if self.vendor_like not in _VENDORS:
            raise InvalidArgument(f"profile {self.name!r}: vendor_like must be one of {_VENDORS}")
        if self.memset_engine not in MEMSET_ENGINES:
            raise InvalidArgument(
                f"profile {self.name!r}: memset_engine must be one of {MEMSET_ENGINES}, got {self.memset_engine!r}"
            )
        if not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise InvalidArgument(f"profile {self.name!r}: memory_bytes must be a positive integer")
        object.__setattr__(self, "kernel_rates", tuple(KernelRate.from_value(r) for r in self.kernel_rates))
        object.__setattr__(self, "disk_read_bps", _disk_rates(self.name, self.disk_read_bps))
        if self.ring_threads is not None and (
            not isinstance(self.ring_threads, int) or isinstance(self.ring_threads, bool) or self.ring_threads < 1
        ):
            raise InvalidArgument(
                f"profile {self.name!r}: ring_threads must be a count >= 1, got {self.ring_threads!r}"
            )
        if self.ring_fill not in RING_FILLS:
            raise InvalidArgument(
                f"profile {self.name!r}: ring_fill must be one of {', '.join(map(str, RING_FILLS))}, "
                f"got {self.ring_fill!r}"
            )
        if not (_is_number(self.lookahead_hit) and 0 <= self.lookahead_hit <= 1):
            raise InvalidArgument(f"profile {self.name!r}: lookahead_hit must be a share in 0..1")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("host_memcpy_total_bps", "h2d_gather_bps", "call_s"):
                continue
            if f.name == "disk_read_bps":  # checked by _disk_rates
                continue
            if f.name.endswith(("_bps", "_per_s")) and not (_is_number(value) and value > 0):
                raise InvalidArgument(f"profile {self.name!r}: {f.name} must be a positive number, got {value!r}")
            if f.name.endswith("_s") and not f.name.endswith("_per_s") and not (_is_number(value) and value >= 0):
                raise InvalidArgument(f"profile {self.name!r}: {f.name} must be a number >= 0, got {value!r}")
            if f.type == "bool" and not isinstance(value, bool):
                raise InvalidArgument(f"profile {self.name!r}: {f.name} must be true or false, got {value!r}")

    @property
    def gather_bps(self) -> float:
        """The rate of Stream.gather_h2d: measured where the profile has it, else a DMA's."""
        return self.h2d_pinned_bps if self.h2d_gather_bps is None else self.h2d_gather_bps

    def disk_rate(self, depth: int) -> float:
        """Bytes per second of ``depth`` large reads from the drive at once, all of them together."""
        return _log_interpolated(self.disk_read_bps, depth)

    def kernel_rate(self, kernel: str, shape: Shape, size: float) -> float:
        """Flops per second of ``kernel`` at ``shape`` and ``size``: measured where the profile has it.

        Entries of the nearest measured shape (by log distance) are interpolated in log(size) and
        clamped at the smallest and largest measured size; a kernel without entries runs at
        ``flops_per_s``.
        """
        by_shape = self._rate_index.get(kernel)
        if not by_shape:
            return self.flops_per_s
        points = by_shape.get(shape) or by_shape[min(by_shape, key=lambda s: _shape_distance(s, shape))]
        return _log_interpolated(points, size)

    @functools.cached_property
    def _rate_index(self) -> dict[str, dict[Shape, list[tuple[float, float]]]]:
        index: dict[str, dict[Shape, dict[float, list[float]]]] = {}
        for r in self.kernel_rates:
            index.setdefault(r.kernel, {}).setdefault(r.shape, {}).setdefault(float(r.size), []).append(r.flops_per_s)
        # Two entries at one size (shapes the twin reports alike) count as their mean.
        return {
            kernel: {shape: [(at, sum(v) / len(v)) for at, v in sorted(by.items())] for shape, by in shapes.items()}
            for kernel, shapes in index.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain data ``from_dict`` reads back (what a profile JSON file holds)."""
        data = dataclasses.asdict(self)
        data["kernel_rates"] = [
            {"kernel": r.kernel, "shape": list(r.shape), "size": r.size, "flops_per_s": r.flops_per_s}
            for r in self.kernel_rates
        ]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """A profile from plain data; an optional ``"base"`` names a built-in whose figures fill the rest."""
        values = dict(data)
        base_name = values.pop("base", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown profile field(s) {', '.join(unknown)}", hint=f"known fields: {', '.join(sorted(known))}"
            )
        if base_name is not None:
            values = {**dataclasses.asdict(builtin_profile(str(base_name))), **values}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(values))
        if missing:
            raise InvalidArgument(
                f"profile is missing field(s) {', '.join(missing)}",
                hint=f'give them, or name a built-in to start from with "base" ({", ".join(BUILTIN_PROFILES)})',
            )
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"cannot read simulator profile {os.fspath(path)!r}: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidArgument(f"simulator profile {os.fspath(path)!r} must hold a JSON object")
        return cls.from_dict(data)


def _log_interpolated(points: Sequence[tuple[float, float]], x: float) -> float:
    """The y of (x, y) ``points`` sorted by x at ``x``: linear in log(x) between them, clamped at the ends."""
    i = bisect.bisect_left([p[0] for p in points], x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)


def _disk_rates(name: str, value: object) -> tuple[tuple[int, float], ...]:
    """The drive's rates as (depth, bytes per second) pairs by depth, or InvalidArgument."""
    wanted = "[[reads in flight, bytes per second], ...] with distinct depths >= 1 and positive rates"
    try:
        pairs = tuple((depth, rate) for depth, rate in value)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pairs = ()
    good = all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 and _is_number(r) and r > 0 for d, r in pairs)
    if not pairs or not good or len({d for d, _ in pairs}) != len(pairs):
        raise InvalidArgument(f"profile {name!r}: disk_read_bps must be {wanted}, got {value!r}")
    return tuple(sorted((int(d), float(r)) for d, r in pairs))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shape_distance(a: Shape, b: Shape) -> float:
    if len(a) != len(b):
        return math.inf
    return sum(abs(math.log(max(x, 1) / max(y, 1))) for x, y in zip(a, b, strict=True))


# Figures marked "measured" come from an H200 (PCIe Gen5 x16); "reported" from the R9700 figures
# in llama.cpp PR #28414 and its review; "assumed" have no measurement yet.

# The mul_mat_id tables below but the direct one timed each call alone between events, which also
# counted the host's time to enqueue its first kernel (the direct kernels' rows at ubatch 512 read
# up to 2x slower that way), and ran the one-block grouping kernel: they understate the kernels.
#
# Measured on the H200: mul_mat_id (grouping plus matrix kernel) in TFLOP/s on Qwen3-30B-A3B
# expert shapes (128 experts, top-8, gate/up 768 x 2048, down 2048 x 768), uniform routing;
# per type (ubatch, tile, gate/up, down). docs/results/cuda-h200-kernels.md (Q4_0, Q8_0, F16,
# BF16) and docs/results/realfiles-h200/kernels-all-types.json (the others).
_H200_MUL_MAT_ID: dict[str, tuple[tuple[int, int, float, float], ...]] = {
    "Q4_0": ((512, 32, 18.3, 16.1), (2048, 64, 28.1, 28.9), (4096, 64, 33.0, 32.0)),
    "Q8_0": ((512, 32, 16.2, 16.2), (2048, 32, 24.6, 23.3), (4096, 32, 27.0, 25.0)),
    "F16": ((512, 32, 9.8, 10.8), (2048, 64, 18.4, 19.8), (4096, 64, 22.5, 22.5)),
    "BF16": ((512, 32, 13.4, 13.6), (2048, 64, 19.2, 20.7), (4096, 64, 22.5, 23.4)),
    "Q4_1": ((512, 32, 16.3, 17.0), (4096, 32, 27.8, 26.9)),
    "Q5_0": ((512, 32, 15.2, 15.5), (4096, 32, 25.6, 24.6)),
    "Q5_1": ((512, 32, 15.7, 14.7), (4096, 32, 26.6, 23.3)),
    "Q2_K": ((512, 32, 8.1, 8.4), (4096, 32, 13.3, 13.4)),
    "Q3_K": ((512, 32, 8.2, 8.2), (4096, 32, 13.4, 11.9)),
    "Q4_K": ((512, 32, 12.8, 12.1), (4096, 32, 20.6, 18.6)),
    "Q5_K": ((512, 32, 11.3, 10.3), (4096, 32, 17.9, 15.7)),
    "Q6_K": ((512, 32, 8.4, 8.2), (4096, 32, 12.9, 12.0)),
    "IQ4_NL": ((512, 32, 16.8, 16.1), (4096, 32, 26.5, 26.1)),
    "IQ4_XS": ((512, 32, 15.6, 14.0), (4096, 32, 26.2, 23.4)),
    "MXFP4": ((512, 32, 13.5, 13.5), (4096, 32, 23.4, 21.7)),
    "F32": ((512, 32, 12.9, 12.4), (4096, 32, 21.8, 21.6)),
}


# measured: the matrix-core (bf16 mma.sync) mul_mat_id, `python -m microbench.kernels --backend cuda
# --types Q4_0 Q4_K --ubatch 512 4096 --paths simt mma` on the H200 (docs/results/cuda-h200-kernels.md).
# Other types on this path run at flops_per_s until measured.
_H200_MUL_MAT_ID_MMA = {
    "Q4_0": ((512, 64, 35.2, 30.4), (4096, 64, 96.5, 85.8)),
    "Q4_K": ((512, 64, 30.5, 21.8), (4096, 64, 70.3, 56.0)),
}


# measured: the int8 mul_mat_id (int8.cu, activations quantized per 32-block, mma.sync s8; the
# quantizer's time included), `python -m microbench.kernels --backend cuda --types Q4_0 Q4_K --ubatch
# 512 4096 --paths mma int8 --tiles 32 64 128 --repeats 10` on the H200, 2026-12-01
# (docs/results/cuda-h200-kernels.md). Each ubatch row lists the tile the launcher picks there.
_H200_MUL_MAT_ID_INT8 = {
    "Q4_0": ((512, 64, 30.4, 27.2), (4096, 128, 75.0, 68.2)),
    "Q4_K": ((512, 64, 26.0, 22.5), (4096, 128, 70.2, 59.0)),
}


# measured: the direct-decode mul_mat_id (direct.cu, its bf16 rounding and grouping included) and gate,
# up and SwiGLU fused in one pass (rated on the work of both tensors), `python -m microbench.kernels
# --backend cuda --types Q4_0 Q4_K --ubatch 512 2048 4096 --paths direct --tiles 64 128` (calls back to
# back) on the H200, 2026-12-01 21:22 UTC, the mean of two rounds (docs/results/cuda-h200-kernels.md,
# "final2"). Each ubatch row lists the tile the launcher picks there: (ubatch, tile, gate/up, down,
# gate+up fused).
_H200_MUL_MAT_ID_DIRECT = {
    "Q4_0": ((512, 64, 101.6, 92.9, 107.8), (2048, 64, 179.7, 163.9, 180.5), (4096, 128, 222.1, 188.5, 220.2)),
    "Q4_K": ((512, 64, 87.4, 84.4, 91.7), (2048, 64, 151.5, 143.0, 155.0), (4096, 128, 191.8, 174.8, 187.9)),
}


def _h200_kernel_rates() -> tuple[KernelRate, ...]:
    rates = []
    tables = (("", _H200_MUL_MAT_ID), ("mma_", _H200_MUL_MAT_ID_MMA), ("int8_", _H200_MUL_MAT_ID_INT8))
    for family, table in tables:
        for type_name, rows in table.items():
            for ubatch, tile, gate_up, down in rows:
                kernel = f"moe_mul_mat_id_{family}{type_name.lower()}_m{tile}"
                pairs_per_expert = ubatch * 8 / 128
                rates.append(KernelRate(kernel, (768, 2048), pairs_per_expert, gate_up * 1e12))
                rates.append(KernelRate(kernel, (2048, 768), pairs_per_expert, down * 1e12))
    for type_name, direct_rows in _H200_MUL_MAT_ID_DIRECT.items():
        for ubatch, tile, gate_up, down, fused in direct_rows:
            suffix = f"_direct_{type_name.lower()}_m{tile}"
            pairs_per_expert = ubatch * 8 / 128
            rates.append(KernelRate(f"moe_mul_mat_id{suffix}", (768, 2048), pairs_per_expert, gate_up * 1e12))
            rates.append(KernelRate(f"moe_mul_mat_id{suffix}", (2048, 768), pairs_per_expert, down * 1e12))
            rates.append(KernelRate(f"moe_gate_up{suffix}", (768, 2048), pairs_per_expert, fused * 1e12))
    return tuple(rates)


CUDA_H200 = Profile(
    name="cuda-h200",
    vendor_like="nvidia",
    device_name="NVIDIA H200",
    memory_bytes=141 * 10**9,  # datasheet: 141 GB HBM3e
    h2d_pinned_bps=55.4e9,  # measured: pinned and registered H2D, 64 MB..1 GB
    # measured: pageable numpy and unregistered mmap gave 6.7..9.2 GB/s; the 1 GiB copy of the
    # event-order bench took ~127 ms (8.4 GB/s), docs/results/cuda-h200.md
    h2d_pageable_bps=8.4e9,
    d2h_bps=55.4e9,  # assumed: the PCIe link is symmetric
    d2h_pageable_bps=7.5e9,  # assumed: staged through a pinned bounce buffer like H2D
    d2d_bps=2.0e12,  # assumed: a copy reads and writes every byte, ~40% of the 4.8 TB/s HBM3e peak
    peer_bps=50e9,  # assumed: peers over PCIe Gen5 x16
    memset_bps=3.0e12,  # assumed: write-only traffic, ~60% of the HBM3e peak
    # Kernels without a measured rate below: mul_mat_id, Q4_0, Qwen3-30B-A3B expert shapes at ubatch
    # 512 (18.3 TFLOP/s gate/up, 16.1 down; docs/results/cuda-h200-kernels.md).
    flops_per_s=17.5e12,
    matrix_cores=True,  # datasheet: Hopper tensor cores (mma.sync bf16)
    int8_matrix_cores=True,  # datasheet: Hopper tensor cores (mma.sync s8)
    mma_fragments=True,  # sm_90: mma.sync m16n8k16 bf16
    max_shared_bytes=227 * 1024,  # datasheet: sm_90 blocks opt into up to 227 KB
    # measured: the device time before each operation of a chain, fitted to the whole model's replayed decode
    # step of the 48-layer qwen3-30b-a3b Q4_K_M file all on the GPU (285.5 tokens/s, 507 operations a
    # step, chained launches; docs/results/h200-2026-12-06.md): predicted 283.7, and from host memory 37.9
    # and 66.9 against the measured 38.7 and 66.9 (-ncmoe all, 24). The expert blocks alone had fitted 7.7 us.
    launch_latency_s=6.2e-6,
    copy_latency_s=10e-6,  # assumed: DMA setup; with enqueue_s it matches the measured 1.26 ms for 64 MB
    enqueue_s=15e-6,  # measured: six enqueues of the event-order bench took 0.04..0.08 ms from Python
    call_s=15e-6,  # the same calls: back to back, no work between them
    host_memcpy_bps=8.1e9,  # measured: numpy.copyto mmap -> pinned, one thread
    host_register_bps=_GIB / 26e-3,  # measured: registering 1 GB took 26 ms
    pageable_blocks_host=True,  # measured: the host is blocked for the whole pageable copy
    host_register=True,
    host_register_read_only=True,  # measured: cudaHostRegisterReadOnly of a PROT_READ mmap works
    # assumed: not measured whether the driver fills with a kernel or a copy engine; either runs
    # beside the kernels of other streams rather than after them.
    memset_engine="fill-kernel",
    # measured: `expertstream tune` fitted the ring of 12 fill processes (16 x 8 MiB chunks) to a
    # 512-token prefill of 12 of the 48-layer file's layers at 38.8 and 48.4 GB/s in two runs; whole
    # prefills moved 31-48 GB/s (docs/results/predict-h200.md). The mean of the two fits; before the
    # fill processes, 12 threads moved 27.3-31.6 GB/s.
    host_memcpy_total_bps=43.6e9,
    ring_threads=12,  # measured host: 16 cores, so hostmem's default of min(12, cores)
    ring_fill="processes",  # what hostmem runs there: a GPU, the model's files mapped, Linux
    # measured: gather.cu reading 16 and 64 MiB of 1 MiB rows from pinned memory, `expertstream tune`
    # (docs/results/decode-h200.md)
    h2d_gather_bps=51.4e9,
    # measured: decode of the 48-layer Q4_0 file with every expert in registered host memory, 26.22 tokens/s
    # with the gather replayed from one graph against 10.68 with DMAs after reading the ids back
    # (docs/results/decode-h200.md)
    decode_gather=True,
    # measured: the lent H200 machine's root filesystem (virtio) under the 48-layer file, O_DIRECT reads of
    # 16 MiB, microbench.disk_read (docs/results/disk-h200.md); fit_disk's rates differ from these by
    # under 0.3% at a 33 us latency
    disk_read_bps=((1, 1.54e9), (4, 1.62e9), (16, 1.80e9)),
    disk_latency_s=33e-6,
    kernel_rates=_h200_kernel_rates(),
)

# Fitted to the R9700 figures of the PR #28414 report only, through tune's own fit functions
# (microbench/rocm_r9700_fit.py, which prints these values; docs/results/rocm-sim.md says which
# figure fits what and what is predicted). `expertstream tune` on an AMD GPU replaces it.
_R9700_GATE_UP = ("moe_mul_mat_id_q4_0_m64", (640, 2560), 80.0)  # mul_mat_id at ub 4096: shape, pairs per expert
ROCM_R9700 = Profile(
    name="rocm-r9700",
    vendor_like="amd",
    device_name="AMD Radeon AI PRO R9700",
    memory_bytes=32 * _GIB,  # datasheet: 32 GB GDDR6
    h2d_pinned_bps=53e9,  # fitted: the hipMemcpy microbench, 53 GB/s pinned
    h2d_pageable_bps=53e9,  # fitted: the same, pageable
    d2h_bps=53e9,  # assumed: the PCIe link is symmetric
    d2h_pageable_bps=53e9,  # assumed: like H2D
    d2d_bps=0.26e12,  # assumed: a copy reads and writes every byte, ~40% of the 644 GB/s GDDR6 peak
    peer_bps=50e9,  # assumed: peers over PCIe 5.0 x16
    memset_bps=0.39e12,  # assumed: write-only traffic, ~60% of the GDDR6 peak
    flops_per_s=4.8e13,  # assumed: kernels without a fitted rate run at mul_mat_id's
    matrix_cores=True,  # datasheet: RDNA4 WMMA (gfx1201)
    max_shared_bytes=64 * 1024,  # datasheet: a workgroup's LDS
    launch_latency_s=5e-6,  # assumed: like the CUDA profile
    copy_latency_s=10e-6,  # assumed: like the CUDA profile
    enqueue_s=30e-6,  # assumed: the same Python binding overhead as on CUDA, twice the H200's
    host_memcpy_bps=8.1e9,  # assumed: the H200 host's one-thread figure
    host_register_bps=_GIB / 26e-3,  # assumed: like the CUDA profile
    # Fitted: the event order (B released at 1.3 ms with its wait before copy2, at 22 ms after)
    # read as the report reads it: the runtime pins pageable memory on the fly and returns, and a
    # wait enqueued after such a copy resolves against the copy stream's tail. (ROCm's
    # documentation calls pageable copies synchronous instead; tune on an AMD GPU tells which.)
    pageable_blocks_host=False,
    pageable_wait_binds_tail=True,
    host_register=True,  # hipHostRegister exists
    host_register_read_only=False,  # HIP exposes no read-only registration flag
    memset_engine="fill-kernel",  # ROCm's runtime fills device memory with a blit kernel on the stream's queue
    h2d_gather_bps=None,  # assumed: no figure; a kernel reading host memory gathers at the DMA rate
    kernel_rates=(
        # fitted: gate_L 2.49 ms and up_L 3.13 ms in the reported timeline (llama.cpp's kernels)
        KernelRate(*_R9700_GATE_UP, 5.4011e13),
        KernelRate(*_R9700_GATE_UP, 4.2950e13),
        # fitted: the runner's stand-in for attention and the rest of a layer, at the rate that
        # makes the stock path run 27k tokens at the reported 1014 t/s
        KernelRate("moe_rms_norm", (), 3.0 * 4096 * 2560, 6.8141e8),
    ),
)

BUILTIN_PROFILES: dict[str, Profile] = {p.name: p for p in (CUDA_H200, ROCM_R9700)}

ProfileSpec = Union[str, "os.PathLike[str]", Profile, Mapping[str, Any], None]


def builtin_profile(name: str) -> Profile:
    try:
        return BUILTIN_PROFILES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown simulator profile {name!r}", hint=f"built-in profiles: {', '.join(BUILTIN_PROFILES)}"
        ) from None


def resolve_profile(spec: ProfileSpec) -> Profile:
    """A Profile from a name, a JSON file path, a dict or a Profile; None means the default."""
    if spec is None:
        spec = os.environ.get(PROFILE_ENV, "").strip() or DEFAULT_PROFILE
    if isinstance(spec, Profile):
        return spec
    if isinstance(spec, Mapping):
        return Profile.from_dict(spec)
    text = os.fspath(spec)
    if text in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[text]
    if text.endswith(".json") or Path(text).is_file():
        return Profile.from_json(text)
    raise InvalidArgument(
        f"unknown simulator profile {text!r}",
        hint=f"use one of {', '.join(BUILTIN_PROFILES)}, a Profile, a dict or a JSON file path",
    )


__all__ = [
    "BUILTIN_PROFILES",
    "MEMSET_ENGINES",
    "PROFILE_ENV",
    "KernelRate",
    "Profile",
    "ProfileSpec",
    "builtin_profile",
    "resolve_profile",
]
