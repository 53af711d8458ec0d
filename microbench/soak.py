"""A long run in one process, and real failures on the real backend.

Soak: one runner, ``--prefills`` prefill runs and ``--decode-steps`` decode steps in all,
each prefill followed by its share of the decode steps, cycling through slot counts and host
memory modes. Every prefill must give the reference hash (computed first with the stock
path from pinned memory), and so must the decode rows once all steps ran; device memory
and page-locked host memory are sampled after every round and must come back to their
baseline when everything is closed.

Failures (``--failures``), each expected to fall back or fail with one clear line, and to
give the reference bytes where it falls back:

- ``device-full``: most of the device's free memory is taken first, so staging slots
  cannot be allocated (prefetch turns itself off for the run);
- ``register-refused``: the model's mapping is already registered by another placement,
  so the driver refuses to register it again (the placement falls back to a staging ring);
- ``file-removed``: the model file is unlinked while mapped (the mapping stays valid).

    python -m microbench.soak --backend cuda --model FILE.gguf --prefills 100 --decode-steps 10000 --failures
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import expertstream
from expertstream.backends.base import Device, DeviceBuffer, Usage
from expertstream.engine.runner import Batching, MoeRunner, sha256
from expertstream.errors import BackendError
from expertstream.hostmem import HostMemoryMode, HostWeights
from expertstream.model import MoeModel
from expertstream.scheduler import RunStats, Scheduler

from ._common import Column, emit, environment

log = logging.getLogger(__name__)

SLOTS = (0, 3, 2, 4, 8)
MODES = (HostMemoryMode.REGISTERED, HostMemoryMode.PINNED, HostMemoryMode.RING, HostMemoryMode.MMAP)


class _LogLines(logging.Handler):
    """Counts WARNING (and worse) lines, to show a failure said so once."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _memory(device: Device) -> dict[str, int]:
    return {"device_free": device.free_memory(), "page_locked": device.page_locked_bytes}


def _reference(runner: MoeRunner, model: MoeModel, device: Device) -> tuple[str, str]:
    with HostWeights.open(model, device, HostMemoryMode.PINNED) as weights, Scheduler(slots=0) as scheduler:
        runner.poison_prefill_output(scheduler.stream)
        runner.poison_decode_output(scheduler.stream)
        scheduler.run(runner.prefill_plan(weights))
        for step in range(runner.batching.decode_steps):
            scheduler.run(runner.decode_plan(weights, step))
    prefill, decode = runner.prefill_output(), runner.decode_output()
    if not (np.isfinite(prefill).all() and np.isfinite(decode).all()):
        raise RuntimeError("the reference run left non-finite (poisoned) outputs: it cannot vouch for other runs")
    return sha256(prefill), sha256(decode)


