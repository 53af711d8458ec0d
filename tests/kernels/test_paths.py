"""Which path mul_mat_id takes per weight type and device, and the scratch it needs there."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.backends import sim
from expertstream.kernels import MoeKernels, layout, scratch_bytes
from expertstream.kernels.layout import FORMATS, INT8_DEFAULT_TYPES, MatrixPath, TileM, default_path

from . import tensors
from .tensors import Shape

_T = GGMLQuantizationType


def test_only_types_with_an_int8_kernel_default_to_it() -> None:
    with_int8 = {t for t, fmt in FORMATS.items() if fmt.int8}
    assert INT8_DEFAULT_TYPES.issubset(with_int8)
    assert {_T.Q4_0, _T.Q4_K}.issubset(with_int8)


@pytest.mark.parametrize("w_type", list(FORMATS), ids=lambda t: t.name)
def test_default_path_per_type_and_device(w_type: GGMLQuantizationType) -> None:
    assert default_path(w_type, matrix_cores=False, int8_matrix_cores=False) is MatrixPath.SIMT
    assert default_path(w_type, matrix_cores=True, int8_matrix_cores=False) is MatrixPath.MMA
    expected = MatrixPath.INT8 if w_type in INT8_DEFAULT_TYPES else MatrixPath.MMA
    assert default_path(w_type, matrix_cores=True, int8_matrix_cores=True) is expected


def test_asking_for_int8_sends_types_without_it_to_the_bf16_path() -> None:
    with sim.open(profile="cuda-h200") as backend:
        device = backend.device(0)
        assert device.capabilities.int8_matrix_cores
        with MoeKernels(device) as default, MoeKernels(device, MatrixPath.INT8) as int8:
            for w_type in (_T.Q4_0, _T.Q8_0):
                expected = MatrixPath.INT8 if w_type in INT8_DEFAULT_TYPES else MatrixPath.MMA
                assert default.path_for(w_type) is expected
            assert int8.path_for(_T.Q4_K) is MatrixPath.INT8 and int8.path_for(_T.F16) is MatrixPath.MMA
            assert int8.mul_mat_id_kernel(_T.Q4_0, 4096 * 8, 128, 2048) == "moe_mul_mat_id_int8_q4_0_m128"
            assert int8.mul_mat_id_kernel(_T.Q8_0, 512 * 8, 128, 2048) == "moe_mul_mat_id_mma_q8_0_m64"


def test_int8_tile_heights_grow_with_pairs_per_expert() -> None:
    fmt = FORMATS[_T.Q4_0]
    assert fmt.tile_for(8 * 128, 128, MatrixPath.INT8) is TileM.SHORT
    assert fmt.tile_for(512 * 8, 128, MatrixPath.INT8) is TileM.TALL
    assert fmt.tile_for(4096 * 8, 128, MatrixPath.INT8) is TileM.TALLEST


@pytest.mark.parametrize("x_per_pair", [False, True], ids=["shared_x", "x_per_pair"])
def test_scratch_bytes_cover_the_int8_path(x_per_pair: bool) -> None:
    """A caller's scratch of scratch_bytes(...) is enough for the int8 path at any tile height."""
    shape = Shape(n_expert=4, n_out=32, n_in=544, n_tokens=9, top_k=2, x_per_pair=x_per_pair)
    rng = np.random.default_rng(3)
    with sim.open(profile="cuda-h200") as backend, MoeKernels(backend.device(0), MatrixPath.INT8) as kernels:
        device = backend.device(0)
        problem = tensors.make_problem(device, rng, _T.Q4_0, shape, tensors.distinct_ids(rng, 9, 2, np.arange(4)))
        nbytes = scratch_bytes(shape.n_tokens, shape.top_k, shape.n_expert, shape.n_in, x_per_pair)
        x_rows = shape.n_pairs if x_per_pair else shape.n_tokens
        assert nbytes >= layout.quantized_x_bytes(x_rows, shape.n_in)
        with device.alloc(nbytes) as scratch, device.stream() as stream:
            y = tensors.poisoned(device, shape.n_pairs * shape.n_out * 4)
            for tile in layout.INT8_TILES:
                kernels.mul_mat_id(
                    stream,
                    problem.w_buf,
                    _T.Q4_0,
                    shape.n_expert,
                    shape.n_out,
                    shape.n_in,
                    problem.x_buf,
                    x_per_pair,
                    problem.ids_buf,
                    shape.n_tokens,
                    shape.top_k,
                    y,
                    scratch=scratch,
                    tile_m=tile,
                )
            stream.synchronize()
            assert np.isfinite(y.read().view(np.float32)).all()
