"""`expertstream prefill` (alias `bench`) and `expertstream demo`: the main job, measured per setting.

`prefill` takes llama-bench's spelling beside its own (-m, -p, -n, -b, -ub, -ncmoe, -lm/--no-mmap,
-r, -o); comma lists of prompt sizes, decode steps, batches, ubatches, slot counts and host memory
modes expand into a matrix of rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..backends import ENV_VAR, resolve_name
from ..backends import backend as open_backend
from ..backends.base import Backend, Device, Vendor
from ..backends.sim.profiles import BUILTIN_PROFILES, Profile, resolve_profile
from ..bench.measure import Measurement, Settings, measure, measure_h2d_peak, probe_bytes, ticks
from ..bench.placeholder import write_sparse_model
from ..bench.predict import MODE_CHOICES, SLOT_CHOICES, Choice, choose, predict, ubatch_choices, with_predictions
from ..bench.provenance import provenance
from ..bench.report import (
    COLUMNS_HELP,
    Row,
    as_csv,
    as_json,
    as_jsonl,
    format_markdown,
    format_table,
    mismatched,
    ring_note,
)
from ..bench.tune import fields_not_tuned, tune
from ..engine.offload import parse_gpu_memory
from ..engine.runner import Batching
from ..hostmem import (
    DEFAULT_RING_CHUNK_BYTES,
    DEFAULT_RING_CHUNKS,
    DEFAULT_RING_PART_BYTES,
    PROCESS_RING_CHUNK_BYTES,
    PROCESS_RING_CHUNKS,
    PROCESS_RING_PART_BYTES,
    HostMemoryMode,
    RingFill,
)
from ..kernels.layout import MatrixPath
from ..model import PRESETS, MoeModel, make_model
from ..scheduler import check_slots
from ..timeline import write_chrome_trace
from .make_model import expert_type_option, open_model
from .tools import (
    EXIT_STATUS_HELP,
    HelpFormatter,
    UsageError,
    int_list,
    progress_bar,
    scratch_folder,
    writable_path,
)

FORMATS = ("text", "md", "csv", "json", "jsonl")
LOAD_MODES = {"mmap": HostMemoryMode.MMAP, "none": HostMemoryMode.PINNED}  # llama-bench's -lm


def _device_list(text: str) -> tuple[int, ...]:
    devices = int_list(0)(text)
    if len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"a device is named twice in {text!r}")
    return devices


AUTO = "auto"


def _slot_list(text: str) -> tuple[int, ...] | str:
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        values = tuple(check_slots(int(part)) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected slot counts such as 0,3; got {text!r}")
    return values


def _ubatch_list(text: str) -> tuple[int, ...] | str:
    return AUTO if text.strip().lower() == AUTO else int_list(1)(text)


def _mode_list(text: str) -> tuple[HostMemoryMode, ...]:
    choices = ", ".join(m.value for m in HostMemoryMode)
    try:
        values = tuple(HostMemoryMode(part.strip().lower()) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"host memory modes are {choices}; got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected host memory modes ({choices}); got {text!r}")
    return values


def _load_modes(text: str) -> tuple[HostMemoryMode, ...]:
    try:
        values = tuple(LOAD_MODES[part.strip().lower()] for part in text.split(",") if part.strip())
    except KeyError:
        raise argparse.ArgumentTypeError(f"load modes are mmap, none; got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected load modes (mmap, none); got {text!r}")
    return values


def _n_cpu_moe(text: str) -> tuple[str, ...]:
    values = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    if not values or any(v != "all" and not v.isdigit() for v in values):
        raise argparse.ArgumentTypeError(f"expected 'all' or layer counts, got {text!r}")
    return values


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


PREFILL_EPILOG = f"""\
Prefill runs every layer of every ubatch as one plan, so the staging ring keeps copying across
ubatch boundaries. A made model (no MODEL) holds data on GPUs and on the simulator; at real
model sizes the simulator's numpy kernels take minutes, so on a machine without a GPU use
--timing-only for full-size runs.

