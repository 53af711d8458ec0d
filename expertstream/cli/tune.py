"""`expertstream tune`: the command line over bench/tuner.py, and its short summary."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from ..backends.base import Backend
from ..backends.sim.profiles import Profile
from ..bench.tuner import DEFAULT_PRESET, DEFAULT_UBATCHES, Tuned, calibration_model, gather_step_seconds, tune
from ..hostmem import HostMemoryMode
from ..kernels.layout import FORMATS
from ..model import PRESETS, MoeModel
from .make_model import open_model
from .tools import EXIT_STATUS_HELP, HelpFormatter, UsageError, int_list, open_backend, writable_path

DEFAULT_OUTPUT = "expertstream-profile.json"

EPILOG = f"""\
The profile is a simulator profile: pass it to `expertstream prefill --backend sim --sim-profile
FILE --timing-only ...` to predict any model, prompt and setting in virtual time, or to
`prefill --predict FILE` on the GPU to print the prediction beside each measured row. It holds
the measured fields and names the built-in profile that supplies the rest ("base").

What is measured: H2D and D2H rates from pinned and pageable memory (a file mapping), whether
a pageable copy holds the host, the event-order question (where a stream's wait must be
enqueued), DMA setup, kernel launch latency and host time per call, the rate of the runner's
kernels per expert type, tensor shape and ubatch, memcpy from a mapping per thread count,
registration; then a few decode steps of the job fix the host time per call. Last, the drive
behind the model's file: O_DIRECT reads with 1, 4 and 16 in flight and one small read's latency
(what --host-memory disk reads at).

{EXIT_STATUS_HELP}"""


def _types(text: str) -> tuple[GGMLQuantizationType, ...]:
    names = [part.strip().upper() for part in text.split(",") if part.strip()]
    known = ", ".join(f.qtype.name for f in FORMATS.values())
    try:
        values = tuple(GGMLQuantizationType[name] for name in names)
    except KeyError as exc:
        raise argparse.ArgumentTypeError(f"unknown expert type {exc.args[0]}; types: {known}") from None
    unsupported = [t.name for t in values if t not in FORMATS]
    if not values or unsupported:
        raise argparse.ArgumentTypeError(f"expected expert types among {known}; got {text!r}")
    return values


def register(subparsers: Any) -> None:
    """Add the tune subcommand to the CLI's subparsers."""
    p = subparsers.add_parser(
        "tune",
        help="measure this GPU (on the H200: 9-15 s, 21-37 s with a 48-layer model) and write a simulator "
        "profile that predicts prefill on it",
        description="Measure the device, its host link and the job's kernels, fit a simulator profile "
        "and write it; print a short summary.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--backend", default="auto", help="auto, cuda, hip or sim")
    p.add_argument("--device", type=int, default=0, help="device index")
    p.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="PROFILE.json", help="where to write it")
    p.add_argument("-m", "--model", help="measure this GGUF model's expert types and shapes")
    p.add_argument(
        "--preset",
        type=str.lower,
        choices=sorted(PRESETS),
        default=None,
        help=f"without a model: the shapes to measure ({DEFAULT_PRESET})",
    )
    p.add_argument("--types", type=_types, default=None, help="expert types to measure (the model's, else Q4_0)")
    p.add_argument(
        "-ub",
        "--ubatch",
        type=int_list(1),
        default=",".join(map(str, DEFAULT_UBATCHES)),
        help="ubatches to time the kernels at",
    )
    p.add_argument("--threads", type=int_list(1), default=None, help="host thread counts to copy a mapping with")
    p.add_argument("--name", help="the profile's name (default: tuned-<device name>)")
    p.add_argument("--sim-profile", help="with --backend sim: the profile the simulated device has")
    p.add_argument("--json", action="store_true", help="print the profile and the raw timings as JSON")
    p.set_defaults(run=_run)


@contextmanager
def _opened(args: argparse.Namespace) -> Iterator[Backend]:
    if args.sim_profile is not None and args.backend != "sim":
        raise UsageError("--sim-profile describes a simulated device: use it with --backend sim")
    if args.backend == "sim":
        # Timing only: the probes measure time, and the simulator needs no bytes for it.
        with open_backend("sim", profile=args.sim_profile, data=False, check_hazards=False) as sim:
            yield sim
        return
    with open_backend(args.backend) as backend:
        yield backend


