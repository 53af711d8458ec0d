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
import numpy as np

from ..model import ModelPreset, get_preset, parse_expert_type, tensor_specs
from ..model.writer import add_metadata

logger = logging.getLogger(__name__)


def write_sparse_model(
    preset: ModelPreset | str,
    qtype: gguf.GGMLQuantizationType | str,
    path: str | Path,
    *,
    layers: int | None = None,
) -> Path:
    """Write the header of ``preset``'s model and extend the file over its tensor data without writing it."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    qtype = parse_expert_type(qtype)
    n_layer = preset.n_layer if layers is None else layers
    path = Path(path)
    specs = tensor_specs(preset, qtype, n_layer)
    writer = gguf.GGUFWriter(path, preset.arch)
    try:
        add_metadata(writer, preset, n_layer, qtype)
        for spec in specs:
            writer.add_tensor_info(
                spec.name, spec.byte_shape, np.dtype(np.uint8), spec.nbytes, raw_dtype=spec.qtype
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    finally:
        writer.close()
    align = writer.data_alignment
    data_start = gguf.GGUFWriter.ggml_pad(path.stat().st_size, align)
    total = data_start + sum(gguf.GGUFWriter.ggml_pad(spec.nbytes, align) for spec in specs)
    os.truncate(path, total)
    logger.info("wrote sparse %s: %s, %s, %d layers, %d bytes", path, preset.name, qtype.name, n_layer, total)
    return path
