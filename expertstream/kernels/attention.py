"""Causal attention over an f16 KV cache: the launcher of attention.cu.

``attention`` takes one of two routes, by the number of query tokens:

- prefill (more than ``DECODE_MAX_TOKENS`` tokens): one block per tile of queries and head walks
  the keys its queries see in tiles staged in shared memory, with an online softmax. On devices
  with ``Capabilities.matrix_cores`` Q.K^T and P.V run on f16 matrix instructions with float32
  accumulation (``uses_matrix_cores``): mma.sync on NVIDIA sm_80+, MFMA on AMD CDNA2/CDNA3
  (gfx90a, gfx94x), WMMA on RDNA3/RDNA4 (gfx11, gfx12). Elsewhere (RDNA2 and older, NVIDIA before
  sm_80), or where the MoeKernels instance was made for ``MatrixPath.SIMT``, they run in float32
  FMAs. Wide heads (``WIDE_DIMS``) take mma.sync kernels of their own, for prefill and for the
  split-K decode below, where the device also has ``Capabilities.mma_fragments`` and room for their
  shared memory (``uses_wide_mma``; deepseek2's 576-wide latent only where the values are the keys'
  own rows, as its cache holds them), else float32 ones.
- decode (a few tokens): split-K over chunks of ``DECODE_CHUNK`` keys, so one token's attention
  over a long cache spreads over the whole GPU: each block writes its rows' running max, sum and
  unnormalized output into scratch, and the last block of each KV head's rows to finish (a counter
  per group, wrapped back to 0) merges its rows' chunks in ascending order, in the same launch,
  where the cache has at most ``FUSED_MAX_CHUNKS`` chunks; over a longer cache (or with
  ``fused=False``) a second launch of a combine kernel, one block per row, does, the same bytes:
  there one block merging 8 rows of hundreds of chunks each in turn would take longer than the
  launch it saves. Chunks past a token's position write nothing. The scratch and counters are the
  MoeKernels instance's own (``reserve_decode`` takes them ahead of a capture), so attention calls
  on concurrent streams need their own instances.

Results never depend on timing, nor on ``kv_len`` beyond the rows a query sees: a captured decode
step replayed with kv_len = the cache size gives the bytes an eager call with just enough rows
gives. Cache rows that no query of the launch sees are never read into the result and may hold
anything (NaN included), but the simulator declares reads of all ``kv_len`` rows.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..backends.base import BufferView, Stream
from ..errors import InvalidArgument
from . import layout
from .args import ViewLike, positive, view
from .layout import MatrixPath

if TYPE_CHECKING:
    from .launcher import MoeKernels

log = logging.getLogger(__name__)

# Must match attention.cu.
THREADS = 128
PREFILL_ROWS = 32  # queries per block of the SIMT prefill
MMA_ROWS = 64  # queries per block of the matrix-core prefill
TALL_MMA_ROWS = 128  # queries per block of NVIDIA's 8-warp matrix-core prefill (attn_prefill_mma128_d*)
TALL_HEAD_DIMS = (128,)  # head dims NVIDIA's matrix-core prefill runs in blocks of TALL_MMA_ROWS by default
MMA_ROWS_VAR = "EXPERTSTREAM_ATTN_MMA_ROWS"  # MMA_ROWS or TALL_MMA_ROWS: overrides that choice
DECODE_ROWS = 8  # (token, head) rows per decode block
DECODE_CHUNK = 32  # keys per decode block (one token over a 512-row cache: 16 chunks a KV head)
COMBINE_STRANDS = 4  # threads per (row, d) of the decode combine, each adding every 4th chunk (attention.cu)
COMBINE_MAX_THREADS = 1024  # a block's limit: wider heads' (strand, d) pairs take turns (the bytes do not change)
DECODE_MAX_TOKENS = 8  # up to this many tokens take the split-K decode
FUSED_MAX_CHUNKS = 64  # decode combines in its own launch up to this many chunks (2048 cache rows)
HEAD_DIMS = (64, 128)  # head dims with a kernel instance
WIDE_DIMS = (256, 576)  # head dims of the wide kernel alone: qwen3next's; deepseek2's latent key (512 + 64)
WIDE_ROWS = DECODE_ROWS  # (token, head) rows per block of the wide kernels (attention.cu's ATTN_WIDE_ROWS)
WIDE_MMA_ROWS = 64  # (token, head) rows per block of the wide matrix-core prefill
WIDE_MMA_THREADS = 256
_KEYS = 32  # keys per staged tile (attention.cu's ATTN_KEYS)
SHARED_KV_DIMS = (576,)  # wide heads whose matrix-core kernel reads the values from the keys' rows
# Kernels the source defines for NVIDIA sm_80+ alone (mma.sync fragments and more than AMD's 64 KB of
# LDS a block): uses_wide_mma never picks them elsewhere.
NVIDIA_ONLY_KERNELS = tuple(f"attn_wide_mma{kind}_d{d}" for kind in ("", "_decode") for d in WIDE_DIMS) + tuple(
    f"attn_prefill_mma{TALL_MMA_ROWS}_d{d}" for d in HEAD_DIMS
)
CACHE_ALIGN = 16  # bytes: the kernels read cache rows 16 bytes at a time
ROW_ALIGN = 8  # bytes: query and output rows are read and written two floats at a time
_SCRATCH_ALIGN = 16
_MAX_GRID = layout.MAX_GRID_Y


def uses_matrix_cores(kernels: MoeKernels) -> bool:
    """Whether prefill takes the f16 matrix-core kernel on this instance's device.

    Every device with ``Capabilities.matrix_cores`` has the f16 instruction of the same shape as
    the bf16 one mma.cu uses, so the capability that picks mul_mat_id's matrix-core path picks
    attention's too.
    """
    return kernels.device.capabilities.matrix_cores and kernels.path is not MatrixPath.SIMT


def mma_rows(kernels: MoeKernels, head_dim: int) -> int:
    """Queries a block of the matrix-core prefill of heads ``head_dim`` wide takes on this instance's
    device. Where it runs mma.sync fragments: TALL_MMA_ROWS for TALL_HEAD_DIMS (eight warps against
    each staged tile, half the cache reads), MMA_ROWS otherwise (where three blocks of four warps an SM
    ran faster), or what $EXPERTSTREAM_ATTN_MMA_ROWS says. Elsewhere MMA_ROWS. The bytes are the same."""
    value = os.environ.get(MMA_ROWS_VAR, "").strip()
    if value not in ("", str(MMA_ROWS), str(TALL_MMA_ROWS)):
        raise InvalidArgument(
            f"{MMA_ROWS_VAR}={value!r} is not a prefill block height",
            call="attention",
            hint=f"set it to {MMA_ROWS} or {TALL_MMA_ROWS}, or unset it",
        )
    if not kernels.device.capabilities.mma_fragments:
        if value == str(TALL_MMA_ROWS) and kernels.device.name not in _told_no_tall:
            _told_no_tall.add(kernels.device.name)
            log.warning(
                "%s=%s: %s has no mma.sync fragments (NVIDIA sm_80+); its prefill attention runs %d-query blocks",
                MMA_ROWS_VAR,
                value,
                kernels.device.name,
                MMA_ROWS,
            )
        return MMA_ROWS
    if value:
        return int(value)
    return TALL_MMA_ROWS if head_dim in TALL_HEAD_DIMS else MMA_ROWS


_told_no_tall: set[str] = set()  # devices whose log said the override cannot apply


def wide_mma_shared_bytes(head_dim: int) -> int:
    """The shared memory a block of attn_wide_mma_d{head_dim} lays out (attention.cu's AttnWideMma::BYTES):
    the block's queries and double-buffered key tiles (and value tiles, where they are not the keys'
    rows) in f16, the score tile, the P tile and five numbers a row."""
    ld = head_dim + 8
    tiles = 2 if head_dim in SHARED_KV_DIMS else 4
    staged = 2 * (WIDE_MMA_ROWS * ld + tiles * _KEYS * ld)
    return staged + 4 * WIDE_MMA_ROWS * (_KEYS + 4) + 2 * WIDE_MMA_ROWS * (_KEYS + 8) + 5 * 4 * WIDE_MMA_ROWS


def uses_wide_mma(kernels: MoeKernels, head_dim: int, shared_kv: bool) -> bool:
    """Whether this wide head dim takes the mma.sync kernels (prefill and split-K decode) on this
    instance's device, with the values in the keys' own rows where ``shared_kv``."""
    caps = kernels.device.capabilities
    return (
        head_dim in WIDE_DIMS
        and uses_matrix_cores(kernels)
        and caps.mma_fragments
        and caps.max_shared_bytes >= wide_mma_shared_bytes(head_dim)
        and (shared_kv or head_dim not in SHARED_KV_DIMS)
    )


class _WideBlock(NamedTuple):
    """How the wide heads' kernels of a call run: on the matrix cores or in float32 FMAs."""

    kind: str  # kernel names: attn_{kind}_d{head_dim}, attn_{kind}_decode_d{head_dim}
    rows: int  # (token, head) rows a block
    threads: int
    shared_mem: int  # dynamic shared memory a block