@contextmanager
def _model(args: argparse.Namespace, backend: Backend) -> Iterator[MoeModel]:
    if args.model is not None:
        if args.preset is not None:
            raise UsageError(f"--preset describes a model to make; with a model file ({args.model}) leave it out")
        with open_model(args.model) as model:
            yield model
        return
    qtype = args.types[0].name if args.types else "Q4_0"
    with tempfile.TemporaryDirectory(prefix="expertstream-tune-") as folder:
        path = calibration_model(backend, Path(folder), args.preset or DEFAULT_PRESET, qtype)
        with MoeModel.open(path) as model:
            yield model


def _run(args: argparse.Namespace, command_line: str) -> int:
    output = writable_path(args.output, "-o")
    started = time.perf_counter()
    with _opened(args) as backend, _model(args, backend) as model:
        device = backend.device(args.device)
        opened_s = time.perf_counter() - started
        step = _progress()
        tuned = tune(
            backend,
            device,
            model,
            types=args.types or (),
            ubatches=args.ubatch,
            host_threads=args.threads,
            name=args.name,
            progress=step,
        )
        step("")
    seconds = time.perf_counter() - started
    phases = {"open device and model": opened_s, **tuned.phases_s}
    output.write_text(json.dumps(tuned.document(), indent=1) + "\n", encoding="utf-8")
    if args.json:
        document = {
            "profile": tuned.document(),
            "measurements": dataclasses.asdict(tuned.measurements),
            "decode_step_s": tuned.decode_step_s,
            "graph_step_s": tuned.graph_step_s,
            "dma_step_s": tuned.dma_step_s,
            "decode_layers": tuned.decode_layers,
            "host_paths": [path.as_dict() for path in tuned.host_paths],
            "disk": None if tuned.disk is None else dataclasses.asdict(tuned.disk),
            "seconds": seconds,
            "phases_s": phases,
        }
        print(json.dumps(document, indent=1))
    else:
        print(summary(tuned, backend.name))
        print(f"  phases, s: {', '.join(f'{name} {s:.1f}' for name, s in phases.items())}")
        print(f"profile written to {output} in {seconds:.1f} s (base {tuned.base}: peer copies, other kernels)")
    return 0


def _progress() -> Callable[[str], None]:
    """Progress lines on a terminal only, each over the last."""
    shown = sys.stderr.isatty()

    def step(what: str) -> None:
        if shown:
            print(f"\r\033[Ktune: {what}", end="" if what else "\r", file=sys.stderr, flush=True)

    return step


def summary(tuned: Tuned, backend_name: str) -> str:
    """A few lines: rates, the pageable behaviour and where waits go, overheads, host copies, kernels."""
    p, m = tuned.profile, tuned.measurements
    lines = [f"{p.device_name} ({backend_name}), {p.memory_bytes / 2**30:.1f} GiB"]
    pageable = "holds the host until done" if p.pageable_blocks_host else "returns at once"
    lines.append(
        f"  H2D: pinned {p.h2d_pinned_bps / 1e9:.1f} GB/s, pageable (file mapping) {p.h2d_pageable_bps / 1e9:.1f} "
        f"GB/s, which {pageable}; D2H {p.d2h_bps / 1e9:.1f} / {p.d2h_pageable_bps / 1e9:.1f} GB/s; the device's "
        f"own reads of page-locked memory (decode's expert gathers) {p.gather_bps / 1e9:.1f} GB/s"
    )
    lines.append(_event_order_line(tuned))
    launch = f"launch {m.launch_s * 1e6:.1f} us back to back"
    steps = "decode steps" if tuned.decode_layers is None else f"decode steps of {tuned.decode_layers} layers"
    if tuned.graph_step_s is not None:
        fitted = f"fitted to {_ms(tuned.graph_step_s)} replayed {steps}"
        launch += f" ({p.launch_latency_s * 1e6:.1f} us in a chain, {fitted})"
    lines.append(
        f"  overheads: {launch}, copy setup {p.copy_latency_s * 1e6:.1f} us, host "
        f"per call {m.enqueue_s * 1e6:.1f} us alone ({p.enqueue_s * 1e6:.1f} us in the job, fitted to "
        f"{_ms(tuned.decode_step_s)} {steps})"
    )
    lines.append(_decode_copies_line(tuned, steps))
    copies = ", ".join(f"{r.threads}: {r.nbytes / r.seconds / 1e9:.1f}" for r in m.host_copies)
    bus = "no shared limit" if p.host_memcpy_total_bps is None else f"limit {p.host_memcpy_total_bps / 1e9:.1f} GB/s"
    register = "-" if m.register_bytes_per_s is None else f"{m.register_bytes_per_s / 1e9:.1f} GB/s"
    lines.append(
        f"  ring fills from a mapping, GB/s by threads: {copies} ({bus}); registration {register}, read-only "
        f"{'yes' if p.host_register_read_only else 'no'}"
    )
    if m.ring_bytes_per_s is not None and m.ring_small is not None:
        small = m.ring_small
        lines.append(
            f"  staging ring: streams {m.ring_bytes_per_s / 1e9:.1f} GB/s; a {small.nbytes / 1e6:.2f} MB copy (decode) "
            f"{small.seconds_per_copy * 1e6:.0f} us, {p.host_copy_latency_s * 1e6:.0f} us of it fixed"
        )
    for path in tuned.host_paths:
        ring = path.mode is HostMemoryMode.RING
        what = f"staging ring ({p.ring_fill or 'threads'})" if ring else "mapping (pageable H2D)"
        line = (
            f"  through the {what}: a prefill ubatch {_ms(path.prefill_s)}, {path.fitted_bps / 1e9:.1f} GB/s fitted "
            f"to it (the probes: {path.probe_bps / 1e9:.1f})"
        )
        if path.decode_step_s is not None and path.fitted_latency_s is not None:
            line += (
                f"; a decode step {_ms(path.decode_step_s)}, {path.fitted_latency_s * 1e6:.0f} us per "
                f"{'fill' if ring else 'copy'} fitted to it"
            )
        lines.append(line)
    lines += _disk_lines(tuned)
    kernels = _kernel_lines(p)
    if kernels:
        lines.append("  kernels, TFLOP/s by size (mul_mat_id: pairs per expert):")
        lines += [f"    {line}" for line in kernels]
    else:
        lines.append("  kernels: every one measured is bound by launch overhead (no rate kept)")
    return "\n".join(lines)


