"""`expertstream make-model`, and opening a model file named on the command line."""

from __future__ import annotations

import argparse
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderField

from ..clitools import EXIT_STATUS_HELP, HelpFormatter, progress_bar, writable_path
from .layout import EXPERT_TYPES, ModelError
from .loader import MoeModel
from .presets import PRESETS
from .writer import TensorSpec, make_model

_GGUF_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key count


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
    parser.add_argument("--type", dest="qtype", default="Q4_0", **expert_type_option(), help="expert weight type")
    parser.add_argument("-o", "--output", required=True, help="the .gguf file to write")
    parser.add_argument("--layers", type=int, default=None, help="write only the first N layers (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.set_defaults(run=_make_model)


def expert_type_option() -> dict[str, Any]:
    """``type`` and ``choices`` of a --type option: gguf's names, in any case ('q4_0' is Q4_0)."""
    return {"type": str.upper, "choices": [t.name for t in EXPERT_TYPES]}


def _make_model(args: argparse.Namespace) -> int:
    output = writable_path(args.output, "-o")
    with progress_bar(0, output.name, "B", unit_scale=True, unit_divisor=1024) as bar:

        def wrote(spec: TensorSpec) -> None:
            bar.update(spec.nbytes)

        try:
            path = make_model(args.preset, args.qtype, output, layers=args.layers, seed=args.seed, on_tensor=wrote)
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
    """MoeModel.open, with a truncated file or a corrupt header reported in one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    try:
        return MoeModel.open(path)
    except ModelError as exc:
        if not isinstance(exc.__cause__, ValueError):
            raise
        raise ModelError(_damage(path, exc.__cause__)) from None
    except (IndexError, ValueError, OverflowError, MemoryError, struct.error) as exc:
        raise ModelError(_damage(path, exc)) from None


def _damage(path: Path, exc: BaseException) -> str:
    """What is wrong with a file GGUFReader could not take apart, as precisely as can be said."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            magic, version, n_tensors, n_kv = _GGUF_HEADER.unpack(f.read(_GGUF_HEADER.size))
    except struct.error:
        return f"{path}: not a GGUF file: {size} bytes, shorter than a GGUF header"
    if magic != b"GGUF":
        return f"{path}: not a GGUF file (starts with {magic!r})"
    # Each tensor info and metadata entry takes at least 8 bytes (a length or a count).
    if 8 * (n_tensors + n_kv) > size:
        return (
            f"{path}: corrupt GGUF header: it declares {n_tensors} tensors and {n_kv} metadata keys, "
            f"more than a file of {size} bytes can describe"
        )
    expected = _data_end(path)
    if expected is not None and expected > size:
        return f"{path}: truncated: its header describes {expected} bytes of file, the file has {size}"
    return f"{path}: corrupt GGUF file ({size} bytes): {exc}"


class _LayoutOnly(GGUFReader):
    """A reader that only adds up where the tensor data ends, without viewing it."""

    data_end = 0

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        for field in fields:
            _, _, _, dims, raw_dtype, offset = field.parts
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            n_bytes = int(np.prod(dims)) * type_size // block
            self.data_end = max(self.data_end, start_offs + int(offset[0]) + n_bytes)
        self.tensors = []


def _data_end(path: Path) -> int | None:
    try:
        return _LayoutOnly(path).data_end
    except Exception:  # the header itself is damaged: no size to compare against
        return None
