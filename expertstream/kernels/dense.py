"""Launchers of the dense kernels of dense.cu: what a transformer forward pass needs besides
attention and the expert matmuls.

- ``get_rows``: rows of a table (token_embd) decoded to float32, any type of layout.FORMATS;
- ``rms_norm``: the RMS norm with an optional weight, over hidden rows or per-head Q/K rows;
- ``add_rows``: a bias added to every row (projection biases);
- ``rope``: the rotary position embedding of ggml's rope_ext, normal and NEOX modes, YaRN;
- ``store_rows_f16``: float32 rows written into a float16 cache at given rows (the KV cache);
- ``copy_columns``: columns of rows taken out into rows of their own;
- ``mla_rope_store``: deepseek2's latent attention inputs: the heads' absorbed queries with their
  rotated parts, and the shared key row into the cache.

Every function only enqueues work on the given stream. Shapes are float32 row-major unless
noted; positions and ids are int32 on the device, so a captured graph can replay a launch
with new values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from ..backends.base import BufferView, DeviceBuffer, KernelArg, Stream
from ..errors import InvalidArgument
from ..ggml import RowType
from . import layout
from .args import ViewLike, fits_int32, positive, view, weight_view
from .layout import WeightFormat

if TYPE_CHECKING:
    from .launcher import MoeKernels

GET_ROWS_THREADS = 128  # must match dense.cu
GET_ROWS_CHUNK = GET_ROWS_THREADS * 32  # row elements per block
NORM_MAX_THREADS = 256  # the norm's sum: at most this many lanes (dense.cu's DENSE_NORM_MAX_THREADS)
NORM_BLOCK_THREADS = 1024  # the norm kernels' blocks: at most this many threads (DENSE_NORM_BLOCK_THREADS)
DENSE_THREADS = 256


@dataclass(frozen=True)
class Rope:
    """How ``rope`` rotates: ggml_rope_ext's parameters."""

    n_rot: int  # rotated dimensions of each head (<= head_dim, even); the rest pass through
    neox: bool  # NEOX mode rotates pairs (i, i + n_rot/2); normal mode rotates (2i, 2i+1)
    freq_base: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0  # YaRN: > 0 mixes interpolation and extrapolation per dimension
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0  # the training context YaRN's correction dims are computed from


def yarn_corr_dims(rope: Rope) -> tuple[float, float]:
    """(low, high): the pair indices between which YaRN's ramp goes from extrapolation to
    interpolation, computed in float32 as ggml_rope_yarn_corr_dims computes them."""
    f32 = np.float32

    def corr_dim(n_rotations: float) -> np.float32:
        ratio = f32(rope.n_ctx_orig) / (f32(n_rotations) * f32(2) * f32(math.pi))
        return f32(rope.n_rot) * np.log(ratio) / (f32(2) * np.log(f32(rope.freq_base)))

    low = max(0.0, float(np.floor(corr_dim(rope.beta_fast))))
    high = min(float(rope.n_rot - 1), float(np.ceil(corr_dim(rope.beta_slow))))
    return low, high


def rope_mscale(rope: Rope) -> float:
    """What cos and sin are scaled by: attn_factor, times 1 + 0.1 ln(1 / freq_scale) under YaRN."""
    if rope.ext_factor == 0.0:
        return rope.attn_factor
    return rope.attn_factor * (1.0 + 0.1 * math.log(1.0 / rope.freq_scale))


