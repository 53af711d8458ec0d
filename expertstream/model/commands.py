"""`expertstream make-model`: write a synthetic GGUF MoE model for tests and benchmarks."""

from __future__ import annotations

import argparse
from typing import Any

from .loader import MoeModel
from .presets import PRESETS
from .writer import make_model, type_choices


def register(subparsers: Any) -> None:
    """Add the make-model subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "make-model",
        help="write a synthetic GGUF MoE model with a real model's shapes",
        description="Write a GGUF file with a preset's MoE shapes and deterministic random expert weights.",
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model shapes to imitate")
    parser.add_argument(
        "--type",
        dest="qtype",
        default="Q4_0",
        type=str.upper,
        choices=type_choices(),
        help="expert weight type, or a llama.cpp mix (Q4_K_M, ...) with its per-tensor choices",
    )
    parser.add_argument("-o", "--output", required=True, help="the .gguf file to write")
    parser.add_argument("--layers", type=int, default=None, help="write only the first N layers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.set_defaults(run=_make_model)


def _make_model(args: argparse.Namespace) -> int:
    path = make_model(args.preset, args.qtype, args.output, layers=args.layers, seed=args.seed)
    with MoeModel.open(path) as model:
        print(f"{path}: {path.stat().st_size} bytes ({path.stat().st_size / 2**30:.2f} GiB)")
        print(
            f"{model.arch}: {model.n_layer} layers, {model.n_expert} experts, top-{model.top_k}, "
            f"n_embd {model.n_embd}, n_ff {model.n_ff}"
        )
        for tensor in (model.layers[0].router, *model.layers[0].experts):
            print(f"  {tensor.name}: {tensor.qtype.name} ne={tensor.ne} {tensor.nbytes} bytes")
        experts = sum(t.nbytes for t in model.expert_tensors)
        print(f"expert tensors: {len(model.expert_tensors)}, {experts} bytes in all")
    return 0