{COLUMNS_HELP}

JSON (-o json) is one document: the run's provenance (version, git commit, device, driver,
library versions, seed, command line), the model, and one object per row with every column
above plus transfer_floor_tokens_per_s and compute_only_tokens_per_s.

{EXIT_STATUS_HELP}"""


def register(subparsers: Any) -> None:
    """Add the prefill (alias bench) and demo subcommands to the CLI's subparsers."""
    prefill = subparsers.add_parser(
        "prefill",
        aliases=["bench"],
        help="MoE prefill (and decode) with host-resident experts, one row per setting",
        description="Run a GGUF MoE model's expert layers through the scheduler for each setting (prompt "
        "size, ubatch, decode steps, slot count, host memory mode); report time to first token, tokens/s, "
        "H2D bandwidth, overlap and an output hash that must be equal across rows.",
        epilog=PREFILL_EPILOG,
        formatter_class=HelpFormatter,
    )
    prefill.add_argument("model", nargs="?", help="a GGUF MoE model (default: make --preset in a temporary folder)")
    prefill.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", help="the same, llama-bench's way")
    prefill.add_argument("--backend", default="auto", help="auto, cuda, hip or sim (auto honours $" + ENV_VAR + ")")
    prefill.add_argument(
        "--device",
        "--devices",
        dest="device",
        type=_device_list,
        default="0",
        help="device index, or a comma list that splits the layers in order over those devices (e.g. 0,1)",
    )
    prefill.add_argument("-p", "--tokens", type=int_list(1), default="512", help="prompt tokens (comma list)")
    prefill.add_argument(
        "-n", "--decode", type=int_list(0), default="0", metavar="STEPS", help="decode steps of one token (comma list)"
    )
    prefill.add_argument(
        "-b", "--batch", type=int_list(1), default=None, help="logical batch (comma list); ubatch is at most this"
    )
    prefill.add_argument(
        "-ub",
        "--ubatch",
        type=_ubatch_list,
        default="512",
        help="tokens per ubatch (comma list), or auto: the fastest of 512..4096 by prediction",
    )
    prefill.add_argument(
        "--slots",
        type=_slot_list,
        default="0,2,3,4",
        help="staging slots (comma list; 0 = stock), or auto: the fastest that fits by prediction",
    )
    prefill.add_argument(
        "--host-memory",
        type=_mode_list,
        default=None,
        help="comma list of mmap, registered, pinned, ring, auto. Default: registered where the device can, "
        "else ring; auto given alone: the fastest of registered, ring, mmap by prediction",
    )
    prefill.add_argument(
        "-lm", "--load-mode", type=_load_modes, default=None, help="llama-bench's: mmap (= mmap) or none (= pinned)"
    )
    prefill.add_argument("--no-mmap", action="store_true", help="the same as -lm none")
    prefill.add_argument(
        "-ncmoe",
        "--n-cpu-moe",
        type=_n_cpu_moe,
        default=None,
        metavar="N",
        help="keep the experts of the first N MoE layers in host memory (streamed); the rest are uploaded once and "
        "stay on the device. 'all' streams every layer; a comma list runs each (default: all)",
    )
    prefill.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        default=None,
        metavar="SIZE|auto",
        help="device memory to use (e.g. 24G, 512M; auto: what is free): as many layers' experts stay on the "
        "device as fit beside the staging slots, the rest stream (default: every layer streams)",
    )
    prefill.add_argument("-r", "--repetitions", type=_positive, default=3, help="timed runs per row, after a warm-up")
    prefill.add_argument(
        "--predict",
        nargs="?",
        const="",
        metavar="PROFILE.json",
        help="print the simulator's prediction beside each row, with a profile from `expertstream tune` (on a "
        "GPU without one: tune first, ~30 s; on the simulator: its own profile). The auto settings use it too",
    )
    prefill.add_argument(
        "--ring-fill",
        choices=[f.value for f in RingFill],
        default=RingFill.AUTO.value,
        help="who fills the staging ring's chunks: helper processes (fast: they do not share the interpreter "
        "lock), threads, or auto: processes on a GPU where the model's files allow, else threads "
        "(default: %(default)s)",
    )
    prefill.add_argument(
        "--ring-threads", type=_positive, default=None, help="workers (threads or processes) filling the staging ring"
    )
    prefill.add_argument(
        "--ring-chunks",
        type=_positive,
        default=None,
        help=f"the staging ring's pinned chunks (at least 2; default {PROCESS_RING_CHUNKS} with fill processes, "
        f"{DEFAULT_RING_CHUNKS} with threads)",
    )
    prefill.add_argument(
        "--ring-chunk-mib",
        type=_positive,
        default=None,
        help=f"MiB per staging ring chunk (default {PROCESS_RING_CHUNK_BYTES >> 20} with fill processes, "
        f"{DEFAULT_RING_CHUNK_BYTES >> 20} with threads)",
    )
    prefill.add_argument(
        "--ring-part-mib",
        type=_positive,
        default=None,
        help=f"least MiB one ring worker copies of a chunk's fill (default {PROCESS_RING_PART_BYTES >> 20} with fill "
        f"processes, {DEFAULT_RING_PART_BYTES >> 20} with threads); microbench.ring_limits compares geometries on "
        "this machine",
    )
    prefill.add_argument(
        "--matrix-path",
        choices=("auto", *(p.value for p in MatrixPath)),
        default="auto",
        help="mul_mat_id's kernels for every expert type: simt (float32), mma (bf16 matrix cores) or int8 "
        "(activations quantized per 32-block; Q4_0 and Q4_K, other types take mma); auto: each type's "
        "default on the device (default: %(default)s)",
    )
    prefill.add_argument(
        "--no-direct",
        action="store_true",
        help="on the mma path, keep Q4_0 and Q4_K on the shared-tile kernels instead of the ones that decode "
        "weights straight into matrix fragments (NVIDIA sm_80+)",
    )
    prefill.add_argument(
        "--no-gather",
        action="store_true",
        help="decode: read each layer's routing ids back and copy the used experts with DMA (llama.cpp's way) "
        "instead of the device copying them from registered or pinned memory itself",
    )
    prefill.add_argument(
        "--no-graphs",
        action="store_true",
        help="decode: issue each step's calls one by one instead of replaying one captured step (a CUDA or HIP "
        "graph, used where every copy comes from registered or pinned memory)",
    )
    prefill.add_argument(
        "--fuse-gate-up",
        action="store_true",
        help="gate, up and SwiGLU as one split per layer where the direct kernels apply; the split takes two "
        "staging slots at once, so use slots >= 3",
    )
    prefill.add_argument("--seed", type=int, default=0, help="seed of the input embeddings (and of a made model)")
    prefill.add_argument("-o", "--output-format", choices=FORMATS, default="text", help="how to print the rows")
    prefill.add_argument("--json", action="store_true", help="the same as -o json")
    prefill.add_argument(
        "--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace of every copy and kernel per stream"
    )
    model = prefill.add_argument_group("model made when none is given")
    model.add_argument("--preset", type=str.lower, default=None, choices=sorted(PRESETS), help="shapes (tiny)")
    model.add_argument("--type", dest="qtype", default=None, **expert_type_option(), help="expert type (Q4_0)")
    model.add_argument("--layers", type=_positive, default=None, help="keep only the first N layers (all)")
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
        epilog=f"{COLUMNS_HELP}\n\n{EXIT_STATUS_HELP}",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--json", action="store_true", help="print one JSON document with both runs")
    demo.set_defaults(run=_demo)


