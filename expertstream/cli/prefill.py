"""`expertstream prefill` (alias `bench`) and `expertstream demo`: the main job, measured per setting.

`prefill` takes llama-bench's spelling beside its own (-m, -p, -n, -b, -ub, -ncmoe, -lm/--no-mmap,
-r, -o); comma lists of prompt sizes, decode steps, batches, ubatches, slot counts and host memory
modes expand into a matrix of rows.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..backends import ENV_VAR, resolve_name
from ..backends.base import Backend, Device, Vendor
from ..backends.sim.profiles import BUILTIN_PROFILES, Profile, resolve_profile
from ..bench.measure import Settings, measure, measure_h2d_peak, probe_bytes, ticks
from ..bench.placeholder import write_sparse_model
from ..bench.predict import Choice, predict, with_predictions
from ..bench.provenance import provenance
from ..bench.report import COLUMNS_HELP, Row
from ..bench.tuner import fields_not_tuned, tune
from ..engine.model import Model
from ..engine.offload import format_gpu_memory, format_size, parse_gpu_memory, parse_size
from ..engine.sampling import Sampling
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
from .config import AUTO, PREDICTED_MODES, RunConfig
from .estimate import SAY_FROM_S, numpy_seconds
from .make_model import expert_type_option, open_model
from .output import Report, RowPrinter, notice
from .tools import (
    EXIT_STATUS_HELP,
    HelpFormatter,
    Parser,
    RunProgress,
    UsageError,
    add_decode_copies,
    add_decode_lookahead,
    duration,
    int_list,
    on_hard_stop,
    open_backend,
    option_type,
    progress_bar,
    scratch_folder,
    write_out,
    write_trace,
)

FORMATS = ("text", "md", "csv", "json", "jsonl")
LOAD_MODES = {"mmap": HostMemoryMode.MMAP, "none": HostMemoryMode.PINNED}  # llama-bench's -lm


def _device_list(text: str) -> tuple[int, ...]:
    devices = int_list(0)(text)
    if len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"a device is named twice in {text!r}")
    return devices


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


def _mode_list(text: str) -> tuple[HostMemoryMode, ...] | str:
    choices = ", ".join([*(m.value for m in HostMemoryMode), AUTO])
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if names == [AUTO]:
        return PREDICTED_MODES
    if AUTO in names:
        raise argparse.ArgumentTypeError(f"auto picks one mode by prediction: give it alone, not in {text!r}")
    try:
        values = tuple(HostMemoryMode(name) for name in names)
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


PREFILL_EPILOG = f"""\
Prefill runs every layer of every ubatch as one plan, so the staging ring keeps copying across
ubatch boundaries. A made model (no MODEL) holds data on GPUs and on the simulator; at real
model sizes the simulator's numpy kernels take minutes, so on a machine without a GPU use
--timing-only for full-size runs (a run with data that will take a minute or more says so first,
with an estimate).

Rows are printed as each group of them (one prompt, ubatch, decode and -ncmoe setting) finishes:
text and md print the table's header with the first rows, csv and jsonl a line per row. Progress
(rows done and an estimate of the time left) goes to stderr: a bar on a terminal, else a line as
each group but the last finishes. Ctrl-C keeps the rows printed (exit status 130).

{COLUMNS_HELP}

JSON (-o json) is one document, printed at the end: the run's provenance (version, git commit,
device, driver, library versions, seed, command line), the model, and one object per row with
every column above plus transfer_floor_tokens_per_s, compute_only_tokens_per_s,
decode_link_limit_tokens_per_s and decode_link_pct (and n_cpu_moe,
gpu_memory or host_cache where given); rows of --host-memory disk add, per prefill, the expert bytes
its host cache served (host_cache_bytes), the bytes read from the drive (disk_bytes_read), those
found in the page cache instead (page_cache_bytes) and the share served from RAM
(host_cache_hit_pct). Ctrl-C prints it with the rows done and "interrupted": true.

