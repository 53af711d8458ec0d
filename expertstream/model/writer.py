"""Write synthetic GGUF MoE models: real architecture shapes, deterministic random weights.

A file is complete for llama.cpp's loader of its architecture (model/tensors.py lists the
tensors, ``add_metadata`` the keys, model/vocabulary.py the vocabulary). Benchmark files
are several GB, so tensors are streamed to the file one at a time (tensor infos first, then
each tensor's data) and quantized blocks are built directly from random bytes with a bounded
scale instead of quantizing floats. Every tensor's bytes depend only on (seed, name), so
``generate`` reproduces exactly what a file holds.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize

from ..errors import InvalidArgument
from ..ggml import iq1_m_scale_bits, row_size, set_iq1_m_scale_bits
from .mixes import MIX_DEFAULTS, MIX_FILE_TYPES, TensorShape, is_quantizable, mix_types
from .presets import LinearAttention, ModelPreset, get_preset
from .schema import EXPERT_ROLES, TensorRole
from .tensors import Init, TensorPlan, file_tensors
from .vocabulary import add_vocabulary

log = logging.getLogger(__name__)

_FILE_TYPES = {
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.Q4_K: LlamaFileType.MOSTLY_Q4_K_S,
    GGMLQuantizationType.Q5_K: LlamaFileType.MOSTLY_Q5_K_S,
    GGMLQuantizationType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    GGMLQuantizationType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    GGMLQuantizationType.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
    GGMLQuantizationType.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
    GGMLQuantizationType.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    GGMLQuantizationType.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    GGMLQuantizationType.IQ1_S: LlamaFileType.MOSTLY_IQ1_S,
    GGMLQuantizationType.IQ1_M: LlamaFileType.MOSTLY_IQ1_M,
    GGMLQuantizationType.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS,
    GGMLQuantizationType.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS,
    GGMLQuantizationType.IQ2_S: LlamaFileType.MOSTLY_IQ2_M,  # llama.cpp's IQ2_M is the mix of IQ2_S tensors
    GGMLQuantizationType.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
    GGMLQuantizationType.IQ3_S: LlamaFileType.MOSTLY_IQ3_S,
}
# Byte offset of each block's f16 scale d (MXFP4's is an E8M0 byte at 0).
_SCALE_OFFSET = {
    GGMLQuantizationType.Q4_0: 0,
    GGMLQuantizationType.Q8_0: 0,
    GGMLQuantizationType.Q4_1: 0,
    GGMLQuantizationType.Q5_0: 0,
    GGMLQuantizationType.Q5_1: 0,
    GGMLQuantizationType.Q4_K: 0,
    GGMLQuantizationType.Q5_K: 0,
    GGMLQuantizationType.Q6_K: 208,
    GGMLQuantizationType.IQ4_NL: 0,
    GGMLQuantizationType.IQ4_XS: 0,
    GGMLQuantizationType.MXFP4: 0,
    GGMLQuantizationType.Q2_K: 80,
    GGMLQuantizationType.Q3_K: 108,
    GGMLQuantizationType.IQ1_S: 0,
    GGMLQuantizationType.IQ2_XXS: 0,
    GGMLQuantizationType.IQ2_XS: 0,
    GGMLQuantizationType.IQ2_S: 0,
    GGMLQuantizationType.IQ3_XXS: 0,
    GGMLQuantizationType.IQ3_S: 0,
}  # IQ1_M keeps its scale in the top nibbles of its scale words (ggml.iq1_m_scale_bits).
# Random bytes are valid blocks of every type once the scales are set: the i-quants' grid and
# sign indices have exactly as many bits as their tables have entries.
# Types whose blocks add a minimum to unsigned quants: byte offset of the f16 minimum (or of
# dmin, the k-quants' scale of their sub-block minimums) and the mean of the quants, which
# the minimum cancels so that every block's values average zero.
_MINIMUM = {
    GGMLQuantizationType.Q4_1: (2, 7.5),
    GGMLQuantizationType.Q5_1: (2, 15.5),
    GGMLQuantizationType.Q4_K: (2, 7.5),
    GGMLQuantizationType.Q5_K: (2, 15.5),
    GGMLQuantizationType.Q2_K: (82, 1.5),
}
WRITABLE_TYPES = (*_FILE_TYPES,)

# RMS of 1 + m for a uniformly random mantissa m in [0, 1): a random-mantissa float with
# exponent e has RMS magnitude 2**e times this.
_MANTISSA_RMS = math.sqrt(7 / 3)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the writer emits: its name, role, layer, type, shape (ggml order) and values."""

    name: str
    role: TensorRole | None  # None for the tensors outside the MoE block's four
    layer: int
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]
    init: Init = Init.WEIGHT
    rms: float | None = None  # of a weight's values; None: 1/sqrt(fan-in)

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


