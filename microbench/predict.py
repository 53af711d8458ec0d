"""Predicted beside measured: the prefill matrix on one model, with a profile tuned in the same run.

In one process:

1. the model: make-model of qwen3-30b-a3b (Q4_0, all 48 layers unless --layers) in a temporary
   folder, or --model FILE;
2. `expertstream tune` on the device with that model: the simulator profile;
3. the matrix through ``expertstream.moe.measure`` (what `expertstream prefill` runs): each ubatch
   (fastest first) x slots 0/2/3/4 x host memory registered/ring/mmap, a --tokens prompt then
   --decode-steps steps of decode;
4. the same settings predicted on the simulator with that profile, on a simulated device with
   this device's free memory, and the settings `auto` picks from those predictions;
5. per row, predicted against measured (target: within 10%, prefill and decode); per choice,
   whether auto's pick is the measured best or within 3% of it.

Results are written after each ubatch (--out: predict.json, predict.md), so a run cut short
keeps what it finished.

    python -m microbench.predict --out results                 # a GPU; see docs/results/predict-h200.md
    python -m microbench.predict --backend sim --preset tiny --tokens 64 --ubatch 32,16 --decode-steps 2
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import expertstream
from expertstream.backends.base import Backend
from expertstream.hostmem import HostMemoryMode
from expertstream.model import PRESETS, MoeModel, make_model
from expertstream.moe.measure import Settings, measure
from expertstream.moe.predict import Candidate, pick, predict_candidates, seconds
from expertstream.moe.report import Row
from expertstream.moe.runner import Batching
from expertstream.moe.tune import Tuned, tune

log = logging.getLogger("microbench.predict")

SLOTS = (0, 2, 3, 4)
MODES = (HostMemoryMode.REGISTERED, HostMemoryMode.RING, HostMemoryMode.MMAP)
ROW_TARGET = 0.10
AUTO_TARGET = 0.03


@dataclass
class Run:
    """Everything measured and predicted so far."""

    header: dict[str, Any]
    tuned: Tuned | None = None
    rows: list[tuple[Row, Row]] = field(default_factory=list)  # (measured, predicted)
    candidates: list[Candidate] = field(default_factory=list)
    free_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def _error(measured: float | None, predicted: float | None) -> float | None:
    return None if not measured or not predicted else measured / predicted - 1


def row_checks(measured: Row, predicted: Row) -> dict[str, Any]:
    ttft = _error(measured.ttft_s, predicted.ttft_s)
    decode = _error(measured.decode_tokens_per_s, predicted.decode_tokens_per_s)
    errors = [e for e in (ttft, decode) if e is not None]
    return {
        "ubatch": measured.ubatch,
        "slots": measured.slots,
        "host_memory": measured.host_memory,
        "ttft_s": measured.ttft_s,
        "predicted_ttft_s": predicted.ttft_s,
        "ttft_error": ttft,
        "decode_tokens_per_s": measured.decode_tokens_per_s,
        "predicted_decode_tokens_per_s": predicted.decode_tokens_per_s,
        "decode_error": decode,
        "met": all(abs(e) <= ROW_TARGET for e in errors),
    }


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
        "profile": run.tuned.document() if run.tuned else None,
        "decode_step_s_for_tune": run.tuned.decode_step_s if run.tuned else None,
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
    lines = [
        f"Device {doc['device']} ({doc['backend']}); model {doc['model']['arch']}, {doc['model']['n_layer']} layers, "
        f"{doc['model']['expert_type']}, {doc['model']['expert_bytes'] / 1e9:.2f} GB of experts; {doc['tokens']}-token "
        f"prompt, {doc['decode_steps']} decode steps; {doc['repeats']} timed run(s) per row after a warm-up.",
        f"Steps (s): {', '.join(f'{k} {v:.0f}' for k, v in doc['timings_s'].items())}.",
        "",
        "| ubatch | slots | host | ttft s | predicted | err | decode t/s | predicted | err | within 10% |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['ubatch']} | {r['slots']} | {r['host_memory']} | {r['ttft_s']:.4f} | {r['predicted_ttft_s']:.4f} | "
            f"{_pct(r['ttft_error'])} | {_num(r['decode_tokens_per_s'], '.1f')} | "
            f"{_num(r['predicted_decode_tokens_per_s'], '.1f')} | {_pct(r['decode_error'])} | "
            f"{'yes' if r['met'] else 'NO'} |"
        )
    met = sum(r["met"] for r in doc["rows"])
    worst = max((abs(e) for r in doc["rows"] for e in (r["ttft_error"], r["decode_error"]) if e is not None), default=0)
    lines += ["", f"Rows within 10%: {met} of {len(doc['rows'])}; worst error {worst:.1%}.", ""]
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
        if run.tuned is not None:
            (out / "profile.json").write_text(json.dumps(run.tuned.document(), indent=1) + "\n")
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
                "command": " ".join(sys.argv),
            }
        )
        run.timings["model"] = time.perf_counter() - started
        run.free_bytes = device.free_memory()
        step = time.perf_counter()
        run.tuned = tune(backend, device, model, ubatches=(1, *args.ubatch), progress=lambda w: log.info("tune: %s", w))
        run.timings["tune"] = time.perf_counter() - step
        _write(run, args.out)
        for ubatch in args.ubatch:
            settings = Settings(Batching(args.tokens, ubatch, args.decode_steps), SLOTS, MODES, repeats=args.repeats)
            step = time.perf_counter()
            measured = measure(backend, device, model, settings, functools.partial(_progress, f"ub {ubatch}"))
            run.timings[f"measure ub {ubatch}"] = time.perf_counter() - step
            step = time.perf_counter()
            predicted = predict_candidates(
                run.tuned.profile,
                model,
                settings,
                slots=SLOTS,
                modes=MODES,
                ubatches=(ubatch,),
                memory_bytes=run.free_bytes,
            )
            rows, candidates = predicted[ubatch]
            run.timings[f"predict ub {ubatch}"] = time.perf_counter() - step
            run.rows += list(zip(measured.rows, rows, strict=True))
            run.candidates += candidates
            _write(run, args.out)
        run.timings["total"] = time.perf_counter() - started
    return _write(run, args.out)


def _progress(what: str, step: str) -> None:
    log.info("%s: %s", what, step)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microbench.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="auto", help="auto, cuda, hip or sim")
    parser.add_argument("--model", help="a GGUF model (default: make --preset with --layers in a temporary folder)")
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--type", default="Q4_0", help="expert type of the made model")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers of the made model (all)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--ubatch", type=_ints, default=(4096, 2048, 512), help="comma list, measured in this order")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per row after a warm-up")
    parser.add_argument("--out", type=Path, help="write predict.json, predict.md and profile.json here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    doc = run(args)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