def _wide_block(kernels: MoeKernels, head_dim: int, shared_kv: bool) -> _WideBlock:
    if uses_wide_mma(kernels, head_dim, shared_kv):
        return _WideBlock("wide_mma", WIDE_MMA_ROWS, WIDE_MMA_THREADS, wide_mma_shared_bytes(head_dim))
    return _WideBlock("wide", WIDE_ROWS, THREADS, 0)


def prefill_kernel(kernels: MoeKernels, head_dim: int, shared_kv: bool) -> str:
    """The kernel a prefill of heads ``head_dim`` wide launches on this instance's device (the values in
    the keys' own rows where ``shared_kv``)."""
    if head_dim in WIDE_DIMS:
        return f"attn_{_wide_block(kernels, head_dim, shared_kv).kind}_d{head_dim}"
    return _prefill_block(kernels, head_dim)[0]


def _prefill_block(kernels: MoeKernels, head_dim: int) -> tuple[str, int, int]:
    """The prefill kernel of heads ``head_dim`` wide (not WIDE_DIMS) on this instance's device, the queries
    a block of it takes and its threads (a warp for each 16 queries on the matrix cores)."""
    if not uses_matrix_cores(kernels):
        return f"attn_prefill_simt_d{head_dim}", PREFILL_ROWS, THREADS
    rows = mma_rows(kernels, head_dim)
    return f"attn_prefill_mma{rows if rows != MMA_ROWS else ''}_d{head_dim}", rows, 2 * rows