DEMO_SPEED = ["--preset", "qwen3-30b-a3b", "--layers", "8", "--tokens", "4096", "--ubatch", "2048", "--slots", "0,3"]
DEMO_BYTES = ["--preset", "tiny", "--tokens", "64", "--ubatch", "16", "--slots", "0,2,3", "--decode", "4"]


def _demo(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="expertstream demo")
    register(parser.add_subparsers())

    def prefill(*argv: str) -> Report:
        sub = parser.parse_args(["prefill", *argv])
        sub.command_line = args.command_line
        return _measure_all(sub)

    with open_backend("auto") as default:
        # Without a GPU the kernels are numpy twins: real sizes only run in virtual time.
        simulated = default.vendor is Vendor.SIM
    if not simulated:
        reports = [prefill(*DEMO_SPEED, "--decode", "16")]
    else:
        reports = [prefill("--backend", "sim", "--timing-only", *DEMO_SPEED)]
        if not args.json:
            print("Speed: real expert sizes, simulated H200, virtual time (no data moved)")
            _print(reports[0], "text")
            print(
                "\nBytes: a tiny model with data; the output hash must be the same in every row (its copies "
                "take microseconds, so its times measure per-call overhead, not streaming)"
            )
        reports.append(prefill("--backend", "sim", *DEMO_BYTES))
    if args.json:
        print(json.dumps({"runs": [r.document() for r in reports]}, indent=2))
    elif simulated:
        _print(reports[1], "text")
    else:
        _print(reports[0], "text")
    return max(r.check() for r in reports)


