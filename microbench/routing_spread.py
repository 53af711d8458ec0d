"""Fraction of experts each layer's router uses over one ubatch, per preset.

Routers are the bytes make-model writes (``generate`` of each layer's router and selection
bias, identical to the file's), routed with the reference router of the preset's
architecture (kernels/reference.py ``route``) on the hidden state the runner feeds the
first layer: its deterministic embeddings after the weightless RMS norm (moe/standin.py).

    python3 microbench/routing_spread.py [--ubatch 512 4096] [--preset NAME ...]
"""

from __future__ import annotations

import argparse

import numpy as np

from expertstream.kernels import reference as ref
from expertstream.model import file_specs, generate, get_preset
from expertstream.model.presets import PRESETS, ModelPreset
from expertstream.moe.arch import ffn_config
from expertstream.moe.runner import embeddings


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


def spread(p: ModelPreset, ubatch: int, seed: int = 0) -> list[float]:
    """Per MoE layer: the fraction of experts chosen by at least one of ``ubatch`` tokens."""
    routing = ffn_config(p.arch, _metadata(p).get).routing
    x = ref.rms_norm(embeddings(seed, 0, ubatch, p.n_embd)).astype(np.float32)
    specs = {s.name: s for s in file_specs(p, "Q8_0", p.n_layer)}
    out = []
    for i in range(p.n_dense_lead, p.n_layer):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ubatch", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--preset", nargs="+", default=[n for n in PRESETS if not n.startswith("tiny")])
    args = parser.parse_args()
    print("| preset | arch | experts | top-k | ubatch | min used | mean used | layers below 99% |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.preset:
        p = get_preset(name)
        for ubatch in args.ubatch:
            fractions = spread(p, ubatch)
            low = sum(f < 0.99 for f in fractions)
            print(
                f"| {name} | {p.arch} | {p.n_expert} | {p.top_k} | {ubatch} | {min(fractions):.1%} | "
                f"{np.mean(fractions):.1%} | {low}/{len(fractions)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
