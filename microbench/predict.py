"""Predicted beside measured: the prefill matrix on one model, with a profile tuned in the same run.

In one process:

1. the model: make-model of qwen3-30b-a3b (Q4_0, all 48 layers unless --layers) in a temporary
   folder, or --model FILE;
2. `expertstream tune` on the device with that model: the simulator profile;
3. the matrix through ``expertstream.bench.measure`` (what `expertstream prefill` runs): each ubatch
   (fastest first) x slots 0/2/3/4 x host memory registered/ring/mmap, a --tokens prompt then
   --decode-steps steps of decode; with --rounds N, each ubatch's settings N times in turn, the
   median compared and the spread reported;
4. the same settings predicted on the simulator with that profile, on a simulated device with
   this device's free memory, and the settings `auto` picks from those predictions;
5. per row, predicted against measured (target: within 10%, prefill and decode); per choice,
   whether auto's pick is the measured best or within 3% of it. With rounds, also how many rows
   have each prediction within 10% of at least one round: what the host's own spread allows.

Results are written after each ubatch (--out: predict.json, predict.md), so a run cut short
keeps what it finished.

``--replay DIR`` measures nothing: it reads an earlier run's predict.json (the measured rows) and
profile.json (the profile tune fitted there), predicts every row again with this simulator on
a sparse model of the same shape, and writes the same tables, marked as a replay. A profile
written before tune measured some field lacks it; the replay then takes the base profile's
value and names the fields it had to take. A run that measured a ``--model`` file is replayed on
the model that ``--preset``, ``--type`` and ``--layers`` make (same shape, or an error). With
``--refit``, the ring's and the mapping's rates and costs are fitted again, by this simulator, to
the prefill and decode that run's tune measured through them.

    python -m microbench.predict --out results                 # a GPU; see docs/results/predict-h200.md
    python -m microbench.predict --backend sim --preset tiny --tokens 64 --ubatch 32,16 --decode-steps 2
    python -m microbench.predict --replay results --out replayed
    python -m microbench.predict --replay results --refit --out refitted
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import expertstream
from expertstream.backends.base import Backend
from expertstream.backends.sim.profiles import Profile
from expertstream.bench.measure import Measurement, Settings, measure
from expertstream.bench.placeholder import write_sparse_model
from expertstream.bench.predict import Candidate, pick, predict_candidates, seconds
from expertstream.bench.report import Row
from expertstream.bench.tuner import HOST_PATH_FIELDS, HostPathFit, Tuned, fields_not_tuned, refit_host_paths, tune
from expertstream.engine.runner import Batching
from expertstream.errors import InvalidArgument
from expertstream.hostmem import HostMemoryMode
from expertstream.model import PRESETS, MoeModel, make_model

log = logging.getLogger("microbench.predict")

SLOTS = (0, 2, 3, 4)
MODES = (HostMemoryMode.REGISTERED, HostMemoryMode.RING, HostMemoryMode.MMAP)
ROW_TARGET = 0.10
AUTO_TARGET = 0.03


@dataclass(frozen=True)
class Measured:
    """What a row measured that the checks compare: from this run's Row, or from an earlier run's JSON."""

    ubatch: int
    slots: int
    host_memory: str
    ttft_s: float  # the median over the rounds
    decode_steps: int
    decode_tokens_per_s: float | None
    ttft_runs: tuple[float, ...] = ()  # each round's, where there were several
    decode_runs: tuple[float, ...] = ()

    @classmethod
    def over_rounds(cls, rounds: Sequence[Sequence[Row]]) -> list[Measured]:
        """One per setting: the median of its rows in each round (each round measures the same settings in order)."""
        out = []
        for rows in zip(*rounds, strict=True):
            first = rows[0]
            settings = {(r.ubatch, r.slots, r.host_memory) for r in rows}
            if len(settings) > 1:
                raise InvalidArgument(
                    f"the rounds measured different settings in one place: {sorted(settings)}",
                    hint="a host memory mode fell back in some rounds only; see the log, or measure one round",
                )
            ttft = tuple(r.ttft_s for r in rows)
            # Held to the median step, as tune fits it: a few steps a busy host delays are not the model's.
            decode = tuple(1.0 / s for r in rows if (s := r.decode_step_s))
            out.append(
                cls(
                    first.ubatch,
                    first.slots,
                    first.host_memory,
                    statistics.median(ttft),
                    first.decode_steps,
                    statistics.median(decode) if decode else None,
                    ttft if len(rows) > 1 else (),
                    decode if len(rows) > 1 else (),
                )
            )
        return out

    @property
    def ttft_spread(self) -> float | None:
        """How far the rounds' times to first token spread: slowest / fastest - 1 (None for one round)."""
        return max(self.ttft_runs) / min(self.ttft_runs) - 1 if len(self.ttft_runs) > 1 else None