def soak(device: Device, path: Path, prefills: int, decode_steps: int, batching: Batching) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    mismatches = 0
    per_round = -(-decode_steps // prefills)
    with MoeModel.open(path) as model:
        with MoeRunner(device, model, batching) as runner:
            prefill_ref, decode_ref = _reference(runner, model, device)
        # After the reference: the kernels are compiled and loaded, which the backend keeps until it closes.
        baseline = _memory(device)
        with MoeRunner(device, model, batching) as runner:
            steps = iter(range(decode_steps))
            settings = itertools.cycle(itertools.product(MODES, SLOTS))
            for round_ in range(prefills):
                mode, slots = next(settings)
                with HostWeights.open(model, device, mode) as weights, Scheduler(slots=slots) as scheduler:
                    if round_ == 0:  # the decode steps fill their rows over all the rounds
                        runner.poison_decode_output(scheduler.stream)
                    runner.poison_prefill_output(scheduler.stream)
                    scheduler.run(runner.prefill_plan(weights))
                    ok = sha256(runner.prefill_output()) == prefill_ref
                    mismatches += not ok
                    for step in itertools.islice(steps, per_round):
                        scheduler.run(runner.decode_plan(weights, step))
                    samples.append(
                        {"round": round_, "host_memory": weights.mode.value, "slots": slots, "prefill_ok": ok}
                    )
                samples[-1].update(_memory(device))  # what is held between rounds: the runner only
            decode_ok = sha256(runner.decode_output()) == decode_ref
    end = _memory(device)
    return {
        "prefills": prefills,
        "decode_steps": decode_steps,
        "prefill_mismatches": mismatches,
        "decode_identical": decode_ok,
        "baseline": baseline,
        "end": end,
        "back_to_baseline": end == baseline,
        "samples": samples,
    }


@contextmanager
def _device_nearly_full(device: Device, leave: int) -> Iterator[None]:
    """Take all but ``leave`` bytes of the device's free memory, in a few large buffers."""
    taken: list[DeviceBuffer] = []
    try:
        while (free := device.free_memory()) > leave + (64 << 20):
            try:
                taken.append(device.alloc(min(free - leave, 8 << 30), Usage.COMPUTE))
            except BackendError:
                break
        yield
    finally:
        for buf in taken:
            buf.close()


def _run_once(runner: MoeRunner, weights: HostWeights, slots: int) -> tuple[str, RunStats]:
    with Scheduler(slots=slots) as scheduler:
        runner.poison_prefill_output(scheduler.stream)
        stats = scheduler.run(runner.prefill_plan(weights))
    return sha256(runner.prefill_output()), stats


def failures(device: Device, path: Path, batching: Batching) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    handler = _LogLines()
    logging.getLogger("expertstream").addHandler(handler)
    try:
        with MoeModel.open(path) as model, MoeRunner(device, model, batching) as runner:
            reference, _ = _reference(runner, model, device)

            # The simulator's device memory is this process's RAM: filling it would fill the host.
            if device.backend.name != "sim":
                handler.lines.clear()
                with HostWeights.open(model, device, HostMemoryMode.REGISTERED) as weights:
                    slot_bytes = max(t.nbytes for t in model.expert_tensors)
                    with _device_nearly_full(device, leave=2 * slot_bytes):
                        digest, stats = _run_once(runner, weights, 8)
                fallbacks = {k: v for dev in stats.devices.values() for k, v in dev.fallbacks.items() if v}
                row = _row("device-full", digest == reference, fallbacks, handler.lines)
                row["exercised"] = bool(fallbacks)  # slots small enough still fit: nothing was tested
                rows.append(row)

            handler.lines.clear()
            with HostWeights.open(model, device, HostMemoryMode.REGISTERED) as first:
                with HostWeights.open(model, device, HostMemoryMode.REGISTERED) as second:
                    digest, _ = _run_once(runner, second, 3)
                    fell_back = [f"{f.requested.value}->{f.used.value}: {f.reason}" for f in second.stats.fallbacks]
                assert first.mode is HostMemoryMode.REGISTERED
            row = _row("register-refused", digest == reference, {"host": fell_back}, handler.lines)
            row["exercised"] = bool(fell_back)  # a platform that registers twice refuses nothing
            rows.append(row)

        handler.lines.clear()
        with tempfile.TemporaryDirectory(prefix="soak-") as folder:
            copy = Path(folder) / path.name
            shutil.copyfile(path, copy)
            with (
                MoeModel.open(copy) as model,
                MoeRunner(device, model, batching) as runner,
                HostWeights.open(model, device, HostMemoryMode.MMAP) as weights,
            ):
                os.unlink(copy)
                digest, _ = _run_once(runner, weights, 3)
            rows.append(_row("file-removed", digest == reference, {}, handler.lines))
    finally:
        logging.getLogger("expertstream").removeHandler(handler)
    return rows


def _row(what: str, identical: bool, fallbacks: Mapping[Any, Any], lines: Sequence[str]) -> dict[str, Any]:
    return {
        "failure": what,
        "identical": identical,
        "fallbacks": fallbacks,
        "log_lines": len(lines),
        "log": list(lines),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m microbench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=("auto", "cuda", "hip", "sim"))
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prefills", type=int, default=100)
    p.add_argument("--decode-steps", type=int, default=10_000)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--ubatch", type=int, default=512)
    p.add_argument("--failures", action="store_true", help="also run the real-failure cases")
    p.add_argument(
        "--failures-model",
        type=Path,
        help="the model for the failure cases (default --model); device-full needs tensors of tens of MB, "
        "or its slots still fit beside the driver's allocation granularity",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with expertstream.backend(args.backend) as backend:
        device = backend.device(0)
        result: dict[str, Any] = environment(backend, device)
        batching = Batching(args.tokens, args.ubatch, args.decode_steps)
        result["soak"] = soak(device, args.model, args.prefills, args.decode_steps, batching)
        rows: list[dict[str, Any]] = []
        s = result["soak"]
        rows.append(
            {
                "what": f"soak: {s['prefills']} prefills, {s['decode_steps']} decode steps",
                "ok": s["prefill_mismatches"] == 0 and s["decode_identical"] and s["back_to_baseline"],
                "detail": f"mismatches {s['prefill_mismatches']}, decode identical {s['decode_identical']}, "
                f"device free {s['baseline']['device_free']} -> {s['end']['device_free']}, page-locked "
                f"{s['baseline']['page_locked']} -> {s['end']['page_locked']}",
            }
        )
        if args.failures:
            model = args.failures_model or args.model
            result["failures"] = failures(device, model, Batching(args.tokens, args.ubatch))
            for f in result["failures"]:
                rows.append(
                    {
                        "what": f["failure"],
                        "ok": f["identical"] and f.get("exercised", True),
                        "detail": f"fallbacks {f['fallbacks']}, {f['log_lines']} log line(s)"
                        + ("" if f.get("exercised", True) else "; not exercised"),
                    }
                )
        result["rows"] = rows
    emit(args, result, [Column("what", "case"), Column("ok", "held"), Column("detail", "detail")], "soak and failures")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