@dataclass
class Report:
    """The header shared by every row of a prefill command and one Measurement per batching."""

    header: dict[str, Any]
    results: list[Measurement] = field(default_factory=list)

    @property
    def rows(self) -> list[Row]:
        return [row for result in self.results for row in result.rows]

    def document(self) -> dict[str, Any]:
        first = self.results[0].baselines
        baselines = {
            "h2d_peak_gbps": first.h2d_peak_gbps,
            "compute_only_s": first.compute_only_s,  # of the first batching; every row has its own
            "compute_only_all_layers": first.compute_only_all_layers,
            "compute_only_sha256": first.compute_only_sha256,
            "matrix_paths": self.results[0].matrix_paths,  # mul_mat_id's path per expert type
            "kernel_families": self.results[0].kernel_families,  # and its kernels: the path, or "direct"
            "gate_up_fused": self.results[0].gate_up_fused,
        }
        return as_json({**self.header, **baselines}, self.rows)

    def check(self) -> int:
        """0 when every row's output agrees (with the others and the compute-only run), else 1."""
        differing = mismatched(self.rows)
        if differing:
            _error(f"outputs differ between rows: {', '.join(differing)}")
            return 1
        broken = [f"{r.label} ({r.nonfinite})" for r in self.rows if r.nonfinite]
        if broken:
            _error(f"non-finite outputs in rows: {', '.join(broken)}")
            return 1
        for result in self.results:
            reference = result.baselines.compute_only_sha256
            if reference is not None and result.rows and result.rows[0].prefill_sha256 != reference:
                _error("streamed outputs differ from the device-resident (compute-only) run")
                return 1
        return 0