@dataclass
class Run:
    """Everything measured and predicted so far."""

    header: dict[str, Any]
    tuned: Tuned | None = None
    profile_document: dict[str, Any] | None = None  # replays: the profile file read back
    rows: list[tuple[Measured, Row]] = field(default_factory=list)  # (measured, predicted)
    candidates: list[Candidate] = field(default_factory=list)
    free_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def _error(measured: float | None, predicted: float | None) -> float | None:
    return None if not measured or not predicted else measured / predicted - 1


def row_checks(measured: Measured, predicted: Row) -> dict[str, Any]:
    ttft = _error(measured.ttft_s, predicted.ttft_s)
    # Both sides held to the median step (the measured rounds are; see Measured.over_rounds).
    predicted_decode = None if predicted.decode_step_s is None else 1.0 / predicted.decode_step_s
    decode = _error(measured.decode_tokens_per_s, predicted_decode)
    errors = [e for e in (ttft, decode) if e is not None]
    return {
        "ubatch": measured.ubatch,
        "slots": measured.slots,
        "host_memory": measured.host_memory,
        "ttft_s": measured.ttft_s,
        "predicted_ttft_s": predicted.ttft_s,
        "ttft_error": ttft,
        "decode_tokens_per_s": measured.decode_tokens_per_s,
        "predicted_decode_tokens_per_s": predicted_decode,
        "decode_error": decode,
        "met": all(abs(e) <= ROW_TARGET for e in errors),
        "ttft_runs": list(measured.ttft_runs),
        "decode_runs": list(measured.decode_runs),
        "ttft_spread": measured.ttft_spread,
    }


def near_a_round(row: Mapping[str, Any]) -> bool | None:
    """Whether each of a row's predictions is within ROW_TARGET of at least one round's measurement
    (None for a row measured once): the check the host's own spread between rounds allows."""
    if len(row.get("ttft_runs") or ()) < 2:
        return None
    pairs = [(row["ttft_runs"], row["predicted_ttft_s"]), (row["decode_runs"], row["predicted_decode_tokens_per_s"])]
    return all(
        any(abs(error) <= ROW_TARGET for run in runs if (error := _error(run, predicted)) is not None)
        for runs, predicted in pairs
        if runs and predicted
    )


def auto_checks(run: Run) -> list[dict[str, Any]]:
    """For each choice auto makes: its pick against the measured best among the same settings."""
    measured = {(r.ubatch, r.slots, r.host_memory): seconds(r) for r, _ in run.rows}
    ubatches = sorted({r.ubatch for r, _ in run.rows})
    modes = [m for m in MODES if any(r.host_memory == m.value for r, _ in run.rows)]
    scopes: list[tuple[str, Any]] = [("slots x host memory x ubatch", lambda c: True)]
    scopes += [(f"slots x host memory, ubatch {u}", lambda c, u=u: c.ubatch == u) for u in ubatches]
    scopes += [
        (f"slots, ubatch {u}, {m.value}", lambda c, u=u, m=m: c.ubatch == u and c.host_memory is m)
        for u in ubatches
        for m in modes
    ]
    out = []
    for name, within in scopes:
        candidates = [c for c in run.candidates if within(c) and (c.ubatch, c.slots, c.host_memory.value) in measured]
        if not any(c.seconds is not None for c in candidates):
            continue
        choice = pick(candidates, run.free_bytes)
        best_key = min(((c.ubatch, c.slots, c.host_memory.value) for c in candidates), key=lambda k: measured[k])
        best_s = measured[best_key]
        picked_s = measured[(choice.ubatch, choice.slots, choice.host_memory.value)]
        out.append(
            {
                "choice": name,
                "picked": choice.best.label,
                "predicted_s": choice.best.seconds,
                "picked_measured_s": picked_s,
                "best": f"slots {best_key[1]}, {best_key[2]}, ubatch {best_key[0]}",
                "best_measured_s": best_s,
                "ratio": picked_s / best_s,
                "met": picked_s <= best_s * (1 + AUTO_TARGET),
            }
        )
    return out


