"""Typed launchers of the MoE kernels: expert matmul by routing ids, SwiGLU, the weighted sum
of the top-k outputs, router top-k.

``MoeKernels(device)`` compiles the source of program.py through ``device.compile`` (NVRTC or
hipRTC; the simulator runs the numpy twin of twins.py, routing_twins.py or dense_twins.py that
each compile hands over) and launches the kernels with validated arguments. Every method only enqueues work
on the given stream. A kernel's module holds the shared code and the mul_mat_id instances of
its own weight type only: a model of one type compiles two small modules, not every type's
kernels.

mul_mat_id has three paths (``layout.MatrixPath``): the float32 SIMT kernels of simt.cu, the
bf16 matrix-core kernels of mma.cu (float32 accumulation), and the int8 kernels of int8.cu
(weight quants times activations quantized per 32-element block, int32 products, float32
accumulation) for the types that have one. By default each type takes the path
``layout.default_path`` gives for the device's capabilities: SIMT without matrix cores, INT8
for the types of ``layout.INT8_DEFAULT_TYPES`` where int8 matrix instructions exist, MMA
otherwise. ``MoeKernels(device, path)`` asks for one path for every type (types without an
int8 kernel take MMA when INT8 is asked for); ``path_for`` says which one a type takes. On
one device and path, outputs are byte-identical however the pairs are grouped into tiles.

On the MMA path, Q4_0, Q4_K, Q6_K and MXFP4 rows (of a multiple of 64 elements) take the direct-decode kernels
of direct.cu where the device has ``Capabilities.mma_fragments`` (NVIDIA sm_80+), whatever the
number of pairs (``uses_direct``; ``MoeKernels(device, direct=False)`` keeps the shared-tile
kernels). Only those kernels have the fused forms: ``gate_up`` (gate, up and SwiGLU in one pass)
and mul_mat_id's ``route_weights`` (each row scaled by its pair's routing weight).

``MoeKernels(device, gemv=True)`` takes the matrix-vector kernels of gemv.cu for calls of at most
``layout.GEMV_MAX_PAIRS`` (token, k) pairs (decode): two weight rows per 32-lane wave, no grouping
pass, float32 products on every path but for the types of ``layout.GEMV_INT8_TYPES``, whose rows
meet the activations on the int8 grid (``uses_gemv``). Off by default here; the engine asks for it.

Shapes (all float32 unless noted, row-major, contiguous):

- ``mul_mat_id``: w [n_expert][n_out][n_in] of ``w_type`` (layout.FORMATS lists the
  supported types) with ggml's padding tail for quantized rows; x [n_tokens, n_in] shared by
  a token's top_k pairs, or [n_tokens, top_k, n_in] when ``x_per_pair``; ids int32
  [n_tokens, top_k]; y [n_tokens, top_k, n_out]. Ids outside [0, n_expert) give NaN rows,
  never a stray read.
- ``swiglu``: out[i] = silu(gate[i]) * up[i] for n elements.
- ``weighted_sum``: out[t, :] = sum_k weights[t, k] * y[t, k, :] (k ascending; combine into zeros).
- ``combine``: hidden[t, :] += sum_k weights[t, k] * y[t, k, :] (or sum_k y[t, k, :] without
  weights) + extra[t, :] (a shared expert's output, optional): the end of an MoE layer.
- ``router_topk``: logits = x @ router^T with router [n_expert, n_embd]; ids int32
  [n_tokens, top_k] of the largest logits, descending, ties to the lower id; weights
  [n_tokens, top_k] = softmax over the selected logits.

Scratch: mul_mat_id groups the pairs by expert on the device into an int32 scratch buffer
of ``scratch_bytes(...)``, where the int8 path also keeps the quantized activations (16-byte
aligned there). Pass ``scratch`` to own it; without it the instance uses one buffer of its
own, grown when a call needs more and freed by ``close()``. That buffer is shared by every
call of the instance, so calls on concurrent streams must pass their own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._closing import Closing
from ..backends.base import BufferView, Device, DeviceBuffer, Kernel, Stream, Usage
from ..backends.sim import KernelSpec
from ..errors import InvalidArgument
from ..ggml import RowType
from . import attention_twins, dense_twins, layout, recurrent_twins, routing, routing_twins, twins
from .args import ViewLike, fits_int32, positive, view, weight_view
from .layout import MatrixPath, TileM, WeightFormat, weight_format
from .program import kernel_source, module_types

log = logging.getLogger(__name__)

# Each kernel's numpy twin, handed to every compile: the simulator runs it, GPU backends ignore it.
TWINS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        *twins.twin_specs(),
        *routing_twins.twin_specs(),
        *dense_twins.twin_specs(),
        *attention_twins.twin_specs(),
        *recurrent_twins.twin_specs(),
    )
}


def default_path(device: Device, w_type: RowType) -> MatrixPath:
    """The path ``w_type`` takes on ``device`` by default (layout.default_path, from its capabilities)."""
    caps = device.capabilities
    return layout.default_path(w_type, caps.matrix_cores, caps.int8_matrix_cores)


def check_path(device: Device, path: MatrixPath | None) -> None:
    """Refuse a path ``device`` has no matrix instructions for (None: each type's default there)."""
    caps = device.capabilities
    if path is MatrixPath.MMA and not caps.matrix_cores:
        missing = "bf16 matrix instructions"
    elif path is MatrixPath.INT8 and not caps.int8_matrix_cores:
        missing = "int8 matrix instructions"
    else:
        return
    raise InvalidArgument(
        f"{device.label} ({device.name}) has no {missing} for matrix path {path.value!r}",
        hint="use auto (each expert type's default path on the device) or simt",
    )


def scratch_bytes(n_tokens: int, top_k: int, n_expert: int, n_in: int, x_per_pair: bool = False) -> int:
    """Bytes of scratch mul_mat_id needs for this many pairs and experts (any tile, any path).

    The grouping words, then the activations as the matrix kernel reads them: quantized per
    32-element block (int8 path) or rounded to bf16 (direct kernels).
    """
    n_pairs = n_tokens * top_k
    x_rows = n_pairs if x_per_pair else n_tokens
    converted = max(layout.quantized_x_bytes(x_rows, n_in), layout.direct_x_bytes(x_rows, n_in))
    return layout.quantized_x_offset(n_pairs, n_expert, min(TileM)) + converted


def _direct_views(
    call: str, x: ViewLike, ids: ViewLike, n_tokens: int, top_k: int, n_in: int, x_per_pair: bool
) -> tuple[BufferView, BufferView, int]:
    """The activation rows and ids a direct call of these shapes reads, and the number of rows."""
    x_rows = n_tokens * top_k if x_per_pair else n_tokens
    return view(call, "x", x, x_rows * n_in * 4, 4), view(call, "ids", ids, n_tokens * top_k * 4, 4), x_rows


def gemv_launch(fmt: WeightFormat, n_out: int, n_pairs: int) -> tuple[str, int]:
    """The matrix-vector mul_mat_id kernel of ``fmt`` for ``n_pairs`` pairs of ``n_out`` rows, and the
    rows each of its blocks computes: one row a wave for a launch of fewer than GEMV_ONE_ROW_UNDER rows
    in all, two otherwise. Either writes the same bytes."""
    if n_out * n_pairs < layout.GEMV_ONE_ROW_UNDER:
        return fmt.gemv_one_row_kernel_name, layout.GEMV_ONE_ROW_ROWS
    return fmt.gemv_kernel_name, layout.GEMV_ROWS


def _i32(value: int) -> np.int32:
    return np.int32(value)


@dataclass(frozen=True)
class DirectInputs:
    """Activation rows rounded and (token, k) pairs grouped for the direct kernels, in a scratch of
    their own (``MoeKernels.prepare_direct``). mul_mat_id calls of the same ``x``, ``ids``, shapes and
    tile height take them (``prepared=``) instead of rounding and grouping again: the Q, K and V
    projections of one token batch read one input. Valid until the next prepare_direct of the
    same kernels, in stream order."""

    x: BufferView
    ids: BufferView
    n_tokens: int
    top_k: int
    n_expert: int
    n_in: int
    tile_m: TileM
    groups: BufferView  # the grouping words
    rounded: BufferView  # the rows rounded to bf16
    x_per_pair: bool = False  # x holds a row per (token, k) pair (a down projection's input)

    def matches(
        self,
        x: BufferView,
        ids: BufferView,
        n_tokens: int,
        top_k: int,
        n_expert: int,
        n_in: int,
        tile_m: TileM,
        x_per_pair: bool = False,
    ) -> bool:
        """Whether a call of these inputs and tile height reads exactly what was prepared."""
        return (x, n_in, x_per_pair) == (self.x, self.n_in, self.x_per_pair) and self.groups_match(
            ids, n_tokens, top_k, n_expert, tile_m
        )

    def groups_match(self, ids: BufferView, n_tokens: int, top_k: int, n_expert: int, tile_m: TileM) -> bool:
        """Whether these ids and tile height group as what was prepared."""
        return (ids, n_tokens, top_k, n_expert, tile_m) == (
            self.ids,
            self.n_tokens,
            self.top_k,
            self.n_expert,
            self.tile_m,
        )


class MoeKernels(Closing):
    """Typed launchers for the MoE kernels on one device."""

    def __init__(
        self,
        device: Device,
        path: MatrixPath | None = None,
        direct: bool = True,
        gemv: bool = False,
        decode_epilogues: bool | None = None,
    ) -> None:
        self.device = device
        # None: each type takes its default path on this device (layout.default_path).
        self.path = path
        # Whether the MMA path takes direct.cu's kernels where they apply (benchmarks turn it off to
        # compare them with the shared-tile kernels of mma.cu).
        self.direct = direct
        # Whether calls of few pairs take gemv.cu's matrix-vector kernels (uses_gemv). The runner asks
        # for them by default: on the H200 a decode step took 3.7 ms with them and 6.6 ms on the tile
        # kernels (microbench/decode_profile.py, 8 layers of qwen3-30b-a3b Q4_K_M).
        self.gemv = gemv
        # Whether decode joins a launch's work to the one before it in the launch's last block(s): the
        # attention's combine, the output projection's residual add and FFN norm, the down projection's
        # combine and next norm (the same bytes either way). Off: on an H100 each ran slower than the two
        # launches it replaces (docs/results/decode-round4.md). None reads $EXPERTSTREAM_DECODE_EPILOGUES.
        self.decode_epilogues = (
            layout.decode_epilogues_from_environment() if decode_epilogues is None else decode_epilogues
        )
        self._prepared: DirectInputs | None = None  # the last prepare_direct's: what its scratch holds
        if path is MatrixPath.SIMT and device.capabilities.matrix_cores:
            log.info("mul_mat_id on %s takes the float32 SIMT path although it has matrix cores", device.label)
        self._sources: dict[tuple[RowType, ...], str] = {}  # by module_types
        self._kernels: dict[str, Kernel] = {}
        # Per owner (a launcher's name): the last is current; earlier ones may still be in use.
        self._scratch: dict[str, list[DeviceBuffer]] = {}

    def path_for(self, w_type: RowType) -> MatrixPath:
        """The path mul_mat_id takes for ``w_type``: the one asked for (types without an int8 kernel
        take MMA there), else the device's default for the type."""
        if self.path is None:
            return default_path(self.device, w_type)
        return weight_format(w_type).path_on(self.path)

    def uses_direct(self, w_type: RowType, n_in: int) -> bool:
        """Whether mul_mat_id of ``w_type`` rows of ``n_in`` elements takes a direct-decode kernel
        (direct.cu): on the MMA path, on devices with mma_fragments, for the types that have one.
        Only those kernels fuse gate, up and SwiGLU (``gate_up``) and scale by routing weights."""
        fmt = weight_format(w_type)
        return (
            self.direct
            and self.device.capabilities.mma_fragments
            and self.path_for(w_type) is MatrixPath.MMA
            and fmt.direct_fits(n_in)
        )

    def uses_gemv(self, n_pairs: int) -> bool:
        """Whether mul_mat_id of ``n_pairs`` (token, k) pairs takes a matrix-vector kernel (gemv.cu):
        when asked for (``gemv``) and for at most layout.GEMV_MAX_PAIRS pairs (mul_mat_id keeps the tile
        kernels when given a tile height). It computes in float32 whatever the path, and takes
        ``route_weights`` where the direct kernels would."""
        return self.gemv and n_pairs <= layout.GEMV_MAX_PAIRS

    def tile_for(self, w_type: RowType, n_pairs: int, n_expert: int, n_in: int) -> TileM:
        """The tile height mul_mat_id picks for this type, number of pairs and experts, and rows of
        ``n_in`` elements (which decide whether a direct-decode kernel fits)."""
        if self.uses_direct(w_type, n_in):
            return weight_format(w_type).direct_tile_for(n_pairs, n_expert)
        return weight_format(w_type).tile_for(n_pairs, n_expert, self.path_for(w_type))

    def direct_tile(self, w_type: RowType, n_pairs: int, n_expert: int, n_in: int) -> TileM | None:
        """The direct kernel's tile height a mul_mat_id of these shapes takes; None where it takes
        another kernel (the matrix-vector ones for a few pairs, or a type or row with no direct kernel)."""
        if self.uses_gemv(n_pairs) or not self.uses_direct(w_type, n_in):
            return None
        return weight_format(w_type).direct_tile_for(n_pairs, n_expert)

    def mul_mat_id_kernel(
        self, w_type: RowType, n_pairs: int, n_expert: int, n_in: int, n_out: int = layout.GEMV_ONE_ROW_UNDER
    ) -> str:
        """The name of the matrix kernel mul_mat_id launches for these shapes (see ``uses_gemv``,
        ``gemv_launch`` and ``tile_for``); ``n_out``, one expert's output rows, only picks between
        the matrix-vector kernels (by default as many as take two rows a wave)."""
        fmt = weight_format(w_type)
        if self.uses_gemv(n_pairs):
            return gemv_launch(fmt, n_out, n_pairs)[0]
        tile = self.tile_for(w_type, n_pairs, n_expert, n_in)
        if self.uses_direct(w_type, n_in):
            return fmt.direct_kernel_name(tile)
        return fmt.kernel_name(tile, self.path_for(w_type))

    def kernel(self, name: str) -> Kernel:
        """Kernel ``name``, compiled on first use with the shared code and its own type's instances only."""
        kernel = self._kernels.get(name)
        if kernel is None:
            types = module_types(name)
            source = self._sources.get(types)
            if source is None:
                source = self._sources[types] = kernel_source(types)
            # Every kernel of the source opens with KERNEL_PROLOGUE, or a prefetch_* helper and then it
            # (a source test says so).
            kernel = self._kernels[name] = self.device.compile(source, name, twin=TWINS.get(name), chained=True)
        return kernel

    def prepare(self, w_types: Iterable[RowType]) -> None:
        """Compile now what the kernels of a model with experts of ``w_types`` need (else on first use)."""
        self.kernel("moe_swiglu")
        for w_type in w_types:
            self.kernel(self.mul_mat_id_kernel(w_type, 1, 1, layout.DIRECT_K))
            if self.uses_gemv(1):
                self.kernel(weight_format(w_type).gemv_gate_up_kernel_name)
            if self.uses_direct(w_type, layout.DIRECT_K):
                self.kernel(weight_format(w_type).direct_kernel_name(TileM.SHORT, gate_up=True))
                self.kernel("moe_round_x_direct")

    def mul_mat_id(
        self,
        stream: Stream,
        w: ViewLike,
        w_type: RowType,
        n_expert: int,
        n_out: int,
        n_in: int,
        x: ViewLike,
        x_per_pair: bool,
        ids: ViewLike,
        n_tokens: int,
        top_k: int,
        y: ViewLike,
        scratch: ViewLike | None = None,
        tile_m: TileM | None = None,
        route_weights: ViewLike | None = None,
        prepared: DirectInputs | None = None,
        silu_gate: ViewLike | None = None,
        gemv: bool | None = None,
    ) -> None:
        """y[t, k, :] = W[ids[t, k]] @ x[t] (or x[t, k]) with float32 accumulation.

        ``tile_m`` overrides the tile height chosen for the number of pairs per expert
        (benchmarks compare them); results are the same bytes with either. Given, it also keeps a
        call of few pairs on the tile kernels where ``uses_gemv`` would take the matrix-vector one.
        ``route_weights`` (float32 [n_tokens, top_k], where ``uses_direct`` holds: the direct kernels,
        or the matrix-vector ones in their place) scales each pair's row:
        y[t, k, :] = route_weights[t, k] * (W[ids[t, k]] @ x).
        ``prepared`` (``prepare_direct`` of this x, ids and shapes): the rounded rows and groups to
        read, for a call that takes a direct kernel of the tile height they were grouped for.
        ``silu_gate`` (float32 [n_tokens, top_k, n_out], a call that takes the matrix-vector kernels):
        y = silu(silu_gate) * (W x), the bytes of this call without it followed by ``swiglu``.
        ``gemv``: None takes the matrix-vector kernels where ``uses_gemv(n_pairs)`` does; True takes them
        for any number of pairs where this instance takes them at all (pairs that each read a weight
        of their own, such as one token's heads through per-head tensors, read every row once either
        way, and one launch replaces the tile path's grouping); False keeps the tile kernels.
        """
        call = "MoeKernels.mul_mat_id"
        fmt = weight_format(w_type)
        path = self.path_for(w_type)
        positive(call, n_expert=n_expert, n_out=n_out, n_in=n_in, n_tokens=n_tokens, top_k=top_k)
        self._check_mul_mat_id_shapes(call, fmt, n_expert, n_out, n_in, n_tokens * top_k)
        n_pairs = n_tokens * top_k
        direct = self.uses_direct(w_type, n_in)
        gemv = tile_m is None and (self.uses_gemv(n_pairs) if gemv is None else gemv and self.gemv)
        if gemv and n_pairs > layout.MAX_GRID_Y:
            raise InvalidArgument(
                f"{n_pairs} pairs are more than one matrix-vector launch takes (at most {layout.MAX_GRID_Y})",
                call=call,
                hint="leave gemv to uses_gemv, or split the call",
            )
        if route_weights is not None and not direct:
            raise InvalidArgument(
                f"route_weights needs a direct-decode kernel, which {fmt.qtype.name} rows of {n_in} elements on "
                f"{self.device.label} do not take",
                call=call,
                hint="check uses_direct() first, or scale the rows afterwards (weighted_sum)",
            )
        tiles_here = fmt.direct_tiles if direct else fmt.tiles_on(path)
        if tile_m is None:
            tile_m = self.tile_for(w_type, n_pairs, n_expert, n_in)
        elif tile_m not in tiles_here:
            shown = ", ".join(str(int(t)) for t in tiles_here)
            raise InvalidArgument(
                f"{fmt.qtype.name} has no {int(tile_m)}-row tile on the {path.value} path",
                call=call,
                hint=f"tile heights there: {shown}",
            )
        align = layout.DIRECT_ALIGN if direct and not gemv else fmt.unit_bytes
        w_view = weight_view(call, "w", w, fmt, n_expert, n_out, n_in, align)
        x_rows = n_pairs if x_per_pair else n_tokens
        x_view = view(call, "x", x, x_rows * n_in * 4, 4)
        ids_view = view(call, "ids", ids, n_pairs * 4, 4)
        y_view = view(call, "y", y, n_pairs * n_out * 4, 4)
        weights_view = None if route_weights is None else view(call, "route_weights", route_weights, n_pairs * 4)
        gate_view = None if silu_gate is None else view(call, "silu_gate", silu_gate, n_pairs * n_out * 4, 4)
        if gate_view is not None and not (gemv and weights_view is None):
            raise InvalidArgument(
                "silu_gate is an epilogue of the matrix-vector kernels, without route_weights",
                call=call,
                hint="check uses_gemv() first, or run swiglu after the call",
            )
        if prepared is not None and prepared is not self._prepared:
            raise InvalidArgument(
                "prepared inputs were overwritten by a later prepare_direct",
                call=call,
                hint="prepare_direct again, or leave prepared out",
            )
        if prepared is not None and not (
            direct
            and not gemv
            and prepared.matches(x_view, ids_view, n_tokens, top_k, n_expert, n_in, tile_m, x_per_pair)
        ):
            raise InvalidArgument(
                "prepared inputs were made for other activations, ids, shapes or tile height, or this call "
                f"takes no direct kernel ({fmt.qtype.name} rows of {n_in} elements, {n_pairs} pairs)",
                call=call,
                hint="prepare_direct with this call's x, ids and tile_for(), or leave prepared out",
            )
        if gemv:
            name, block_rows = gemv_launch(fmt, n_out, n_pairs)
            stream.launch(
                self.kernel(name),
                (-(-n_out // block_rows), n_pairs),
                layout.GEMV_THREADS,
                (
                    w_view,
                    x_view,
                    ids_view,
                    y_view,
                    _i32(n_expert),
                    _i32(n_out),
                    _i32(n_in),
                    _i32(top_k),
                    _i32(1 if x_per_pair else 0),
                    _i32(n_pairs),
                    np.uint64(0) if weights_view is None else weights_view,
                    np.uint64(0) if gate_view is None else gate_view,
                ),
            )
            return
        if direct:
            name = fmt.direct_kernel_name(tile_m)
            self._direct(
                stream,
                call,
                name,
                (w_view,),
                x_view,
                ids_view,
                y_view,
                scratch,
                tile_m,
                (n_expert, n_out, n_in, n_tokens, top_k, x_per_pair),
                weights_view,
                prepared,
            )
            return
        tiles = layout.max_tiles(n_pairs, n_expert, tile_m)
        words = layout.scratch_words(n_pairs, n_expert, tile_m)
        need = words * 4
        if path is MatrixPath.INT8:
            xq_at = layout.quantized_x_offset(n_pairs, n_expert, tile_m)
            need = xq_at + layout.quantized_x_bytes(x_rows, n_in)
        align = layout.SCRATCH_ALIGN if path is MatrixPath.INT8 else 4
        whole = self.scratch("mul_mat_id", need) if scratch is None else view(call, "scratch", scratch, need, align)
        scratch_view = BufferView(whole.buffer, whole.offset, words * 4)
        if path is MatrixPath.INT8:
            # The int8 kernel reads the activations as the quantizer leaves them in the scratch.
            x_floats, x_view = x_view, BufferView(whole.buffer, whole.offset + xq_at, need - xq_at)
            quant_blocks = x_rows * (n_in // layout.QUANT_BLOCK)
            stream.launch(
                self.kernel("moe_quantize_x"),
                -(-quant_blocks // layout.QUANT_THREADS),
                layout.QUANT_THREADS,
                (x_floats, x_view, _i32(x_rows), _i32(n_in)),
            )
        self._group(stream, ids_view, scratch_view, n_pairs, n_expert, tile_m, tiles)
        threads = {MatrixPath.SIMT: layout.MMID_THREADS, MatrixPath.MMA: layout.MMA_THREADS}.get(
            path, layout.INT8_THREADS
        )
        stream.launch(
            self.kernel(fmt.kernel_name(tile_m, path)),
            (-(-n_out // layout.TILE_N), tiles),
            threads,
            (
                w_view,
                x_view,
                scratch_view,
                y_view,
                _i32(n_expert),
                _i32(n_out),
                _i32(n_in),
                _i32(top_k),
                _i32(1 if x_per_pair else 0),
                _i32(tiles),
            ),
        )

    def gate_up(
        self,
        stream: Stream,
        w_gate: ViewLike,
        w_up: ViewLike,
        w_type: RowType,
        n_expert: int,
        n_out: int,
        n_in: int,
        x: ViewLike,
        ids: ViewLike,
        n_tokens: int,
        top_k: int,
        y: ViewLike,
        scratch: ViewLike | None = None,
        tile_m: TileM | None = None,
    ) -> None:
        """y[t, k, :] = silu(G @ x[t]) * (U @ x[t]) with G, U = w_gate[ids[t, k]], w_up[ids[t, k]]:
        gate, up and SwiGLU in one pass, where a direct kernel fits (``uses_direct``) or the call takes
        the matrix-vector kernels (``uses_gemv``, unless ``tile_m`` is given). The same bytes as
        mul_mat_id of each tensor followed by swiglu."""
        call = "MoeKernels.gate_up"
        fmt = weight_format(w_type)
        positive(call, n_expert=n_expert, n_out=n_out, n_in=n_in, n_tokens=n_tokens, top_k=top_k)
        self._check_mul_mat_id_shapes(call, fmt, n_expert, n_out, n_in, n_tokens * top_k)
        if tile_m is None and self.uses_gemv(n_tokens * top_k):
            self._gate_up_vec(stream, call, fmt, (w_gate, w_up), n_expert, n_out, n_in, x, ids, n_tokens, top_k, y)
            return
        if not self.uses_direct(w_type, n_in):
            raise InvalidArgument(
                f"gate_up needs a direct-decode kernel, which {fmt.qtype.name} rows of {n_in} elements on "
                f"{self.device.label} do not take",
                call=call,
                hint="check uses_direct() or uses_gemv() first, or run mul_mat_id for each tensor and then swiglu",
            )
        n_pairs = n_tokens * top_k
        if tile_m is None:
            tile_m = fmt.direct_tile_for(n_pairs, n_expert)
        elif tile_m not in fmt.direct_tiles:
            shown = ", ".join(str(int(t)) for t in fmt.direct_tiles)
            raise InvalidArgument(f"no {int(tile_m)}-row tile for gate_up", call=call, hint=f"tile heights: {shown}")
        weights = tuple(
            weight_view(call, name, w, fmt, n_expert, n_out, n_in, layout.DIRECT_ALIGN)
            for name, w in (("w_gate", w_gate), ("w_up", w_up))
        )
        self._direct(
            stream,
            call,
            fmt.direct_kernel_name(tile_m, gate_up=True),
            weights,
            view(call, "x", x, n_tokens * n_in * 4, 4),
            view(call, "ids", ids, n_pairs * 4, 4),
            view(call, "y", y, n_pairs * n_out * 4, 4),
            scratch,
            tile_m,
            (n_expert, n_out, n_in, n_tokens, top_k, False),
            None,
        )

    def mul_mat_vec_parts(
        self,
        stream: Stream,
        w_type: RowType,
        n_in: int,
        x: ViewLike,
        n_tokens: int,
        parts: Sequence[tuple[ViewLike, int, ViewLike]],
    ) -> None:
        """y_p[t] = W_p @ x[t] for up to three dense projections (W_p, n_out_p, y_p) of one weight type
        and row length that read the same ``n_tokens`` rows x, in one matrix-vector launch: the bytes of
        one ``mul_mat_id`` of one expert per part. For as many rows as ``uses_gemv`` takes."""
        call = "MoeKernels.mul_mat_vec_parts"
        fmt = weight_format(w_type)
        positive(call, n_in=n_in, n_tokens=n_tokens)
        if not 1 <= len(parts) <= 3:
            raise InvalidArgument(f"{len(parts)} parts; the kernel runs one to three", call=call)
        if not self.uses_gemv(n_tokens):
            raise InvalidArgument(
                f"{n_tokens} rows take the tile kernels, not the matrix-vector ones",
                call=call,
                hint="check uses_gemv() first, or run one mul_mat_id per projection",
            )
        weights, outputs, n_outs = [], [], []
        for p, (w, n_out, y) in enumerate(parts):
            positive(call, n_out=n_out)
            self._check_mul_mat_id_shapes(call, fmt, 1, n_out, n_in, n_tokens)
            weights.append(weight_view(call, f"w{p}", w, fmt, 1, n_out, n_in, fmt.unit_bytes))
            outputs.append(view(call, f"y{p}", y, n_tokens * n_out * 4, 4))
            n_outs.append(n_out)
        absent = 3 - len(parts)
        null = [np.uint64(0)] * absent
        stream.launch(
            self.kernel(fmt.gemv_parts_kernel_name),
            (-(-max(n_outs) // layout.GEMV_ROWS), len(parts) * n_tokens),
            layout.GEMV_THREADS,
            (
                *weights,
                *null,
                view(call, "x", x, n_tokens * n_in * 4, 4),
                *outputs,
                *null,
                *(_i32(n) for n in n_outs + [0] * absent),
                _i32(n_in),
                _i32(n_tokens),
            ),
        )

    def _gate_up_vec(
        self,
        stream: Stream,
        call: str,
        fmt: WeightFormat,
        weights: tuple[ViewLike, ViewLike],
        n_expert: int,
        n_out: int,
        n_in: int,
        x: ViewLike,
        ids: ViewLike,
        n_tokens: int,
        top_k: int,
        y: ViewLike,
    ) -> None:
        """gate_up of a few pairs on the matrix-vector kernel: a gate row and an up row a wave."""
        n_pairs = n_tokens * top_k
        w_gate = weight_view(call, "w_gate", weights[0], fmt, n_expert, n_out, n_in, fmt.unit_bytes)
        w_up = weight_view(call, "w_up", weights[1], fmt, n_expert, n_out, n_in, fmt.unit_bytes)
        stream.launch(
            self.kernel(fmt.gemv_gate_up_kernel_name),
            (-(-n_out // layout.GEMV_GATE_UP_ROWS), n_pairs),
            layout.GEMV_THREADS,
            (
                w_gate,
                w_up,
                view(call, "x", x, n_tokens * n_in * 4, 4),
                view(call, "ids", ids, n_pairs * 4, 4),
                view(call, "y", y, n_pairs * n_out * 4, 4),
                _i32(n_expert),
                _i32(n_out),
                _i32(n_in),
                _i32(top_k),
                _i32(n_pairs),
            ),
        )

    def _group(
        self, stream: Stream, ids: BufferView, scratch: BufferView, n_pairs: int, n_expert: int, tile_m: int, tiles: int
    ) -> None:
        blocks = layout.group_blocks(n_pairs)
        stream.launch(
            self.kernel("moe_group_count"),
            blocks,
            layout.GROUP_THREADS,
            (ids, scratch, _i32(n_pairs), _i32(n_expert), _i32(tiles)),
        )
        stream.launch(
            self.kernel("moe_group_place"),
            blocks,
            layout.GROUP_THREADS,
            (ids, scratch, _i32(n_pairs), _i32(n_expert), _i32(tile_m), _i32(tiles)),
        )

    def prepare_direct(
        self,
        stream: Stream,
        x: ViewLike,
        ids: ViewLike,
        n_tokens: int,
        top_k: int,
        n_expert: int,
        n_in: int,
        tile_m: TileM,
        x_per_pair: bool = False,
        groups_of: DirectInputs | None = None,
    ) -> DirectInputs:
        """Round ``x`` [n_tokens, n_in] (or [n_tokens, top_k, n_in] with ``x_per_pair``) and group the
        pairs of ``ids`` for direct kernels of ``tile_m`` rows, once, for every mul_mat_id of these
        inputs to take (``prepared=``). ``groups_of``, the last preparation, of the same ids and tile
        height: its groups are taken and only ``x`` is rounded (a down projection after its gate). The
        instance's own scratch holds them until the next call of this method."""
        call = "MoeKernels.prepare_direct"
        positive(call, n_tokens=n_tokens, top_k=top_k, n_expert=n_expert, n_in=n_in)
        if not (self.direct and self.device.capabilities.mma_fragments):
            raise InvalidArgument(
                f"{self.device.label} takes no direct-decode kernels", call=call, hint="check uses_direct() first"
            )
        if n_in % layout.DIRECT_K or tile_m not in layout.DIRECT_TILES:
            raise InvalidArgument(
                f"direct kernels take rows of a multiple of {layout.DIRECT_K} elements and tiles of "
                f"{', '.join(str(int(t)) for t in layout.DIRECT_TILES)} rows, "
                f"not {n_in} elements and {int(tile_m)} rows",
                call=call,
                hint="prepare with tile_for() of a call that uses_direct()",
            )
        n_pairs = n_tokens * top_k
        x_view, ids_view, x_rows = _direct_views(call, x, ids, n_tokens, top_k, n_in, x_per_pair)
        if groups_of is None:
            need = layout.quantized_x_offset(n_pairs, n_expert, tile_m) + layout.direct_x_bytes(x_rows, n_in)
            groups, rounded, _ = self._direct_inputs(
                stream,
                call,
                x_view,
                ids_view,
                self.scratch("direct_inputs", need),
                tile_m,
                (n_expert, n_in, n_tokens, top_k, x_per_pair),
            )
        else:
            if groups_of is not self._prepared or not groups_of.groups_match(
                ids_view, n_tokens, top_k, n_expert, tile_m
            ):
                raise InvalidArgument(
                    "groups_of is not the last preparation, or groups other ids, shapes or tile height",
                    call=call,
                    hint="leave groups_of out: the pairs are then grouped again",
                )
            self._check_direct_rows(call, x_rows, n_in)
            groups = groups_of.groups
            rounded = self.scratch("direct_rounded", layout.direct_x_bytes(x_rows, n_in))
            self._round_direct(stream, x_view, rounded, x_rows, n_in)
        self._prepared = DirectInputs(
            x_view, ids_view, n_tokens, top_k, n_expert, n_in, tile_m, groups, rounded, x_per_pair
        )
        return self._prepared

    def shared_direct(
        self,
        stream: Stream,
        x: ViewLike,
        ids: ViewLike,
        n_tokens: int,
        top_k: int,
        n_expert: int,
        n_in: int,
        tile_m: TileM,
        x_per_pair: bool = False,
    ) -> DirectInputs | None:
        """What the last preparation gives a call of these inputs: itself where it is of these rows,
        ids and tile height; its groups, with ``x`` rounded anew, where only the ids and tile height
        agree (a down projection after its gate); else None. The caller vouches that x and ids still
        hold what they held when it was made."""
        last = self._prepared
        if last is None:
            return None
        x_view, ids_view, _ = _direct_views("MoeKernels.shared_direct", x, ids, n_tokens, top_k, n_in, x_per_pair)
        if last.matches(x_view, ids_view, n_tokens, top_k, n_expert, n_in, tile_m, x_per_pair):
            return last
        if last.groups_match(ids_view, n_tokens, top_k, n_expert, tile_m):
            return self.prepare_direct(
                stream, x_view, ids_view, n_tokens, top_k, n_expert, n_in, tile_m, x_per_pair, groups_of=last
            )
        return None

    def _direct_inputs(
        self,
        stream: Stream,
        call: str,
        x: BufferView,
        ids: BufferView,
        scratch: ViewLike | None,
        tile_m: TileM,
        shape: tuple[int, int, int, int, bool],
    ) -> tuple[BufferView, BufferView, int]:
        """Round the activations and group the pairs into the scratch: (grouping words, rounded rows,
        tiles)."""
        n_expert, n_in, n_tokens, top_k, x_per_pair = shape
        n_pairs = n_tokens * top_k
        x_rows = n_pairs if x_per_pair else n_tokens
        self._check_direct_rows(call, x_rows, n_in)
        tiles = layout.max_tiles(n_pairs, n_expert, tile_m)
        words = layout.scratch_words(n_pairs, n_expert, tile_m)
        xb_at = layout.quantized_x_offset(n_pairs, n_expert, tile_m)
        need = xb_at + layout.direct_x_bytes(x_rows, n_in)
        whole = (
            self.scratch("mul_mat_id", need)
            if scratch is None
            else view(call, "scratch", scratch, need, layout.SCRATCH_ALIGN)
        )
        groups = BufferView(whole.buffer, whole.offset, words * 4)
        xb = BufferView(whole.buffer, whole.offset + xb_at, need - xb_at)
        self._round_direct(stream, x, xb, x_rows, n_in)
        self._group(stream, ids, groups, n_pairs, n_expert, tile_m, tiles)
        return groups, xb, tiles

    @staticmethod
    def _check_direct_rows(call: str, x_rows: int, n_in: int) -> None:
        if x_rows * n_in >= 1 << 32:  # the kernels hold an activation row's start as a 32-bit element offset
            raise InvalidArgument(
                f"{x_rows} activation rows of {n_in} elements are over the 2^32 elements the direct-decode "
                "kernels address",
                call=call,
                hint="split the batch",
            )

    def _round_direct(self, stream: Stream, x: BufferView, xb: BufferView, x_rows: int, n_in: int) -> None:
        """The activation rows rounded to bf16 in the direct kernels' order (moe_round_x_direct)."""
        round_words = x_rows * n_in // 2
        stream.launch(
            self.kernel("moe_round_x_direct"),
            min(-(-round_words // layout.DIRECT_ROUND_THREADS), layout.MAX_GRID_Y),
            layout.DIRECT_ROUND_THREADS,
            (x, xb, _i32(x_rows), _i32(n_in)),
        )

    def _direct(
        self,
        stream: Stream,
        call: str,
        name: str,
        weights: tuple[BufferView, ...],
        x: BufferView,
        ids: BufferView,
        y: BufferView,
        scratch: ViewLike | None,
        tile_m: TileM,
        shape: tuple[int, int, int, int, int, bool],
        route_weights: BufferView | None,
        prepared: DirectInputs | None = None,
    ) -> None:
        """Round the activations into the scratch and group the pairs (or take ``prepared``'s), then
        launch direct kernel ``name``."""
        n_expert, n_out, n_in, n_tokens, top_k, x_per_pair = shape
        if prepared is None:
            groups, xb, tiles = self._direct_inputs(
                stream, call, x, ids, scratch, tile_m, (n_expert, n_in, n_tokens, top_k, x_per_pair)
            )
        else:
            groups, xb = prepared.groups, prepared.rounded
            tiles = layout.max_tiles(n_tokens * top_k, n_expert, tile_m)
        gate_up = len(weights) == 2
        outputs_per_block = layout.TILE_N // 2 if gate_up else layout.TILE_N
        tail: tuple[BufferView | np.uint64, ...] = ()
        if not gate_up:
            tail = (route_weights if route_weights is not None else np.uint64(0),)
        stream.launch(
            self.kernel(name),
            (-(-n_out // outputs_per_block), tiles),
            layout.DIRECT_THREADS,
            (
                *weights,
                xb,
                groups,
                y,
                _i32(n_expert),
                _i32(n_out),
                _i32(n_in),
                _i32(top_k),
                _i32(1 if x_per_pair else 0),
                _i32(tiles),
                *tail,
            ),
        )

    def swiglu(self, stream: Stream, gate: ViewLike, up: ViewLike, out: ViewLike, n: int) -> None:
        """out[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for i < n."""
        call = "MoeKernels.swiglu"
        positive(call, n=n)
        views = [view(call, name, arg, n * 4, 4) for name, arg in (("gate", gate), ("up", up), ("out", out))]
        blocks = min(-(-n // layout.ELEMENTWISE_THREADS), layout.MAX_GRID_Y)
        stream.launch(self.kernel("moe_swiglu"), blocks, layout.ELEMENTWISE_THREADS, (*views, _i32(n)))

    def weighted_sum(
        self, stream: Stream, y: ViewLike, weights: ViewLike, out: ViewLike, n_tokens: int, top_k: int, n: int
    ) -> None:
        """out[t, :] = sum over k ascending of weights[t, k] * y[t, k, :]: combine into a zeroed ``out``."""
        args = self.combine_args("MoeKernels.weighted_sum", y, weights, None, ("out", out), n_tokens, top_k, n)
        target = args[3]
        stream.memset(target.buffer, target.offset, target.nbytes)
        self._launch_combine(stream, args, n_tokens, n)

    def combine(
        self,
        stream: Stream,
        y: ViewLike,
        weights: ViewLike | None,
        extra: ViewLike | None,
        hidden: ViewLike,
        n_tokens: int,
        top_k: int,
        n: int,
    ) -> None:
        """hidden[t, :] += sum over k ascending of weights[t, k] * y[t, k, :] (of y[t, k, :] where
        ``weights`` is None: rows mul_mat_id's route_weights already scaled), + extra[t, :] if given."""
        args = self.combine_args("MoeKernels.combine", y, weights, extra, ("hidden", hidden), n_tokens, top_k, n)
        self._launch_combine(stream, args, n_tokens, n)

    def combine_args(
        self,
        call: str,
        y: ViewLike,
        weights: ViewLike | None,
        extra: ViewLike | None,
        target: tuple[str, ViewLike],
        n_tokens: int,
        top_k: int,
        n: int,
    ) -> tuple[Any, ...]:
        """moe_combine's checked arguments (y, weights, extra, target, n_tokens, top_k, n); ``target`` is
        (its name for messages, the view added into). dense.combine_rms_norm passes them on too."""
        positive(call, n_tokens=n_tokens, top_k=top_k, n=n)
        fits_int32(call, y=n_tokens * top_k * n)
        null = np.uint64(0)
        return (
            view(call, "y", y, n_tokens * top_k * n * 4, 4),
            null if weights is None else view(call, "weights", weights, n_tokens * top_k * 4, 4),
            null if extra is None else view(call, "extra", extra, n_tokens * n * 4, 4),
            view(call, target[0], target[1], n_tokens * n * 4, 4),
            _i32(n_tokens),
            _i32(top_k),
            _i32(n),
        )

    def _launch_combine(self, stream: Stream, args: tuple[Any, ...], n_tokens: int, n: int) -> None:
        grid = (-(-n // layout.ELEMENTWISE_THREADS), min(n_tokens, layout.MAX_GRID_Y))
        stream.launch(self.kernel("moe_combine"), grid, layout.ELEMENTWISE_THREADS, args)

    def router_topk(
        self,
        stream: Stream,
        x: ViewLike,
        router: ViewLike,
        n_tokens: int,
        n_embd: int,
        n_expert: int,
        top_k: int,
        ids: ViewLike,
        weights: ViewLike,
    ) -> None:
        """ids, weights = top_k of x @ router^T per token, softmax over the selected logits.

        Two launches: the logits (spread over the experts, so one token's take as many blocks as
        the router has waves of experts), then the selection, into this instance's scratch."""
        call = "MoeKernels.router_topk"
        positive(call, n_tokens=n_tokens, n_embd=n_embd, n_expert=n_expert, top_k=top_k)
        if n_expert > layout.ROUTER_MAX_EXPERTS:
            raise InvalidArgument(
                f"router_topk handles at most {layout.ROUTER_MAX_EXPERTS} experts, got {n_expert}", call=call
            )
        if top_k > min(n_expert, layout.ROUTER_MAX_K):
            raise InvalidArgument(
                f"top_k {top_k} exceeds min(n_expert, {layout.ROUTER_MAX_K}) = {min(n_expert, layout.ROUTER_MAX_K)}",
                call=call,
            )
        fits_int32(call, x=n_tokens * n_embd, router=n_expert * n_embd)
        logits = self.scratch("router_topk", n_tokens * n_expert * 4)
        routing.router_logits(self, stream, x, router, None, logits, n_tokens, n_embd, n_expert)
        routing.router_select(
            self, stream, logits, None, routing.SELECTED_SOFTMAX, n_tokens, n_expert, top_k, ids, weights
        )

    def close(self) -> None:
        """Free the instance's own scratch; work that uses it must be finished."""
        for buffers in self._scratch.values():
            for buf in buffers:
                buf.close()
        self._scratch.clear()

    @staticmethod
    def _check_mul_mat_id_shapes(
        call: str, fmt: WeightFormat, n_expert: int, n_out: int, n_in: int, n_pairs: int
    ) -> None:
        if n_expert > layout.MAX_EXPERTS:
            raise InvalidArgument(f"at most {layout.MAX_EXPERTS} experts are supported, got {n_expert}", call=call)
        if n_in % fmt.block_elements:
            raise InvalidArgument(
                f"n_in {n_in} is not a multiple of the {fmt.qtype.name} block size {fmt.block_elements}",
                call=call,
            )
        fits_int32(call, pairs=n_pairs)
        expert_bytes = n_out * fmt.row_bytes(fmt.padded_row_elements(n_in))
        if expert_bytes > layout.MAX_INT32:
            raise InvalidArgument(
                f"one expert's rows take {expert_bytes} bytes, over the 2 GiB the kernel addresses", call=call
            )
        if layout.max_tiles(n_pairs, n_expert, min(TileM)) > layout.MAX_GRID_Y:
            raise InvalidArgument(
                f"{n_pairs} (token, k) pairs need more than {layout.MAX_GRID_Y} tiles",
                call=call,
                hint="split the batch",
            )

    def scratch(self, owner: str, nbytes: int) -> BufferView:
        """``nbytes`` of the instance's own device scratch for ``owner`` (the launcher's name: each owner
        has its own buffer), grown when a call needs more and freed by ``close()``. Calls of one owner
        share it, so they must run in one stream's order."""
        buffers = self._scratch.setdefault(owner, [])
        current = buffers[-1] if buffers else None
        if current is None or current.nbytes < nbytes:
            size = 1 << max(12, (nbytes - 1).bit_length())  # grow by powers of two: few buffers are ever kept
            log.debug("%s scratch on %s grows to %d bytes", owner, self.device.label, size)
            current = self.device.alloc(size, Usage.COMPUTE)
            buffers.append(current)
        return current.view(0, nbytes)

    def zeroed(self, owner: str, nbytes: int) -> BufferView:
        """``nbytes`` of device memory for ``owner`` that held zeros when allocated, grown (to fresh
        zeros) when a call needs more: counters a kernel puts back to 0 before it ends. Calls of one
        owner share it, so they must run in one stream's order."""
        buffers = self._scratch.setdefault(owner, [])
        current = buffers[-1] if buffers else None
        if current is None or current.nbytes < nbytes:
            size = 1 << max(8, (nbytes - 1).bit_length())
            current = self.device.upload(np.zeros(size, np.uint8), Usage.COMPUTE)
            buffers.append(current)
        return current.view(0, nbytes)

    @property
    def scratch_bytes(self) -> int:
        """Device bytes the instance's scratch holds now (every owner's buffers, earlier ones too)."""
        return sum(buf.alloc_size for buffers in self._scratch.values() for buf in buffers)


__all__ = ["TWINS", "DirectInputs", "MoeKernels", "check_path", "default_path", "scratch_bytes"]
