"""numpy twins of the attention kernels of attention.cu (see attention.py), in float32 like them.

Both prefill kernels (SIMT and matrix-core) share one twin; the decode pair keeps its split: the
decode twin writes every (token, head, chunk)'s max, sum and unnormalized output (chunks a row
does not see as -inf, 0, zeros) and the combine twin merges the chunks each row sees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..backends.base import BufferView
from ..backends.sim import Access, KernelSpec
from ..backends.sim.kernels import Dim3Tuple
from .attention import DECODE_CHUNK, HEAD_DIMS, WIDE_DIMS

Args = tuple[Any, ...]
Run = Callable[[Args, Dim3Tuple, Dim3Tuple], None]
_F32 = np.float32
_NEG_INF = _F32(-np.inf)


def visible_rows(positions: np.ndarray, kv_len: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the first and last cache row it sees (empty where first > last)."""
    pos = positions.astype(np.int64)
    last = np.minimum(pos, kv_len - 1)
    first = np.where((window > 0) & (pos >= window), pos - window + 1, 0)
    return first, last


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    kv_len: int,
    window: int,
    scale: float,
    sinks: np.ndarray | None,
) -> np.ndarray:
    """Causal attention in float32: q [n_tokens, n_head, D], k and v f16 [rows, n_head_kv, D]."""
    n_head = q.shape[1]
    group = n_head // k.shape[1]
    out = np.zeros_like(q)
    first, last = visible_rows(positions, kv_len, window)
    seen = first <= last
    if not seen.any():
        return out
    lo, hi = int(first[seen].min()), int(last[seen].max())  # rows outside are never read, as in the kernels
    rows = np.arange(lo, hi + 1)
    mask = (rows >= first[:, None]) & (rows <= last[:, None])
    keys = k[lo : hi + 1].astype(_F32)
    values = v[lo : hi + 1].astype(_F32)
    for h in range(n_head):
        scores = np.where(mask, (q[:, h] @ keys[:, h // group].T) * _F32(scale), _NEG_INF)
        top = scores.max(axis=1)
        if sinks is not None:
            top = np.maximum(top, sinks[h])
        shift = np.where(top == _NEG_INF, _F32(0), top)
        p = np.exp(scores - shift[:, None])
        total = p.sum(axis=1)
        if sinks is not None:
            total += np.exp(sinks[h] - shift)
        o = p @ values[:, h // group]
        out[:, h] = np.divide(o, total[:, None], out=np.zeros_like(o), where=total[:, None] > 0)
    return out


def _as_view(arg: Any) -> BufferView:
    return arg if isinstance(arg, BufferView) else arg.view()


def _accesses(reads: Sequence[int], writes: Sequence[int]) -> Callable[[Args], Sequence[Access]]:
    """Reads of the arguments at ``reads`` (null pointers skipped), then writes of those at ``writes``."""

    def accesses(args: Args) -> Sequence[Access]:
        found = [Access(_as_view(args[i]), write=False) for i in reads if not isinstance(args[i], np.generic)]
        return [*found, *(Access(_as_view(args[i]), write=True) for i in writes)]

    return accesses


def _sinks(arg: Any, n_head: int) -> np.ndarray | None:
    return arg.view(_F32)[:n_head] if isinstance(arg, np.ndarray) else None


def _prefill_runner(head_dim: int) -> Run:
    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        q_b, k_b, v_b, out_b, pos_b, sinks_b, n_tokens, kv_len, n_head, n_head_kv, window, scale = args
        n_tokens, kv_len, n_head, n_head_kv = int(n_tokens), int(kv_len), int(n_head), int(n_head_kv)
        q = q_b.view(_F32).reshape(n_tokens, n_head, head_dim)
        k = k_b.view(np.float16).reshape(kv_len, n_head_kv, head_dim)
        v = v_b.view(np.float16).reshape(kv_len, n_head_kv, head_dim)
        out = attend(q, k, v, pos_b.view(np.int32), kv_len, int(window), float(scale), _sinks(sinks_b, n_head))
        out_b.view(_F32)[:] = out.reshape(-1)

    return run


def _decode_runner(head_dim: int) -> Run:
    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        q_b, k_b, v_b, ml_b, o_b, pos_b, n_tokens, kv_len, n_head, n_head_kv, window, scale, n_chunks = args
        n_tokens, kv_len, n_head, n_head_kv = int(n_tokens), int(kv_len), int(n_head), int(n_head_kv)
        group = n_head // n_head_kv
        q = q_b.view(_F32).reshape(n_tokens, n_head_kv, group, head_dim)
        k = k_b.view(np.float16).reshape(kv_len, n_head_kv, head_dim)
        v = v_b.view(np.float16).reshape(kv_len, n_head_kv, head_dim)
        ml = ml_b.view(_F32).reshape(n_tokens, n_head_kv, group, int(n_chunks), 2)
        partial_o = o_b.view(_F32).reshape(n_tokens, n_head_kv, group, int(n_chunks), head_dim)
        ml[..., 0] = _NEG_INF
        ml[..., 1] = 0
        partial_o[:] = 0
        first, last = visible_rows(pos_b.view(np.int32), kv_len, int(window))
        for t in range(n_tokens):
            for c in range(int(first[t]) // DECODE_CHUNK, int(last[t]) // DECODE_CHUNK + 1):
                lo = max(int(first[t]), c * DECODE_CHUNK)
                hi = min(int(last[t]), c * DECODE_CHUNK + DECODE_CHUNK - 1)
                if lo > hi:
                    continue
                keys = k[lo : hi + 1].astype(_F32)
                scores = np.einsum("gqd,jgd->gqj", q[t], keys) * _F32(scale)
                top = scores.max(axis=2)
                p = np.exp(scores - top[..., None])
                ml[t, :, :, c, 0] = top
                ml[t, :, :, c, 1] = p.sum(axis=2)
                partial_o[t, :, :, c] = np.einsum("gqj,jgd->gqd", p, v[lo : hi + 1].astype(_F32))

    return run


def _combine_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    ml_b, o_b, pos_b, sinks_b, out_b, n_tokens, kv_len, n_head, window, n_chunks, head_dim = args
    n_tokens, n_head, n_chunks, head_dim = int(n_tokens), int(n_head), int(n_chunks), int(head_dim)
    ml = ml_b.view(_F32).reshape(n_tokens, n_head, n_chunks, 2)
    partial_o = o_b.view(_F32).reshape(n_tokens, n_head, n_chunks, head_dim)
    out = out_b.view(_F32).reshape(n_tokens, n_head, head_dim)
    sinks = _sinks(sinks_b, n_head)
    first, last = visible_rows(pos_b.view(np.int32), int(kv_len), int(window))
    for t in range(n_tokens):
        seen = first[t] <= last[t]  # a row that sees nothing reads no chunk and gets zeros
        chunks = slice(int(first[t]) // DECODE_CHUNK, int(last[t]) // DECODE_CHUNK + 1 if seen else 0)
        m = ml[t, :, chunks, 0]
        top = np.max(m, axis=1, initial=_NEG_INF)
        if sinks is not None:
            top = np.maximum(top, sinks)
        with np.errstate(invalid="ignore"):  # -inf - -inf where a chunk and the top are both empty
            weights = np.where(m == _NEG_INF, _F32(0), np.exp(m - top[:, None]))
        total = (ml[t, :, chunks, 1] * weights).sum(axis=1)
        if sinks is not None:
            total += np.exp(sinks - top)
        o = (partial_o[t, :, chunks] * weights[..., None]).sum(axis=1)
        out[t] = np.divide(o, total[:, None], out=np.zeros_like(o), where=total[:, None] > 0)


def _fused_decode_runner(head_dim: int) -> Run:
    """attn_decode_fused_d*: the decode launch's args, then sinks, out and the counters."""
    decode = _decode_runner(head_dim)

    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        decode(args[:13], grid, block)
        ml_b, o_b, pos_b, n_tokens, kv_len, n_head, window, n_chunks = (*args[3:6], *args[6:9], args[10], args[12])
        combine = (ml_b, o_b, pos_b, args[13], args[14], n_tokens, kv_len, n_head, window, n_chunks, head_dim)
        _combine_run(combine, grid, block)

    return run


def _attention_flops(args: Args) -> float:
    n_tokens, kv_len, n_head = int(args[6]), int(args[7]), int(args[8])
    head_dim = _as_view(args[0]).nbytes // (4 * n_tokens * n_head)
    return 4.0 * n_tokens * n_head * head_dim * kv_len


def _prefill_spec(name: str, head_dim: int) -> KernelSpec:
    return KernelSpec(name, _prefill_runner(head_dim), _accesses((0, 1, 2, 4, 5), (3,)), _attention_flops)


def _decode_spec(name: str, head_dim: int) -> KernelSpec:
    return KernelSpec(name, _decode_runner(head_dim), _accesses((0, 1, 2, 5), (3, 4)), _attention_flops)


def twin_specs() -> list[KernelSpec]:
    """The twin of every kernel attention.py launches (the wide kernels take the prefill's and the
    decode's arguments)."""
    specs = [
        KernelSpec(
            "attn_decode_combine", _combine_run, _accesses((0, 1, 2, 3), (4,)), lambda a: 3.0 * float(a[4].nbytes)
        ),
    ]
    for head_dim in WIDE_DIMS:
        specs += [
            _prefill_spec(f"attn_wide_d{head_dim}", head_dim),
            _prefill_spec(f"attn_wide_mma_d{head_dim}", head_dim),
            _decode_spec(f"attn_wide_decode_d{head_dim}", head_dim),
            _decode_spec(f"attn_wide_mma_decode_d{head_dim}", head_dim),
        ]
    for head_dim in HEAD_DIMS:
        specs += [_prefill_spec(f"attn_prefill_{path}_d{head_dim}", head_dim) for path in ("simt", "mma", "mma128")]
        specs.append(_decode_spec(f"attn_decode_d{head_dim}", head_dim))
        specs.append(
            KernelSpec(
                f"attn_decode_fused_d{head_dim}",
                _fused_decode_runner(head_dim),
                _accesses((0, 1, 2, 5, 13, 15), (3, 4, 14, 15)),
                _attention_flops,
            )
        )
    return specs