def get_rows(
    kernels: MoeKernels,
    stream: Stream,
    table: ViewLike,
    table_type: RowType,
    n_cols: int,
    n_table_rows: int,
    ids: ViewLike,
    n_ids: int,
    out: ViewLike,
) -> None:
    """out[i, :] = row ids[i] of table, decoded to float32.

    ``table`` holds n_table_rows rows of n_cols elements of ``table_type``, as a GGUF tensor
    stores them (token_embd); ids int32 [n_ids]; out [n_ids, n_cols]. An id outside
    [0, n_table_rows) gives a NaN row, never a stray read.
    """
    call = "get_rows"
    fmt = _table_format(call, table_type)
    positive(call, n_cols=n_cols, n_table_rows=n_table_rows, n_ids=n_ids)
    if n_cols % fmt.block_elements:
        raise InvalidArgument(
            f"n_cols {n_cols} is not a multiple of the {fmt.qtype.name} block size {fmt.block_elements}", call=call
        )
    fits_int32(call, out=n_ids * n_cols)
    args = (
        view(call, "table", table, n_table_rows * fmt.row_bytes(n_cols), fmt.unit_bytes),
        view(call, "ids", ids, n_ids * 4),
        view(call, "out", out, n_ids * n_cols * 4),
        np.int32(n_cols),
        np.int32(n_table_rows),
        np.int32(n_ids),
    )
    grid = (-(-n_cols // GET_ROWS_CHUNK), min(n_ids, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel(fmt.get_rows_kernel_name), grid, GET_ROWS_THREADS, args)


def rms_norm(
    kernels: MoeKernels,
    stream: Stream,
    x: ViewLike,
    weight: ViewLike | None,
    out: ViewLike,
    n_rows: int,
    n: int,
    eps: float,
) -> None:
    """out[r, :] = x[r, :] / sqrt(mean(x[r, :]**2) + eps) * weight[:] (weight [n]; None: no weight).

    ``out`` may be the same view as ``x`` (in place), not a view partly over it. Hidden rows
    take n = n_embd; a per-head Q/K norm takes n_rows = tokens * heads and n = head_dim. The
    sum of squares is reduced in a fixed order, so results never depend on timing.
    """
    call = "rms_norm"
    positive(call, n_rows=n_rows, n=n)
    _check_eps(call, eps)
    fits_int32(call, x=n_rows * n)
    x_view = view(call, "x", x, n_rows * n * 4)
    out_view = view(call, "out", out, n_rows * n * 4)
    _same_or_apart(call, x_view, out_view)
    args = (
        x_view,
        np.uint64(0) if weight is None else view(call, "weight", weight, n * 4),
        out_view,
        np.int32(n_rows),
        np.int32(n),
        np.float32(eps),
    )
    stream.launch(kernels.kernel("dense_rms_norm"), n_rows, norm_block(n), args)


def add_rms_norm(
    kernels: MoeKernels,
    stream: Stream,
    hidden: ViewLike,
    delta: ViewLike,
    weight: ViewLike | None,
    out: ViewLike,
    n_rows: int,
    n: int,
    eps: float,
) -> None:
    """hidden += delta, then out = rms_norm(hidden) * weight: a residual add and the next norm in one
    launch, the same bytes as ``standin.add_inplace`` followed by ``rms_norm``. ``out`` apart from
    ``hidden`` and ``delta``."""
    call = "add_rms_norm"
    positive(call, n_rows=n_rows, n=n)
    _check_eps(call, eps)
    fits_int32(call, hidden=n_rows * n)
    rows = (("hidden", hidden), ("delta", delta), ("out", out))
    views = {name: view(call, name, v, n_rows * n * 4) for name, v in rows}
    for a, b in (("hidden", "delta"), ("out", "hidden"), ("out", "delta")):
        _apart(call, a, views[a], b, views[b])
    args = (
        views["hidden"],
        views["delta"],
        np.uint64(0) if weight is None else view(call, "weight", weight, n * 4),
        views["out"],
        np.int32(n_rows),
        np.int32(n),
        np.float32(eps),
    )
    stream.launch(kernels.kernel("dense_add_rms_norm"), n_rows, norm_block(n), args)


_ADD_NORM_COUNTERS = "add_norm_counters"  # the MoeKernels owner of project_add_rms_norm's counters


def reserve_project_add_rms_norm(kernels: MoeKernels, n_tokens: int) -> None:
    """Take now the counters project_add_rms_norm calls of up to ``n_tokens`` rows use, so that a call
    captured into a graph later finds them."""
    kernels.zeroed(_ADD_NORM_COUNTERS, n_tokens * 4)


def project_add_rms_norm(
    kernels: MoeKernels,
    stream: Stream,
    w: ViewLike,
    w_type: RowType,
    n_in: int,
    x: ViewLike,
    n_tokens: int,
    y: ViewLike,
    hidden: ViewLike,
    weight: ViewLike | None,
    out: ViewLike,
    n: int,
    eps: float,
) -> None:
    """y = W x (W [n, n_in] of ``w_type``, a few rows: ``MoeKernels.uses_gemv``), then ``add_rms_norm``
    (hidden += y; out = rms_norm(hidden) * weight) in one launch, the bytes of the two: decode's
    attention output, residual add and FFN norm. The last block of each token's rows to finish does the
    token's add and norm, counting in the instance's own counters (``MoeKernels.zeroed``), so calls run
    in one stream's order."""
    call = "project_add_rms_norm"
    fmt = layout.weight_format(w_type)
    positive(call, n_in=n_in, n_tokens=n_tokens, n=n)
    _check_eps(call, eps)
    if not kernels.uses_gemv(n_tokens):
        raise InvalidArgument(
            f"{n_tokens} rows take the tile kernels, not the matrix-vector ones",
            call=call,
            hint="check uses_gemv() first, or run mul_mat_id and add_rms_norm",
        )
    views = {name: view(call, name, v, n_tokens * n * 4) for name, v in (("y", y), ("hidden", hidden), ("out", out))}
    for a, b in (("hidden", "y"), ("out", "hidden"), ("out", "y")):
        _apart(call, a, views[a], b, views[b])
    args = (
        weight_view(call, "w", w, fmt, 1, n, n_in, fmt.unit_bytes),
        view(call, "x", x, n_tokens * n_in * 4, 4),
        views["y"],
        views["hidden"],
        _norm_weight(call, weight, n),
        views["out"],
        kernels.zeroed(_ADD_NORM_COUNTERS, n_tokens * 4),
        np.int32(n),
        np.int32(n_in),
        np.float32(eps),
    )
    _launch_gemv_rows(kernels, stream, fmt.gemv_add_norm_kernel_name, n, n_tokens, args)


def _norm_weight(call: str, weight: ViewLike | None, n: int) -> BufferView | np.uint64:
    """A norm's weight argument: its [n] floats, or a null pointer for none."""
    return np.uint64(0) if weight is None else view(call, "weight", weight, n * 4)


def _launch_gemv_rows(
    kernels: MoeKernels, stream: Stream, name: str, n: int, grid_y: int, args: tuple[KernelArg, ...]
) -> None:
    """A matrix-vector launch with a block per MOE_GEMV_ROWS of the n output rows, grid_y rows of blocks."""
    stream.launch(kernels.kernel(name), (-(-n // layout.GEMV_ROWS), grid_y), layout.GEMV_THREADS, args)


def combine_rms_norm(
    kernels: MoeKernels,
    stream: Stream,
    y: ViewLike,
    weights: ViewLike | None,
    extra: ViewLike | None,
    hidden: ViewLike,
    weight: ViewLike | None,
    out: ViewLike,
    n_tokens: int,
    top_k: int,
    n: int,
    eps: float,
) -> None:
    """``MoeKernels.combine`` (hidden += the layer's weighted expert rows, + extra), then out =
    rms_norm(hidden) * weight, in one launch, the same bytes as the two: the end of an MoE layer and
    the norm of whatever reads its rows next. ``out`` apart from ``hidden``, ``y`` and ``extra``."""
    call = "combine_rms_norm"
    _check_eps(call, eps)
    combine = kernels.combine_args(call, y, weights, extra, ("hidden", hidden), n_tokens, top_k, n)
    out_view = view(call, "out", out, n_tokens * n * 4)
    for name, other in (("hidden", combine[3]), ("y", combine[0]), ("extra", combine[2])):
        if isinstance(other, BufferView):
            _apart(call, "out", out_view, name, other)
    args = (*combine[:4], _norm_weight(call, weight, n), out_view, *combine[4:], np.float32(eps))
    stream.launch(kernels.kernel("dense_combine_rms_norm"), n_tokens, norm_block(n), args)


_COMBINE_NORM_COUNTERS = "combine_norm_counters"  # the MoeKernels owner of down_combine_rms_norm's counters


def reserve_down_combine_rms_norm(kernels: MoeKernels, n_tokens: int) -> None:
    """Take now the counters down_combine_rms_norm calls of up to ``n_tokens`` tokens use, so that a
    call captured into a graph later finds them."""
    kernels.zeroed(_COMBINE_NORM_COUNTERS, n_tokens * 4)


def down_combine_rms_norm(
    kernels: MoeKernels,
    stream: Stream,
    w: ViewLike,
    w_type: RowType,
    n_expert: int,
    n_in: int,
    act: ViewLike,
    ids: ViewLike,
    n_tokens: int,
    top_k: int,
    y: ViewLike,
    route_weights: ViewLike | None,
    weights: ViewLike | None,
    extra: ViewLike | None,
    hidden: ViewLike,
    weight: ViewLike | None,
    out: ViewLike,
    n: int,
    eps: float,
) -> None:
    """An MoE layer's down projection of one pair's activations each (``MoeKernels.mul_mat_id`` with
    x_per_pair, rows scaled by ``route_weights`` where given, a few pairs: ``MoeKernels.uses_gemv``),
    then ``combine_rms_norm`` of its rows (``weights``, ``extra``) into ``hidden`` and ``out`` in one
    launch, the bytes of the two: the end of a decode token's MoE layer with the norm of what reads its
    rows next. The last block of each token's rows to finish does the token's combine and norm, counting
    in the instance's own counters (``MoeKernels.zeroed``), so calls run in one stream's order."""
    call = "down_combine_rms_norm"
    fmt = layout.weight_format(w_type)
    positive(call, n_expert=n_expert, n_in=n_in, n_tokens=n_tokens, top_k=top_k, n=n)
    _check_eps(call, eps)
    n_pairs = n_tokens * top_k
    if not kernels.uses_gemv(n_pairs):
        raise InvalidArgument(
            f"{n_pairs} pairs take the tile kernels, not the matrix-vector ones",
            call=call,
            hint="check uses_gemv() first, or run mul_mat_id and combine_rms_norm",
        )
    combine = kernels.combine_args(call, y, weights, extra, ("hidden", hidden), n_tokens, top_k, n)
    out_view = view(call, "out", out, n_tokens * n * 4, 4)
    for name, other in (("hidden", combine[3]), ("y", combine[0]), ("extra", combine[2])):
        if isinstance(other, BufferView):
            _apart(call, "out", out_view, name, other)
    for name, other in (("hidden", combine[3]), ("extra", combine[2])):
        if isinstance(other, BufferView):
            _apart(call, "y", combine[0], name, other)
    args = (
        weight_view(call, "w", w, fmt, n_expert, n, n_in, fmt.unit_bytes),
        view(call, "act", act, n_pairs * n_in * 4, 4),
        view(call, "ids", ids, n_pairs * 4, 4),
        combine[0],
        np.uint64(0) if route_weights is None else view(call, "route_weights", route_weights, n_pairs * 4, 4),
        *combine[1:4],
        _norm_weight(call, weight, n),
        out_view,
        kernels.zeroed(_COMBINE_NORM_COUNTERS, n_tokens * 4),
        np.int32(n_expert),
        np.int32(n),
        np.int32(n_in),
        np.int32(top_k),
        np.float32(eps),
    )
    _launch_gemv_rows(kernels, stream, fmt.gemv_combine_norm_kernel_name, n, n_pairs, args)


def add_rows(kernels: MoeKernels, stream: Stream, y: ViewLike, bias: ViewLike, n_rows: int, n: int) -> None:
    """y[r, :] += bias[:] for y [n_rows, n] and bias [n]: projection biases."""
    call = "add_rows"
    positive(call, n_rows=n_rows, n=n)
    args = (view(call, "y", y, n_rows * n * 4), view(call, "bias", bias, n * 4), np.int32(n_rows), np.int32(n))
    grid = (-(-n // DENSE_THREADS), min(n_rows, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel("dense_add_rows"), grid, DENSE_THREADS, args)


def rope(
    kernels: MoeKernels,
    stream: Stream,
    x: ViewLike,
    positions: ViewLike,
    n_tokens: int,
    n_heads: int,
    head_dim: int,
    rope: Rope,
) -> None:
    """Rotate x [n_tokens, n_heads, head_dim] in place by the positions int32 [n_tokens].

    ggml's rope_ext: pair i of the first n_rot dimensions of each head turns by
    pos * freq_base^(-2i / n_rot) times freq_scale, or under YaRN (ext_factor != 0) by a mix of
    that and the unscaled angle, ramped between the correction dims of beta_fast and beta_slow
    for n_ctx_orig; cos and sin are scaled by ``rope_mscale``.
    """
    call = "rope"
    positive(call, n_tokens=n_tokens, n_heads=n_heads, head_dim=head_dim)
    _check_rope(call, rope, head_dim)
    fits_int32(call, x=n_tokens * n_heads * head_dim)
    args = (
        view(call, "x", x, n_tokens * n_heads * head_dim * 4),
        view(call, "positions", positions, n_tokens * 4),
        np.int32(n_tokens),
        np.int32(n_heads),
        np.int32(head_dim),
        *_rope_args(rope),
    )
    grid = (-(-n_heads * (rope.n_rot // 2) // DENSE_THREADS), min(n_tokens, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel("dense_rope"), grid, DENSE_THREADS, args)


def store_rows_f16(
    kernels: MoeKernels,
    stream: Stream,
    src: ViewLike,
    cache: ViewLike,
    positions: ViewLike,
    n_tokens: int,
    width: int,
) -> None:
    """cache[positions[i], :] = src[i, :] rounded to float16 (nearest even): the KV cache write.

    src float32 [n_tokens, width]; cache float16 [rows, width], its rows as many as the view
    (or the buffer's nbytes) holds; positions int32 [n_tokens] on the device, so a captured graph
    can replay the write. A position outside the cache's rows writes nothing; two tokens at
    one position leave either one's row.
    """
    call = "store_rows_f16"
    positive(call, n_tokens=n_tokens, width=width)
    fits_int32(call, src=n_tokens * width)
    whole = cache.view(0, cache.nbytes) if isinstance(cache, DeviceBuffer) else cache
    row_bytes = 2 * width
    n_cache_rows = min(whole.nbytes // row_bytes, layout.MAX_INT32) if isinstance(whole, BufferView) else 0
    if n_cache_rows < 1:
        raise InvalidArgument(
            f"cache must be a DeviceBuffer or BufferView of at least one row of {width} float16 values",
            call=call,
        )
    args = (
        view(call, "src", src, n_tokens * width * 4),
        view(call, "cache", whole, n_cache_rows * row_bytes, 2),
        view(call, "positions", positions, n_tokens * 4),
        np.int32(n_tokens),
        np.int32(width),
        np.int32(n_cache_rows),
    )
    grid = (-(-width // DENSE_THREADS), min(n_tokens, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel("dense_store_rows_f16"), grid, DENSE_THREADS, args)


def norm_threads(n: int) -> int:
    """The lanes of rms_norm's sum for rows of ``n`` elements (its order depends on them, dense.cu's
    norm_lanes), and the block of the norms that run one head a block (qkv_rope_store)."""
    return min(NORM_MAX_THREADS, max(32, 1 << (n - 1).bit_length()))


def norm_block(n: int) -> int:
    """The threads of a norm kernel's block for rows of ``n`` elements: about two elements a thread, so
    one block has a whole row's loads in flight at once; at least the sum's lanes, at most
    NORM_BLOCK_THREADS. The bytes do not depend on it."""
    return min(NORM_BLOCK_THREADS, max(norm_threads(n), (1 << (n - 1).bit_length()) // 2))


@dataclass(frozen=True)
class AttentionInputs:
    """A token batch's projected rows and where attention reads them: q, k, v float32
    [n_tokens, heads, head_dim], the per-head norm weights (None: no norm), the float16 caches
    [rows, n_head_kv, head_dim] and the positions int32 [n_tokens]."""

    q: ViewLike
    k: ViewLike
    v: ViewLike
    q_norm: ViewLike | None
    k_norm: ViewLike | None
    k_cache: BufferView
    v_cache: BufferView
    positions: ViewLike


def qkv_rope_store(
    kernels: MoeKernels,
    stream: Stream,
    rows: AttentionInputs,
    n_tokens: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    rope: Rope,
    eps: float,
) -> None:
    """In one launch, the bytes of: rms_norm of each q and k head row by its weight (where given),
    rope of q and k, then store_rows_f16 of k and v into the caches at the positions (q in place).

    The same operations in the same order as those calls, so a run gives the same bytes either
    way (k's float rows are not written back: only its cache row is). head_dim up to NORM_MAX_THREADS.
    """
    call = "qkv_rope_store"
    positive(call, n_tokens=n_tokens, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
    _check_rope(call, rope, head_dim)
    if head_dim > NORM_MAX_THREADS:
        raise InvalidArgument(f"head_dim {head_dim} is over the {NORM_MAX_THREADS} one block handles", call=call)
    _check_eps(call, eps)
    fits_int32(call, q=n_tokens * n_head * head_dim)
    kv_width = n_head_kv * head_dim
    n_cache_rows = min(rows.k_cache.nbytes, rows.v_cache.nbytes) // (2 * kv_width)
    if n_cache_rows < 1:
        raise InvalidArgument(f"the caches must hold at least one row of {kv_width} float16 values", call=call)
    n_cache_rows = min(n_cache_rows, layout.MAX_INT32)

    def weight(name: str, w: ViewLike | None) -> BufferView | np.uint64:
        return np.uint64(0) if w is None else view(call, name, w, head_dim * 4)

    args = (
        view(call, "q", rows.q, n_tokens * n_head * head_dim * 4),
        view(call, "k", rows.k, n_tokens * kv_width * 4),
        view(call, "v", rows.v, n_tokens * kv_width * 4),
        weight("q_norm", rows.q_norm),
        weight("k_norm", rows.k_norm),
        view(call, "k_cache", rows.k_cache, n_cache_rows * kv_width * 2, 2),
        view(call, "v_cache", rows.v_cache, n_cache_rows * kv_width * 2, 2),
        view(call, "positions", rows.positions, n_tokens * 4),
        np.int32(n_tokens),
        np.int32(n_head),
        np.int32(n_head_kv),
        np.int32(head_dim),
        np.int32(n_cache_rows),
        np.float32(eps),
        *_rope_args(rope),
    )
    grid = (n_head + 2 * n_head_kv, min(n_tokens, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel("dense_qkv_rope_store"), grid, norm_threads(head_dim), args)


def copy_columns(
    kernels: MoeKernels,
    stream: Stream,
    src: ViewLike,
    src_width: int,
    first: int,
    width: int,
    dst: ViewLike,
    n_rows: int,
) -> None:
    """dst[r, :] = src[r, first:first + width] for src float32 [n_rows, src_width], dst [n_rows, width]."""
    call = "copy_columns"
    positive(call, n_rows=n_rows, src_width=src_width, width=width)
    if first < 0 or first + width > src_width:
        raise InvalidArgument(f"columns {first}..{first + width} are outside rows of {src_width}", call=call)
    fits_int32(call, src=n_rows * src_width)
    src_view = view(call, "src", src, n_rows * src_width * 4)
    dst_view = view(call, "dst", dst, n_rows * width * 4)
    _apart(call, "dst", dst_view, "src", src_view)
    args = (src_view, dst_view, np.int32(n_rows), np.int32(src_width), np.int32(first), np.int32(width))
    grid = (-(-width // DENSE_THREADS), min(n_rows, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel("dense_copy_columns"), grid, DENSE_THREADS, args)


@dataclass(frozen=True)
class LatentInputs:
    """deepseek2's projected rows of a token batch, float32: q [n_tokens, n_head, nope + n_rot] (attn_q's),
    q_abs [n_tokens, n_head, rank] (each head's unrotated query through attn_k_b), kv [n_tokens,
    rank + n_rot] (attn_kv_a_mqa's: the latent, then the key's part to rotate); kv_norm [rank] (None:
    no weight); the positions int32 [n_tokens]."""

    q: ViewLike
    q_abs: ViewLike
    kv: ViewLike
    kv_norm: ViewLike | None
    positions: ViewLike


def mla_rope_store(
    kernels: MoeKernels,
    stream: Stream,
    rows: LatentInputs,
    q_out: ViewLike,
    cache: ViewLike,
    n_tokens: int,
    n_head: int,
    rank: int,
    nope: int,
    rope: Rope,
    eps: float,
) -> None:
    """q_out [n_tokens, n_head, rank + n_rot] = each head's q_abs row, then its q's last n_rot rotated;
    cache[positions[t]] = rms_norm(kv[t, :rank]) * kv_norm, then kv[t, rank:] rotated, as float16 rows of
    rank + n_rot: what attention over one shared key-value head reads (hparams.Mla). The operations of
    ``rms_norm``, ``rope`` and ``store_rows_f16``, in one launch."""
    call = "mla_rope_store"
    positive(call, n_tokens=n_tokens, n_head=n_head, rank=rank)
    if nope < 0:
        raise InvalidArgument(f"nope must be >= 0, got {nope}", call=call)
    _check_rope(call, rope, rope.n_rot)
    _check_eps(call, eps)
    width = rank + rope.n_rot
    fits_int32(call, q_out=n_tokens * n_head * width)
    whole = cache.view(0, cache.nbytes) if isinstance(cache, DeviceBuffer) else cache
    n_cache_rows = min(whole.nbytes // (2 * width), layout.MAX_INT32) if isinstance(whole, BufferView) else 0
    if n_cache_rows < 1:
        raise InvalidArgument(f"the cache must hold at least one row of {width} float16 values", call=call)
    q_out_view = view(call, "q_out", q_out, n_tokens * n_head * width * 4)
    reads = {
        "q": view(call, "q", rows.q, n_tokens * n_head * (nope + rope.n_rot) * 4),
        "q_abs": view(call, "q_abs", rows.q_abs, n_tokens * n_head * rank * 4),
        "kv": view(call, "kv", rows.kv, n_tokens * width * 4),
    }
    for name, other in reads.items():
        _apart(call, "q_out", q_out_view, name, other)
    args = (
        *reads.values(),
        _norm_weight(call, rows.kv_norm, rank),
        q_out_view,
        view(call, "cache", whole, n_cache_rows * width * 2, 2),
        view(call, "positions", rows.positions, n_tokens * 4),
        np.int32(n_tokens),
        np.int32(n_head),
        np.int32(rank),
        np.int32(nope),
        np.int32(n_cache_rows),
        np.float32(eps),
        *_rope_args(rope),
    )
    grid = (n_head + 1, min(n_tokens, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel("dense_mla_rope_store"), grid, norm_threads(width), args)


def _rope_args(rope: Rope) -> tuple[np.int32 | np.float32, ...]:
    """The rotation's kernel arguments, in dense.cu's order: n_rot, neox, freq_base, freq_scale,
    ext_factor, the YaRN correction dims (zeros without YaRN), mscale."""
    low, high = yarn_corr_dims(rope) if rope.ext_factor != 0.0 else (0.0, 0.0)
    return (
        np.int32(rope.n_rot),
        np.int32(1 if rope.neox else 0),
        np.float32(rope.freq_base),
        np.float32(rope.freq_scale),
        np.float32(rope.ext_factor),
        np.float32(low),
        np.float32(high),
        np.float32(rope_mscale(rope)),
    )


def _table_format(call: str, table_type: RowType) -> WeightFormat:
    try:
        fmt = layout.FORMATS.get(GGMLQuantizationType(int(table_type)))
    except ValueError:
        fmt = None
    if fmt is None:
        supported = ", ".join(f.qtype.name for f in layout.FORMATS.values())
        raise InvalidArgument(f"no decoder for table type {table_type!r}", call=call, hint=f"supported: {supported}")
    return fmt


def _check_rope(call: str, rope: Rope, head_dim: int) -> None:
    if not (isinstance(rope.n_rot, (int, np.integer)) and 2 <= rope.n_rot <= head_dim and rope.n_rot % 2 == 0):
        raise InvalidArgument(f"n_rot must be even and in [2, head_dim {head_dim}], got {rope.n_rot!r}", call=call)
    factors = {
        "freq_base": rope.freq_base,
        "freq_scale": rope.freq_scale,
        "ext_factor": rope.ext_factor,
        "attn_factor": rope.attn_factor,
    }
    for name, value in factors.items():
        if not math.isfinite(value):
            raise InvalidArgument(f"{name} must be finite, got {value!r}", call=call)
    if rope.freq_base <= 0.0 or rope.freq_scale <= 0.0:
        raise InvalidArgument(
            f"freq_base and freq_scale must be positive, got {rope.freq_base!r} and {rope.freq_scale!r}", call=call
        )
    if rope.ext_factor != 0.0 and not (
        rope.n_ctx_orig > 0 and rope.freq_base != 1.0 and rope.beta_fast > 0.0 and rope.beta_slow > 0.0
    ):
        raise InvalidArgument(
            "YaRN (ext_factor != 0) needs n_ctx_orig > 0, freq_base != 1 and positive beta_fast and beta_slow, "
            f"got {rope.n_ctx_orig!r}, {rope.freq_base!r}, {rope.beta_fast!r}, {rope.beta_slow!r}",
            call=call,
            hint="n_ctx_orig is the training context (llama.cpp's yarn original context, else n_ctx_train)",
        )


def _same_or_apart(call: str, x: BufferView, out: BufferView) -> None:
    """An in-place call passes one view twice; any other overlap would read values already written."""
    if _overlaps(x, out) and x.offset != out.offset:
        raise InvalidArgument(
            f"out (bytes {out.offset}..{out.end}) partly overlaps x (bytes {x.offset}..{x.end})",
            call=call,
            hint="pass the same view for an in-place norm, or views that do not overlap",
        )


def _check_eps(call: str, eps: float) -> None:
    if not (math.isfinite(eps) and eps >= 0.0):
        raise InvalidArgument(f"eps must be a finite number >= 0, got {eps!r}", call=call)


def _overlaps(a: BufferView, b: BufferView) -> bool:
    return a.buffer is b.buffer and a.offset < b.end and b.offset < a.end


def _apart(call: str, name: str, a: BufferView, other_name: str, b: BufferView) -> None:
    """Views a kernel reads and writes at once, each element by another thread, must not overlap."""
    if _overlaps(a, b):
        raise InvalidArgument(
            f"{name} (bytes {a.offset}..{a.end}) overlaps {other_name} (bytes {b.offset}..{b.end})",
            call=call,
            hint=f"give {name} rows of its own",
        )


__all__ = [
    "AttentionInputs",
    "LatentInputs",
    "Rope",
    "add_rms_norm",
    "add_rows",
    "copy_columns",
    "get_rows",
    "mla_rope_store",
    "qkv_rope_store",
    "rms_norm",
    "rope",
    "rope_mscale",
    "store_rows_f16",
    "yarn_corr_dims",
]
