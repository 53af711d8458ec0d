"""Write synthetic GGUF MoE models: real architecture shapes, deterministic random weights.

Benchmark files are several GB, so tensors are streamed to the file one at a time (tensor
infos first, then each tensor's data) and quantized blocks are built directly from random
bytes with a bounded f16 scale instead of quantizing floats. Every tensor's bytes depend
only on (seed, layer, role), so ``generate`` reproduces exactly what a file holds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from ..errors import InvalidArgument
from ..ggml import row_size
from .layout import EXPERT_ROLES, TensorRole, parse_expert_type
from .presets import ModelPreset, get_preset

log = logging.getLogger(__name__)

_FILE_TYPES = {
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
}

# RMS of the integer part of one weight: q - 8 for Q4_0 (q uniform in 0..15), q for Q8_0
# (uniform int8), and 1 for float types whose magnitude is set by the exponent alone.
_UNIT_RMS = {
    GGMLQuantizationType.Q4_0: float(np.sqrt(np.mean(np.arange(-8, 8) ** 2))),
    GGMLQuantizationType.Q8_0: float(np.sqrt(np.mean(np.arange(-128, 128) ** 2))),
    GGMLQuantizationType.F16: 1.0,
    GGMLQuantizationType.BF16: 1.0,
}
# RMS of 1 + m for a uniformly random mantissa m in [0, 1): a random-mantissa float with
# exponent e has RMS magnitude 2**e times this.
_MANTISSA_RMS = math.sqrt(7 / 3)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the writer emits: its name, role, layer, type and shape (ggml order)."""

    name: str
    role: TensorRole
    layer: int
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return row_size(self.qtype, self.ne[0])

    @property
    def nbytes(self) -> int:
        return self.row_bytes * math.prod(self.ne[1:])

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """numpy shape of the raw bytes: outer dimensions first, one row of bytes last."""
        return (*reversed(self.ne[1:]), self.row_bytes)


def tensor_specs(preset: ModelPreset, qtype: GGMLQuantizationType, n_layer: int) -> list[TensorSpec]:
    """The router (F32) and the three expert tensors of each of the first ``n_layer`` layers."""
    specs = []
    for layer in range(n_layer):
        for role in (TensorRole.ROUTER, *EXPERT_ROLES):
            specs.append(
                TensorSpec(
                    name=role.tensor_name(layer),
                    role=role,
                    layer=layer,
                    qtype=GGMLQuantizationType.F32 if role is TensorRole.ROUTER else qtype,
                    ne=role.ne(preset.n_embd, preset.n_ff_exp, preset.n_expert),
                )
            )
    return specs