def _error(message: str) -> None:
    print(f"expertstream prefill: {message}", file=sys.stderr)


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before anything runs, what cannot mean what it says."""
    if args.model is not None and args.model_flag is not None:
        raise UsageError("give the model once: as MODEL or as -m, not both")
    args.model = args.model if args.model is not None else args.model_flag
    if args.model is not None:
        given = [
            flag
            for flag, value in (("--preset", args.preset), ("--type", args.qtype), ("--layers", args.layers))
            if value is not None
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} describe a model to make; with a model file ({args.model}) leave them out"
            )
    modes = [m for m in (args.host_memory, args.load_mode, (HostMemoryMode.PINNED,) if args.no_mmap else None) if m]
    if len(modes) > 1:
        raise UsageError("choose host memory once: --host-memory, -lm or --no-mmap")
    args.host_memory = modes[0] if modes else (HostMemoryMode.AUTO,)
    # Given alone, auto is predicted; by default (or in a list) it is the fixed rule of hostmem.
    args.host_memory_auto = bool(modes) and modes[0] == (HostMemoryMode.AUTO,)
    if _automatic(args) and (len(args.tokens) > 1 or len(args.decode) > 1 or len(args.batch or ()) > 1):
        raise UsageError("auto picks one setting for one prompt: give one -p, one -n and at most one -b")
    if args.json:
        args.output_format = "json"
    if args.trace:
        args.trace = writable_path(args.trace, "--trace")


def _automatic(args: argparse.Namespace) -> bool:
    return AUTO in (args.slots, args.ubatch) or args.host_memory_auto


def _batchings(args: argparse.Namespace) -> list[tuple[Batching, int | None]]:
    """Every (prompt, batch, ubatch, decode) combination, with the logical batch when -b was given."""
    out: list[tuple[Batching, int | None]] = []
    for tokens, batch, ubatch, decode in itertools.product(
        args.tokens, args.batch or (None,), args.ubatch, args.decode
    ):
        effective = ubatch if batch is None else min(ubatch, batch)
        if batch is not None and batch % effective:
            raise UsageError(f"-b {batch} is not a multiple of -ub {ubatch}: ubatches would not tile the batch")
        out.append((Batching(tokens, effective, decode), batch))
    return out


def _n_cpu_moe_values(args: argparse.Namespace) -> list[int | None]:
    """The -ncmoe settings to run: None streams every layer (or what --gpu-memory decides)."""
    values = args.n_cpu_moe or ("all",)
    if args.gpu_memory is not None and args.n_cpu_moe:
        raise UsageError("-ncmoe and --gpu-memory both choose which layers stream: give one of them")
    return [None if value == "all" else int(value) for value in values]


def _open(args: argparse.Namespace) -> Backend:
    options: dict[str, Any] = {}
    if max(args.device) > 0 and resolve_name(args.backend) == "sim":
        options["devices"] = max(args.device) + 1  # the simulator has as many devices as the run names
    if args.sim_profile is not None:
        options["profile"] = args.sim_profile
    if args.timing_only:
        options["data"] = False
    if not options:
        return open_backend(args.backend)
    if not (args.sim_profile or args.timing_only):
        return open_backend("sim", **options)
    what = "--timing-only" if args.timing_only else "--sim-profile"
    if args.backend not in ("auto", "sim"):
        raise UsageError(
            f"{what} is simulator-only, not for {args.backend}; use --backend sim (or leave --backend out)"
        )
    from_env = os.environ.get(ENV_VAR, "").strip().lower()
    if args.backend == "auto" and from_env not in ("", "sim"):
        raise UsageError(
            f"{what} is simulator-only, but {ENV_VAR}={from_env} asks for {from_env}; "
            f"pass --backend sim or unset {ENV_VAR}"
        )
    return open_backend("sim", **options)


@contextmanager
def _model(args: argparse.Namespace, backend: Backend) -> Iterator[MoeModel]:
    if args.model is not None:
        with open_model(args.model) as model:
            yield model
        return
    preset, qtype = args.preset or "tiny", args.qtype or "Q4_0"
    with tempfile.TemporaryDirectory(prefix="expertstream-") as folder, scratch_folder(folder):
        path = Path(folder) / f"{preset}-{qtype}.gguf"
        if backend.host.holds_data:
            with progress_bar(0, f"making {path.name}", "B", unit_scale=True, unit_divisor=1024) as bar:
                make_model(
                    preset, qtype, path, layers=args.layers, seed=args.seed, on_tensor=lambda s: bar.update(s.nbytes)
                )
        else:
            write_sparse_model(preset, qtype, path, layers=args.layers)
        with MoeModel.open(path) as model:
            yield model


def _measure_all(args: argparse.Namespace) -> Report:
    _check_arguments(args)
    if args.ubatch != AUTO:
        _batchings(args)  # refuse a bad -b / -ub pair before anything is made or opened
    with _open(args) as backend:
        if args.trace:
            backend.start_trace()  # GPUs: timing events around every copy and kernel; the simulator always records
        devices = [backend.device(index) for index in args.device]
        with _model(args, backend) as model:
            profile = _prediction_profile(args, backend, devices[0], model)
            choice = _apply_auto(args, profile, model, devices) if _automatic(args) else None
            runs = [
                (_settings(args, batching, n_cpu_moe), batch)
                for (batching, batch), n_cpu_moe in itertools.product(_batchings(args), _n_cpu_moe_values(args))
            ]
            settings = [setting for setting, _ in runs]
            total = sum(ticks(s, s.batching) for s in settings)
            names = sorted({d.name for d in devices})
            shown = names[0] if len(devices) == 1 else f"{len(devices)} x {' + '.join(names)}"
            report = Report(_header(backend, shown, model, args))
            if choice is not None:
                report.header["auto"] = {**_picked(choice), "why": choice.explain()}
            with progress_bar(total, "prefill", "ub") as bar:

                def step(what: str) -> None:
                    bar.set_postfix_str(what, refresh=False)
                    bar.update()

                peak = measure_h2d_peak(backend, devices, probe_bytes(model))
                for setting, batch in runs:
                    result = measure(backend, devices, model, setting, step, h2d_peak_gbps=peak)
                    if batch is not None:
                        result.rows = [replace(row, batch=batch) for row in result.rows]
                    report.results.append(result)
            if args.predict is not None:
                assert profile is not None
                for result, setting in zip(report.results, settings, strict=True):
                    predicted = predict(profile, model, setting, devices=len(devices))
                    result.rows = with_predictions(result.rows, predicted.rows)
        if args.trace:
            write_chrome_trace(backend.timeline or (), args.trace)
    return report


def _settings(args: argparse.Namespace, batching: Batching, n_cpu_moe: int | None) -> Settings:
    return Settings(
        batching,
        args.slots,
        args.host_memory,
        args.seed,
        repeats=args.repetitions,
        ring_threads=args.ring_threads,
        ring_fill=args.ring_fill,
        ring_chunks=args.ring_chunks,
        ring_chunk_bytes=None if args.ring_chunk_mib is None else args.ring_chunk_mib << 20,
        ring_part_bytes=None if args.ring_part_mib is None else args.ring_part_mib << 20,
        n_cpu_moe=n_cpu_moe,
        gpu_memory=args.gpu_memory,
        matrix_path=None if args.matrix_path == "auto" else MatrixPath(args.matrix_path),
        direct=not args.no_direct,
        fuse_gate_up=args.fuse_gate_up,
        gather=not args.no_gather,
        graphs=not args.no_graphs,
    )


def _prediction_profile(args: argparse.Namespace, backend: Backend, device: Device, model: MoeModel) -> Profile | None:
    """The profile predictions use: --predict's file, the simulator's own, or one tuned here and now."""
    if args.predict is None and not _automatic(args):
        return None
    if args.predict:
        profile = resolve_profile(args.predict)
        _say_what_was_not_tuned(args.predict)
        return profile
    if backend.vendor is Vendor.SIM:
        return Profile.from_dict(backend.describe()["profile"])
    _error("no profile given (--predict PROFILE.json): tuning this device first")
    return tune(backend, device, model).profile


def _say_what_was_not_tuned(spec: str) -> None:
    """A profile file from an earlier tune lacks what tune measures now: say which fields its base fills in."""
    if spec in BUILTIN_PROFILES or not Path(spec).is_file():
        return  # a built-in profile is whole
    document = json.loads(Path(spec).read_text(encoding="utf-8"))  # resolve_profile has checked it
    missing = fields_not_tuned(document)
    if missing:
        _error(
            f"{spec} was tuned before tune measured {', '.join(missing)}: its predictions take them from "
            f"the built-in profile {document.get('base')!r} (assumed, not measured); run expertstream tune "
            "again to measure them"
        )


def _apply_auto(args: argparse.Namespace, profile: Profile | None, model: MoeModel, devices: list[Device]) -> Choice:
    """Resolve the auto settings by prediction; say in one line what was picked and why."""
    assert profile is not None
    tokens, decode = args.tokens[0], args.decode[0]
    batch = args.batch[0] if args.batch else None
    n_cpu_moe = _n_cpu_moe_values(args)[0]
    base = _settings(args, Batching(tokens, min(tokens, 512), decode), n_cpu_moe)
    choice = choose(
        profile,
        model,
        base,
        slots=SLOT_CHOICES if args.slots == AUTO else args.slots,
        modes=MODE_CHOICES if args.host_memory_auto else args.host_memory,
        ubatches=ubatch_choices(tokens, batch) if args.ubatch == AUTO else args.ubatch,
        free_bytes=min(d.free_memory() for d in devices),
        devices=len(devices),
    )
    _error(choice.explain())
    if args.slots == AUTO:
        args.slots = (choice.slots,)
    if args.host_memory_auto:
        args.host_memory = (choice.host_memory,)
    if args.ubatch == AUTO:
        args.ubatch = (choice.ubatch,)
    return choice


def _picked(choice: Choice) -> dict[str, Any]:
    return {
        "slots": choice.slots,
        "host_memory": choice.host_memory.value,
        "ubatch": choice.ubatch,
        "predicted_s": choice.best.seconds,
    }


def _prefill(args: argparse.Namespace) -> int:
    report = _measure_all(args)
    _print(report, args.output_format)
    return report.check()


def _print(report: Report, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(report.document(), indent=2))
    elif fmt == "jsonl":
        print(as_jsonl(report.header, report.rows))
    elif fmt == "csv":
        print(as_csv(report.rows))
    elif fmt == "md":
        print(format_markdown(report.rows))
    else:
        _print_summary(report)
        print(format_table(report.rows))
        note = ring_note(report.rows)
        if note:
            print(note)


def _header(backend: Backend, device_name: str, model: MoeModel, args: argparse.Namespace) -> dict[str, Any]:
    profile = backend.describe().get("profile")  # simulators describe theirs
    first = args.tokens[0], args.ubatch[0], args.decode[0]
    return {
        **provenance(backend, args.device, args.command_line),
        "backend": backend.name,
        "device": device_name,
        "profile": profile["name"] if profile else None,
        "timing_only": not backend.host.holds_data,
        "seed": args.seed,
        "model": model.summary(),
        "tokens": first[0],
        "ubatch": first[1],
        "decode_steps": first[2],
    }


def _print_summary(report: Report) -> None:
    header = report.header
    model = header["model"]
    where = header["device"] + (f" (profile {header['profile']})" if header["profile"] else "")
    print(f"backend {header['backend']}: {where}{', timing only' if header['timing_only'] else ''}")
    print(
        f"model: {model['arch']}, {model['n_layer']} layers, {model['n_expert']} experts, "
        f"top-{model['top_k']}, {model['expert_type']}, {model['expert_bytes'] / 1e9:.3f} GB of experts"
    )
    if report.results:
        first = report.results[0]
        families = ", ".join(f"{name} {family}" for name, family in first.kernel_families.items())
        print(f"expert kernels: {families}{'; gate, up and SwiGLU fused' if first.gate_up_fused else ''}")
    for result in report.results:
        base, row = result.baselines, result.rows[0]
        print(
            f"{row.tokens} tokens in ubatches of {row.ubatch}; pinned H2D peak "
            f"{base.h2d_peak_gbps:.1f} GB/s; compute only {base.compute_only_s:.4f} s"
            f"{'' if base.compute_only_all_layers else ' (layer 0 weights for all layers)'}"
        )
