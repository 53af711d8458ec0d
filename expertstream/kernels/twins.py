"""numpy twins of the MoE kernels (the routing ones aside: routing_twins.py): what the simulator runs for them.

Each twin takes the launch arguments in the kernel's order, computes what the kernel
computes (float32, vectorized, for CI-sized shapes) and declares every byte range it reads
or writes. The mul_mat_id twin reads quantized rows up to the next multiple of 512
elements like the kernel, so a dirty padding tail turns outputs into NaN here too; its
matrix product is an einsum, whose sum for one output does not depend on how many rows
share the call, so results do not depend on how tokens are grouped. The twin of the
matrix-core kernels first rounds decoded weights and activations to bf16 as they do
(round to nearest even); their products are exact in float32, which they accumulate in.
The twin of the activation quantizer of the int8 path reproduces its bytes exactly; the twin
of the int8 kernels takes those bytes, computes each 32-element block's integer dot exactly
and scales and sums the blocks in float32 in ascending k, as the kernels do (without their
fused multiply-adds, so results agree within rounding, not bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..backends.base import BufferView
from ..backends.sim import Access, KernelSpec
from ..backends.sim.kernels import Dim3Tuple
from . import layout, quants
from .layout import FORMATS, MatrixPath, WeightFormat

Args = tuple[Any, ...]


def _as_view(arg: Any) -> BufferView:
    return arg if isinstance(arg, BufferView) else arg.view()


# -- grouping ------------------------------------------------------------------------------
# moe_group_count args: ids, scratch, n_pairs, n_expert, max_tiles
# moe_group_place args: ids, scratch, n_pairs, n_expert, tile_m, max_tiles


def _buckets(ids_bytes: np.ndarray, n_pairs: int, n_expert: int) -> np.ndarray:
    ids = ids_bytes.view(np.int32)[:n_pairs]
    return np.where((ids >= 0) & (ids < n_expert), ids, n_expert)


def _group_count_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    ids_bytes, scratch_bytes, n_pairs, n_expert, max_tiles = (args[0], args[1], *map(int, args[2:]))
    bucket = _buckets(ids_bytes, n_pairs, n_expert)
    blocks = layout.group_blocks(n_pairs)
    chunks = np.arange(n_pairs) // layout.GROUP_CHUNK
    counts = np.zeros((blocks, n_expert + 1), np.int32)
    np.add.at(counts, (chunks, bucket), 1)
    at = layout.SCRATCH_HEADER + 3 * max_tiles + n_pairs
    scratch_bytes.view(np.int32)[at : at + counts.size] = counts.reshape(-1)


def _group_place_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    ids_bytes, scratch_bytes, n_pairs, n_expert, tile_m, max_tiles = (args[0], args[1], *map(int, args[2:]))
    bucket = _buckets(ids_bytes, n_pairs, n_expert)
    counts = np.bincount(bucket, minlength=n_expert + 1)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    tiles_per_bucket = -(-counts // tile_m)
    tile_bucket = np.repeat(np.arange(n_expert + 1), tiles_per_bucket)
    first_tile = np.concatenate([[0], np.cumsum(tiles_per_bucket)[:-1]])
    begin = (np.arange(tile_bucket.size) - first_tile[tile_bucket]) * tile_m
    words = scratch_bytes.view(np.int32)
    words[0] = tile_bucket.size
    table = words[layout.SCRATCH_HEADER : layout.SCRATCH_HEADER + 3 * max_tiles].reshape(max_tiles, 3)
    table[: tile_bucket.size] = np.stack(
        [tile_bucket, offsets[tile_bucket] + begin, np.minimum(tile_m, counts[tile_bucket] - begin)], axis=1
    )
    rows_at = layout.SCRATCH_HEADER + 3 * max_tiles
    words[rows_at : rows_at + bucket.size] = np.argsort(bucket, kind="stable")


def _group_count_accesses(args: Args) -> Sequence[Access]:
    return [Access(_as_view(args[0]), write=False), Access(_as_view(args[1]), write=True)]


def _group_place_accesses(args: Args) -> Sequence[Access]:
    scratch = _as_view(args[1])
    return [Access(_as_view(args[0]), write=False), Access(scratch, write=False), Access(scratch, write=True)]


def _group_flops(args: Args) -> float:
    return float(args[2])


# -- mul_mat_id ----------------------------------------------------------------------------
# args: w, x, scratch, y, n_expert, n_out, n_in, top_k, x_per_pair, max_tiles


def _padded_rows(w_bytes: np.ndarray, fmt: WeightFormat, expert: int, n_out: int, n_in: int) -> np.ndarray:
    """float32 [n_out, padded n_in] of one expert, rows read past n_in as the kernel reads them."""
    row_bytes = fmt.row_bytes(n_in)
    width = fmt.row_bytes(fmt.padded_row_elements(n_in))
    start = expert * n_out * row_bytes
    rows = np.lib.stride_tricks.as_strided(
        w_bytes[start:], shape=(n_out, width), strides=(row_bytes, 1), writeable=False
    )
    return quants.decode_rows(rows, fmt.qtype)


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 precision (nearest, ties to even), as float32; NaN stays NaN."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    quiet_nan = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x00400000)
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(is_nan, quiet_nan, rounded).view(np.float32)


def pack_quantized_x(q: np.ndarray, d: np.ndarray, s: np.ndarray) -> np.ndarray:
    """uint8 [n_rows, row bytes]: each row's int8 q, then its (d, s) pairs, padded to 16 bytes."""
    n_rows, n_blocks, _ = q.shape
    n_in = n_blocks * layout.QUANT_BLOCK
    out = np.zeros((n_rows, layout.quantized_x_row_bytes(n_in)), np.uint8)
    out[:, :n_in] = q.reshape(n_rows, n_in).view(np.uint8)
    pairs = np.stack([d, s], axis=-1).astype(np.float32).reshape(n_rows, -1)
    out[:, n_in : n_in + 8 * n_blocks] = pairs.view(np.uint8)
    return out