{EXIT_STATUS_HELP}"""


def register(subparsers: Any) -> None:
    """Add the prefill (alias bench) and demo subcommands to the CLI's subparsers."""
    prefill = subparsers.add_parser(
        "prefill",
        aliases=["bench"],
        help="MoE prefill (and decode) with host-resident experts, one row per setting",
        description="Run a GGUF MoE model (the whole model; its expert layers alone with --experts-only) "
        "through the scheduler for each setting (prompt size, ubatch, decode steps, slot count, host memory "
        "mode); report time to first token, tokens/s, H2D bandwidth, overlap and an output hash that must be "
        "equal across rows.",
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
        help="comma list of mmap, registered, pinned, ring, disk (a ring read from the file with O_DIRECT, past "
        "the page cache; what the page cache holds already is taken from there), preferred (disk where the "
        "model's tensors do not fit the host memory this process may fill, "
        "else registered where the device can, else ring; the default), or auto alone: the fastest of registered, "
        "ring, mmap by prediction (disk alone where the tensors do not fit)",
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
        type=option_type(parse_gpu_memory),
        default=None,
        metavar="SIZE|auto",
        help="device memory to use (e.g. 24G, 512M; auto: what is free): as many layers' experts stay on the "
        "device as fit beside the staging slots, the rest stream (default: every layer streams)",
    )
    prefill.add_argument(
        "--host-cache",
        type=option_type(parse_size),
        default=None,
        metavar="SIZE",
        help="with --host-memory disk: RAM (e.g. 24G, 512M) for the tensors of the first whole MoE layers that fit, "
        "read once from the file and copied from there, and what is left for single experts decode uses again; "
        "the rest is read from the file at every use",
    )
    prefill.add_argument("-r", "--repetitions", type=_positive, default=3, help="timed runs per row, after a warm-up")
    prefill.add_argument(
        "--predict",
        nargs="?",
        const="",
        metavar="PROFILE.json",
        help="print the simulator's prediction beside each row, with a profile from `expertstream tune` (on a "
        "GPU without one: tune first, 21-37 s on the H200 with a 48-layer model; on the simulator: its own "
        "profile). The auto settings use it too",
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
        f"processes, {DEFAULT_RING_PART_BYTES >> 20} with threads); `python -m microbench.ring_limits`, run from the "
        "root of a clone of the repository (microbench/ is not installed), compares geometries on this machine",
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
        help="on the mma path, keep Q4_0, Q4_K, Q6_K and MXFP4 on the shared-tile kernels instead of the ones "
        "that decode weights straight into matrix fragments (NVIDIA sm_80+)",
    )
    add_decode_copies(prefill, "--predict")
    add_decode_lookahead(prefill)
    prefill.add_argument(
        "--no-graphs",
        action="store_true",
        help="issue every call one by one instead of replaying one captured decode step, and one captured "
        "ubatch for each full ubatch of a whole-model prompt (CUDA or HIP graphs, used where every copy comes "
        "from registered or pinned memory and no prefetch slot is read; the same bytes)",
    )
    prefill.add_argument(
        "--fuse-gate-up",
        action="store_true",
        help="gate, up and SwiGLU as one split per layer where the direct kernels apply; the split takes two "
        "staging slots at once, so use slots >= 3",
    )
    prefill.add_argument(
        "--no-gemv",
        dest="gemv",
        action="store_false",
        help="decode's few rows on the tile kernels, as prefill's, instead of the matrix-vector kernels (one "
        "output row per wave, no grouping pass: 1.8x faster decode steps on the H200)",
    )
    prefill.add_argument(
        "--experts-only",
        action="store_true",
        help="run the expert blocks alone around a weightless stand-in (no attention, embeddings or head): the "
        "expert pipeline by itself. Default: the whole model",
    )
    prefill.add_argument(
        "--prefill-order",
        choices=("ubatch", "layer", "auto"),
        default=None,
        help="ubatch-major, or layer-major (every ubatch through a layer before the next: each layer's experts "
        "cross once per prompt; whole model only), or auto: layer-major where the prompt's rows fit a quarter of "
        "the device's free memory. Default: auto with --host-memory disk (each layer's experts read from the "
        "file once per prompt), else ubatch",
    )
    prefill.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens (and of a made model)")
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


