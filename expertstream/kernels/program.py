"""The CUDA-C source of the MoE kernels: which files, in which order, and which instances.

NVRTC and hipRTC compile one translation unit, so the .cu files of this package are read and
concatenated in the order of ``SOURCE_NAMES``, each using what the files before it define:

- formats.cu: type numbers, the constants shared with layout.py, block layouts, value tables;
- grids.cu: the i-quants' lattice grid tables;
- decode.cu: ``decode_slice``, each type's block decoder;
- grouping.cu: the (token, k) pairs bucketed by expert and cut into tiles;
- simt.cu: the float32 SIMT mul_mat_id and the tile start every mul_mat_id shares;
- gemv.cu: the matrix-vector mul_mat_id for a few pairs (decode), one output row per wave;
- elementwise.cu: SwiGLU and the combine at the end of an MoE layer;
- routing.cu: router top-k and the per-architecture routing and FFN pieces (routing.py);
- standin.cu: the RMS norm and residual add the runner puts around each MoE block;
- mma.cu, int8.cu, direct.cu: the matrix-core, int8 and direct-decode mul_mat_id;
- dense.cu: the dense pieces of a forward pass (dense.py): get_rows, RMS norm, bias rows,
  rotary embedding, the float16 KV cache write;
- attention.cu: causal attention over an f16 KV cache (attention.py);
- recurrent.cu: qwen3next's causal convolution, gated delta rule and output gate (recurrent.py).

After them come the per-type instances of the weight types a module needs: mul_mat_id's (tile
and matrix-vector), and get_rows' for tables of that type.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib import resources

from ..ggml import RowType
from . import layout
from .layout import MatrixPath, TileM, WeightFormat, weight_format

SOURCE_NAMES = (
    "formats.cu",
    "grids.cu",
    "decode.cu",
    "grouping.cu",
    "simt.cu",
    "gemv.cu",
    "elementwise.cu",
    "routing.cu",
    "standin.cu",
    "mma.cu",
    "int8.cu",
    "direct.cu",
    "dense.cu",
    "attention.cu",
    "recurrent.cu",
)


def kernel_source(types: Iterable[RowType] | None = None) -> str:
    """The CUDA-C source of the kernels, as NVRTC and hipRTC compile it.

    The files of ``SOURCE_NAMES`` (the shared code and every kernel that is not per type), then
    the per-type instances of ``types`` (every type of layout.FORMATS when None): mul_mat_id's,
    one kernel per path and tile height and the matrix-vector one, and get_rows', each naming its
    type by its ggml number, the template argument of the block formats in formats.cu. Compile time
    grows with the instances, so a module holds only what its kernel needs (``module_types``).
    """
    files = [source_file(name) for name in SOURCE_NAMES]
    formats = layout.FORMATS.values() if types is None else [weight_format(t) for t in dict.fromkeys(types)]
    instances = [f"{line}\n" for fmt in formats for _, line in _instances(fmt)]
    return "\n".join(files) + "\n" + "".join(instances)


def source_file(name: str) -> str:
    """The text of ``name``, one of ``SOURCE_NAMES``."""
    return resources.files(__package__).joinpath(name).read_text(encoding="ascii")


def type_kernels(fmt: WeightFormat) -> list[str]:
    """The names of every per-type kernel of ``fmt``: each path's tile heights, the direct ones, the
    matrix-vector ones, get_rows."""
    return [name for name, _ in _instances(fmt)]


def _instances(fmt: WeightFormat) -> Iterator[tuple[str, str]]:
    """(kernel name, instance line) of every per-type kernel of ``fmt``."""
    qtype = int(fmt.qtype)
    for path, macro in _INSTANCE_MACROS:
        for tile in fmt.tiles_on(path):
            yield _instance(fmt.kernel_name(tile, path), macro, qtype, tile)
    for tile in fmt.direct_tiles:
        yield _instance(fmt.direct_kernel_name(tile), "MOE_MUL_MAT_ID_DIRECT", qtype, tile)
        yield _instance(fmt.direct_kernel_name(tile, gate_up=True), "MOE_GATE_UP_DIRECT", qtype, tile)
    yield fmt.gemv_kernel_name, f"MOE_MUL_MAT_VEC_ID({fmt.gemv_kernel_name}, {qtype})"
    yield fmt.gemv_one_row_kernel_name, f"MOE_MUL_MAT_VEC_ID1({fmt.gemv_one_row_kernel_name}, {qtype})"
    yield fmt.gemv_gate_up_kernel_name, f"MOE_GATE_UP_VEC_ID({fmt.gemv_gate_up_kernel_name}, {qtype})"
    yield fmt.gemv_parts_kernel_name, f"MOE_MUL_MAT_VEC_PARTS({fmt.gemv_parts_kernel_name}, {qtype})"
    name = fmt.gemv_add_norm_kernel_name
    yield name, f"DENSE_MUL_MAT_VEC_ADD_NORM({name}, {qtype})"
    name = fmt.gemv_combine_norm_kernel_name
    yield name, f"DENSE_MUL_MAT_VEC_COMBINE_NORM({name}, {qtype})"
    name = fmt.get_rows_kernel_name
    yield name, f"DENSE_GET_ROWS({name}, {qtype})"


def _instance(name: str, macro: str, qtype: int, tile: TileM) -> tuple[str, str]:
    return name, f"{macro}({name}, {qtype}, {int(tile)})"


_INSTANCE_MACROS = (
    (MatrixPath.SIMT, "MOE_MUL_MAT_ID"),
    (MatrixPath.MMA, "MOE_MUL_MAT_ID_MMA"),
    (MatrixPath.INT8, "MOE_MUL_MAT_ID_INT8"),
)
# The weight type of every per-type kernel, by name.
_TYPE_OF_KERNEL: dict[str, RowType] = {
    name: fmt.qtype for fmt in layout.FORMATS.values() for name, _ in _instances(fmt)
}


def module_types(kernel: str) -> tuple[RowType, ...]:
    """The weight types whose instances the module holding ``kernel`` compiles: its own, or none."""
    w_type = _TYPE_OF_KERNEL.get(kernel)
    return () if w_type is None else (w_type,)


__all__ = ["SOURCE_NAMES", "kernel_source", "module_types", "source_file", "type_kernels"]
