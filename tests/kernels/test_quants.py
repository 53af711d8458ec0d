"""The twins' block decoders against gguf.quants.dequantize, llama.cpp's Python reference.

Random bytes with sane scales cover every quant value and bit pattern; the decoders must
agree bit for bit, since the twins stand in for the kernel wherever the suite runs on the
simulator.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from gguf.quants import dequantize

from expertstream.errors import InvalidArgument
from expertstream.kernels import quants
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS

from .tensors import QUANTIZED


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_decoder_matches_gguf_bit_for_bit(rng: np.random.Generator, qtype: GGMLQuantizationType) -> None:
    fmt = FORMATS[qtype]
    rows = ref.random_weights(rng, qtype, 24, 4 * max(fmt.block_elements, 32))
    ours = quants.decode_rows(rows, qtype)
    theirs = dequantize(rows, qtype)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.isfinite(ours).all()
    differ = ours.view(np.uint32) != np.asarray(theirs, np.float32).view(np.uint32)
    assert not differ.any(), (
        f"{np.count_nonzero(differ)} of {differ.size} values differ, first at {np.argwhere(differ)[0]}"
    )


@pytest.mark.parametrize(
    ("table", "grid"),
    [
        ("IQ1S_GRID", gguf_quants.IQ1_S),
        ("IQ2XXS_GRID", gguf_quants.IQ2_XXS),
        ("IQ2XS_GRID", gguf_quants.IQ2_XS),
        ("IQ2S_GRID", gguf_quants.IQ2_S),
        ("IQ3XXS_GRID", gguf_quants.IQ3_XXS),
        ("IQ3S_GRID", gguf_quants.IQ3_S),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_kernel_grid_tables_hold_every_point_of_ggmls_grids(table: str, grid: type) -> None:
    """Random blocks reach a few hundred grid points per run; this checks all of them."""
    grid.init_grid()
    theirs = grid.grid.reshape(grid.grid_shape)
    assert quants.grid_entries(table).size == grid.grid_shape[0]
    assert np.array_equal(quants.grid_points(table), theirs)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_all_ones_block_decodes_to_non_finite_values(qtype: GGMLQuantizationType) -> None:
    """What a dirty padding tail holds must poison the sums it is folded into (0 * value)."""
    block = np.full((1, FORMATS[qtype].block_bytes), 0xFF, np.uint8)
    values = quants.decode_rows(block, qtype)
    assert not np.isfinite(values).all()
    with np.errstate(invalid="ignore"):
        assert np.isnan(np.float32(0) * values).any()


def test_unknown_type_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="no decoder for TQ1_0"):
        quants.decode_rows(np.zeros((1, 54), np.uint8), GGMLQuantizationType.TQ1_0)


def test_the_kernels_have_one_format_for_each_expert_type_the_loader_accepts() -> None:
    from expertstream.ggml import EXPERT_TYPES
    from expertstream.kernels.layout import FORMATS

    assert list(FORMATS) == list(EXPERT_TYPES)
