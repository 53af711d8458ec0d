"""Fraction of experts each layer's router uses over one ubatch, per preset.

Two measurements of the same weights (``generate``, identical to the file's):

- stand-in (default): each layer's router applied, by the reference router of the preset's
  architecture (kernels/reference.py ``route``), to the hidden state the runner feeds the
  first layer: its deterministic embeddings after the weightless RMS norm (expertstream/engine/standin.py).
- llama.cpp (``--llamacpp BIN``): a file make-model writes, with its first ``--layers``
  layers, run through llama.cpp's own forward pass by ``BIN``, the counter in
  microbench/llamacpp_routing (its build.sh builds it): random prompt tokens as llama-bench
  draws them, every MoE layer's top-k expert ids read from the graph. ``--file`` measures an
  existing file instead of writing one per preset.

    python3 microbench/routing_spread.py [--ubatch 512 4096] [--preset NAME ...]
    python3 microbench/routing_spread.py --llamacpp BIN [--layers 4] [--type MIX] [--preset NAME ...]
    python3 microbench/routing_spread.py --llamacpp BIN --file MODEL.gguf [--ubatch 512 4096]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from expertstream.engine.arch import ffn_config
from expertstream.engine.runner import embeddings
from expertstream.kernels import reference as ref
from expertstream.model import file_specs, generate, get_preset, make_model
from expertstream.model.presets import PRESETS, ModelPreset

# The type each preset is measured in under llama.cpp: the mix people download.
LLAMACPP_TYPES = {"gpt-oss": "MXFP4_MOE"}
DEFAULT_TYPE = "Q4_K_M"
_LINE = re.compile(r"ubatch (\d+) layer (\d+) used (\d+) of (\d+) tokens (\d+) max_share ([0-9.]+)")


def _metadata(p: ModelPreset) -> dict[str, object]:
    keys = {
        "expert_gating_func": p.gating,
        "expert_weights_norm": p.weights_norm,
        "expert_weights_scale": p.weights_scale,
        "expert_group_count": p.n_group or None,
        "expert_group_used_count": p.n_group_used or None,
        "expert_shared_count": p.n_shared or None,
    }
    return {f"{p.arch}.{k}": v for k, v in keys.items() if v is not None}


def spread(p: ModelPreset, ubatch: int, seed: int = 0, n_layer: int | None = None) -> list[float]:
    """Stand-in: per MoE layer (of the first ``n_layer``), the fraction of experts any of ``ubatch`` tokens chose."""
    n_layer = p.n_layer if n_layer is None else n_layer
    routing = ffn_config(p.arch, _metadata(p).get).routing
    x = ref.rms_norm(embeddings(seed, 0, ubatch, p.n_embd)).astype(np.float32)
    specs = {s.name: s for s in file_specs(p, "Q8_0", n_layer)}
    out = []
    for i in range(p.n_dense_lead, n_layer):
        router = generate(specs[f"blk.{i}.ffn_gate_inp.weight"], seed).view(np.float32).reshape(p.n_expert, p.n_embd)
        bias_spec = specs.get(f"blk.{i}.exp_probs_b.bias")
        bias = None if bias_spec is None else generate(bias_spec, seed).view(np.float32).astype(np.float64)
        router_bias = specs.get(f"blk.{i}.ffn_gate_inp.bias")
        logits = (x @ router.T).astype(np.float64)
        if router_bias is not None:
            logits += generate(router_bias, seed).view(np.float32)
        ids, _ = ref.route(logits, routing, p.top_k, bias)
        out.append(np.unique(ids).size / p.n_expert)
    return out


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer in llama.cpp's forward pass over one ubatch."""

    layer: int
    used: int  # distinct experts at least one token went to
    n_expert: int
    max_share: float  # the busiest expert's share of the (token, k) pairs

    @property
    def fraction(self) -> float:
        return self.used / self.n_expert


def parse_counter(output: str) -> list[LayerRouting]:
    """The counter's lines for its first ubatch, in layer order."""
    rows = []
    for match in _LINE.finditer(output):
        ubatch, layer, used, n_expert, _, share = match.groups()
        if int(ubatch) == 0:
            rows.append(LayerRouting(int(layer), int(used), int(n_expert), float(share)))
    return sorted(rows, key=lambda r: r.layer)