def _demo(args: argparse.Namespace, command_line: str) -> int:
    parser = Parser(prog="expertstream demo")
    register(parser.add_subparsers())
    printers: list[RowPrinter] = []

    def prefill(*argv: str) -> Report:
        printers.append(RowPrinter(None if args.json else "text"))
        return _measure_all(RunConfig.from_args(parser.parse_args(["prefill", *argv]), command_line), printers[-1])

    with open_backend("auto") as default:
        # Without a GPU the kernels are numpy twins: real sizes only run in virtual time.
        simulated = default.vendor is Vendor.SIM
    told: list[bool] = []

    def tell_interrupted() -> None:  # once, whether Ctrl-C unwinds here or a hard stop cuts in
        if not told:
            told.append(True)
            _print_runs(printers, interrupted=True)

    if not args.json:
        _demo_text()
    with on_hard_stop(tell_interrupted) if args.json else nullcontext():
        try:
            if not simulated:
                reports = [prefill(*DEMO_SPEED, "--decode", "16")]
            else:
                if not args.json:
                    write_out("Speed: real expert sizes, simulated H200, virtual time (no data moved)")
                reports = [prefill("--backend", "sim", "--timing-only", *DEMO_SPEED)]
                if not args.json:
                    write_out(
                        "\nBytes: a tiny model with data; the output hash must be the same in every row (its copies "
                        "take microseconds, so its times measure per-call overhead, not streaming)"
                    )
                reports.append(prefill("--backend", "sim", *DEMO_BYTES))
        except KeyboardInterrupt:
            if args.json:
                tell_interrupted()
            raise
    if args.json:
        _print_runs(printers)
    return max(r.check() for r in reports)


DEMO_PROMPT = "Experts stream to the device while attention computes, so"


def _demo_text() -> None:
    """A prompt becoming text through the whole model on the default backend (a tiny made model: its
    weights are random, so is its text)."""
    write_out("Text: a prompt through a tiny made model (random weights), end to end, greedy")
    with tempfile.TemporaryDirectory(prefix="expertstream-demo-") as folder:
        path = make_model("tiny", "Q8_0", Path(folder) / "tiny.gguf")
        with Model.open(path, ubatch=16) as model:
            pieces = model.generate(DEMO_PROMPT, 24, Sampling(temperature=0))
            write_out(f"{DEMO_PROMPT}|{''.join(piece.text for piece in pieces)}\n")


def _print_runs(printers: list[RowPrinter], interrupted: bool = False) -> None:
    """The demo's JSON: one document with every run that has rows (marked when Ctrl-C cut it short)."""
    runs = [p.report.document() for p in printers if p.report is not None and p.report.results]
    if runs or not interrupted:
        write_out(json.dumps({"runs": runs, **({"interrupted": True} if interrupted else {})}, indent=2))


def _open(config: RunConfig) -> Backend:
    options: dict[str, Any] = {}
    if max(config.devices) > 0 and resolve_name(config.backend) == "sim":
        options["devices"] = max(config.devices) + 1  # the simulator has as many devices as the run names
    if config.sim_profile is not None:
        options["profile"] = config.sim_profile
    if config.timing_only:
        options["data"] = False
    if not options:
        return open_backend(config.backend)
    if not (config.sim_profile or config.timing_only):
        return open_backend("sim", **options)
    what = "--timing-only" if config.timing_only else "--sim-profile"
    if config.backend not in ("auto", "sim"):
        raise UsageError(
            f"{what} is simulator-only, not for {config.backend}; use --backend sim (or leave --backend out)"
        )
    from_env = os.environ.get(ENV_VAR, "").strip().lower()
    if config.backend == "auto" and from_env not in ("", "sim"):
        raise UsageError(
            f"{what} is simulator-only, but {ENV_VAR}={from_env} asks for {from_env}; "
            f"pass --backend sim or unset {ENV_VAR}"
        )
    return open_backend("sim", **options)


