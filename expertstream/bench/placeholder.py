"""Sparse model files: a preset's full GGUF layout whose tensor data is a hole in the file.

The simulator's timing-only mode never reads weight bytes, so a run at a real model's full
scale (tens of GB of experts) needs only the file's layout. A sparse file gives the loader and
every host memory mode exactly that, on disk and in memory almost for free. Read, its weights
are zeros.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf

from ..model import ModelPreset
from ..model.writer import start_model_file

log = logging.getLogger(__name__)


def write_sparse_model(
    preset: ModelPreset | str,
    qtype: gguf.GGMLQuantizationType | str,
    path: str | Path,
    *,
    layers: int | None = None,
) -> Path:
    """Write the header of ``preset``'s model and extend the file over its tensor data without writing it."""
    path = Path(path)
    writer, specs = start_model_file(preset, qtype, path, layers=layers)
    writer.close()
    align = writer.data_alignment
    data_start = gguf.GGUFWriter.ggml_pad(path.stat().st_size, align)
    total = data_start + sum(gguf.GGUFWriter.ggml_pad(spec.nbytes, align) for spec in specs)
    os.truncate(path, total)
    log.info("wrote sparse %s: %d tensors, %d bytes", path, len(specs), total)
    return path
