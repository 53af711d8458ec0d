"""Where one whole-model decode step spends its time (``python -m microbench.decode_profile``).

Runs a prompt, then decode steps of one token: the first through the scheduler (compiling the
kernels), the rest replayed from one captured step where the scheduler can capture it, timed
on the host clock per step. Last, one more step is issued call by call with a timing event
either side of every copy and kernel, and the table sums those device times per operation
name: how many calls a step makes of each and how long they take together. The bytes a
step must read (the weights other than the experts, each used expert's rows once, the KV
rows) over the replayed step's time say how far it is from the device's memory bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from expertstream.engine.model import Model, _DecodeSteps
from expertstream.engine.runner import MoeRunner
from expertstream.model import MoeModel
from expertstream.timeline import TimelineOp

from ._common import Column, emit, model_arguments, model_file, open_backend, parser, print_table

COLUMNS = (
    Column("name", "operation"),
    Column("calls", "calls/step"),
    Column("device_us", "device us", "{:.1f}"),
    Column("share", "share", "{:.1%}"),
)


def step_bytes(path: Path, model: MoeModel, runner: MoeRunner, position: int) -> int:
    """The bytes one decode step reads at least: every tensor but the experts once (of the
    embedding table one row), top_k experts' gate, up and down rows per layer, and the K and V
    rows of ``position`` tokens."""
    experts = {info.name: info for info in model.expert_tensors}
    total = 0
    for tensor in GGUFReader(path).tensors:
        n_bytes = int(tensor.n_bytes)
        if tensor.name in experts:
            n_bytes = n_bytes // int(tensor.shape[-1]) * model.top_k
        elif tensor.name == "token_embd.weight":
            n_bytes //= int(tensor.shape[-1])
        total += n_bytes
    whole = runner.whole
    return total + (0 if whole is None else runner.kv_cache_bytes * position // whole.n_ctx)


def main(argv: list[str] | None = None) -> int:
    p = parser("decode_profile", __doc__.splitlines()[0])
    model_arguments(p, layers=8)
    p.add_argument("-p", "--prompt", type=int, default=64, help="prompt tokens before the steps")
    p.add_argument("-n", "--steps", type=int, default=16, help="decode steps (the first compiles; one more is traced)")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0, help="layers whose experts stay in host memory")
    p.add_argument("--host-memory", default="pinned")
    p.add_argument("-ub", "--ubatch", type=int, help="prefill ubatch (default: the whole prompt)")
    p.add_argument("--top", type=int, default=25, help="prefill rows shown")
    p.add_argument("--no-gemv", dest="gemv", action="store_false", help="few rows on the tile kernels")
    p.add_argument("--no-graphs", action="store_true", help="replay nothing: every step call by call")
    p.add_argument(
        "--profiler-range",
        action="store_true",
        help="the next-to-last timed step inside the backend's profiler range (CUDA: cudaProfilerStart/Stop), "
        "for `ncu --profile-from-start off`",
    )
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be at least 3: one compiles, one or more are timed, one is traced")
    # With data on the simulator: the steps read their logits back.
    with open_backend(args, data=True) as backend, model_file(args, "decode_profile") as path:
        result = profile(backend, Path(path), args)
    out = sys.stderr if args.json else sys.stdout
    print(
        f"prefill of {result['prompt']} tokens (ubatch {result['ubatch']}): {result['prefill_ms']:.2f} ms; traced: "
        f"{result['prefill_device_ms']:.2f} ms in {result['prefill_calls']} operations",
        file=out,
    )
    print_table(result["prefill_rows"][: args.top], COLUMNS, out)
    emit(args, result, COLUMNS, f"one decode step, {result['step_ms']:.3f} ms replayed ({result['path']})")
    print(
        f"bytes a step reads: {result['step_bytes'] / 1e6:.1f} MB, {result['step_gbs']:.0f} GB/s at the replayed "
        f"step's time; traced step: {result['traced_ms']:.3f} ms end to end, {result['device_ms']:.3f} ms in "
        f"{result['calls']} operations",
        file=out,
    )
    return 0


def _by_name(ops: Sequence[TimelineOp]) -> tuple[list[dict[str, Any]], float, int]:
    """Device time per operation name, most first; the total; the number of operations."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for op in ops:
        if op.device is not None:
            by_name[op.name].append(op.end - op.start)
    total = sum(sum(v) for v in by_name.values())
    rows = [
        {"name": name, "calls": len(v), "device_us": sum(v) * 1e6, "share": sum(v) / total}
        for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    ]
    return rows, total, sum(len(v) for v in by_name.values())


def _traced(backend: Any, run: Callable[[], object]) -> tuple[list[TimelineOp], float]:
    """The operations ``run`` enqueued (with their device times) and its time on the host clock."""
    backend.start_trace()
    already = len(backend.timeline or ())
    start = backend.host.timestamp()
    run()
    elapsed = backend.host.timestamp() - start
    return list(backend.timeline or ())[already:], elapsed


def profile(backend: Any, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"slots": 3, "host_memory": args.host_memory, "gemv": args.gemv}
    options.update(graphs=not args.no_graphs, n_cpu_moe=args.n_cpu_moe, ubatch=args.ubatch or args.prompt)
    host = backend.host
    with Model.open(path, backend=backend, devices=(args.device,), **options) as model:
        steps = args.steps
        with model._runner(args.prompt, steps, all_logits=False) as (runner, scheduler, experts):
            runner.set_prompt([1 + i % 100 for i in range(args.prompt)])
            prefill_s = []
            for _ in range(2):  # the first compiles
                start = host.timestamp()
                scheduler.run(runner.prefill_plan(experts))
                prefill_s.append(host.timestamp() - start)
            times = []
            with _DecodeSteps(runner, scheduler, experts, not args.no_graphs) as decode:
                for step in range(steps - 1):
                    ranged = args.profiler_range and step == steps - 2
                    with backend.profiler_range() if ranged else contextlib.nullcontext():
                        start = host.timestamp()
                        decode.run(step, 1 + step)
                        times.append(host.timestamp() - start)
                replay_path = decode.path
            # Traced last: timing events bracket every operation from here on.
            last = steps - 1
            runner.set_decode_token(last, 7)
            step_ops, traced_s = _traced(backend, lambda: scheduler.run(runner.decode_plan(experts, last)))
            prefill_ops, traced_prefill_s = _traced(backend, lambda: scheduler.run(runner.prefill_plan(experts)))
            step_s = statistics.median(times[1:])
            nbytes = step_bytes(path, model.model, runner, args.prompt + steps)
    rows, device_s, calls = _by_name(step_ops)
    prefill_rows, prefill_device_s, prefill_calls = _by_name(prefill_ops)
    return {
        "backend": backend.name,
        "device": backend.device(args.device).name,
        "model": str(path),
        "prompt": args.prompt,
        "ubatch": options["ubatch"],
        "n_cpu_moe": args.n_cpu_moe,
        "gemv": args.gemv,
        "path": replay_path,
        "prefill_ms": prefill_s[-1] * 1e3,
        "prefill_traced_ms": traced_prefill_s * 1e3,
        "prefill_device_ms": prefill_device_s * 1e3,
        "prefill_calls": prefill_calls,
        "prefill_rows": prefill_rows,
        "step_ms": step_s * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "step_bytes": nbytes,
        "step_gbs": nbytes / step_s / 1e9,
        "traced_ms": traced_s * 1e3,
        "device_ms": device_s * 1e3,
        "calls": calls,
        "rows": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