def generate(spec: TensorSpec, seed: int) -> np.ndarray:
    """The raw bytes (flat uint8) the writer stores for ``spec`` with ``seed``.

    Weights have an RMS of about 1/sqrt(fan_in) so that activations stay O(1) layer after
    layer. Float experts get random sign and mantissa with one fixed exponent; quantized
    blocks get random quants and a positive f16 scale with one fixed exponent.
    """
    stream = np.random.SeedSequence([seed, spec.layer, list(TensorRole).index(spec.role)])
    target_rms = 1.0 / math.sqrt(spec.ne[0])
    if spec.qtype is GGMLQuantizationType.F32:
        rng = np.random.Generator(np.random.PCG64(stream))
        values = rng.standard_normal(spec.nbytes // 4, dtype=np.float32) * np.float32(target_rms)
        return values.view(np.uint8)
    words = np.random.PCG64(stream).random_raw(-(-spec.nbytes // 8))
    raw = words.view(np.uint8)[: spec.nbytes]
    exponent = round(math.log2(target_rms / (_UNIT_RMS[spec.qtype] * _MANTISSA_RMS)))
    if spec.qtype is GGMLQuantizationType.F16:
        _set_float_exponent(raw.view(np.uint16), exponent + 15, mantissa_bits=10)
    elif spec.qtype is GGMLQuantizationType.BF16:
        _set_float_exponent(raw.view(np.uint16), exponent + 127, mantissa_bits=7)
    else:
        _set_block_scales(raw, spec.qtype, exponent + 15)
    return raw


def _set_float_exponent(words: np.ndarray, biased_exponent: int, mantissa_bits: int) -> None:
    """Keep each 16-bit float's random sign and mantissa, replace its exponent."""
    keep = np.uint16(0x8000 | ((1 << mantissa_bits) - 1))
    words &= keep
    words |= np.uint16(biased_exponent << mantissa_bits)


def _set_block_scales(raw: np.ndarray, qtype: GGMLQuantizationType, biased_exponent: int) -> None:
    """Make each block's leading f16 scale positive with a fixed exponent (random mantissa)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    high_byte = raw.reshape(-1, type_size)[:, 1]  # little-endian f16: sign, exponent, 2 mantissa bits
    high_byte &= np.uint8(0x03)
    high_byte |= np.uint8(biased_exponent << 2)


def add_metadata(writer: gguf.GGUFWriter, preset: ModelPreset, n_layer: int, qtype: GGMLQuantizationType) -> None:
    """The architecture's keys a loader needs, under gguf's names for ``preset.arch``."""
    writer.add_name(preset.name)
    writer.add_block_count(n_layer)
    writer.add_embedding_length(preset.n_embd)
    writer.add_expert_count(preset.n_expert)
    writer.add_expert_used_count(preset.top_k)
    writer.add_expert_feed_forward_length(preset.n_ff_exp)
    writer.add_file_type(_FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def start_model_file(
    preset: ModelPreset | str,
    qtype: GGMLQuantizationType | str,
    path: str | Path,
    *,
    layers: int | None = None,
) -> tuple[gguf.GGUFWriter, list[TensorSpec]]:
    """Write the header, metadata and tensor infos of a model file; the data is the caller's.

    Returns the open writer, positioned for ``write_tensor_data`` of each spec in order, and
    the specs. ``layers`` keeps only the first N layers. The caller closes the writer. Bad
    arguments raise InvalidArgument before the file is touched.
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    qtype = parse_expert_type(qtype)
    n_layer = preset.n_layer if layers is None else layers
    if not 1 <= n_layer <= preset.n_layer:
        raise InvalidArgument(f"{preset.name} has layers 1..{preset.n_layer}; asked for {n_layer}")
    specs = tensor_specs(preset, qtype, n_layer)
    path = Path(path)
    writer = gguf.GGUFWriter(path, preset.arch)
    try:
        add_metadata(writer, preset, n_layer, qtype)
        for spec in specs:
            writer.add_tensor_info(spec.name, spec.byte_shape, np.dtype(np.uint8), spec.nbytes, raw_dtype=spec.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    except BaseException:
        writer.close()
        path.unlink(missing_ok=True)
        raise
    return writer, specs


def make_model(
    preset: ModelPreset | str,
    qtype: GGMLQuantizationType | str,
    path: str | Path,
    *,
    layers: int | None = None,
    seed: int = 0,
    on_tensor: Callable[[TensorSpec], None] | None = None,
) -> Path:
    """Write a synthetic model with ``preset``'s shapes and expert type ``qtype`` to ``path``.

    ``layers`` keeps only the first N layers (a smaller file with the same tensor sizes).
    ``on_tensor`` is called after each tensor is written (a progress bar).
    Memory stays bounded by the largest single tensor. A partial file is removed on error.
    """
    if seed < 0:
        raise InvalidArgument(f"seed must be non-negative, got {seed}")
    path = Path(path)
    writer, specs = start_model_file(preset, qtype, path, layers=layers)
    try:
        for spec in specs:
            writer.write_tensor_data(generate(spec, seed))
            if on_tensor is not None:
                on_tensor(spec)
    except BaseException:
        writer.close()
        path.unlink(missing_ok=True)
        raise
    writer.close()
    n_layer = specs[-1].layer + 1
    log.info("wrote %s: %s, %d layers, %d bytes", path, writer.arch, n_layer, path.stat().st_size)
    return path