@contextmanager
def _model(config: RunConfig, backend: Backend) -> Iterator[MoeModel]:
    if config.model_path is not None:
        with open_model(config.model_path) as model:
            yield model
        return
    made = config.made
    with tempfile.TemporaryDirectory(prefix="expertstream-") as folder, scratch_folder(folder):
        path = Path(folder) / f"{made.preset}-{made.qtype}.gguf"
        if backend.host.holds_data:
            with progress_bar(0, f"making {path.name}", "B", unit_scale=True, unit_divisor=1024) as bar:
                make_model(
                    made.preset,
                    made.qtype,
                    path,
                    layers=made.layers,
                    seed=config.seed,
                    on_tensor=lambda s: bar.update(s.nbytes),
                )
        else:
            write_sparse_model(made.preset, made.qtype, path, layers=made.layers)
        with MoeModel.open(path) as model:
            yield model


def _measure_all(config: RunConfig, printer: RowPrinter) -> Report:
    """Measure every row group of ``config``, handing each to ``printer`` as it finishes."""
    with _open(config) as backend:
        if config.trace:
            backend.start_trace()  # GPUs: timing events around every copy and kernel; the simulator always records
        devices = [backend.device(index) for index in config.devices]
        with _model(config, backend) as model:
            profile = _prediction_profile(config, backend, devices[0], model)
            config = config.resolve_decode_copies(profile or _own_profile(backend))
            if config.auto:
                assert profile is not None
                config = config.resolve_auto(profile, model, devices)
                assert config.choice is not None
                notice(config.choice.explain())
            _warn_about_layer_counts(config, model)
            if backend.host.virtual_time and backend.host.holds_data:  # the numpy kernels compute
                _say_if_long(model, [setting for setting, _ in config.runs()])
            names = sorted({d.name for d in devices})
            shown = names[0] if len(devices) == 1 else f"{len(devices)} x {' + '.join(names)}"
            header = _header(backend, shown, model, config)
            if config.choice is not None:
                header["auto"] = {**_picked(config.choice), "why": config.choice.explain()}
            report = printer.begin(header)
            _measure_groups(config, backend, devices, model, profile, printer)
        if config.trace:
            write_trace(backend, header["device"], header["model"], header["command_line"], config.trace)
    printer.finish()
    return report


def _measure_groups(
    config: RunConfig,
    backend: Backend,
    devices: list[Device],
    model: MoeModel,
    profile: Profile | None,
    printer: RowPrinter,
) -> None:
    """Each row group in turn, handed to ``printer`` at once; Ctrl-C still prints what is done."""
    runs = config.runs()
    rows = sum(len(setting.slots) * len(setting.host_memory) for setting, _ in runs)
    progress = RunProgress("prefill", sum(ticks(setting, setting.batching) for setting, _ in runs), rows)
    try:
        with on_hard_stop(lambda: printer.finish(interrupted=True)):
            peak = measure_h2d_peak(backend, devices, probe_bytes(model))
            for setting, batch in runs:
                result = measure(backend, devices, model, setting, progress.step, h2d_peak=peak)
                result.rows = _with_settings(result.rows, config, setting, batch)
                if config.predict is not None:
                    assert profile is not None
                    predicted = predict(profile, model, setting, devices=len(devices))
                    result.rows = with_predictions(result.rows, predicted.rows)
                progress.finished(len(result.rows))
                printer.add(result)
    except KeyboardInterrupt:
        printer.finish(interrupted=True)
        raise
    finally:
        progress.close()