def _decode_copies_line(tuned: Tuned, steps: str) -> str:
    """Which way decode copies its experts (the profile's decode_gather) and the steps that chose it."""
    p = tuned.profile
    chosen = "the device's gather" if p.decode_gather else "DMAs after reading the routing ids back"
    if tuned.dma_step_s is None or tuned.decode_step_s is None:
        return f"  decode copies: {chosen}"
    return (
        f"  decode copies: {chosen} (--decode-copies auto with this profile): the gather's {steps} "
        f"{_ms(gather_step_seconds(tuned.graph_step_s, tuned.decode_step_s))}, with DMAs {_ms(tuned.dma_step_s)}"
    )


def _disk_lines(tuned: Tuned) -> list[str]:
    """The drive's rates by reads in flight and its latency; whether they were measured and how."""
    p, disk = tuned.profile, tuned.disk
    rates = ", ".join(f"{depth}: {bps / 1e9:.2f}" for depth, bps in p.disk_read_bps)
    if disk is None:
        how = "the simulated machine's"
    else:
        how = f"{Path(disk.path).name}, " + ("O_DIRECT" if disk.direct else "buffered: the filesystem refuses O_DIRECT")
    lines = [f"  drive ({how}): GB/s by reads in flight {rates}; one small read {p.disk_latency_s * 1e6:.0f} us"]
    note = None if disk is None else disk.cache_note()
    return lines + ([f"    {note}"] if note else [])


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _event_order_line(tuned: Tuned) -> str:
    rows = {(r.host_memory, r.wait): r.released_s for r in tuned.measurements.event_order}
    before, after = rows.get(("pageable", "before")), rows.get(("pageable", "after"))
    if before is None or after is None:
        return "  event order: not measured"
    advice = "enqueue the wait before the next copy" if after > 1.5 * before else "either order"
    why = ""
    if after > 1.5 * before:
        held = tuned.profile.pageable_blocks_host
        why = " (the copy holds the host)" if held else " (the wait binds the stream's tail)"
    return (
        f"  event order, pageable: released {before * 1e3:.2f} ms with the wait before copy2, {after * 1e3:.2f} ms "
        f"after{why}: {advice}"
    )


def _kernel_lines(profile: Profile) -> list[str]:
    by_kernel: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for rate in profile.kernel_rates:
        size = f"{rate.size:g}" if rate.shape else f"{rate.size:.3g} flops"
        by_kernel.setdefault((rate.kernel, rate.shape), []).append(f"{size}: {rate.flops_per_s / 1e12:.2f}")
    return [
        " ".join((kernel, "x".join(map(str, shape)))).rstrip() + ": " + ", ".join(cells)
        for (kernel, shape), cells in by_kernel.items()
    ]
