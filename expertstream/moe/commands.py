"""`expertstream prefill` and `expertstream demo`: the main job, measured per slot setting."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..backends import backend as open_backend
from ..backends.base import Backend, Vendor
from ..hostmem import HostMemoryMode
from ..model import EXPERT_TYPES, PRESETS, MoeModel, make_model
from ..scheduler import check_slots
from ..timeline import write_chrome_trace
from .measure import Measurement, Settings, measure
from .offload import parse_gpu_memory
from .placeholder import write_sparse_model
from .report import Progress, as_json, format_table, mismatched
from .runner import Batching


def _slot_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(check_slots(int(part)) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mode_list(text: str) -> tuple[HostMemoryMode, ...]:
    try:
        return tuple(HostMemoryMode(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        choices = ", ".join(m.value for m in HostMemoryMode)
        raise argparse.ArgumentTypeError(f"host memory modes are {choices}; got {text!r}") from None


def _gpu_memory(text: str) -> int | str:
    try:
        return parse_gpu_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: Any) -> None:
    """Add the prefill and demo subcommands to the CLI's subparsers."""
    prefill = subparsers.add_parser(
        "prefill",
        help="MoE prefill (and decode) with host-resident experts, one row per slot setting",
        description="Run a GGUF MoE model's expert layers through the scheduler for each slot setting and "
        "host memory mode; report time to first token, tokens/s, H2D bandwidth, overlap and an output hash "
        "that must be equal across rows (exit status 1 if not).",
    )
    prefill.add_argument("model", nargs="?", help="a GGUF MoE model (default: make --preset in a temporary folder)")
    prefill.add_argument("--backend", default="auto", help="auto, cuda, hip or sim (default auto)")
    prefill.add_argument("--device", type=int, default=0, help="device index")
    prefill.add_argument("--tokens", type=_positive, default=512, help="prompt tokens")
    prefill.add_argument("--ubatch", type=_positive, default=512, help="tokens per ubatch")
    prefill.add_argument("--slots", type=_slot_list, default=_slot_list("0,2,3,4"), help="comma list, e.g. 0,2,3,4")
    prefill.add_argument(
        "--host-memory",
        type=_mode_list,
        default=_mode_list("auto"),
        help="comma list of mmap, registered, pinned, ring, auto",
    )
    prefill.add_argument(
        "--ring-threads",
        type=_positive,
        default=None,
        help="host threads filling the staging ring (ring mode)",
    )
    prefill.add_argument(
        "--n-cpu-moe",
        "-ncmoe",
        type=_non_negative,
        default=None,
        metavar="N",
        help="keep the experts of the first N MoE layers in host memory (streamed); the rest stay on the device",
    )
    prefill.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        default=None,
        metavar="SIZE|auto",
        help="device memory to use (e.g. 24G, 512M; auto: what is free): as many layers' experts stay on the "
        "device as fit beside the staging slots, the rest stream",
    )
    prefill.add_argument("--decode", type=int, default=0, metavar="STEPS", help="decode steps of one token")
    prefill.add_argument("--seed", type=int, default=0, help="seed of the input embeddings (and of a made model)")
    prefill.add_argument("--json", action="store_true", help="print one JSON object")
    prefill.add_argument(
        "--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace of every copy and kernel per stream"
    )
    model = prefill.add_argument_group("model made when none is given")
    model.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    model.add_argument("--type", dest="qtype", default="Q4_0", choices=[t.name for t in EXPERT_TYPES])
    model.add_argument("--layers", type=_positive, default=None, help="keep only the first N layers")
    sim = prefill.add_argument_group("simulator (--backend sim)")
    sim.add_argument("--sim-profile", help="cuda-h200, rocm-r9700, or a profile JSON file")
    sim.add_argument(
        "--timing-only",
        action="store_true",
        help="no data: full-scale runs in virtual time (the made model is a sparse file, no hashes)",
    )
    prefill.set_defaults(run=_prefill)

    demo = subparsers.add_parser(
        "demo",
        help="the main job: prefill with prefetch off and on, on the default backend",
        description="Prefill Qwen3-30B-A3B-shaped expert layers (8 layers, Q4_0) with slots 0 and 3 on the "
        "default backend. On the simulator that run is timing only (virtual time at real sizes), and a "
        "second run on a tiny model with data checks that every slot setting gives the same bytes.",
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object per run")
    demo.set_defaults(run=_demo)


DEMO_SPEED = ["--preset", "qwen3-30b-a3b", "--layers", "8", "--tokens", "4096", "--ubatch", "2048", "--slots", "0,3"]
DEMO_BYTES = ["--preset", "tiny", "--tokens", "64", "--ubatch", "16", "--slots", "0,2,3", "--decode", "4"]


def _demo(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="expertstream demo")
    register(parser.add_subparsers())
    extra = ["--json"] if args.json else []
    with open_backend("auto") as default:
        # Without a GPU the kernels are numpy twins: real sizes only run in virtual time.
        simulated = default.vendor is Vendor.SIM
    if not simulated:
        return _prefill(parser.parse_args(["prefill", *DEMO_SPEED, "--decode", "16", *extra]))
    if not args.json:
        print("Speed: real expert sizes, simulated H200, virtual time (no data moved)")
    code = _prefill(parser.parse_args(["prefill", "--backend", "sim", "--timing-only", *DEMO_SPEED, *extra]))
    if not args.json:
        print(
            "\nBytes: a tiny model with data; the output hash must be the same in every row (its copies "
            "take microseconds, so its times measure per-call overhead, not streaming)"
        )
    return code or _prefill(parser.parse_args(["prefill", "--backend", "sim", *DEMO_BYTES, *extra]))


def _open(args: argparse.Namespace) -> Backend:
    options: dict[str, Any] = {}
    if args.sim_profile is not None:
        options["profile"] = args.sim_profile
    if args.timing_only:
        options["data"] = False
    if not options:
        return open_backend(args.backend)
    if args.backend not in ("auto", "sim"):
        raise SystemExit(
            f"expertstream prefill: --sim-profile and --timing-only describe the simulator, not {args.backend}; "
            "use --backend sim (or leave --backend out)"
        )
    return open_backend("sim", **options)


@contextmanager
def _model(args: argparse.Namespace, backend: Backend) -> Iterator[MoeModel]:
    if args.model is not None:
        with MoeModel.open(args.model) as model:
            yield model
        return
    with tempfile.TemporaryDirectory(prefix="expertstream-") as folder:
        path = Path(folder) / f"{args.preset}-{args.qtype}.gguf"
        if backend.holds_data:
            make_model(args.preset, args.qtype, path, layers=args.layers, seed=args.seed)
        else:
            write_sparse_model(args.preset, args.qtype, path, layers=args.layers)
        with MoeModel.open(path) as model:
            yield model


def _prefill(args: argparse.Namespace) -> int:
    if args.decode < 0:
        raise SystemExit(f"expertstream prefill: --decode must be >= 0, got {args.decode}")
    with _open(args) as backend:
        if args.trace:
            backend.start_trace()  # GPUs: timing events around every copy and kernel; the simulator always records
        device = backend.device(args.device)
        settings = Settings(
            Batching(args.tokens, args.ubatch, args.decode),
            args.slots,
            args.host_memory,
            args.seed,
            ring_threads=args.ring_threads,
            n_cpu_moe=args.n_cpu_moe,
            gpu_memory=args.gpu_memory,
        )
        with _model(args, backend) as model:
            progress = Progress(2 + len(settings.slots) * len(settings.host_memory))
            try:
                result = measure(backend, device, model, settings, progress.step)
            finally:
                progress.close()
            header = _header(backend, device.name, model, settings, result)
        if args.trace:
            write_chrome_trace(backend.timeline or (), args.trace)
    if args.json:
        print(json.dumps(as_json(header, result.rows), indent=2))
    else:
        _print_table(header, result)
    return _check(result)


def _header(
    backend: Backend, device_name: str, model: MoeModel, settings: Settings, result: Measurement
) -> dict[str, Any]:
    base = result.baselines
    profile = backend.describe().get("profile")  # simulators describe theirs
    return {
        "backend": backend.name,
        "device": device_name,
        "profile": profile["name"] if profile else None,
        "timing_only": not backend.holds_data,
        "model": model.summary(),
        "tokens": settings.batching.tokens,
        "ubatch": settings.batching.ubatch,
        "decode_steps": settings.batching.decode_steps,
        "h2d_peak_gbps": base.h2d_peak_gbps,
        "compute_only_s": base.compute_only_s,
        "compute_only_all_layers": base.compute_only_all_layers,
        "compute_only_sha256": base.compute_only_sha256,
    }


def _print_table(header: dict[str, Any], result: Measurement) -> None:
    model = header["model"]
    where = header["device"] + (f" (profile {header['profile']})" if header["profile"] else "")
    print(f"backend {header['backend']}: {where}{', timing only' if header['timing_only'] else ''}")
    print(
        f"model: {model['arch']}, {model['n_layer']} layers, {model['n_expert']} experts, "
        f"top-{model['top_k']}, {model['expert_type']}, {model['expert_bytes'] / 1e9:.3f} GB of experts"
    )
    print(
        f"{header['tokens']} tokens in ubatches of {header['ubatch']}; pinned H2D peak "
        f"{header['h2d_peak_gbps']:.1f} GB/s; compute only {header['compute_only_s']:.4f} s"
        f"{'' if header['compute_only_all_layers'] else ' (layer 0 weights for all layers)'}"
    )
    print(format_table(result.rows))


def _check(result: Measurement) -> int:
    differing = mismatched(result.rows)
    if differing:
        print(f"expertstream prefill: outputs differ between rows: {', '.join(differing)}", file=sys.stderr)
        return 1
    broken = [f"{r.label} ({r.nonfinite})" for r in result.rows if r.nonfinite]
    if broken:
        print(f"expertstream prefill: non-finite outputs in rows: {', '.join(broken)}", file=sys.stderr)
        return 1
    reference = result.baselines.compute_only_sha256
    if reference is not None and result.rows and result.rows[0].prefill_sha256 != reference:
        print(
            "expertstream prefill: streamed outputs differ from the device-resident (compute-only) run",
            file=sys.stderr,
        )
        return 1
    return 0
