"""Prefill attention's rate (``python -m microbench.attention``): TFLOP/s of the causal kernels.

One launch of ``attention`` per row: a ubatch of ``--tokens`` queries at the end of a context of
``--context`` positions (the queries' positions are context - tokens .. context - 1, so each sees
its causal prefix of the F16 cache), on the head shapes of the presets the whole model runs:
qwen3-30b-a3b (32 query heads, 4 KV heads of 128), gpt-oss-20b (64 of 64 over 8, sinks, and its
128-key window), qwen3-next (16 of 256 over 2) and deepseek2's latent (16 of 576 over one shared
key-value row). A row's FLOPs count only what a query sees: 4 * head_dim (QK and PV, a multiply and
an add each) per (query, head, visible key); deepseek2's latent counts 2 * (576 + 512). Times are
device time per call, back to back behind a gate (as ``microbench.kernels`` times them), the median
of three rounds. The kernel a row ran is the launcher's choice on the device (``kernel``, from
``attention.prefill_kernel``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from expertstream.backends.base import Backend, Device, Stream
from expertstream.bench.probes import Gate
from expertstream.kernels import MoeKernels
from expertstream.kernels.attention import attention, prefill_kernel

from ._common import Column, emit, environment, open_backend
from ._common import parser as common_parser
from .kernels import GATE_BYTES, time_ms


@dataclass(frozen=True)
class HeadShape:
    name: str
    n_head: int
    n_head_kv: int
    head_dim: int
    window: int = 0
    sinks: bool = False
    value_dim: int | None = None  # deepseek2's latent: values are the first 512 columns of the key row

    @property
    def shared_kv(self) -> bool:
        return self.value_dim is not None


SHAPES = {
    s.name: s
    for s in (
        HeadShape("qwen3-30b-a3b", 32, 4, 128),
        HeadShape("gpt-oss-20b", 64, 8, 64, window=128, sinks=True),
        HeadShape("qwen3-next", 16, 2, 256),
        HeadShape("deepseek2-latent", 16, 1, 576, value_dim=512),
    )
}


@dataclass(frozen=True)
class Row:
    shape: str
    tokens: int
    context: int
    kernel: str
    kernel_ms: float
    tflops: float


COLUMNS: Sequence[Column] = (
    Column("shape", "heads"),
    Column("tokens", "tokens"),
    Column("context", "context"),
    Column("kernel", "kernel"),
    Column("kernel_ms", "kernel ms", "{:.3f}"),
    Column("tflops", "TFLOP/s", "{:.1f}"),
)


def visible_pairs(tokens: int, context: int, window: int) -> int:
    """(query, key) pairs a ubatch of ``tokens`` queries ending at ``context`` sees, causally."""
    positions = np.arange(context - tokens, context, dtype=np.int64)
    seen = positions + 1
    if window:
        seen = np.minimum(seen, window)
    return int(seen.sum())


def measure_one(
    device: Device,
    stream: Stream,
    gate: Gate,
    kernels: MoeKernels,
    shape: HeadShape,
    tokens: int,
    context: int,
    args: argparse.Namespace,
) -> Row:
    rng = np.random.default_rng(args.seed)
    d = shape.head_dim
    q = rng.standard_normal((tokens, shape.n_head, d), dtype=np.float32)
    cache = (rng.standard_normal((context, shape.n_head_kv, d), dtype=np.float32) * 0.5).astype(np.float16)
    positions = np.arange(context - tokens, context, dtype=np.int32)
    sinks = rng.standard_normal(shape.n_head, dtype=np.float32) if shape.sinks else None
    with (
        device.upload(q) as q_buf,
        device.upload(cache) as k_buf,
        device.upload(cache if shape.shared_kv else cache[::-1].copy()) as v_buf,
        device.upload(positions) as pos_buf,
        device.alloc(tokens * shape.n_head * d * 4) as out,
        device.upload(sinks if sinks is not None else np.zeros(1, np.float32)) as sinks_buf,
    ):
        v_view = k_buf.view() if shape.shared_kv else v_buf.view()

        def launch() -> None:
            attention(
                kernels,
                stream,
                q_buf.view(),
                k_buf.view(),
                v_view,
                out.view(),
                pos_buf.view(),
                n_tokens=tokens,
                kv_len=context,
                n_head=shape.n_head,
                n_head_kv=shape.n_head_kv,
                head_dim=d,
                scale=1.0 / float(np.sqrt(d)),
                window=shape.window,
                sinks=sinks_buf.view() if shape.sinks else None,
            )

        ms = time_ms(device, stream, gate, launch, args.warmup, args.repeats)
        device.synchronize()
    flops_per_pair = 2 * (d + (shape.value_dim or d))
    flops = visible_pairs(tokens, context, shape.window) * shape.n_head * flops_per_pair
    kernel = prefill_kernel(kernels, shape.head_dim, shape.shared_kv)
    return Row(shape.name, tokens, context, kernel, ms, flops / (ms * 1e-3) / 1e12)


def run(be: Backend, args: argparse.Namespace) -> dict[str, Any]:
    device = be.device(args.device)
    rows: list[Row] = []
    with MoeKernels(device) as kernels, device.stream() as stream, Gate.opened(device, stream, GATE_BYTES) as gate:
        for name in args.shapes:
            for tokens in args.tokens:
                for context in args.context:
                    if context < tokens:
                        continue
                    rows.append(measure_one(device, stream, gate, kernels, SHAPES[name], tokens, context, args))
        device.synchronize()
    return {**environment(be, device), "repeats": args.repeats, "rows": [asdict(r) for r in rows]}


def main(argv: list[str] | None = None) -> int:
    p = common_parser("attention", "Prefill attention's TFLOP/s on the presets' head shapes.")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="head shapes")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096], help="queries per launch (a ubatch)")
    p.add_argument("--context", type=int, nargs="+", default=[4096, 32768], help="cache positions the last query sees")
    p.add_argument("--repeats", type=int, default=10, help="calls per timing round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with open_backend(args) as be:
        result = run(be, args)
    emit(args, result, COLUMNS, "prefill attention, one launch per row")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
