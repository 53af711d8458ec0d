"""Where one mul_mat_id call's device time goes: each of its launches replayed alone.

The same Qwen3-30B-A3B expert shapes, routing and timing as ``microbench.kernels`` (calls back to
back behind a gate, the median of three rounds). One call is enqueued through a stream that notes
its launches (the activation rounding or quantizer, the grouping kernels, the matrix kernel); then
each launch is replayed on its own with the same arguments and timed the same way. Replaying reads
what the call left in the scratch, so every launch sees the inputs it sees inside the call.

    python -m microbench.launches --backend cuda [--types Q4_0 Q4_K] [--ubatch 512 4096]
        [--tiles auto 64 128] [--path direct]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from expertstream.backends.base import Backend, Device, DeviceBuffer, Stream
from expertstream.bench.probes import Gate, expert_weights
from expertstream.kernels import MoeKernels, layout
from expertstream.kernels.layout import TileM

from ._common import Column, emit, environment, open_backend
from ._common import parser as common_parser
from .kernels import FAMILIES, GATE_BYTES, N_EXPERT, PROBLEM, SHAPES, TOP_K, TensorShape, time_ms


@dataclass(frozen=True)
class Row:
    type: str
    tensor: str
    ubatch: int
    tile_m: int
    launch: str  # a kernel's name, or "call" for the whole call
    ms: float
    share: float  # of the call's time


class _Noting:
    """A stream that notes the launches enqueued through it (and enqueues them)."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self.launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.launches.append((args, kwargs))
        self._stream.launch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def measure_call(
    device: Device,
    stream: Stream,
    gate: Gate,
    kernels: MoeKernels,
    w: DeviceBuffer,
    w_type: GGMLQuantizationType,
    shape: TensorShape,
    ubatch: int,
    tile: TileM,
    rng: np.random.Generator,
    repeats: int,
) -> list[Row]:
    n_pairs = ubatch * TOP_K
    ids = np.argsort(rng.random((ubatch, N_EXPERT)), axis=1)[:, :TOP_K].astype(np.int32)
    x_rows = n_pairs if shape.x_per_pair else ubatch
    x = rng.standard_normal((x_rows, shape.n_in), dtype=np.float32)
    with device.upload(x) as x_buf, device.upload(ids) as ids_buf, device.alloc(n_pairs * shape.n_out * 4) as y:

        def call(on: Any = stream) -> None:
            kernels.mul_mat_id(
                on,
                w,
                w_type,
                N_EXPERT,
                shape.n_out,
                shape.n_in,
                x_buf,
                shape.x_per_pair,
                ids_buf,
                ubatch,
                TOP_K,
                y,
                tile_m=tile,
            )

        whole = time_ms(device, stream, gate, call, 1, repeats)
        noting = _Noting(stream)
        call(noting)
        stream.synchronize()
        rows = [Row(w_type.name, shape.name, ubatch, int(tile), "call", whole, 1.0)]
        for args, kwargs in noting.launches:
            ms = time_ms(device, stream, gate, functools.partial(stream.launch, *args, **kwargs), 1, repeats)
            rows.append(Row(w_type.name, shape.name, ubatch, int(tile), args[0].name, ms, ms / whole))
    return rows


def run(be: Backend, args: argparse.Namespace) -> dict[str, Any]:
    device = be.device(args.device)
    path, direct = FAMILIES[args.path]
    rng = np.random.default_rng(args.seed)
    rows: list[Row] = []
    with MoeKernels(device, path, direct=direct) as kernels, device.stream() as stream, contextlib.ExitStack() as stack:
        gate = stack.enter_context(Gate.opened(device, stream, GATE_BYTES))
        for type_name in args.types:
            w_type = GGMLQuantizationType[type_name]
            for shape in SHAPES:
                with expert_weights(device, rng, w_type, shape.n_out, shape.n_in, N_EXPERT) as w:
                    for ubatch in args.ubatch:
                        n_pairs = ubatch * TOP_K
                        asked = (
                            kernels.tile_for(w_type, n_pairs, N_EXPERT, shape.n_in) if t == "auto" else TileM(int(t))
                            for t in args.tiles
                        )
                        for tile in dict.fromkeys(asked):
                            rows += measure_call(
                                device, stream, gate, kernels, w, w_type, shape, ubatch, tile, rng, args.repeats
                            )
        device.synchronize()
    return {
        **environment(be, device),
        "path": args.path,
        **PROBLEM,
        "repeats": args.repeats,
        "rows": [asdict(r) for r in rows],
    }


COLUMNS: Sequence[Column] = (
    Column("type", "type"),
    Column("tensor", "tensor"),
    Column("ubatch", "ubatch"),
    Column("tile_m", "tile"),
    Column("launch", "launch"),
    Column("ms", "ms", "{:.3f}"),
    Column("share", "of call", "{:.0%}"),
)


def main(argv: list[str] | None = None) -> int:
    p = common_parser("launches", "Each launch of one mul_mat_id call on Qwen3-30B-A3B expert shapes, timed alone.")
    p.add_argument(
        "--types", nargs="+", default=["Q4_0", "Q4_K"], choices=[f.qtype.name for f in layout.FORMATS.values()]
    )
    p.add_argument("--ubatch", type=int, nargs="+", default=[512, 4096], help="tokens per call")
    p.add_argument("--tiles", nargs="+", default=["auto"], choices=["auto", *(str(int(t)) for t in TileM)])
    p.add_argument("--path", default="direct", choices=list(FAMILIES), help="kernel family")
    p.add_argument("--repeats", type=int, default=20, help="calls per timing round")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with open_backend(args) as be:
        result = run(be, args)
    emit(args, result, COLUMNS, "mul_mat_id launch by launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