def _with_settings(rows: list[Row], config: RunConfig, setting: Settings, batch: int | None) -> list[Row]:
    """``rows`` carrying the settings the command line gave that the measurement does not know."""
    given: dict[str, Any] = {}
    if batch is not None:
        given["batch"] = batch
    if config.n_cpu_moe:
        given["n_cpu_moe"] = "all" if setting.n_cpu_moe is None else setting.n_cpu_moe
    if config.gpu_memory is not None:
        given["gpu_memory"] = format_gpu_memory(config.gpu_memory)
    if config.host_cache is not None:
        given["host_cache"] = format_size(config.host_cache)
    return [replace(row, **given) for row in rows] if given else rows


def _warn_about_layer_counts(config: RunConfig, model: MoeModel) -> None:
    """Say once when -ncmoe asks for more layers than the model has: those rows stream every layer."""
    layers = len(model.layers)
    beyond = [str(n) for n in config.n_cpu_moe if n is not None and n > layers]
    if beyond:
        notice(
            f"warning: -ncmoe {','.join(beyond)} is more than the model's {layers} MoE layers: "
            f"{'its' if len(beyond) == 1 else 'their'} rows stream every layer, as with -ncmoe all"
        )


def _say_if_long(model: MoeModel, runs: list[Settings]) -> None:
    """Say up front when the simulator's numpy kernels will take minutes, and what is quicker."""
    seconds = numpy_seconds(model, runs)
    if seconds >= SAY_FROM_S:
        notice(
            f"the simulator computes with numpy on this host: this run with data will take about "
            f"{duration(seconds)} (a rough estimate from timing one expert of each tensor); --timing-only "
            "runs the same settings in virtual time, in seconds"
        )


def _own_profile(backend: Backend) -> Profile | None:
    """A simulator's own profile; None for a GPU."""
    described = backend.describe().get("profile")
    return None if described is None else Profile.from_dict(described)


def _prediction_profile(config: RunConfig, backend: Backend, device: Device, model: MoeModel) -> Profile | None:
    """The profile predictions use: --predict's file, the simulator's own, or one tuned here and now."""
    if not config.needs_profile:
        return None
    if config.predict:
        profile = resolve_profile(config.predict)
        _say_what_was_not_tuned(config.predict)
        return profile
    own = _own_profile(backend)
    if own is not None:
        return own
    notice("no profile given (--predict PROFILE.json): tuning this device first")
    return tune(backend, device, model).profile


def _say_what_was_not_tuned(spec: str) -> None:
    """A profile file from an earlier tune lacks what tune measures now: say which fields its base fills in."""
    if spec in BUILTIN_PROFILES or not Path(spec).is_file():
        return  # a built-in profile is whole
    document = json.loads(Path(spec).read_text(encoding="utf-8"))  # resolve_profile has checked it
    missing = fields_not_tuned(document)
    if missing:
        notice(
            f"{spec} was tuned before tune measured {', '.join(missing)}: its predictions take them from "
            f"the built-in profile {document.get('base')!r} (assumed, not measured); run expertstream tune "
            "again to measure them"
        )


def _picked(choice: Choice) -> dict[str, Any]:
    return {
        "slots": choice.slots,
        "host_memory": choice.host_memory.value,
        "ubatch": choice.ubatch,
        "predicted_s": choice.best.seconds,
    }


def _prefill(args: argparse.Namespace, command_line: str) -> int:
    config = RunConfig.from_args(args, command_line)
    return _measure_all(config, RowPrinter(config.output_format)).check()


def _header(backend: Backend, device_name: str, model: MoeModel, config: RunConfig) -> dict[str, Any]:
    profile = backend.describe().get("profile")  # simulators describe theirs
    first = config.tokens[0], config.ubatch[0], config.decode[0]
    return {
        **provenance(backend, config.devices, config.command_line),
        "backend": backend.name,
        "device": device_name,
        "profile": profile["name"] if profile else None,
        "timing_only": not backend.host.holds_data,
        "seed": config.seed,
        "model": model.summary(),
        "tokens": first[0],
        "ubatch": first[1],
        "decode_steps": first[2],
        "decode_copies": config.decode_copies,
    }