TypeChoice = GGMLQuantizationType | str


def parse_type(choice: TypeChoice) -> GGMLQuantizationType | str:
    """A single tensor type (any the writer can fill) or the name of a llama.cpp mix."""
    if isinstance(choice, str):
        name = choice.upper()
        if name in MIX_DEFAULTS:
            return name
        member = GGMLQuantizationType.__members__.get(name)
        if member is None:
            raise InvalidArgument(f"unknown tensor type {choice!r}", hint=f"choose one of {', '.join(type_choices())}")
        choice = member
    if choice not in WRITABLE_TYPES:
        raise InvalidArgument(
            f"the writer cannot fill {choice.name}", hint=f"choose one of {', '.join(type_choices())}"
        )
    return choice


def type_choices() -> list[str]:
    """What ``--type`` accepts: llama.cpp mix names, then single types."""
    singles = [t.name for t in WRITABLE_TYPES if t.name not in MIX_DEFAULTS]
    return [*MIX_DEFAULTS, *singles]


def tensor_specs(preset: ModelPreset, qtype: TypeChoice, n_layer: int, residual_scale: float = 1.0) -> list[TensorSpec]:
    """The router (F32) and the three expert tensors of each MoE layer among the first ``n_layer``."""
    moe = {role.tensor_name(i) for i in range(n_layer) for role in TensorRole}
    return [s for s in file_specs(preset, qtype, n_layer, residual_scale) if s.name in moe]


