"""Throughput of the MoE expert matmul (mul_mat_id) on Qwen3-30B-A3B-shaped tensors.

128 experts, top-8 routing drawn uniformly per token, n_embd 2048, n_ff 768: gate/up
[128][768][2048] with one activation row per token, down [128][2048][768] with one per
(token, k) pair. A row's time is the device time per call (device grouping plus the tiled kernel)
with ``--repeats`` calls run back to back behind a gate (work held on the stream until the host has
enqueued them all), the median of three such rounds; ``--timing single`` instead times each call
alone between events, which also counts the host's time to enqueue the call's first kernel.
Rows give it as TFLOP/s of useful work (2 * tokens * top_k * n_out *
n_in) and against the time the tensor takes to cross the bus at the pinned host-to-device
bandwidth (measured here unless ``--bandwidth-gbs`` is given). Each kernel family of mul_mat_id
(``simt``: float32 FMAs; ``mma``: bf16 matrix cores through shared weight tiles; ``direct``: bf16
matrix cores with weights decoded straight into fragments, for the types that have it on devices
with mma_fragments, its time including the activation rounding; ``int8``: int8 matrix cores, for
the types that have it, its time including the activation quantizer) is measured at the tile height
it picks, or at each height given with ``--tiles``, all on the same routing and activations;
"vs simt" is each output's relative difference from the SIMT path's (about 2.4e-3 for the
bf16 paths, from their rounding; about 5e-3 for the int8 path). For the gate/up shape ``direct``
also times gate, up and SwiGLU fused in one pass (tensor "gate+up", twice the work of one tensor)
beside the three launches it replaces (tensor "gate,up,swiglu"), both over two distinct
tensors, gate and up, as the runner reads them.

    python -m microbench.kernels --backend cuda [--json] [--ubatch 512 2048 4096] [--types Q4_0 F16]
        [--paths simt mma direct int8] [--tiles auto 32 64 128]

``--gemv`` measures decode sizes instead (1 and 8 pairs of one token; kernels_gemv.py): the
matrix-vector kernels of gemv.cu against each family's tile kernel, as GB/s of weight bytes read
(types Q4_0 and Q4_K unless ``--types`` is given).

    python -m microbench.kernels --backend cuda --gemv [--paths simt mma direct]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from expertstream.backends.base import Backend, Device, DeviceBuffer, Stream
from expertstream.bench.probes import Gate, back_to_back, expert_weights
from expertstream.kernels import MoeKernels
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS, MatrixPath, TileM, weight_format

from . import kernels_gemv
from ._common import MIB, Column, emit, environment, median, open_backend
from ._common import parser as common_parser
from .kernels_gemv import TensorShape

log = logging.getLogger(__name__)

N_EXPERT = 128
TOP_K = 8
FP32_SIMT_PEAK_TFLOPS = 67.0  # H100/H200 SXM datasheet, plain fp32 FMA
BF16_DENSE_PEAK_TFLOPS = 989.0  # H100/H200 SXM datasheet, dense bf16 tensor cores
INT8_DENSE_PEAK_TOPS = 1979.0  # H100/H200 SXM datasheet, dense int8 tensor cores
PEAK_TFLOPS = {
    MatrixPath.SIMT: FP32_SIMT_PEAK_TFLOPS,
    MatrixPath.MMA: BF16_DENSE_PEAK_TFLOPS,
    MatrixPath.INT8: INT8_DENSE_PEAK_TOPS,
}
# The kernel families measured: name -> (path, whether the MMA path takes the direct kernels).
FAMILIES = {
    "simt": (MatrixPath.SIMT, False),
    "mma": (MatrixPath.MMA, False),
    "direct": (MatrixPath.MMA, True),
    "int8": (MatrixPath.INT8, False),
}
BANDWIDTH_PROBE_BYTES = 256 * MIB
# The routed problem, as the JSON results name it.
PROBLEM = {"n_expert": N_EXPERT, "top_k": TOP_K, "routing": "uniform random, distinct experts per token"}
GATE_BYTES = 64 * MIB  # one pinned copy of the gate that holds the stream while calls are enqueued
BACK_TO_BACK_ROUNDS = 3


SHAPES = (TensorShape("gate/up", 768, 2048, False), TensorShape("down", 2048, 768, True))


@dataclass(frozen=True)
class Row:
    type: str
    tensor: str
    ubatch: int
    path: str
    tile_m: int
    kernel_ms: float
    tflops: float
    peak_fraction: float
    tensor_mb: float
    transfer_ms: float
    kernel_over_transfer: float
    diff_vs_simt: float | None  # ||y - y_simt|| / ||y_simt|| on the same inputs (None without a SIMT row)


def pinned_bandwidth_gbs(device: Device, stream: Stream, repeats: int) -> float:
    """Median host-to-device bandwidth from pinned memory, in GB/s."""
    with (
        device.alloc_pinned(BANDWIDTH_PROBE_BYTES) as host,
        device.alloc(BANDWIDTH_PROBE_BYTES) as dst,
        device.event(timing=True) as start,
        device.event(timing=True) as end,
    ):
        host.array.fill(0x5A)
        times = []
        for _ in range(repeats + 1):
            stream.record(start)
            stream.copy_h2d(dst, 0, host, 0, BANDWIDTH_PROBE_BYTES)
            stream.record(end)
            end.synchronize()
            times.append(start.elapsed_ms(end))
    return BANDWIDTH_PROBE_BYTES / median(times[1:]) / 1e6


def time_ms(
    device: Device, stream: Stream, gate: Gate | None, launch: Callable[[], None], warmup: int, repeats: int
) -> float:
    """Device milliseconds per call of ``launch``: back to back behind ``gate``, the median of
    BACK_TO_BACK_ROUNDS rounds of ``repeats`` calls; without a gate, the median of ``repeats``
    calls timed one at a time."""
    if gate is not None:
        for _ in range(warmup):
            launch()
        stream.synchronize()
        rounds = [
            back_to_back(device.backend, device, stream, gate, launch, repeats)[0] for _ in range(BACK_TO_BACK_ROUNDS)
        ]
        return median(rounds) * 1e3
    with device.event(timing=True) as start, device.event(timing=True) as end:
        for _ in range(warmup):
            launch()
        times = []
        for _ in range(repeats):
            stream.record(start)
            launch()
            stream.record(end)
            end.synchronize()
            times.append(start.elapsed_ms(end))
    return median(times)


def tiles_to_measure(
    args: argparse.Namespace, w_type: GGMLQuantizationType, family: str, kernels: MoeKernels, ubatch: int, n_in: int
) -> list[TileM]:
    """The asked tile heights the family has for the type, "auto" being the launcher's pick, each once
    (none where the type lacks the family: no int8 rows for types without an int8 kernel, no direct
    rows for types without a direct kernel or on devices without mma_fragments)."""
    fmt = weight_format(w_type)
    path, direct = FAMILIES[family]
    have: tuple[TileM, ...]
    if direct:
        if not kernels.uses_direct(w_type, n_in):
            return []
        auto, have = fmt.direct_tile_for(ubatch * TOP_K, N_EXPERT), fmt.direct_tiles
    else:
        if path is MatrixPath.MMA and kernels.uses_direct(w_type, n_in):
            raise AssertionError("the mma family must not take the direct kernels")
        auto, have = fmt.tile_for(ubatch * TOP_K, N_EXPERT, path), fmt.tiles_on(path)
    asked = [auto if t == "auto" else TileM(int(t)) for t in args.tiles]
    return list(dict.fromkeys(t for t in asked if t in have))


def measure(
    device: Device,
    stream: Stream,
    gate: Gate | None,
    kernels: dict[str, MoeKernels],
    args: argparse.Namespace,
    bandwidth_gbs: float,
) -> list[Row]:
    rng = np.random.default_rng(args.seed)
    rows = []
    for type_name in args.types:
        w_type = GGMLQuantizationType[type_name]
        for shape in SHAPES:
            # gate and up are two tensors, as the runner reads them: one buffer passed as both would
            # let the second half re-read bytes the first left in the cache.
            with (
                expert_weights(device, rng, w_type, shape.n_out, shape.n_in, N_EXPERT) as w,
                expert_weights(device, rng, w_type, shape.n_out, shape.n_in, N_EXPERT) as w_up,
            ):
                for ubatch in args.ubatch:
                    rows += measure_ubatch(
                        device, stream, gate, kernels, args, rng, (w, w_up), w_type, shape, ubatch, bandwidth_gbs
                    )
    return rows


def measure_ubatch(
    device: Device,
    stream: Stream,
    gate: Gate | None,
    kernels: dict[str, MoeKernels],
    args: argparse.Namespace,
    rng: np.random.Generator,
    weights: tuple[DeviceBuffer, DeviceBuffer],
    w_type: GGMLQuantizationType,
    shape: TensorShape,
    ubatch: int,
    bandwidth_gbs: float,
) -> list[Row]:
    """Every asked path and tile on the same routing and activations; outputs compared to the SIMT path's.

    ``weights``: two distinct tensors of the shape; a single-tensor row reads the first, the fused
    gate+up and the unfused gate, up, SwiGLU read both (gate, then up), into two outputs.
    """
    w, w_up = weights
    n_pairs = ubatch * TOP_K
    ids = np.argsort(rng.random((ubatch, N_EXPERT)), axis=1)[:, :TOP_K].astype(np.int32)
    x_rows = n_pairs if shape.x_per_pair else ubatch
    x = rng.standard_normal((x_rows, shape.n_in), dtype=np.float32)
    rows = []
    simt_output: np.ndarray | None = None
    with (
        device.upload(x) as x_buf,
        device.upload(ids) as ids_buf,
        device.alloc(n_pairs * shape.n_out * 4) as y,
        device.alloc(n_pairs * shape.n_out * 4) as y_up,
    ):
        for family, path_kernels in sorted(kernels.items(), key=lambda item: item[0] != "simt"):
            path = FAMILIES[family][0]
            for tile in tiles_to_measure(args, w_type, family, path_kernels, ubatch, shape.n_in):

                def launch(
                    path_kernels: MoeKernels = path_kernels,
                    tile: TileM = tile,
                    weight: DeviceBuffer = w,
                    out: DeviceBuffer = y,
                ) -> None:
                    path_kernels.mul_mat_id(
                        stream,
                        weight,
                        w_type,
                        N_EXPERT,
                        shape.n_out,
                        shape.n_in,
                        x_buf,
                        shape.x_per_pair,
                        ids_buf,
                        ubatch,
                        TOP_K,
                        out,
                        tile_m=tile,
                    )

                def fused(path_kernels: MoeKernels = path_kernels, tile: TileM = tile) -> None:
                    path_kernels.gate_up(
                        stream,
                        w,
                        w_up,
                        w_type,
                        N_EXPERT,
                        shape.n_out,
                        shape.n_in,
                        x_buf,
                        ids_buf,
                        ubatch,
                        TOP_K,
                        y,
                        tile_m=tile,
                    )

                def unfused(path_kernels: MoeKernels = path_kernels, tile: TileM = tile) -> None:
                    launch(path_kernels, tile, w, y)
                    launch(path_kernels, tile, w_up, y_up)
                    path_kernels.swiglu(stream, y, y_up, y, n_pairs * shape.n_out)

                timed: list[tuple[str, Callable[[], None], int]] = [(shape.name, launch, 1)]
                if FAMILIES[family][1] and not shape.x_per_pair:
                    timed += [("gate+up", fused, 2), ("gate,up,swiglu", unfused, 2)]
                for tensor, call, tensors in timed:
                    ms = time_ms(device, stream, gate, call, args.warmup, args.repeats)
                    diff = None
                    if device.backend.host.holds_data and tensors == 1:  # no outputs to compare in timing-only runs
                        output = y.read().view(np.float32)
                        if path is MatrixPath.SIMT and simt_output is None:
                            simt_output = output
                        diff = None if simt_output is None else ref.relative_error(output, simt_output)
                    tflops = 2.0 * tensors * n_pairs * shape.n_out * shape.n_in / (ms * 1e-3) / 1e12
                    transfer_ms = tensors * w.alloc_size / (bandwidth_gbs * 1e9) * 1e3  # w, w_up: one size
                    row = Row(
                        w_type.name,
                        tensor,
                        ubatch,
                        family,
                        int(tile),
                        ms,
                        tflops,
                        tflops / PEAK_TFLOPS[path],
                        tensors * w.alloc_size / 1e6,
                        transfer_ms,
                        ms / transfer_ms,
                        diff,
                    )
                    rows.append(row)
                    log.info("%s", row)
    return rows


def run(be: Backend, args: argparse.Namespace) -> dict[str, Any]:
    device = be.device(args.device)
    kernels = {f: MoeKernels(device, FAMILIES[f][0], direct=FAMILIES[f][1]) for f in args.paths}
    try:
        if args.gemv:
            return run_gemv(device, kernels, args)
        with device.stream() as stream:
            if args.bandwidth_gbs:
                bandwidth, source = args.bandwidth_gbs, "assumed"
            else:
                bandwidth, source = pinned_bandwidth_gbs(device, stream, args.repeats), "measured"
            with contextlib.ExitStack() as stack:
                gate = None
                if args.timing == "back-to-back":
                    gate = stack.enter_context(Gate.opened(device, stream, GATE_BYTES))
                rows = measure(device, stream, gate, kernels, args, bandwidth)
            device.synchronize()
    finally:
        for path_kernels in kernels.values():
            path_kernels.close()
    return {
        **environment(be, device),
        **PROBLEM,
        "bandwidth_gbs": bandwidth,
        "bandwidth_source": source,
        "peak_tflops": {path.value: peak for path, peak in PEAK_TFLOPS.items()},
        "repeats": args.repeats,
        "timing": args.timing,
        "rows": [asdict(r) for r in rows],
    }


def run_gemv(device: Device, kernels: dict[str, MoeKernels], args: argparse.Namespace) -> dict[str, Any]:
    """The --gemv comparison (kernels_gemv.py), timed as the tile rows are."""
    with device.stream() as stream, contextlib.ExitStack() as stack:
        gate = stack.enter_context(Gate.opened(device, stream, GATE_BYTES)) if args.timing == "back-to-back" else None

        def timed(launch: Callable[[], None]) -> float:
            return time_ms(device, stream, gate, launch, args.warmup, args.repeats)

        types = args.types or kernels_gemv.DEFAULT_TYPES
        rows = kernels_gemv.measure(device, stream, kernels, types, SHAPES, N_EXPERT, args.seed, timed)
        device.synchronize()
    return {
        **environment(device.backend, device),
        "n_expert": N_EXPERT,
        "routing": "one token, distinct experts",
        "repeats": args.repeats,
        "timing": args.timing,
        "rows": [asdict(r) for r in rows],
    }


COLUMNS: Sequence[Column] = (
    Column("type", "type"),
    Column("tensor", "tensor"),
    Column("ubatch", "ubatch"),
    Column("path", "path"),
    Column("tile_m", "tile"),
    Column("kernel_ms", "kernel ms", "{:.3f}"),
    Column("tflops", "TFLOP/s", "{:.1f}"),
    Column("peak_fraction", "of path peak", "{:.0%}"),
    Column("tensor_mb", "MB", "{:.0f}"),
    Column("transfer_ms", "transfer ms", "{:.2f}"),
    Column("kernel_over_transfer", "kernel/transfer", "{:.0%}"),
    Column("diff_vs_simt", "vs simt", "{:.1e}"),
)


def main(argv: list[str] | None = None) -> int:
    p = common_parser("kernels", "mul_mat_id TFLOP/s on Qwen3-30B-A3B expert shapes, against transfer time.")
    p.add_argument("--ubatch", type=int, nargs="+", default=[512, 2048, 4096], help="tokens per call")
    p.add_argument(
        "--types",
        nargs="+",
        choices=[f.qtype.name for f in FORMATS.values()],
        help="weight types (default: every type; Q4_0 and Q4_K with --gemv)",
    )
    p.add_argument(
        "--gemv",
        action="store_true",
        help="decode sizes (1 and 8 pairs): the matrix-vector kernels against the tile kernels, in GB/s",
    )
    p.add_argument("--paths", nargs="+", default=list(FAMILIES), choices=list(FAMILIES), help="kernel families")
    p.add_argument(
        "--tiles",
        nargs="+",
        default=["auto"],
        choices=["auto", *(str(int(t)) for t in TileM)],
        help="tile heights to measure; auto: the one the launcher picks",
    )
    p.add_argument(
        "--repeats", type=int, default=20, help="calls per timing round (per timed call with --timing single)"
    )
    p.add_argument(
        "--timing",
        choices=("back-to-back", "single"),
        default="back-to-back",
        help="back-to-back: calls held behind a gate until all are enqueued, median of 3 rounds; "
        "single: each call alone between events (counts the host's enqueue time)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bandwidth-gbs", type=float, help="assume this pinned bandwidth instead of measuring it")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.types is None and not args.gemv:
        args.types = [f.qtype.name for f in FORMATS.values()]
    with open_backend(args) as be:
        result = run(be, args)
    if args.gemv:
        emit(args, result, kernels_gemv.COLUMNS, "mul_mat_id at decode sizes on Qwen3-30B-A3B expert tensors")
    else:
        emit(args, result, COLUMNS, "mul_mat_id on Qwen3-30B-A3B expert tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
