"""Where one whole-model decode step spends its time (``python -m microbench.decode_profile``).

Runs a prompt, then decode steps of one token: the first through the scheduler (compiling the
kernels), the rest replayed from one captured step where the scheduler can capture it, timed
on the host clock per step. Last, one more step is issued call by call with a timing event
either side of every copy and kernel, and the table sums those device times per operation
name: how many calls a step makes of each and how long they take together. The bytes a
step must read (the weights other than the experts, each used expert's rows once, the KV
rows) over the replayed step's time say how far it is from the device's memory bandwidth.

The timing events of a traced step weigh more than its small kernels. ``--alone`` also times
every kernel launch of one more step on its own: ``ALONE_CHAIN`` launches of it captured in one
graph, replayed ``ALONE_REPLAYS`` times, as the step's graph runs them (one after the other on
one stream). The table gains each operation's time alone per step, and their sum sits beside the
replayed step's time: what the kernels take, and what the step adds between them.
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

from expertstream.backends.base import Stream
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
ALONE_COLUMNS = (*COLUMNS, Column("alone_us", "alone us", "{:.1f}"))
ALONE_CHAIN = 16  # launches of one kernel in the graph that times it alone
ALONE_REPLAYS = 5  # replays of that graph timed together, after one untimed


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
        "--alone",
        action="store_true",
        help="also time each kernel launch of a step on its own, in a graph of its repeats (see above)",
    )
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
        f"prefill of {result['prompt']} tokens (ubatch {result['ubatch']}): {result['prefill_ms']:.2f} ms "
        f"({result['prefill_path']}); traced as calls: {result['prefill_device_ms']:.2f} ms in "
        f"{result['prefill_calls']} operations",
        file=out,
    )
    print_table(result["prefill_rows"][: args.top], COLUMNS, out)
    columns = ALONE_COLUMNS if args.alone else COLUMNS
    emit(args, result, columns, f"one decode step, {result['step_ms']:.3f} ms replayed ({result['path']})")
    print(
        f"bytes a step reads: {result['step_bytes'] / 1e6:.1f} MB, {result['step_gbs']:.0f} GB/s at the replayed "
        f"step's time; traced step: {result['traced_ms']:.3f} ms end to end, {result['device_ms']:.3f} ms in "
        f"{result['calls']} operations",
        file=out,
    )
    if args.alone:
        print(
            f"the step's {result['alone_launches']} kernel launches, each alone in a graph of {ALONE_CHAIN}: "
            f"{result['alone_ms']:.3f} ms together, against the replayed step's {result['step_ms']:.3f} ms",
            file=out,
        )
    return 0


def _noted_launches(run: Callable[[], object]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The kernel launches ``run`` enqueues (on any stream), as Stream.launch got them; it enqueues them too."""
    noted: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    original = Stream.launch

    def noting(stream: Stream, *args: Any, **kwargs: Any) -> None:
        noted.append((args, kwargs))
        original(stream, *args, **kwargs)

    Stream.launch = noting  # type: ignore[method-assign,assignment]
    try:
        run()
    finally:
        Stream.launch = original  # type: ignore[method-assign]
    return noted


def _alone_s(device: Any, stream: Stream, launch: tuple[tuple[Any, ...], dict[str, Any]]) -> float:
    """Device seconds per launch of one kernel launch: ALONE_CHAIN of it captured in one graph, the
    graph replayed ALONE_REPLAYS times after one untimed replay."""
    args, kwargs = launch
    stream.begin_capture()
    try:
        for _ in range(ALONE_CHAIN):
            stream.launch(*args, **kwargs)
    finally:
        graph = stream.end_capture()
    assert graph is not None
    with graph, device.event(timing=True) as start, device.event(timing=True) as end:
        graph.launch(stream)
        stream.record(start)
        for _ in range(ALONE_REPLAYS):
            graph.launch(stream)
        stream.record(end)
        end.synchronize()
        return start.elapsed_ms(end) * 1e-3 / (ALONE_REPLAYS * ALONE_CHAIN)


def _alone(device: Any, launches: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> dict[str, float]:
    """Seconds alone per step by kernel name: each launch timed by _alone_s, summed per name."""
    by_name: dict[str, float] = defaultdict(float)
    with device.stream() as stream:
        for launch in launches:
            by_name[launch[0][0].name] += _alone_s(device, stream, launch)
    return by_name


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
        with model._runner(args.prompt, steps, all_logits=False) as (runner, scheduler, experts, prefill):
            runner.set_prompt([1 + i % 100 for i in range(args.prompt)])
            prefill_s = []
            for _ in range(2):  # the first compiles
                start = host.timestamp()
                prefill.run()  # full ubatches replayed from one captured ubatch where they can be
                prefill_s.append(host.timestamp() - start)
            prefill_path = prefill.path
            times = []
            with _DecodeSteps(runner, scheduler, experts, not args.no_graphs) as decode:
                for step in range(steps - 1):
                    ranged = args.profiler_range and step == steps - 2
                    with backend.profiler_range() if ranged else contextlib.nullcontext():
                        start = host.timestamp()
                        decode.run(step, 1 + step)
                        times.append(host.timestamp() - start)
                replay_path = decode.path
            # Traced last: timing events bracket every operation from then on.
            last = steps - 1
            runner.set_decode_token(last, 7)
            alone: dict[str, float] = {}
            launches = 0
            if args.alone:  # before any trace: no timing events among the launches timed alone
                noted = _noted_launches(lambda: scheduler.run(runner.decode_plan(experts, last)))
                backend.device(args.device).synchronize()
                alone, launches = _alone(backend.device(args.device), noted), len(noted)
                runner.set_decode_token(last, 7)
            step_ops, traced_s = _traced(backend, lambda: scheduler.run(runner.decode_plan(experts, last)))
            prefill_ops, traced_prefill_s = _traced(backend, lambda: scheduler.run(runner.prefill_plan(experts)))
            step_s = statistics.median(times[1:])
            nbytes = step_bytes(path, model.model, runner, args.prompt + steps)
    rows, device_s, calls = _by_name(step_ops)
    for row in rows:
        if args.alone:
            row["alone_us"] = alone.get(row["name"], 0.0) * 1e6
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
        "prefill_path": prefill_path,
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
        "alone_ms": sum(alone.values()) * 1e3,
        "alone_launches": launches,
    }


if __name__ == "__main__":
    raise SystemExit(main())