def document(run: Run) -> dict[str, Any]:
    return {
        **run.header,
        "profile": run.tuned.document() if run.tuned else run.profile_document,
        "decode_step_s_for_tune": run.tuned.decode_step_s if run.tuned else run.header.get("decode_step_s_for_tune"),
        # The MoE layers of those steps (None: the whole model, as runs before the sample was used).
        "decode_layers_for_tune": run.tuned.decode_layers if run.tuned else run.header.get("decode_layers_for_tune"),
        "tune_phases_s": run.tuned.phases_s if run.tuned else run.header.get("tune_phases_s"),
        # The ring probes' raw timings, which the ring rows' predictions are fitted to.
        "tune_ring": _ring_timings(run.tuned) if run.tuned else run.header.get("tune_ring"),
        # The ring's and the mapping's rates as tune fitted them to one prefill ubatch of the job.
        "tune_host_paths": [p.as_dict() for p in run.tuned.host_paths]
        if run.tuned
        else run.header.get("tune_host_paths"),
        "free_bytes": run.free_bytes,
        "timings_s": run.timings,
        "rows": [row_checks(m, p) for m, p in run.rows],
        "auto": auto_checks(run),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(doc: dict[str, Any]) -> str:
    lines = []
    replay = doc.get("replay")
    if replay:
        lines += [
            f"REPLAY: the rows measured on {replay['measured_at']} by `{replay['command']}`, predicted again by "
            f"this simulator on {replay['replayed_at']} from the profile that run fitted"
            + (", its host paths fitted again to what that run's tune measured." if replay.get("refit") else "."),
        ]
        if replay.get("inferred"):
            lines.append(
                f"That profile does not record the kernels' path; it rated only matrix-core kernels, so the replay "
                f"takes {replay['inferred']}."
            )
        if replay["fields_from_base"]:
            lines.append(
                f"That profile lacks field(s) tune now measures, taken from base {replay['base']!r}: "
                f"{', '.join(replay['fields_from_base'])}. Those rows use assumed, not measured, values."
            )
        lines.append("")
    phases = doc.get("tune_phases_s")
    lines += [
        f"Device {doc['device']} ({doc['backend']}); model {doc['model']['arch']}, {doc['model']['n_layer']} layers, "
        f"{doc['model']['expert_type']}, {doc['model']['expert_bytes'] / 1e9:.2f} GB of experts; {doc['tokens']}-token "
        f"prompt, {doc['decode_steps']} decode steps; {doc['repeats']} timed run(s) per row after a warm-up"
        + (
            f", {doc['rounds']} rounds over the settings of each ubatch, the median reported."
            if doc.get("rounds", 1) > 1
            else "."
        ),
        f"Steps (s): {', '.join(f'{k} {v:.0f}' for k, v in doc['timings_s'].items())}.",
        *([f"Tune phases (s): {', '.join(f'{k} {v:.1f}' for k, v in phases.items())}."] if phases else []),
        *_host_path_lines(doc.get("tune_host_paths")),
        "",
    ]
    spread = any(r.get("ttft_spread") is not None for r in doc["rows"])
    lines += [
        "| ubatch | slots | host | ttft s |" + (" spread |" if spread else "") + " predicted | err | decode t/s | "
        "predicted | err | within 10% |",
        "|---:|---:|---|---:|" + ("---:|" if spread else "") + "---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['ubatch']} | {r['slots']} | {r['host_memory']} | {r['ttft_s']:.4f} | "
            + (f"{_pct(r.get('ttft_spread'))} | " if spread else "")
            + f"{r['predicted_ttft_s']:.4f} | {_pct(r['ttft_error'])} | {_num(r['decode_tokens_per_s'], '.1f')} | "
            f"{_num(r['predicted_decode_tokens_per_s'], '.1f')} | {_pct(r['decode_error'])} | "
            f"{'yes' if r['met'] else 'NO'} |"
        )
    met = sum(r["met"] for r in doc["rows"])
    worst = max((abs(e) for r in doc["rows"] for e in (r["ttft_error"], r["decode_error"]) if e is not None), default=0)
    lines += ["", f"Rows within 10%: {met} of {len(doc['rows'])}; worst error {worst:.1%}."]
    near = [flag for r in doc["rows"] if (flag := near_a_round(r)) is not None]
    if near:
        lines.append(
            f"Rows whose predictions are within 10% of at least one of their rounds: {sum(near)} of {len(near)} "
            "(what one setting's spread between rounds allows; the target is the median's)."
        )
    lines.append("")
    lines += [
        "| auto chooses among | picked (predicted s) | picked, measured s | measured best | best s | ratio | "
        "within 3% |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for a in doc["auto"]:
        lines.append(
            f"| {a['choice']} | {a['picked']} ({a['predicted_s']:.4f}) | {a['picked_measured_s']:.4f} | {a['best']} | "
            f"{a['best_measured_s']:.4f} | {a['ratio']:.3f} | {'yes' if a['met'] else 'NO'} |"
        )
    auto_met = sum(a["met"] for a in doc["auto"])
    lines += ["", f"Auto within 3% of the measured best: {auto_met} of {len(doc['auto'])} choices."]
    return "\n".join(lines)


def _write(run: Run, out: Path | None) -> dict[str, Any]:
    doc = document(run)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "predict.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "predict.md").write_text(markdown(doc) + "\n")
        if doc["profile"] is not None:
            (out / "profile.json").write_text(json.dumps(doc["profile"], indent=1) + "\n")
    return doc


@contextmanager
def _model(args: argparse.Namespace, backend: Backend) -> Iterator[MoeModel]:
    if args.model:
        with MoeModel.open(args.model) as model:
            yield model
        return
    with tempfile.TemporaryDirectory(prefix="predict-") as folder:
        path = make_model(args.preset, args.type, Path(folder) / "model.gguf", layers=args.layers)
        with MoeModel.open(path) as model:
            yield model


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    with expertstream.backend(args.backend) as backend, _model(args, backend) as model:
        device = backend.device(0)
        run = Run(
            {
                "backend": backend.name,
                "device": device.name,
                "model": model.summary(),
                "tokens": args.tokens,
                "decode_steps": args.decode_steps,
                "repeats": args.repeats,
                "rounds": args.rounds,
                "command": shlex.join(["python3", "-m", "microbench.predict", *args.argv]),
                "date": _now(),
            }
        )
        run.timings["model"] = time.perf_counter() - started
        run.free_bytes = device.free_memory()
        step = time.perf_counter()
        run.tuned = tune(backend, device, model, ubatches=(1, *args.ubatch), progress=lambda w: log.info("tune: %s", w))
        run.timings["tune"] = time.perf_counter() - step
        _write(run, args.out)
        for ubatch in args.ubatch:
            settings = _settings(args, ubatch)
            step = time.perf_counter()
            rounds: list[Measurement] = []
            for k in range(args.rounds):
                progress = functools.partial(_progress, f"ub {ubatch}, round {k + 1}")
                peak = rounds[0].baselines.h2d_peak if rounds else None  # one peak per ubatch is enough
                rounds.append(measure(backend, device, model, settings, progress, h2d_peak=peak))
            run.timings[f"measure ub {ubatch}"] = time.perf_counter() - step
            _predict(run, run.tuned.profile, model, settings, Measured.over_rounds([m.rows for m in rounds]))
            _write(run, args.out)
        run.timings["total"] = time.perf_counter() - started
    return _write(run, args.out)


def _settings(args: argparse.Namespace, ubatch: int) -> Settings:
    return Settings(Batching(args.tokens, ubatch, args.decode_steps), SLOTS, args.host_memory, repeats=args.repeats)


def _predict(run: Run, profile: Profile, model: MoeModel, settings: Settings, measured: Sequence[Measured]) -> None:
    """Predict one ubatch's rows and candidates, and pair the rows with ``measured`` (same order)."""
    ubatch = settings.batching.ubatch
    step = time.perf_counter()
    predicted = predict_candidates(
        profile,
        model,
        settings,
        slots=SLOTS,
        modes=settings.host_memory,
        ubatches=(ubatch,),
        memory_bytes=run.free_bytes,
    )
    rows, candidates = predicted[ubatch]
    run.timings[f"predict ub {ubatch}"] = time.perf_counter() - step
    run.rows += list(zip(measured, rows, strict=True))
    run.candidates += candidates


def replay(folder: Path, out: Path | None, given: argparse.Namespace | None = None) -> dict[str, Any]:
    """Predict an earlier run's measured rows again, from the profile that run fitted, on this simulator.

    A run that measured a ``--model`` file is replayed on a sparse model of ``given``'s preset, type
    and layers (the shape must match). With ``given.refit``, the host paths are fitted again on
    this simulator to what that run's tune measured of the job through them.
    """
    try:
        earlier = json.loads((folder / "predict.json").read_text())
        profile_document = json.loads((folder / "profile.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            f"cannot replay {folder}: {exc}", hint="give the --out folder of a predict run (predict.json, profile.json)"
        ) from None
    args = _parser().parse_known_args(_arguments(earlier["command"]))[0]
    # What the run recorded, not the defaults of today's parser.
    args.tokens, args.decode_steps, args.repeats = earlier["tokens"], earlier["decode_steps"], earlier["repeats"]
    if args.model:
        if given is None:
            raise InvalidArgument(
                f"cannot replay {folder}: it measured {args.model}, and a replay makes its model from a preset",
                hint="give --preset, --type and --layers of a model of the same shape",
            )
        args.preset, args.type, args.layers = given.preset, given.type, given.layers
    inferred = _inferred_path(profile_document)
    profile = Profile.from_dict({**profile_document, **inferred})
    refit = given is not None and given.refit
    base = str(profile_document.get("base", ""))
    header = {k: v for k, v in earlier.items() if k not in ("profile", "rows", "auto", "timings_s", "free_bytes")}
    header["replay"] = {
        "of": str(folder),
        "command": earlier["command"],
        "measured_at": earlier.get("date") or _measured_at(folder),
        "replayed_at": _now(),
        "base": base,
        "fields_from_base": [f for f in fields_not_tuned(profile_document) if f not in inferred],
        "inferred": inferred,
        "refit": refit,
    }
    run = Run(header, profile_document=profile_document, free_bytes=int(earlier["free_bytes"]))
    rows = earlier["rows"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="predict-replay-") as tmp:
        path = write_sparse_model(args.preset, args.type, Path(tmp) / "model.gguf", layers=args.layers)
        with MoeModel.open(path) as model:
            shape = {k: v for k, v in model.summary().items() if k != "path"}
            wanted = {k: v for k, v in earlier["model"].items() if k != "path"}
            if shape != wanted:
                raise InvalidArgument(f"cannot replay {folder}: its model was {wanted}, the preset makes {shape}")
            if refit:
                profile = _refit(run, profile, model, earlier.get("tune_host_paths") or [])
            for ubatch in dict.fromkeys(r["ubatch"] for r in rows):
                measured = [
                    Measured(
                        r["ubatch"],
                        r["slots"],
                        r["host_memory"],
                        r["ttft_s"],
                        earlier["decode_steps"],
                        r["decode_tokens_per_s"],
                        tuple(r.get("ttft_runs", ())),
                        tuple(r.get("decode_runs", ())),
                    )
                    for r in rows
                    if r["ubatch"] == ubatch
                ]
                _predict(run, profile, model, _settings(args, ubatch), measured)
                _write(run, out)
    run.timings["total"] = time.perf_counter() - started
    return _write(run, out)


def _refit(run: Run, profile: Profile, model: MoeModel, recorded: list[dict[str, Any]]) -> Profile:
    """``profile`` with its host paths fitted again to ``recorded`` (an earlier tune's host path fits)."""
    fields = {f.name for f in dataclasses.fields(HostPathFit)}
    earlier = [
        HostPathFit(**{**{k: v for k, v in r.items() if k in fields}, "mode": HostMemoryMode(r["mode"])})
        for r in recorded
    ]
    profile, fits = refit_host_paths(profile, model, earlier)
    run.header["tune_host_paths"] = [f.as_dict() for f in fits]
    assert run.profile_document is not None
    run.profile_document = {**run.profile_document, **{name: getattr(profile, name) for name in HOST_PATH_FIELDS}}
    return profile


def _host_path_lines(paths: list[dict[str, Any]] | None) -> list[str]:
    if not paths:
        return []
    cells = []
    for p in paths:
        cell = f"{p['mode']} {p['probe_bps'] / 1e9:.1f} -> {p['fitted_bps'] / 1e9:.1f} GB/s ({p['prefill_s']:.3f} s)"
        if p.get("fitted_latency_s") is not None:
            cell += (
                f", {p['probe_latency_s'] * 1e6:.0f} -> {p['fitted_latency_s'] * 1e6:.0f} us per copy "
                f"({p['decode_step_s'] * 1e3:.1f} ms steps)"
            )
        cells.append(cell)
    return [
        f"Host paths fitted to one prefill ubatch and decode steps of the job (probes -> fitted): {'; '.join(cells)}."
    ]


def _ring_timings(tuned: Tuned) -> dict[str, Any]:
    m = tuned.measurements
    small = m.ring_small
    return {
        "ring_bytes_per_s": m.ring_bytes_per_s,
        "small_copy": None if small is None else dataclasses.asdict(small),
        "host_copies": [dataclasses.asdict(h) for h in m.host_copies],
    }


def _inferred_path(profile: dict[str, Any]) -> dict[str, Any]:
    """A profile written before tune recorded the kernels' path: the path of the kernels it rated."""
    if "int8_matrix_cores" in profile:
        return {}
    names = [str(r["kernel"]) for r in profile.get("kernel_rates", [])]
    if any("_mma_" in n for n in names) and not any("_int8_" in n for n in names):
        return {"matrix_cores": True, "int8_matrix_cores": False}
    return {}


def _arguments(command: str) -> list[str]:
    """The arguments of a recorded command line: what follows the script or module name."""
    words = shlex.split(command)
    at = next((i for i, w in enumerate(words) if w.endswith(("microbench.predict", "predict.py"))), 0)
    return words[at + 1 :]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _measured_at(folder: Path) -> str:
    """When an earlier run that recorded no date measured: its log's first timestamp, else its file's time."""
    log_file = folder / "predict.log"
    if log_file.is_file():
        first = log_file.read_text(errors="replace").split(",", 1)[0]
        if first[:4].isdigit():
            return first
    stamp = (folder / "predict.json").stat().st_mtime
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).isoformat(timespec="seconds")


def _progress(what: str, step: str) -> None:
    log.info("%s: %s", what, step)


def _modes(text: str) -> tuple[HostMemoryMode, ...]:
    named = {m.value: m for m in MODES}
    wanted = [m.strip() for m in text.split(",")]
    unknown = [m for m in wanted if m not in named]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or text!r}: give a comma list of {', '.join(named)}")
    return tuple(dict.fromkeys(named[m] for m in wanted))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m microbench.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="auto", help="auto, cuda, hip or sim")
    parser.add_argument("--model", help="a GGUF model (default: make --preset with --layers in a temporary folder)")
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--type", default="Q4_0", help="expert type of the made model")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers of the made model (all)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--ubatch", type=_ints, default=(4096, 2048, 512), help="comma list, measured in this order")
    # Many steps: their median is what a row reports, and a decode step on a GPU varies by tens of percent.
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument(
        "--host-memory",
        type=_modes,
        default=MODES,
        help="comma list of the host memory modes measured, predicted and chosen from (all)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per row after a warm-up")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each ubatch's settings this many times in turn and compare with the median; the spread "
        "of the rounds shows what the host's drift does to one setting",
    )
    parser.add_argument("--out", type=Path, help="write predict.json, predict.md and profile.json here")
    parser.add_argument(
        "--replay", type=Path, metavar="DIR", help="predict an earlier run's rows again; measure nothing"
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="with --replay: fit the host paths again, on this simulator, to what that run's tune measured",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds and --repeats must be at least 1; got {args.rounds} and {args.repeats}")
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.refit and not args.replay:
        parser.error("--refit goes with --replay")
    doc = replay(args.replay, args.out, args) if args.replay else run(args)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
