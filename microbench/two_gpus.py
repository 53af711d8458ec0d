"""Two devices: their host links alone and together, peer copies, and a layer split's outputs.

Transfers (pinned host memory, ``--mb`` per copy, best of ``--repeats``):

- H2D of each device alone, then of both at once (a copy on each device's stream, timed
  from before the first enqueue to after both finish): do the two links add up, or do they
  share a host bottleneck?
- peer copies device 0 -> 1 and 1 -> 0 where peer access is granted, and the same rows
  through pinned host memory (D2H on the sender, H2D on the receiver), the way a layer
  split crosses when peers are refused.

Outputs (``--model FILE``): the model's layers on device 0 alone, then split over devices 0
and 1; prefill and ``--decode`` steps for every slot setting and host memory mode must give
one hash.

    python -m microbench.two_gpus --backend cuda --model FILE.gguf --decode 1000 [--json]
    python -m microbench.two_gpus --backend sim   (timing-only on the simulator's two devices)
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import expertstream
from expertstream.backends.base import Backend, Device, DeviceBuffer, Usage
from expertstream.bench.measure import measure_h2d_peak
from expertstream.engine.runner import Batching, MoeRunner, sha256
from expertstream.errors import BackendError
from expertstream.hostmem import HostWeights
from expertstream.model import MoeModel
from expertstream.scheduler import Scheduler

from ._common import MIB, Column, emit, environment

log = logging.getLogger(__name__)


def _peer_gbps(backend: Backend, src: Device, dst: Device, nbytes: int, repeats: int) -> float | None:
    """src -> dst device copies on dst's stream, or None where peer access is refused."""
    try:
        dst.enable_peer_access(src)
    except BackendError as exc:
        log.warning("no peer access %s -> %s: %s", src.label, dst.label, exc)
        return None
    with ExitStack() as stack:
        a = stack.enter_context(src.alloc(nbytes, Usage.COMPUTE))
        b = stack.enter_context(dst.alloc(nbytes, Usage.COMPUTE))
        stream = stack.enter_context(dst.stream())
        _clear(a)

        def copy() -> None:
            stream.copy_d2d(b, 0, a, 0, nbytes)
            stream.synchronize()

        return _best(backend, repeats, nbytes, copy)


def _via_host_gbps(backend: Backend, src: Device, dst: Device, nbytes: int, repeats: int) -> float:
    """src -> pinned host -> dst, the second copy waiting on an event after the first."""
    with ExitStack() as stack:
        a = stack.enter_context(src.alloc(nbytes, Usage.COMPUTE))
        b = stack.enter_context(dst.alloc(nbytes, Usage.COMPUTE))
        host = stack.enter_context(src.alloc_pinned(nbytes))
        send = stack.enter_context(src.stream())
        receive = stack.enter_context(dst.stream())
        sent = stack.enter_context(src.event())
        _clear(a)

        def cross() -> None:
            send.copy_d2h(host, 0, a, 0, nbytes)
            send.record(sent)
            receive.wait(sent)
            receive.copy_h2d(b, 0, host, 0, nbytes)
            receive.synchronize()

        return _best(backend, repeats, nbytes, cross)


def _clear(buf: DeviceBuffer) -> None:
    with buf.device.stream() as stream:
        stream.memset(buf, 0, buf.nbytes, 0x5A)
        stream.synchronize()


def _best(backend: Backend, repeats: int, nbytes: int, run: Any) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = backend.host.timestamp()
        run()
        best = min(best, backend.host.timestamp() - start)
    return nbytes / best / 1e9