def file_specs(preset: ModelPreset, choice: TypeChoice, n_layer: int, residual_scale: float = 1.0) -> list[TensorSpec]:
    """Every tensor of a complete file with the first ``n_layer`` layers, with its type
    (``residual_scale``: file_tensors')."""
    plans = file_tensors(preset, n_layer, residual_scale)
    parsed = parse_type(choice)
    if isinstance(parsed, str):
        shapes = [TensorShape(p.name, p.ne) for p in plans]
        types = mix_types(parsed, shapes, preset.n_expert, preset.n_head // preset.n_head_kv, n_layer)
    else:
        types = {p.name: _single_type(p, parsed) for p in plans}
    return [TensorSpec(p.name, p.role, p.layer, types[p.name], p.ne, p.init, p.rms) for p in plans]


def _single_type(plan: TensorPlan, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """Experts in ``qtype``; other matrices too where their rows fit its blocks (else F16); vectors F32.

    What llama.cpp never quantizes (routers, convolution weights) stays F32 too.
    """
    if plan.init is not Init.WEIGHT or not is_quantizable(TensorShape(plan.name, plan.ne)):
        return GGMLQuantizationType.F32
    if plan.role in EXPERT_ROLES or plan.ne[0] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    return GGMLQuantizationType.F16


def generate(spec: TensorSpec, seed: int) -> np.ndarray:
    """The raw bytes (flat uint8) the writer stores for ``spec`` with ``seed``.

    Weights have an RMS of about 1/sqrt(fan_in) so that activations stay O(1) layer after
    layer, or the RMS their plan names (embeddings, attention output: model/tensors.py).
    Every weight averages zero: an offset shared by all of a tensor's values would add one
    vector to every token's hidden state, layer after layer, until every router picks the
    same few experts. Float weights get random sign and mantissa with one fixed exponent;
    quantized blocks get random quants and a scale of random sign (and, with a minimum, the
    one that centres the block). Norm weights are ones, biases small, the selection bias one
    shared offset plus small noise per expert (a shared offset does not change which
    experts are chosen). Linear attention's decay rates are drawn from -16..-1, as its real
    initialisation draws them from -16..0 but without rates near zero: a state that never
    decays sums every earlier position into one vector that all tokens share.
    """
    role_index = list(TensorRole).index(spec.role) if spec.role is not None else 100 + zlib.crc32(spec.name.encode())
    stream = np.random.SeedSequence([seed, spec.layer, role_index])
    target_rms = spec.rms if spec.rms is not None else 1.0 / math.sqrt(spec.ne[0])
    if spec.qtype is GGMLQuantizationType.F32:
        rng = np.random.Generator(np.random.PCG64(stream))
        n = spec.nbytes // 4
        if spec.init is Init.ONES:
            values = np.ones(n, np.float32)
        elif spec.init is Init.BIAS:
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
        elif spec.init is Init.SELECTION_BIAS:
            values = np.float32(0.5) + rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
        elif spec.init is Init.DECAY:
            values = -rng.uniform(1.0, 16.0, n).astype(np.float32)
        else:
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(target_rms)
        return values.view(np.uint8)
    words = np.random.PCG64(stream).random_raw(-(-spec.nbytes // 8))
    raw = words.view(np.uint8)[: spec.nbytes]
    if spec.qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        exponent = round(math.log2(target_rms / _MANTISSA_RMS))
        if spec.qtype is GGMLQuantizationType.F16:
            _set_float_exponent(raw.view(np.uint16), exponent + 15, mantissa_bits=10)
        else:
            _set_float_exponent(raw.view(np.uint16), exponent + 127, mantissa_bits=7)
    else:
        _set_scales(raw, spec.qtype, target_rms / _unit_scale_rms(spec.qtype))
    return raw


def _set_float_exponent(words: np.ndarray, biased_exponent: int, mantissa_bits: int) -> None:
    """Keep each 16-bit float's random sign and mantissa, replace its exponent."""
    keep = np.uint16(0x8000 | ((1 << mantissa_bits) - 1))
    words &= keep
    words |= np.uint16(biased_exponent << mantissa_bits)


def _set_scales(raw: np.ndarray, qtype: GGMLQuantizationType, scale: float) -> None:
    """Give every block a scale of random sign and magnitude ``scale`` times 1 plus its random mantissa.

    Blocks with a minimum get the one that centres their values on zero. Small scales become
    f16 subnormals (k-quants multiply d by large sub-scales); MXFP4's E8M0 scale is the power
    of two nearest ``scale``.
    """
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)
    if qtype is GGMLQuantizationType.MXFP4:
        blocks[:, 0] = np.uint8(127 + round(math.log2(scale)))
        return
    if qtype is GGMLQuantizationType.IQ1_M:
        bits = iq1_m_scale_bits(blocks)
        d = np.where(bits & 0x8000, -1.0, 1.0) * scale * (1.0 + (bits & 0x3FF) / 1024.0)
        set_iq1_m_scale_bits(blocks, np.asarray(d, np.float16).view(np.uint16))
        return
    offset = _SCALE_OFFSET[qtype]
    bits = blocks[:, offset].astype(np.uint16) | (blocks[:, offset + 1].astype(np.uint16) << 8)
    sign = np.where(bits & 0x8000, -1.0, 1.0)
    d = sign * scale * (1.0 + (bits & 0x3FF) / 1024.0)
    _put_f16(blocks, offset, d)
    if qtype not in _MINIMUM:
        return
    min_offset, quant_mean = _MINIMUM[qtype]
    if qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1):
        _put_f16(blocks, min_offset, -d * quant_mean)  # x = d q + m
        return
    # k-quants: x = d sc q - dmin m per sub-block; m = sc and dmin = d * mean(q) centre it
    _put_f16(blocks, min_offset, d * quant_mean)
    if qtype is GGMLQuantizationType.Q2_K:
        sub = blocks[:, :16]  # sc in the low nibble, m in the high one
        sub[:] = (sub & 0x0F) * np.uint8(0x11)
    else:
        packed = blocks[:, 4:16]  # 6-bit sc and m: bytes 0-3 and 4-7 low bits, 8-11 one nibble each
        packed[:, 4:8] = packed[:, 0:4]
        packed[:, 8:12] = (packed[:, 8:12] & 0x0F) * np.uint8(0x11)


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    """Store ``values`` (one per block) as little-endian f16 at byte ``offset`` of each block."""
    bits = np.asarray(values, np.float16).view(np.uint16)
    blocks[:, offset] = (bits & 0xFF).astype(np.uint8)
    blocks[:, offset + 1] = (bits >> 8).astype(np.uint8)


def _storable(spec: TensorSpec) -> bool:
    """Whether ``generate`` can write ``spec``'s planned RMS in its type: a normal float16 or bfloat16
    exponent, an E8M0 scale in range, a nonzero float16 block scale (subnormal ones are used)."""
    if spec.init is not Init.WEIGHT or spec.rms is None or spec.qtype is GGMLQuantizationType.F32:
        return True
    if spec.qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        exponent = round(math.log2(spec.rms / _MANTISSA_RMS))
        bias, top = (15, 30) if spec.qtype is GGMLQuantizationType.F16 else (127, 254)
        return 1 <= exponent + bias <= top
    scale = spec.rms / _unit_scale_rms(spec.qtype)
    if spec.qtype is GGMLQuantizationType.MXFP4:
        return 1 <= 127 + round(math.log2(scale)) <= 254
    return 2.0**-24 <= scale <= 65504.0


@functools.cache
def _unit_scale_rms(qtype: GGMLQuantizationType) -> float:
    """The RMS that random blocks of ``qtype`` dequantize to with ``_set_scales`` scale 1."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1024
    raw = np.random.PCG64(0).random_raw(n * type_size // 8 + 1).view(np.uint8)[: n * type_size].copy()
    _set_scales(raw, qtype, 1.0)
    values = np.asarray(dequantize(raw.reshape(1, -1), qtype), np.float64)
    return float(np.sqrt(np.mean(values**2)))


def add_metadata(writer: gguf.GGUFWriter, preset: ModelPreset, n_layer: int, file_type: LlamaFileType) -> None:
    """The keys llama.cpp's loader reads for ``preset.arch``, and a small vocabulary of its kind."""
    arch = preset.arch
    writer.add_name(preset.name)
    writer.add_block_count(n_layer)
    writer.add_context_length(preset.n_ctx)
    writer.add_embedding_length(preset.n_embd)
    writer.add_feed_forward_length(preset.dense_ff if arch != "llama" else preset.n_ff_exp)
    writer.add_head_count(preset.n_head)
    writer.add_head_count_kv(preset.n_head_kv)
    writer.add_rope_freq_base(preset.rope_base)
    writer.add_layer_norm_rms_eps(preset.norm_eps)
    writer.add_expert_count(preset.n_expert)
    writer.add_expert_used_count(preset.top_k)
    writer.add_expert_feed_forward_length(preset.n_ff_exp)
    if arch == "deepseek2":
        rope = preset.rope_dim or preset.head_dim
        writer.add_uint32(f"{arch}.attention.kv_lora_rank", preset.kv_lora_rank)
        # llama.cpp reads q_lora_rank unless the layer count is a Lite model's (26 or 27); 0 means a plain
        # attn_q, so that files with fewer layers (--layers) load too
        writer.add_uint32(f"{arch}.attention.q_lora_rank", preset.q_lora_rank)
        # multi-head latent attention stored as MQA: keys are the latent plus the rotated part
        writer.add_key_length(preset.kv_lora_rank + rope)
        writer.add_value_length(preset.kv_lora_rank)
        writer.add_uint32(f"{arch}.attention.key_length_mla", preset.qk_nope_dim + rope)
        writer.add_uint32(f"{arch}.attention.value_length_mla", preset.v_head_dim)
    else:
        writer.add_key_length(preset.head_dim)
        writer.add_value_length(preset.head_dim)
    writer.add_rope_dimension_count(preset.rope_dim or preset.head_dim)
    if preset.yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(preset.yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(preset.yarn.original_context)
        if preset.yarn.log_multiplier:
            writer.add_rope_scaling_yarn_log_mul(preset.yarn.log_multiplier)
    if preset.sliding_window:
        writer.add_uint32(f"{arch}.attention.sliding_window", preset.sliding_window)
    if preset.n_shared:
        writer.add_uint32(f"{arch}.expert_shared_count", preset.n_shared)
        if arch in ("qwen2moe", "qwen3next"):
            writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", preset.shared_ff)
    if preset.linear is not None:
        _add_linear_attention(writer, preset.linear)
    if arch in ("deepseek2", "glm4moe"):
        writer.add_uint32(f"{arch}.leading_dense_block_count", min(preset.n_dense_lead, n_layer))
        writer.add_float32(f"{arch}.expert_weights_scale", preset.weights_scale or 1.0)
        writer.add_bool(f"{arch}.expert_weights_norm", bool(preset.weights_norm))
        if preset.gating is not None:
            writer.add_uint32(f"{arch}.expert_gating_func", preset.gating)
    if arch == "glm4moe":
        writer.add_uint32(f"{arch}.nextn_predict_layers", 0)
    if preset.n_group > 1:
        writer.add_uint32(f"{arch}.expert_group_count", preset.n_group)
        writer.add_uint32(f"{arch}.expert_group_used_count", preset.n_group_used)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocabulary(writer, arch, preset.n_vocab)


def _add_linear_attention(writer: gguf.GGUFWriter, linear: LinearAttention) -> None:
    """The keys of qwen3next's gated delta net, under llama.cpp's ssm.* names."""
    writer.add_ssm_conv_kernel(linear.conv_kernel)
    writer.add_ssm_inner_size(linear.value_dim)
    writer.add_ssm_state_size(linear.head_dim)
    writer.add_ssm_time_step_rank(linear.v_heads)
    writer.add_ssm_group_count(linear.k_heads)
    writer.add_full_attention_interval(linear.full_attention_interval)


def start_model_file(
    preset: ModelPreset | str,
    qtype: TypeChoice,
    path: str | Path,
    *,
    layers: int | None = None,
    split_max_tensors: int = 0,
    residual_scale: float = 1.0,
) -> tuple[gguf.GGUFWriter, list[TensorSpec]]:
    """Write the header, metadata and tensor infos of a model file; the data is the caller's.

    ``qtype`` is one tensor type for the experts or a llama.cpp mix name ('Q4_K_M'). Returns
    the open writer, positioned for ``write_tensor_data`` of each spec in order, and the
    specs. ``layers`` keeps only the first N layers. ``split_max_tensors`` > 0 writes shards
    of at most that many tensors, named as gguf-split names them
    (``writer.format_shard_names(path)``). ``residual_scale`` multiplies the RMS of every matrix
    that writes into the residual stream (attention's output, the FFN's down projections; 1: the
    default files). The caller closes the writer. Bad arguments raise InvalidArgument before the
    file is touched.
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    parsed = parse_type(qtype)
    n_layer = preset.n_layer if layers is None else layers
    if not 1 <= n_layer <= preset.n_layer:
        raise InvalidArgument(f"{preset.name} has layers 1..{preset.n_layer}; asked for {n_layer}")
    if split_max_tensors < 0:
        raise InvalidArgument(f"split_max_tensors must be 0 (one file) or positive, got {split_max_tensors}")
    if not (math.isfinite(residual_scale) and residual_scale > 0):
        raise InvalidArgument(f"the residual scale must be a positive number, got {residual_scale}")
    specs = file_specs(preset, parsed, n_layer, residual_scale)
    for spec in specs:
        if not _storable(spec):
            raise InvalidArgument(
                f"at residual scale {residual_scale} {spec.name} ({spec.qtype.name}) would have values of RMS "
                f"{spec.rms:.3g}, out of the range its {spec.qtype.name} scales hold",
                hint="choose a residual scale nearer 1",
            )
    file_type = MIX_FILE_TYPES[parsed] if isinstance(parsed, str) else _FILE_TYPES[parsed]
    path = Path(path)
    writer = gguf.GGUFWriter(path, preset.arch, split_max_tensors=split_max_tensors)
    try:
        add_metadata(writer, preset, n_layer, file_type)
        for spec in specs:
            writer.add_tensor_info(spec.name, spec.byte_shape, np.dtype(np.uint8), spec.nbytes, raw_dtype=spec.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    except BaseException:
        _discard(writer, path)
        raise
    return writer, specs


def _flush_to_disk(path: Path) -> None:
    """Write the file's pages to disk before it is used.

    Pages still dirty slowed memcpys from the file's mapping (the staging ring's fills) by a quarter
    or more on the H200 host until written back (docs/results/hostmem-h200.md, run 16): a model
    made for a benchmark must be clean before the benchmark reads it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # a file system without fsync: the file is complete, only not yet on disk
        log.warning("%s: not flushed to disk (%s); reading it right away may be slower until it is", path, exc)
    finally:
        os.close(fd)


def _discard(writer: gguf.GGUFWriter, path: Path) -> None:
    """Close ``writer`` and remove every file it started (each shard of a split model)."""
    writer.close()
    for shard in writer.format_shard_names(path):
        shard.unlink(missing_ok=True)


def make_model(
    preset: ModelPreset | str,
    qtype: TypeChoice,
    path: str | Path,
    *,
    layers: int | None = None,
    seed: int = 0,
    on_tensor: Callable[[TensorSpec], None] | None = None,
    split_max_tensors: int = 0,
    residual_scale: float = 1.0,
) -> Path:
    """Write a synthetic model with ``preset``'s shapes and types ``qtype`` (a type or a mix) to ``path``.

    ``layers`` keeps only the first N layers (a smaller file with the same tensor sizes).
    ``on_tensor`` is called after each tensor is written (a progress bar).
    ``split_max_tensors`` > 0 splits the model as gguf-split does, at most that many tensors
    a shard; the path returned is then the first shard's (``PREFIX-00001-of-0000N.gguf``).
    ``residual_scale`` scales the matrices that write into the residual stream (start_model_file).
    Memory stays bounded by the largest single tensor. Partial files are removed on error.
    """
    if seed < 0:
        raise InvalidArgument(f"seed must be non-negative, got {seed}")
    path = Path(path)
    writer, specs = start_model_file(
        preset, qtype, path, layers=layers, split_max_tensors=split_max_tensors, residual_scale=residual_scale
    )
    try:
        for spec in specs:
            writer.write_tensor_data(generate(spec, seed))
            if on_tensor is not None:
                on_tensor(spec)
    except BaseException:
        _discard(writer, path)
        raise
    writer.close()
    shards = writer.format_shard_names(path)
    for shard in shards:
        _flush_to_disk(shard)
    n_layer = specs[-1].layer + 1
    size = sum(shard.stat().st_size for shard in shards)
    log.info("wrote %s: %s, %d layers, %d shard(s), %d bytes", shards[0], writer.arch, n_layer, len(shards), size)
    return shards[0]
