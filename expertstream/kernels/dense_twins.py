"""numpy twins of the dense kernels of dense.cu (see dense.py): what the simulator runs for them.

Each computes in float32 with the kernel's operations, vectorized: get_rows decodes with
quants.decode_rows (the decoders' values bit for bit); the norm sums its squares in another
order than the kernel's tree, and the rotation computes without the kernel's fused
multiply-adds, so those agree with the GPU within rounding, not bit for bit. The float16 store
rounds to nearest even as the kernel does (NaN payloads aside).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backends.base import BufferView
from ..backends.sim import Access, KernelSpec
from ..backends.sim.kernels import Dim3Tuple
from . import quants
from .layout import FORMATS, WeightFormat
from .twins import combine_run, gemv_runner, weights_access

Args = tuple[Any, ...]
_F32 = np.float32


def _as_view(arg: Any) -> BufferView:
    return arg if isinstance(arg, BufferView) else arg.view()


# -- get_rows: table, ids, out, n_cols, n_table_rows, n_ids ---------------------------------


def _get_rows_runner(fmt: WeightFormat) -> Any:
    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        table_b, ids_b, out_b = args[:3]
        n_cols, n_table_rows, n_ids = map(int, args[3:])
        row_bytes = fmt.row_bytes(n_cols)
        table = table_b[: n_table_rows * row_bytes].reshape(n_table_rows, row_bytes)
        ids = ids_b.view(np.int32)[:n_ids]
        out = out_b.view(_F32).reshape(n_ids, n_cols)
        valid = (ids >= 0) & (ids < n_table_rows)
        out[~valid] = np.nan
        if valid.any():
            out[valid] = quants.decode_rows(table[ids[valid]], fmt.qtype)

    return run


def _get_rows_accesses(args: Args) -> Sequence[Access]:
    return [
        Access(_as_view(args[0]), write=False),
        Access(_as_view(args[1]), write=False),
        Access(_as_view(args[2]), write=True),
    ]


# -- rms_norm: x, weight (or 0), out, n_rows, n, eps ----------------------------------------


def _rms_rows(x: np.ndarray, weight: np.ndarray | None, eps: Any) -> np.ndarray:
    """Rows x [rows, n] over their RMS (times weight [n] where given)."""
    mean_square = np.einsum("rn,rn->r", x, x, dtype=_F32) / _F32(x.shape[1])
    y = x * (_F32(1) / np.sqrt(mean_square + _F32(eps)))[:, None]
    return y if weight is None else y * weight


def _rms_norm_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    x_b, w_b, out_b, n_rows, n, eps = args
    x = x_b.view(_F32).reshape(int(n_rows), int(n))
    weight = w_b.view(_F32) if isinstance(w_b, np.ndarray) else None
    out_b.view(_F32).reshape(int(n_rows), int(n))[:] = _rms_rows(x, weight, eps)


def _rms_norm_accesses(args: Args) -> Sequence[Access]:
    reads = [Access(_as_view(a), write=False) for a in args[:2] if not isinstance(a, np.generic)]
    return [*reads, Access(_as_view(args[2]), write=True)]


# -- add_rms_norm: hidden, delta, weight (or 0), out, n_rows, n, eps --------------------------


def _add_rms_norm_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    h_b, d_b, w_b, out_b, n_rows, n, eps = args
    shape = (int(n_rows), int(n))
    hidden = h_b.view(_F32).reshape(shape)
    hidden += d_b.view(_F32).reshape(shape)
    weight = w_b.view(_F32) if isinstance(w_b, np.ndarray) else None
    out_b.view(_F32).reshape(shape)[:] = _rms_rows(hidden, weight, eps)


def _add_rms_norm_accesses(args: Args) -> Sequence[Access]:
    hidden = _as_view(args[0])
    reads = [Access(_as_view(a), write=False) for a in args[:3] if not isinstance(a, np.generic)]
    return [*reads, Access(hidden, write=True), Access(_as_view(args[3]), write=True)]


# -- combine_rms_norm: y, weights (or 0), extra (or 0), hidden, weight (or 0), out, n_tokens, top_k, n, eps ----


def _combine_rms_norm_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    y_b, w_b, extra_b, h_b, norm_b, out_b, n_tokens, top_k, n, eps = args
    combine_run((y_b, w_b, extra_b, h_b, n_tokens, top_k, n), grid, block)
    shape = (int(n_tokens), int(n))
    weight = norm_b.view(_F32) if isinstance(norm_b, np.ndarray) else None
    out_b.view(_F32).reshape(shape)[:] = _rms_rows(h_b.view(_F32).reshape(shape), weight, eps)


def _combine_rms_norm_accesses(args: Args) -> Sequence[Access]:
    hidden = _as_view(args[3])
    reads = [Access(_as_view(a), write=False) for a in args[:5] if not isinstance(a, np.generic)]
    return [*reads, Access(hidden, write=True), Access(_as_view(args[5]), write=True)]


# -- mul_mat_vec_add_norm: w, x, y, hidden, weight (or 0), out, counters, n, n_in, eps ----------------


def _mul_mat_vec_add_norm_runner(fmt: WeightFormat) -> Any:
    mul_mat_vec = gemv_runner(fmt)

    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        w, x, y, hidden, weight, out, _counters, n, n_in, eps = args
        n_tokens = y.nbytes // (4 * int(n))
        zeros = np.zeros(n_tokens, np.int32).view(np.uint8)
        mul_mat_vec((w, x, zeros, y, 1, n, n_in, 1, 0, n_tokens, 0, 0), grid, block)
        _add_rms_norm_run((hidden, y, weight, out, n_tokens, n, eps), grid, block)

    return run


def _mul_mat_vec_add_norm_accesses_for(fmt: WeightFormat) -> Any:
    def accesses(args: Args) -> Sequence[Access]:
        w, x, y, hidden, weight, out, counters, n, n_in = args[:9]
        reads = [
            Access(_as_view(a), write=False) for a in (x, weight, hidden, counters) if not isinstance(a, np.generic)
        ]
        writes = [Access(_as_view(a), write=True) for a in (y, hidden, out, counters)]
        return [weights_access(fmt, w, 1, n, n_in), *reads, *writes]

    return accesses


def _mul_mat_vec_add_norm_flops(args: Args) -> float:
    n_tokens = _as_view(args[2]).nbytes // (4 * int(args[7]))
    return (2.0 * int(args[8]) + 5.0) * int(args[7]) * n_tokens


# -- mul_mat_vec_combine_norm: w, act, ids, y, route_weights, weights, extra, hidden, weight, out, counters,
#    n_expert, n, n_in, top_k, eps ----------------------------------------------------------------------


def _mul_mat_vec_combine_norm_runner(fmt: WeightFormat) -> Any:
    mul_mat_vec = gemv_runner(fmt)

    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        w, act, ids, y, route_weights, weights, extra, hidden, weight, out = args[:10]
        n_expert, n, n_in, top_k, eps = args[11:16]
        n_pairs = int(grid[1])
        mul_mat_vec((w, act, ids, y, n_expert, n, n_in, top_k, 1, n_pairs, route_weights, 0), grid, block)
        n_tokens = n_pairs // int(top_k)
        _combine_rms_norm_run((y, weights, extra, hidden, weight, out, n_tokens, top_k, n, eps), grid, block)

    return run


def _mul_mat_vec_combine_norm_accesses_for(fmt: WeightFormat) -> Any:
    def accesses(args: Args) -> Sequence[Access]:
        w, act, ids, y, route_weights, weights, extra, hidden, weight, out, counters, n_expert, n, n_in = args[:14]
        read = (act, ids, route_weights, weights, extra, hidden, weight, counters)
        reads = [Access(_as_view(a), write=False) for a in read if not isinstance(a, np.generic)]
        writes = [Access(_as_view(a), write=True) for a in (y, hidden, out, counters)]
        return [weights_access(fmt, w, n_expert, n, n_in), *reads, *writes]

    return accesses


def _mul_mat_vec_combine_norm_flops(args: Args) -> float:
    n, n_in, top_k = int(args[12]), int(args[13]), int(args[14])
    n_pairs = _as_view(args[2]).nbytes // 4
    return 2.0 * n_pairs * n * n_in + (2.0 * top_k + 3.0) * (n_pairs // top_k) * n


# -- add_rows: y, bias, n_rows, n -------------------------------------------------------------


def _add_rows_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    y_b, bias_b, n_rows, n = args
    y = y_b.view(_F32).reshape(int(n_rows), int(n))
    y += bias_b.view(_F32)


def _read_modify_write(args: Args) -> Sequence[Access]:
    """The first argument read and written in place (add_rows' y, rope's x), the second read."""
    target = _as_view(args[0])
    return [Access(target, write=False), Access(_as_view(args[1]), write=False), Access(target, write=True)]


# -- rope: x, positions, n_tokens, n_heads, head_dim, n_rot, neox, freq_base, freq_scale,
#          ext_factor, corr_low, corr_high, mscale ---------------------------------------------


def _rope_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    x_b, pos_b = args[:2]
    n_tokens, n_heads, head_dim = map(int, args[2:5])
    x = x_b.view(_F32).reshape(n_tokens, n_heads, head_dim)
    _rotate(x, pos_b.view(np.int32)[:n_tokens], args[5:])


def _rotate(x: np.ndarray, positions: np.ndarray, rope: Args) -> None:
    """x [n_tokens, heads, head_dim] rotated in place; ``rope``: n_rot, neox, freq_base, freq_scale,
    ext_factor, corr_low, corr_high, mscale (the kernels' argument order)."""
    n_rot, neox = int(rope[0]), int(rope[1])
    freq_base, freq_scale, ext_factor, corr_low, corr_high, mscale = (_F32(a) for a in rope[2:])
    half = n_rot // 2
    pair = np.arange(half)
    inv_freq = np.power(freq_base, -(2 * pair).astype(_F32) / _F32(n_rot))
    theta_extrap = positions.astype(_F32)[:, None] * inv_freq[None, :]
    theta = freq_scale * theta_extrap
    if ext_factor != 0:
        y = (pair.astype(_F32) - corr_low) / max(_F32(0.001), corr_high - corr_low)
        ramp_mix = (_F32(1) - np.clip(y, _F32(0), _F32(1))) * ext_factor
        theta = theta * (_F32(1) - ramp_mix) + theta_extrap * ramp_mix
    cos = (np.cos(theta) * mscale)[:, None, :]
    sin = (np.sin(theta) * mscale)[:, None, :]
    first = pair if neox else 2 * pair
    second = pair + half if neox else 2 * pair + 1
    x0 = x[:, :, first].copy()
    x1 = x[:, :, second].copy()
    x[:, :, first] = x0 * cos - x1 * sin
    x[:, :, second] = x0 * sin + x1 * cos


# -- store_rows_f16: src, cache, positions, n_tokens, width, n_cache_rows ----------------------


def _store_rows_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    src_b, cache_b, pos_b = args[:3]
    n_tokens, width, n_cache_rows = map(int, args[3:])
    src = src_b.view(_F32).reshape(n_tokens, width)
    _store(src, cache_b.view(np.float16).reshape(n_cache_rows, width), pos_b.view(np.int32)[:n_tokens])


def _store(src: np.ndarray, cache: np.ndarray, rows: np.ndarray) -> None:
    """cache[rows[t]] = src[t] as float16, for the rows inside the cache."""
    valid = (rows >= 0) & (rows < cache.shape[0])
    with np.errstate(over="ignore"):  # beyond the largest half is infinity, as the kernel rounds it
        cache[rows[valid]] = src[valid].astype(np.float16)


def _store_rows_accesses(args: Args) -> Sequence[Access]:
    return [
        Access(_as_view(args[0]), write=False),
        Access(_as_view(args[2]), write=False),
        Access(_as_view(args[1]), write=True),
    ]


# -- qkv_rope_store: q, k, v, q_norm (or 0), k_norm (or 0), k_cache, v_cache, positions, n_tokens,
#    n_head, n_head_kv, head_dim, n_cache_rows, eps, then rope's eight ------------------------------


def _qkv_rope_store_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    q_b, k_b, v_b, qn_b, kn_b, kc_b, vc_b, pos_b = args[:8]
    n_tokens, n_head, n_head_kv, head_dim, n_cache_rows = map(int, args[8:13])
    eps, rope = args[13], args[14:]
    positions = pos_b.view(np.int32)[:n_tokens]
    q = q_b.view(_F32).reshape(n_tokens, n_head, head_dim)
    k = k_b.view(_F32).reshape(n_tokens, n_head_kv, head_dim).copy()  # k's float rows stay as they were
    for x, w_b in ((q, qn_b), (k, kn_b)):
        if isinstance(w_b, np.ndarray):
            x[:] = _rms_rows(x.reshape(-1, head_dim), w_b.view(_F32), eps).reshape(x.shape)
        _rotate(x, positions, rope)
    width = n_head_kv * head_dim
    for src, cache_b in ((k, kc_b), (v_b.view(_F32), vc_b)):
        cache = cache_b.view(np.float16).reshape(n_cache_rows, width)
        _store(src.reshape(n_tokens, width), cache, positions)


def _qkv_rope_store_accesses(args: Args) -> Sequence[Access]:
    reads = [Access(_as_view(a), write=False) for a in (*args[:5], args[7]) if not isinstance(a, np.generic)]
    return [*reads, *(Access(_as_view(a), write=True) for a in (args[0], args[5], args[6]))]


def _qkv_rope_store_flops(args: Args) -> float:
    rows = float(args[8]) * (float(args[9]) + 2.0 * float(args[10]))
    return 20.0 * rows * float(args[11])


# -- copy_columns: src, dst, n_rows, src_width, first, width --------------------------------------


def _copy_columns_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    src_b, dst_b = args[:2]
    n_rows, src_width, first, width = map(int, args[2:])
    src = src_b.view(_F32).reshape(n_rows, src_width)
    dst_b.view(_F32).reshape(n_rows, width)[:] = src[:, first : first + width]


def _copy_columns_accesses(args: Args) -> Sequence[Access]:
    return [Access(_as_view(args[0]), write=False), Access(_as_view(args[1]), write=True)]


# -- mla_rope_store: q, q_abs, kv, kv_norm (or 0), q_out, cache, positions, n_tokens, n_head, rank, nope,
#    n_cache_rows, eps, then rope's eight --------------------------------------------------------------


def _mla_rope_store_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    q_b, qa_b, kv_b, kn_b, out_b, cache_b, pos_b = args[:7]
    n_tokens, n_head, rank, nope, n_cache_rows = map(int, args[7:12])
    eps, rope = args[12], args[13:]
    n_rot = int(rope[0])
    width = rank + n_rot
    positions = pos_b.view(np.int32)[:n_tokens]
    q_pe = q_b.view(_F32).reshape(n_tokens, n_head, nope + n_rot)[:, :, nope:].copy()
    _rotate(q_pe, positions, rope)
    out = out_b.view(_F32).reshape(n_tokens, n_head, width)
    out[:, :, :rank] = qa_b.view(_F32).reshape(n_tokens, n_head, rank)
    out[:, :, rank:] = q_pe
    kv = kv_b.view(_F32).reshape(n_tokens, width)
    key = np.empty((n_tokens, 1, width), _F32)
    key[:, 0, :rank] = _rms_rows(kv[:, :rank], kn_b.view(_F32) if isinstance(kn_b, np.ndarray) else None, eps)
    key[:, 0, rank:] = kv[:, rank:]
    _rotate(key[:, :, rank:], positions, rope)
    _store(key.reshape(n_tokens, width), cache_b.view(np.float16).reshape(n_cache_rows, width), positions)


def _mla_rope_store_accesses(args: Args) -> Sequence[Access]:
    reads = [Access(_as_view(a), write=False) for a in (*args[:4], args[6]) if not isinstance(a, np.generic)]
    return [*reads, Access(_as_view(args[4]), write=True), Access(_as_view(args[5]), write=True)]


def _mla_rope_store_flops(args: Args) -> float:
    n_tokens, n_head, rank, n_rot = (float(args[i]) for i in (7, 8, 9, 13))
    return n_tokens * (n_head * (rank + 20.0 * n_rot) + 3.0 * rank + 20.0 * n_rot)


def twin_specs() -> list[KernelSpec]:
    """The twin of every kernel dense.py launches."""
    specs = [
        KernelSpec(
            fmt.get_rows_kernel_name, _get_rows_runner(fmt), _get_rows_accesses, lambda a: float(a[3]) * float(a[5])
        )
        for fmt in FORMATS.values()
    ]
    specs += [
        KernelSpec("dense_rms_norm", _rms_norm_run, _rms_norm_accesses, lambda a: 3.0 * float(a[3]) * float(a[4])),
        KernelSpec(
            "dense_add_rms_norm", _add_rms_norm_run, _add_rms_norm_accesses, lambda a: 4.0 * float(a[4]) * float(a[5])
        ),
        KernelSpec(
            "dense_combine_rms_norm",
            _combine_rms_norm_run,
            _combine_rms_norm_accesses,
            lambda a: (2.0 * float(a[7]) + 3.0) * float(a[6]) * float(a[8]),
        ),
        *(
            KernelSpec(
                fmt.gemv_add_norm_kernel_name,
                _mul_mat_vec_add_norm_runner(fmt),
                _mul_mat_vec_add_norm_accesses_for(fmt),
                _mul_mat_vec_add_norm_flops,
            )
            for fmt in FORMATS.values()
        ),
        *(
            KernelSpec(
                fmt.gemv_combine_norm_kernel_name,
                _mul_mat_vec_combine_norm_runner(fmt),
                _mul_mat_vec_combine_norm_accesses_for(fmt),
                _mul_mat_vec_combine_norm_flops,
            )
            for fmt in FORMATS.values()
        ),
        KernelSpec("dense_add_rows", _add_rows_run, _read_modify_write, lambda a: float(a[2]) * float(a[3])),
        KernelSpec(
            "dense_rope", _rope_run, _read_modify_write, lambda a: 16.0 * float(a[2]) * float(a[3]) * float(a[5])
        ),
        KernelSpec("dense_store_rows_f16", _store_rows_run, _store_rows_accesses, lambda a: float(a[3]) * float(a[4])),
        KernelSpec("dense_qkv_rope_store", _qkv_rope_store_run, _qkv_rope_store_accesses, _qkv_rope_store_flops),
        KernelSpec(
            "dense_copy_columns", _copy_columns_run, _copy_columns_accesses, lambda a: float(a[2]) * float(a[5])
        ),
        KernelSpec("dense_mla_rope_store", _mla_rope_store_run, _mla_rope_store_accesses, _mla_rope_store_flops),
    ]
    return specs