def unpack_quantized_x(rows: np.ndarray, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, d, s) from rows as pack_quantized_x lays them out."""
    n_rows = rows.shape[0]
    n_blocks = n_in // layout.QUANT_BLOCK
    q = np.ascontiguousarray(rows[:, :n_in]).view(np.int8).reshape(n_rows, n_blocks, layout.QUANT_BLOCK)
    pairs = np.ascontiguousarray(rows[:, n_in : n_in + 8 * n_blocks]).view(np.float32).reshape(n_rows, n_blocks, 2)
    return q, pairs[..., 0], pairs[..., 1]


# args: x, xq, n_rows, n_in


def _quantize_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    x_bytes, xq_bytes, n_rows, n_in = args
    n_rows, n_in = int(n_rows), int(n_in)
    x = x_bytes.view(np.float32).reshape(n_rows, n_in)
    xq_bytes.reshape(n_rows, -1)[:] = pack_quantized_x(*quants.quantize_x(x))


def _int8_products(xq: tuple[np.ndarray, np.ndarray, np.ndarray], w: quants.Int8Split) -> np.ndarray:
    """float32 [m, n]: per block (the weights' width) integer dots of activations and weights, scaled and
    summed in k order; the activations' sum term only where the weights have a min."""
    q_w, d_w, m_w = w
    q_x, d_x, s_x = quants.x_blocks(xq, q_w.shape[-1])
    dots = np.einsum("mbk,nbk->bmn", q_x.astype(np.int32), q_w.astype(np.int32))
    acc = np.zeros((q_x.shape[0], q_w.shape[0]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(dots.shape[0]):
            acc += (d_x[:, b, None] * d_w[None, :, b]) * dots[b].astype(np.float32)
            if m_w is not None:
                acc -= m_w[None, :, b] * s_x[:, b, None]
    return acc


def _expert_groups(
    scratch_bytes: np.ndarray, max_tiles: int, n_expert: int, y: np.ndarray
) -> Iterator[tuple[int, np.ndarray]]:
    """(expert, its pairs) from the grouping kernel's table in the scratch; the pairs of ids out of
    range (grouped under ``n_expert``) get NaN outputs here and are not yielded."""
    words = scratch_bytes.view(np.int32)
    table = words[layout.SCRATCH_HEADER : layout.SCRATCH_HEADER + 3 * max_tiles].reshape(-1, 3)
    rows = words[layout.SCRATCH_HEADER + 3 * max_tiles :]
    for expert, first, count in table[: int(words[0])]:
        pairs = rows[first : first + count]
        if expert == n_expert:
            y[pairs] = np.nan
            continue
        yield int(expert), pairs


def _mul_mat_id_runner(fmt: WeightFormat, path: MatrixPath) -> Any:
    if path is MatrixPath.INT8:
        return _int8_runner(fmt)
    rounded = round_to_bf16 if path is MatrixPath.MMA else np.asarray

    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        w_bytes, x_bytes, scratch_bytes, y_bytes, n_expert, n_out, n_in, top_k, x_per_pair, max_tiles = args
        n_expert, n_out, n_in, top_k = int(n_expert), int(n_out), int(n_in), int(top_k)
        x = x_bytes.view(np.float32).reshape(-1, n_in)
        y = y_bytes.view(np.float32).reshape(-1, n_out)
        width = fmt.padded_row_elements(n_in)
        weights: dict[int, np.ndarray] = {}
        for expert, pairs in _expert_groups(scratch_bytes, int(max_tiles), n_expert, y):
            if expert not in weights:
                weights[expert] = rounded(_padded_rows(w_bytes, fmt, int(expert), n_out, n_in))
            acts = np.zeros((pairs.size, width), np.float32)
            acts[:, :n_in] = rounded(x[pairs if x_per_pair else pairs // top_k])
            y[pairs] = np.einsum("mk,nk->mn", acts, weights[expert])

    return run


def _int8_weights(
    w_bytes: np.ndarray, fmt: WeightFormat, expert: int, n_out: int, n_in: int
) -> tuple[quants.Int8Split, np.ndarray]:
    """One expert's rows as the int8 products take them (quants.int8_rows), and what the padded
    part of each row adds against zero activations (whose blocks have scale 0 and quants 0): each
    tail block's multipliers times 0, NaN where one is not finite (a dirty Q4_0, Q4_K, Q6_K or Q8_0
    scale; MXFP4's E8M0 scales are all finite, so its dirty tail adds 0)."""
    row_bytes = fmt.row_bytes(n_in)
    start = expert * n_out * row_bytes
    split = quants.int8_rows(w_bytes[start : start + n_out * row_bytes].reshape(n_out, row_bytes), fmt.qtype)
    tail = np.zeros(n_out, np.float32)
    width = fmt.row_bytes(fmt.padded_row_elements(n_in))
    if width > row_bytes:
        rows = np.lib.stride_tricks.as_strided(w_bytes[start:], shape=(n_out, width), strides=(row_bytes, 1))
        _, d, m = quants.int8_rows(rows[:, row_bytes:], fmt.qtype)
        with np.errstate(invalid="ignore", over="ignore"):
            tail += (np.float32(0) * d).sum(axis=1, dtype=np.float32)
            if m is not None:
                tail += (np.float32(0) * m).sum(axis=1, dtype=np.float32)
    return split, tail


def _int8_runner(fmt: WeightFormat) -> Any:
    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        w_bytes, xq_bytes, scratch_bytes, y_bytes, n_expert, n_out, n_in, top_k, x_per_pair, max_tiles = args
        n_expert, n_out, n_in, top_k = int(n_expert), int(n_out), int(n_in), int(top_k)
        xq = unpack_quantized_x(xq_bytes.reshape(-1, layout.quantized_x_row_bytes(n_in)), n_in)
        y = y_bytes.view(np.float32).reshape(-1, n_out)
        weights: dict[int, tuple[quants.Int8Split, np.ndarray]] = {}
        for expert, pairs in _expert_groups(scratch_bytes, int(max_tiles), n_expert, y):
            if expert not in weights:
                weights[expert] = _int8_weights(w_bytes, fmt, int(expert), n_out, n_in)
            split, tail = weights[expert]
            x_rows = pairs if x_per_pair else pairs // top_k
            q_x, d_x, s_x = xq
            y[pairs] = _int8_products((q_x[x_rows], d_x[x_rows], s_x[x_rows]), split) + tail

    return run


def weights_access(fmt: WeightFormat, w: Any, n_expert: Any, n_out: Any, n_in: Any) -> Access:
    """The read of a weight tensor, whose bytes past the tensor's rows are ggml's padding tail."""
    w_view = _as_view(w)
    tensor_bytes = int(n_expert) * int(n_out) * fmt.row_bytes(int(n_in))
    padded_from = w_view.offset + tensor_bytes if w_view.nbytes > tensor_bytes else None
    return Access(w_view, write=False, padded_from=padded_from)


def _mul_mat_id_accesses_for(fmt: WeightFormat) -> Any:
    def accesses(args: Args) -> Sequence[Access]:
        w, x, scratch, y, n_expert, n_out, n_in = args[:7]
        return [
            weights_access(fmt, w, n_expert, n_out, n_in),
            Access(_as_view(x), write=False),
            Access(_as_view(scratch), write=False),
            Access(_as_view(y), write=True),
        ]

    return accesses


def _mul_mat_id_flops(args: Args) -> float:
    y, n_out, n_in = _as_view(args[3]), int(args[5]), int(args[6])
    n_pairs = y.nbytes // (4 * n_out)
    return 2.0 * n_pairs * n_out * n_in


def mul_mat_id_rate_key(args: Args) -> tuple[tuple[int, int], float]:
    """(n_out, n_in) of one expert and the (token, k) pairs per expert: how fast the kernel runs."""
    y, n_expert, n_out, n_in = _as_view(args[3]), int(args[4]), int(args[5]), int(args[6])
    return (n_out, n_in), y.nbytes / (4 * n_out) / n_expert


# -- the matrix-vector kernels (gemv.cu) ---------------------------------------------------
# moe_mul_mat_vec_id_*: w, x, ids, y, n_expert, n_out, n_in, top_k, x_per_pair, n_pairs, route_weights (or 0),
# silu_gate (or 0)


def _silu_times(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up in float32, moe_swiglu's operations."""
    with np.errstate(over="ignore"):  # exp(-gate) is inf for gate below about -88: silu is -0 there, as expf gives
        return gate / (np.float32(1) + np.exp(-gate)) * up


def gemv_runner(fmt: WeightFormat) -> Any:
    int8 = fmt.qtype in layout.GEMV_INT8_TYPES  # activations on the int8 grid (gemv.cu's GemvInt8)

    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        w_bytes, x_bytes, ids_bytes, y_bytes, n_expert, n_out, n_in, top_k, x_per_pair, n_pairs = args[:10]
        route_weights, silu_gate = args[10:12]
        n_expert, n_out, n_in, top_k, n_pairs = int(n_expert), int(n_out), int(n_in), int(top_k), int(n_pairs)
        scales = route_weights.view(np.float32) if isinstance(route_weights, np.ndarray) else None
        gates = silu_gate.view(np.float32).reshape(-1, n_out) if isinstance(silu_gate, np.ndarray) else None
        x = x_bytes.view(np.float32).reshape(-1, n_in)
        y = y_bytes.view(np.float32).reshape(-1, n_out)
        ids = ids_bytes.view(np.int32)[:n_pairs]
        width = fmt.padded_row_elements(n_in)
        decoded: dict[int, Any] = {}  # each expert's rows, decoded once a call
        for pair, expert in enumerate(ids.tolist()):
            if not 0 <= expert < n_expert:
                y[pair] = np.nan
                continue
            x_row = x[pair if x_per_pair else pair // top_k]
            # Rows stop at n_in but the tensor's last, which reads the padding tail against zeros.
            if int8:
                if expert not in decoded:
                    decoded[expert] = _int8_weights(w_bytes, fmt, expert, n_out, n_in)
                split, tail = decoded[expert]
                out = _int8_products(quants.quantize_x(x_row[None]), split)[0]
                if expert == n_expert - 1:
                    out[-1] += tail[-1]
            else:
                acts = np.zeros(width, np.float32)
                acts[:n_in] = x_row
                if expert not in decoded:
                    decoded[expert] = _padded_rows(w_bytes, fmt, expert, n_out, n_in)
                rows = decoded[expert]
                out = rows[:, :n_in] @ acts[:n_in]
                if expert == n_expert - 1:
                    out[-1] = rows[-1] @ acts
            out = out if scales is None else scales[pair] * out
            y[pair] = out if gates is None else _silu_times(gates[pair], out)

    return run


# moe_gate_up_vec_id_*: w_gate, w_up, x, ids, y, n_expert, n_out, n_in, top_k, n_pairs


def _gemv_gate_up_runner(fmt: WeightFormat) -> Any:
    mul_mat_vec = gemv_runner(fmt)

    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        w_gate, w_up, x, ids, y, n_expert, n_out, n_in, top_k, n_pairs = args
        gate = np.empty_like(y.view(np.float32))
        common = (n_expert, n_out, n_in, top_k, 0, n_pairs)
        mul_mat_vec((w_gate, x, ids, gate.view(np.uint8), *common, 0, 0), grid, block)
        mul_mat_vec((w_up, x, ids, y, *common, 0, gate.view(np.uint8)), grid, block)

    return run


def _gemv_gate_up_accesses_for(fmt: WeightFormat) -> Any:
    gemv_accesses = _gemv_accesses_for(fmt)

    def accesses(args: Args) -> Sequence[Access]:
        w_gate, w_up, x, ids, y, n_expert, n_out, n_in, top_k, n_pairs = args
        # The gate launch's accesses, and the up tensor read beside them.
        gate = gemv_accesses((w_gate, x, ids, y, n_expert, n_out, n_in, top_k, 0, n_pairs, 0, 0))
        return [weights_access(fmt, w_up, n_expert, n_out, n_in), *gate]

    return accesses


def _gemv_gate_up_flops(args: Args) -> float:
    return 4.0 * int(args[9]) * int(args[6]) * int(args[7])


# moe_mul_mat_vec_parts_*: w0, w1, w2, x, y0, y1, y2, n_out0, n_out1, n_out2, n_in, n_tokens; a part
# left out has n_out 0 (and null pointers)


def _gemv_parts(args: Args) -> list[tuple[Any, Any, int]]:
    """(weights, y, n_out) of each part a launch runs."""
    return [(args[p], args[4 + p], int(args[7 + p])) for p in range(3) if int(args[7 + p]) > 0]


def _gemv_parts_runner(fmt: WeightFormat) -> Any:
    mul_mat_vec = gemv_runner(fmt)

    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        x, n_in, n_tokens = args[3], int(args[10]), int(args[11])
        zeros = np.zeros(n_tokens, np.int32).view(np.uint8)
        for w, y, n_out in _gemv_parts(args):
            mul_mat_vec((w, x, zeros, y, 1, n_out, n_in, 1, 0, n_tokens, 0, 0), grid, block)

    return run


def _gemv_parts_accesses_for(fmt: WeightFormat) -> Any:
    def accesses(args: Args) -> Sequence[Access]:
        n_in = int(args[10])
        parts = _gemv_parts(args)
        weights = [weights_access(fmt, w, 1, n_out, n_in) for w, _, n_out in parts]
        outputs = [Access(_as_view(y), write=True) for _, y, _ in parts]
        return [*weights, Access(_as_view(args[3]), write=False), *outputs]

    return accesses


def _gemv_parts_flops(args: Args) -> float:
    return 2.0 * int(args[11]) * int(args[10]) * sum(int(n) for n in args[7:10])


def _gemv_accesses_for(fmt: WeightFormat) -> Any:
    def accesses(args: Args) -> Sequence[Access]:
        w, x, ids, y, n_expert, n_out, n_in = args[:7]
        return [
            weights_access(fmt, w, n_expert, n_out, n_in),
            Access(_as_view(x), write=False),
            Access(_as_view(ids), write=False),
            *[Access(a, write=False) for a in args[10:12] if isinstance(a, BufferView)],
            Access(_as_view(y), write=True),
        ]

    return accesses


def _gemv_flops(args: Args) -> float:
    return 2.0 * int(args[9]) * int(args[5]) * int(args[6])


# -- the direct-decode kernels (direct.cu) --------------------------------------------------
# moe_round_x_direct args: x, xb, n_rows, n_in
# moe_mul_mat_id_direct_*: w, xb, scratch, y, n_expert, n_out, n_in, top_k, x_per_pair, max_tiles, route_weights
# moe_gate_up_direct_*: w_gate, w_up, xb, scratch, y, n_expert, n_out, n_in, top_k, x_per_pair, max_tiles

# Element pair p of a chunk lies at word _PAIR_SLOTS[p] of the chunk in direct.cu's fragment order.
_PAIR_SLOTS = np.array([layout.direct_pair_slot(p) for p in range(8)])


def round_x_direct(x: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits [n_rows, n_in] of float32 rows as moe_round_x_direct writes them: rounded
    to nearest even, each 16-element chunk's element pairs in fragment order."""
    n_rows, n_in = x.shape
    bits = (round_to_bf16(x).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    pairs = bits.reshape(n_rows, n_in // 16, 8, 2)
    out = np.empty_like(pairs)
    out[:, :, _PAIR_SLOTS] = pairs
    return out.reshape(n_rows, n_in)


def unround_x_direct(xb: np.ndarray, n_in: int) -> np.ndarray:
    """float32 [n_rows, n_in] in element order from rows as round_x_direct lays them out."""
    pairs = np.ascontiguousarray(xb).view(np.uint16).reshape(-1, n_in // 16, 8, 2)[:, :, _PAIR_SLOTS]
    return (pairs.reshape(-1, n_in).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _round_x_direct_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    x_bytes, xb_bytes, n_rows, n_in = args
    x = x_bytes.view(np.float32).reshape(int(n_rows), int(n_in))
    xb_bytes.view(np.uint16).reshape(int(n_rows), int(n_in))[:] = round_x_direct(x)


def _direct_products(
    fmt: WeightFormat, w_bytes: np.ndarray, x: np.ndarray, scratch_bytes: np.ndarray, y: np.ndarray, shape: Args
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(expert, pairs, activations of the pairs padded to the kernel's row width) of each group."""
    n_expert, _n_out, n_in, top_k, x_per_pair, max_tiles = (int(v) for v in shape)
    width = fmt.padded_row_elements(n_in)
    for expert, pairs in _expert_groups(scratch_bytes, max_tiles, n_expert, y):
        acts = np.zeros((pairs.size, width), np.float32)
        acts[:, :n_in] = x[pairs if x_per_pair else pairs // top_k]
        yield expert, pairs, acts


def _direct_runner(fmt: WeightFormat, gate_up: bool) -> Any:
    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        n_w = 2 if gate_up else 1
        tensors, (xb_bytes, scratch_bytes, y_bytes), shape = args[:n_w], args[n_w : n_w + 3], args[n_w + 3 : n_w + 9]
        n_out, n_in = int(shape[1]), int(shape[2])
        x = unround_x_direct(xb_bytes, n_in)
        y = y_bytes.view(np.float32).reshape(-1, n_out)
        route_weights = args[-1] if not gate_up and isinstance(args[-1], np.ndarray) else None
        weights: dict[tuple[int, int], np.ndarray] = {}
        for expert, pairs, acts in _direct_products(fmt, tensors[0], x, scratch_bytes, y, shape):
            out = []
            for i, w_bytes in enumerate(tensors):
                if (i, expert) not in weights:
                    weights[i, expert] = round_to_bf16(_padded_rows(w_bytes, fmt, expert, n_out, n_in))
                out.append(np.einsum("mk,nk->mn", acts, weights[i, expert]))
            if gate_up:
                with np.errstate(over="ignore"):
                    y[pairs] = out[0] / (np.float32(1) + np.exp(-out[0])) * out[1]
            elif route_weights is not None:
                y[pairs] = route_weights.view(np.float32)[pairs, None] * out[0]
            else:
                y[pairs] = out[0]

    return run


def _direct_accesses_for(fmt: WeightFormat, gate_up: bool) -> Any:
    def accesses(args: Args) -> Sequence[Access]:
        n_w = 2 if gate_up else 1
        n_expert, n_out, n_in = args[n_w + 3 : n_w + 6]
        found = [weights_access(fmt, w, n_expert, n_out, n_in) for w in args[:n_w]]
        found += [Access(_as_view(args[n_w]), write=False), Access(_as_view(args[n_w + 1]), write=False)]
        if not gate_up and isinstance(args[-1], BufferView):
            found.append(Access(args[-1], write=False))
        found.append(Access(_as_view(args[n_w + 2]), write=True))
        return found

    return accesses


def _direct_flops_for(gate_up: bool) -> Any:
    def flops(args: Args) -> float:
        n_w = 2 if gate_up else 1
        y, n_out, n_in = _as_view(args[n_w + 2]), int(args[n_w + 4]), int(args[n_w + 5])
        return 2.0 * n_w * (y.nbytes // (4 * n_out)) * n_out * n_in

    return flops


def _direct_rate_key_for(gate_up: bool) -> Any:
    def key(args: Args) -> tuple[tuple[int, int], float]:
        n_w = 2 if gate_up else 1
        y, n_expert, n_out, n_in = _as_view(args[n_w + 2]), int(args[n_w + 3]), int(args[n_w + 4]), int(args[n_w + 5])
        return (n_out, n_in), y.nbytes / (4 * n_out) / n_expert

    return key


# -- elementwise, reductions, router -------------------------------------------------------


def _swiglu_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    gate, up, out = (a.view(np.float32) for a in args[:3])
    out[:] = _silu_times(gate, up)


# args: y, weights (or 0), extra (or 0), hidden, n_tokens, top_k, n


def combine_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    """moe_combine's twin (dense_combine_rms_norm's first half)."""
    y_bytes, w_bytes, extra_bytes, hidden_bytes, n_tokens, top_k, n = args
    n_tokens, top_k, n = int(n_tokens), int(top_k), int(n)
    y = y_bytes.view(np.float32).reshape(n_tokens, top_k, n)
    acc = np.zeros((n_tokens, n), np.float32)
    for k in range(top_k):  # ascending k, as the kernel sums
        if isinstance(w_bytes, np.ndarray):
            acc += w_bytes.view(np.float32).reshape(n_tokens, top_k, 1)[:, k] * y[:, k]
        else:
            acc += y[:, k]
    if isinstance(extra_bytes, np.ndarray):
        acc += extra_bytes.view(np.float32).reshape(n_tokens, n)
    hidden = hidden_bytes.view(np.float32).reshape(n_tokens, n)
    hidden += acc


def _combine_accesses(args: Args) -> Sequence[Access]:
    reads = [Access(_as_view(a), write=False) for a in (*args[:3], args[3]) if not isinstance(a, np.generic)]
    return [*reads, Access(_as_view(args[3]), write=True)]


def _rms_norm_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    h_bytes, x_bytes, n_tokens, n = args
    h = h_bytes.view(np.float32).reshape(int(n_tokens), int(n))
    mean_square = np.einsum("tn,tn->t", h, h, dtype=np.float32) / np.float32(n)
    scale = np.float32(1) / np.sqrt(mean_square + np.float32(1e-6))
    x_bytes.view(np.float32).reshape(int(n_tokens), int(n))[:] = h * scale[:, None]


def _add_inplace_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    h_bytes, delta_bytes, _n = args
    h = h_bytes.view(np.float32)
    h += delta_bytes.view(np.float32)


def _add_inplace_accesses(args: Args) -> Sequence[Access]:
    h, delta = _as_view(args[0]), _as_view(args[1])
    return [Access(h, write=False), Access(delta, write=False), Access(h, write=True)]


def _reads_then_writes(n_reads: int, n_writes: int) -> Any:
    def accesses(args: Args) -> Sequence[Access]:
        views = [_as_view(a) for a in args[: n_reads + n_writes]]
        return [Access(v, write=i >= n_reads) for i, v in enumerate(views)]

    return accesses


def twin_specs() -> list[KernelSpec]:
    """The twin of every kernel but those routing_twins.py has, for the launcher to hand to each compile."""
    specs = [
        KernelSpec("moe_group_count", _group_count_run, _group_count_accesses, _group_flops),
        KernelSpec("moe_group_place", _group_place_run, _group_place_accesses, _group_flops),
    ]
    specs.append(
        KernelSpec(
            "moe_quantize_x", _quantize_run, _reads_then_writes(1, 1), lambda args: 3.0 * int(args[2]) * int(args[3])
        )
    )
    for fmt in FORMATS.values():
        for path in MatrixPath:
            for tile_m in fmt.tiles_on(path):
                specs.append(
                    KernelSpec(
                        fmt.kernel_name(tile_m, path),
                        _mul_mat_id_runner(fmt, path),
                        _mul_mat_id_accesses_for(fmt),
                        _mul_mat_id_flops,
                        mul_mat_id_rate_key,
                    )
                )
    specs += [
        KernelSpec(name, gemv_runner(fmt), _gemv_accesses_for(fmt), _gemv_flops, mul_mat_id_rate_key)
        for fmt in FORMATS.values()
        for name in (fmt.gemv_kernel_name, fmt.gemv_one_row_kernel_name)  # a row's sum is the same in both
    ]
    specs += [
        KernelSpec(
            fmt.gemv_parts_kernel_name,
            _gemv_parts_runner(fmt),
            _gemv_parts_accesses_for(fmt),
            _gemv_parts_flops,
        )
        for fmt in FORMATS.values()
    ]
    specs += [
        KernelSpec(
            fmt.gemv_gate_up_kernel_name,
            _gemv_gate_up_runner(fmt),
            _gemv_gate_up_accesses_for(fmt),
            _gemv_gate_up_flops,
            _direct_rate_key_for(True),
        )
        for fmt in FORMATS.values()
    ]
    specs.append(
        KernelSpec(
            "moe_round_x_direct",
            _round_x_direct_run,
            _reads_then_writes(1, 1),
            lambda args: float(args[2]) * int(args[3]),
        )
    )
    for fmt in FORMATS.values():
        for tile_m in fmt.direct_tiles:
            for gate_up in (False, True):
                specs.append(
                    KernelSpec(
                        fmt.direct_kernel_name(tile_m, gate_up),
                        _direct_runner(fmt, gate_up),
                        _direct_accesses_for(fmt, gate_up),
                        _direct_flops_for(gate_up),
                        _direct_rate_key_for(gate_up),
                    )
                )
    specs.append(KernelSpec("moe_swiglu", _swiglu_run, _reads_then_writes(2, 1), lambda args: 4.0 * int(args[3])))
    specs.append(
        KernelSpec(
            "moe_combine",
            combine_run,
            _combine_accesses,
            lambda args: 2.0 * int(args[4]) * int(args[5]) * int(args[6]),
        )
    )
    specs.append(
        KernelSpec(
            "moe_rms_norm",
            _rms_norm_run,
            _reads_then_writes(1, 1),
            lambda args: 3.0 * int(args[2]) * int(args[3]),
        )
    )
    specs.append(KernelSpec("moe_add_inplace", _add_inplace_run, _add_inplace_accesses, lambda args: float(args[2])))
    return specs
