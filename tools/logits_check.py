"""expertstream's logits over the tokens of a llamacpp-logits run, written in its format, and compared.

python3 tools/logits_check.py -m MODEL --ref PREFIX -o OUT_PREFIX [--backend B] [--ubatch U] [--slots S]
    [--host-memory M] [--prefill-order ubatch|layer]

The reference run (microbench/llamacpp_logits: PREFIX.logits, .tokens, .json) fed its first
``n_prompt`` tokens as a prompt and the rest one decode step at a time. This runs the same: the
prompt through expertstream's prefill (every position's logits) and each later token through a
decode step, then writes OUT_PREFIX.logits/.tokens/.json and prints compare.py's summary
(KL(P_ref || P_ours) per position, argmax agreement), for the prompt rows and the decode rows apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from expertstream.engine.model import Model, Options
from microbench.llamacpp_logits.compare import LogitsRun, compare_logits, read_run


def run(args: argparse.Namespace, reference: LogitsRun, n_prompt: int) -> np.ndarray:
    """Our logits for every row of the reference run, [rows, n_vocab]."""
    options = Options(
        ubatch=args.ubatch, slots=args.slots, host_memory=args.host_memory, prefill_order=args.prefill_order
    )
    with Model.open(args.model, backend=args.backend, options=options) as model:
        return model.logits(reference.tokens, prompt=n_prompt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--ref", required=True, help="the llamacpp-logits run's prefix")
    parser.add_argument("-o", "--out", required=True, help="prefix of our run's files")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--ubatch", type=int, default=512)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--host-memory", default="pinned")
    parser.add_argument("--prefill-order", choices=("ubatch", "layer"), default="ubatch")
    args = parser.parse_args(argv)
    reference = read_run(args.ref)
    n_prompt = int(reference.meta.get("n_prompt", len(reference.tokens)))
    ours = run(args, reference, n_prompt)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ours.astype(np.float32).tofile(out.with_name(out.name + ".logits"))
    out.with_name(out.name + ".tokens").write_text("".join(f"{t}\n" for t in reference.tokens))
    meta = {"shape": list(ours.shape), "n_prompt": n_prompt, "model": str(args.model), "settings": vars(args)}
    out.with_name(out.name + ".json").write_text(json.dumps(meta, indent=1))
    for what, part in (("prompt", slice(0, n_prompt)), ("decode", slice(n_prompt, None))):
        result = compare_logits(reference.logits[part], ours[part])
        if result.positions:
            print(
                f"{what}: {result.positions} positions, KL(ref || ours) median {float(np.median(result.kl)):.6g} mean "
                f"{result.mean_kl:.6g} max {result.max_kl:.6g} nats, argmax agreement {result.argmax_agreement:.2%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
