"""`expertstream make-model`, and opening a model file named on the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..model.loader import MoeModel
from ..model.presets import PRESETS
from ..model.schema import ModelError
from ..model.writer import TensorSpec, make_model, type_choices
from .tools import EXIT_STATUS_HELP, HelpFormatter, progress_bar, writable_path


def register(subparsers: Any) -> None:
    """Add the make-model subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "make-model",
        help="write a synthetic GGUF MoE model with a real model's shapes",
        description="Write a GGUF file with a preset's MoE shapes and deterministic random expert weights.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--preset", required=True, type=str.lower, choices=sorted(PRESETS), help="model shapes to imitate"
    )
    parser.add_argument(
        "--type",
        dest="qtype",
        default="Q4_0",
        **expert_type_option(),
        help="expert weight type, or a llama.cpp mix (Q4_K_M, ...) with its per-tensor choices",
    )
    parser.add_argument("-o", "--output", required=True, help="the .gguf file to write")
    parser.add_argument("--layers", type=int, default=None, help="write only the first N layers (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        "--residual-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="multiply the RMS of every matrix that writes into the residual stream (attention output, FFN down) "
        "by S: below 1, rounding differences grow less from layer to layer (1/sqrt(2 * layers) is GPT-2's "
        "initialisation; default 1)",
    )
    parser.set_defaults(run=_make_model)


def expert_type_option() -> dict[str, Any]:
    """``type`` and ``choices`` of a --type option: gguf's type names and llama.cpp's mixes, any case."""
    return {"type": str.upper, "choices": type_choices()}


def _make_model(args: argparse.Namespace, command_line: str) -> int:
    output = writable_path(args.output, "-o")
    with progress_bar(0, output.name, "B", unit_scale=True, unit_divisor=1024) as bar:

        def wrote(spec: TensorSpec) -> None:
            bar.update(spec.nbytes)

        try:
            path = make_model(
                args.preset,
                args.qtype,
                output,
                layers=args.layers,
                seed=args.seed,
                on_tensor=wrote,
                residual_scale=args.residual_scale,
            )
        except OSError as exc:  # the writer has removed the partial file
            raise ModelError(f"cannot write {output}: {exc.strerror or exc}") from None
    with open_model(path) as model:
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


def open_model(path: str | Path) -> MoeModel:
    """MoeModel.open, with a path that is no model file reported in one line naming it and why."""
    path = Path(path)
    if path.is_dir():
        raise ModelError(f"{path}: is a directory")
    if path.exists() and not path.is_file():
        raise ModelError(f"{path}: is not a regular file")
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    return MoeModel.open(path)