def transfers(backend: Backend, devices: Sequence[Device], nbytes: int, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for device in devices:
        rows.append({"what": f"H2D {device.label} alone", "gb_per_s": measure_h2d_peak(backend, device, nbytes).gbps})
    both = " + ".join(d.label for d in devices)
    rows.append({"what": f"H2D {both} at once", "gb_per_s": measure_h2d_peak(backend, list(devices), nbytes).gbps})
    for src, dst in ((devices[0], devices[1]), (devices[1], devices[0])):
        rows.append(
            {"what": f"peer {src.label} -> {dst.label}", "gb_per_s": _peer_gbps(backend, src, dst, nbytes, repeats)}
        )
        rows.append(
            {
                "what": f"via host {src.label} -> {dst.label}",
                "gb_per_s": _via_host_gbps(backend, src, dst, nbytes, repeats),
            }
        )
    return rows


def outputs(
    devices: Sequence[Device],
    path: Path,
    batching: Batching,
    modes: Sequence[str],
    slots: Sequence[int],
) -> list[dict[str, Any]]:
    """One row per (devices, mode, slots): prefill and decode hashes, to be equal across rows."""
    rows: list[dict[str, Any]] = []
    with MoeModel.open(path) as model:
        for placement in ([devices[0]], list(devices)):
            with MoeRunner(placement, model, batching) as runner:
                copied_to = runner.layer_split.expert_devices
                for mode in modes:
                    with HostWeights.open(model, placement[0], mode, copied_to=copied_to) as weights:
                        for n in slots:
                            with Scheduler(slots=n) as scheduler:
                                scheduler.run(runner.prefill_plan(weights))
                                for step in range(batching.decode_steps):
                                    scheduler.run(runner.decode_plan(weights, step))
                            prefill = runner.prefill_output()
                            decode = runner.decode_output()
                            rows.append(
                                {
                                    "devices": "+".join(d.label for d in placement),
                                    "crossing": ",".join(runner.crossings) or "-",
                                    "host_memory": weights.mode.value,
                                    "slots": n,
                                    "prefill_sha256": sha256(prefill)[:16],
                                    "decode_sha256": sha256(decode)[:16] if batching.decode_steps else "-",
                                }
                            )
                            log.info("%s", " ".join(f"{k}={v}" for k, v in rows[-1].items()))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m microbench.two_gpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=("auto", "cuda", "hip", "sim"))
    p.add_argument("--profile", help="simulator profile (with --backend sim)")
    p.add_argument("--mb", type=int, default=256, help="MiB per transfer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", type=Path, help="a GGUF MoE file: check the layer split's outputs")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ubatch", type=int, default=512)
    p.add_argument("--decode", type=int, default=0, help="decode steps after the prefill")
    p.add_argument("--host-memory", default="registered,pinned,ring,mmap")
    p.add_argument("--slots", default="0,2,3")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    options: dict[str, Any] = {"devices": 2, "data": args.model is not None}
    if args.profile:
        options["profile"] = args.profile
    with expertstream.backend(args.backend, **(options if args.backend == "sim" else {})) as backend:
        if len(backend.devices) < 2:
            raise SystemExit(f"{backend.name}: {len(backend.devices)} device(s); this benchmark needs two")
        devices = backend.devices[:2]
        result: dict[str, Any] = {**environment(backend, devices[0]), "devices": len(backend.devices)}
        result["transfers"] = transfers(backend, devices, args.mb * MIB, args.repeats)
        if args.model is not None:
            batching = Batching(args.tokens, args.ubatch, args.decode)
            modes = args.host_memory.split(",")
            slots = [int(s) for s in args.slots.split(",")]
            result["outputs"] = outputs(devices, args.model, batching, modes, slots)
            hashes = {(r["prefill_sha256"], r["decode_sha256"]) for r in result["outputs"]}
            result["identical"] = len(hashes) == 1
    result["rows"] = [*result["transfers"], *result.get("outputs", [])]
    columns = [
        Column("what", "transfer"),
        Column("gb_per_s", "GB/s", "{:.1f}"),
        Column("devices", "devices"),
        Column("crossing", "crossing"),
        Column("host_memory", "host"),
        Column("slots", "slots"),
        Column("prefill_sha256", "prefill"),
        Column("decode_sha256", "decode"),
    ]
    emit(args, result, columns, "two devices" + (f"; outputs identical: {result['identical']}" if args.model else ""))
    return 0 if result.get("identical", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