def decode_chunks(kv_len: int) -> int:
    """How many key chunks a decode launch over ``kv_len`` cache rows splits into."""
    return -(-kv_len // DECODE_CHUNK)


def decode_scratch_bytes(n_tokens: int, n_head: int, head_dim: int, kv_len: int) -> int:
    """Bytes of scratch a decode call of these shapes takes: per (token, head, chunk) a max, a sum
    and head_dim floats of unnormalized output."""
    ml_bytes = _ml_bytes(n_tokens * n_head * decode_chunks(kv_len))
    return ml_bytes + n_tokens * n_head * decode_chunks(kv_len) * head_dim * 4


def decode_counters(n_tokens: int, n_head: int, n_head_kv: int) -> int:
    """How many int32 counters a fused decode call takes: one per (KV head, block of rows)."""
    return n_head_kv * -(-n_tokens * (n_head // n_head_kv) // DECODE_ROWS)


_SCRATCH = "attention"  # the MoeKernels owners of decode's partial sums and of its counters
_COUNTERS = "attention_counters"


def reserve_decode(kernels: MoeKernels, n_tokens: int, n_head: int, n_head_kv: int, head_dim: int, kv_len: int) -> None:
    """Take now the scratch and counters decode calls of up to these shapes use, so that a call
    captured into a graph later (a capture may not allocate) finds them."""
    kernels.scratch(_SCRATCH, decode_scratch_bytes(n_tokens, n_head, head_dim, kv_len))
    kernels.zeroed(_COUNTERS, decode_counters(n_tokens, n_head, n_head_kv) * 4)


def _ml_bytes(partials: int) -> int:
    return -(-partials * 8 // _SCRATCH_ALIGN) * _SCRATCH_ALIGN


def attention(
    kernels: MoeKernels,
    stream: Stream,
    q: ViewLike,
    k_cache: ViewLike,
    v_cache: ViewLike,
    out: ViewLike,
    positions: ViewLike,
    *,
    n_tokens: int,
    kv_len: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    scale: float,
    window: int = 0,
    sinks: ViewLike | None = None,
    fused: bool = True,
) -> None:
    """out[i, h, :] = softmax_j(scale * q[i, h, :] . k[j, g, :]) @ v[j, g, :], g = h // (n_head // n_head_kv).

    q float32 [n_tokens, n_head, head_dim]; k_cache, v_cache float16 [rows, n_head_kv, head_dim]
    (rows >= kv_len, starting at a multiple of 16 bytes); out float32 [n_tokens, n_head, head_dim];
    positions int32 [n_tokens] on the device: query i sits at position positions[i] and sees cache
    rows j <= positions[i] (causal), and only those with positions[i] - j < window where window > 0
    (gpt-oss's sliding-window layers). kv_len is how many cache rows the launch may read (an upper
    bound: a captured decode step replays with kv_len = the cache size and reads only rows <= its
    position). sinks (float32 [n_head], gpt-oss) is one extra logit per head in the softmax's
    denominator that contributes no value. A query that sees no row gets zeros. Head dims: HEAD_DIMS,
    and WIDE_DIMS on kernels of their own (the matrix cores' where ``uses_wide_mma``): one for prefill, a
    split-K one for decode (its partials merged by the same combine, never fused).
    """
    call = "attention"
    positive(call, n_tokens=n_tokens, kv_len=kv_len, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
    _check_shapes(call, n_head, n_head_kv, head_dim, window, scale)
    views = (
        view(call, "q", q, n_tokens * n_head * head_dim * 4, ROW_ALIGN),
        view(call, "k_cache", k_cache, kv_len * n_head_kv * head_dim * 2, CACHE_ALIGN),
        view(call, "v_cache", v_cache, kv_len * n_head_kv * head_dim * 2, CACHE_ALIGN),
    )
    out_view = view(call, "out", out, n_tokens * n_head * head_dim * 4, ROW_ALIGN)
    pos_view = view(call, "positions", positions, n_tokens * 4)
    sinks_arg = np.uint64(0) if sinks is None else view(call, "sinks", sinks, n_head * 4)
    shape = (np.int32(n_tokens), np.int32(kv_len), np.int32(n_head), np.int32(n_head_kv), np.int32(window))
    group = n_head // n_head_kv
    wide = head_dim in WIDE_DIMS
    shared_kv = views[1].buffer is views[2].buffer and views[1].offset == views[2].offset
    block = _wide_block(kernels, head_dim, shared_kv) if wide else None
    if n_tokens > DECODE_MAX_TOKENS:
        prefill_args = (*views, out_view, pos_view, sinks_arg, *shape, np.float32(scale))
        if block is not None:
            kernel = kernels.kernel(f"attn_{block.kind}_d{head_dim}")
            blocks = (-(-n_tokens * group // block.rows), n_head_kv)
            stream.launch(kernel, blocks, block.threads, prefill_args, shared_mem=block.shared_mem)
            return
        name, rows, threads = _prefill_block(kernels, head_dim)
        stream.launch(kernels.kernel(name), (-(-n_tokens // rows), n_head), threads, prefill_args)
        return
    n_chunks = decode_chunks(kv_len)
    scratch = kernels.scratch(_SCRATCH, decode_scratch_bytes(n_tokens, n_head, head_dim, kv_len))
    ml_bytes = _ml_bytes(n_tokens * n_head * n_chunks)
    partial_ml = BufferView(scratch.buffer, scratch.offset, n_tokens * n_head * n_chunks * 8)
    partial_o = BufferView(scratch.buffer, scratch.offset + ml_bytes, scratch.nbytes - ml_bytes)
    grid = (n_chunks, n_head_kv, -(-n_tokens * group // (DECODE_ROWS if block is None else block.rows)))
    decode_args = (*views, partial_ml, partial_o, pos_view, *shape, np.float32(scale), np.int32(n_chunks))
    if block is not None:
        kernel = kernels.kernel(f"attn_{block.kind}_decode_d{head_dim}")
        stream.launch(kernel, grid, block.threads, decode_args, shared_mem=block.shared_mem)
    elif fused and n_chunks <= FUSED_MAX_CHUNKS:
        counters = kernels.zeroed(_COUNTERS, decode_counters(n_tokens, n_head, n_head_kv) * 4)
        fused_args = (*decode_args, sinks_arg, out_view, counters)
        stream.launch(kernels.kernel(f"attn_decode_fused_d{head_dim}"), grid, THREADS, fused_args)
        return
    else:
        stream.launch(kernels.kernel(f"attn_decode_d{head_dim}"), grid, THREADS, decode_args)
    stream.launch(
        kernels.kernel("attn_decode_combine"),
        (n_head, n_tokens),
        min(head_dim * COMBINE_STRANDS, COMBINE_MAX_THREADS),
        (
            partial_ml,
            partial_o,
            pos_view,
            sinks_arg,
            out_view,
            np.int32(n_tokens),
            np.int32(kv_len),
            np.int32(n_head),
            np.int32(window),
            np.int32(n_chunks),
            np.int32(head_dim),
        ),
    )


def _check_shapes(call: str, n_head: int, n_head_kv: int, head_dim: int, window: int, scale: float) -> None:
    if head_dim not in HEAD_DIMS + WIDE_DIMS:
        raise InvalidArgument(
            f"head_dim {head_dim} has no attention kernel",
            call=call,
            hint=f"supported head dims: {HEAD_DIMS + WIDE_DIMS}",
        )
    if n_head % n_head_kv:
        raise InvalidArgument(
            f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}",
            call=call,
            hint="each KV head serves the same number of query heads (GQA)",
        )
    if n_head > _MAX_GRID:
        raise InvalidArgument(f"{n_head} heads are more than one launch handles (at most {_MAX_GRID})", call=call)
    if not isinstance(window, (int, np.integer)) or not 0 <= window <= layout.MAX_INT32:
        raise InvalidArgument(f"window must be 0 (none) or a positive int32, got {window!r}", call=call)
    if not isinstance(scale, (float, int, np.floating)) or not math.isfinite(scale):
        raise InvalidArgument(f"scale must be a finite number, got {scale!r}", call=call)


__all__ = [
    "DECODE_CHUNK",
    "DECODE_MAX_TOKENS",
    "FUSED_MAX_CHUNKS",
    "HEAD_DIMS",
    "MMA_ROWS_VAR",
    "NVIDIA_ONLY_KERNELS",
    "WIDE_DIMS",
    "attention",
    "decode_chunks",
    "decode_counters",
    "decode_scratch_bytes",
    "mma_rows",
    "reserve_decode",
    "uses_matrix_cores",
    "uses_wide_mma",
    "wide_mma_shared_bytes",
]