def llamacpp_spread(binary: Path, model: Path, ubatch: int, threads: int, seed: int = 0) -> list[LayerRouting]:
    """Run the counter on ``model`` for one ubatch of random tokens; RuntimeError says why it gave nothing."""
    run = subprocess.run(
        [str(binary), str(model), str(ubatch), "1", str(seed), str(threads)],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = parse_counter(run.stdout)
    if run.returncode != 0 or not rows:
        lines = [line.strip(". ") for line in run.stderr.splitlines() if line.strip(". ")]
        reasons = [line.split("error loading model: ")[-1] for line in lines if "error loading model: " in line]
        raise RuntimeError((reasons or lines or [f"exit status {run.returncode}"])[-1])
    return rows


def _standin_table(presets: Sequence[str], ubatches: Sequence[int]) -> None:
    print("| preset | arch | experts | top-k | ubatch | min used | mean used | layers below 99% |")
    print("|---|---|---|---|---|---|---|---|")
    for name in presets:
        p = get_preset(name)
        for ubatch in ubatches:
            fractions = spread(p, ubatch)
            low = sum(f < 0.99 for f in fractions)
            print(
                f"| {name} | {p.arch} | {p.n_expert} | {p.top_k} | {ubatch} | {min(fractions):.1%} | "
                f"{np.mean(fractions):.1%} | {low}/{len(fractions)} |",
                flush=True,
            )


def _llamacpp_row(label: str, p: ModelPreset | None, n_layer: int, ubatch: int, rows: list[LayerRouting]) -> str:
    fractions = [r.fraction for r in rows]
    standin = "" if p is None else f"{min(spread(p, ubatch, n_layer=n_layer)):.1%}"
    low = sum(f < 0.99 for f in fractions)
    last = rows[-1]
    return (
        f"| {label} | {n_layer} | {ubatch} | {standin} | {min(fractions):.1%} | {np.mean(fractions):.1%} | "
        f"{last.layer}: {last.fraction:.1%} | {low}/{len(rows)} | {max(r.max_share for r in rows):.1%} |"
    )


def _llamacpp_table(args: argparse.Namespace) -> None:
    print(
        "| file | layers | ubatch | stand-in min used | llama.cpp min used | llama.cpp mean used | last layer | "
        "layers below 99% | busiest expert (max share) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    if args.file is not None:
        for ubatch in args.ubatch:
            rows = llamacpp_spread(args.llamacpp, args.file, ubatch, args.threads)
            print(_llamacpp_row(args.file.name, None, rows[-1].layer + 1, ubatch, rows), flush=True)
        return
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for name in args.preset:
            p = get_preset(name)
            qtype = args.type or LLAMACPP_TYPES.get(p.arch, DEFAULT_TYPE)
            n_layer = min(args.layers, p.n_layer)
            path = make_model(p, qtype, Path(tmp) / f"{name}.gguf", layers=n_layer, seed=args.seed)
            label = f"{name} {qtype}"
            try:
                for ubatch in args.ubatch:
                    try:
                        rows = llamacpp_spread(args.llamacpp, path, ubatch, args.threads)
                    except RuntimeError as exc:
                        print(f"| {label} | {n_layer} | {ubatch} | | llama.cpp: {exc} | | | | |", flush=True)
                        break
                    print(_llamacpp_row(label, p, n_layer, ubatch, rows), flush=True)
            finally:
                path.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ubatch", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--preset", nargs="+", default=[n for n in PRESETS if not n.startswith("tiny")])
    parser.add_argument("--llamacpp", type=Path, help="the llama.cpp routing counter (microbench/llamacpp_routing)")
    parser.add_argument("--file", type=Path, help="with --llamacpp: measure this file instead of writing presets")
    parser.add_argument("--layers", type=int, default=4, help="with --llamacpp: layers of each written file")
    parser.add_argument(
        "--type", help=f"with --llamacpp: type or mix of the files (default {DEFAULT_TYPE}; gpt-oss MXFP4_MOE)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the written files")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's CPU threads")
    parser.add_argument("--tmp", type=Path, default=None, help="where the written files go (default: the temp dir)")
    args = parser.parse_args()
    if args.llamacpp is None:
        _standin_table(args.preset, args.ubatch)
    else:
        _llamacpp_table(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
