"""mul_mat_id against the float64 reference on every usable backend, for every weight type
and every path (float32 SIMT, bf16 matrix cores, int8 where the type has it: the others take
the bf16 path when int8 is asked for), each within its own tolerance.

Fresh random inputs each run; outputs are poisoned with NaN before each launch, so an
element the kernel did not write fails the finiteness check.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.backends.base import Device, Stream, Usage
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels, layout
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import MatrixPath, TileM, weight_format

from . import tensors
from .tensors import ALL_TYPES, QUANTIZED, Shape

# Every path; the bf16 one both through the shared-tile kernels of mma.cu and (for the types that
# have them, on devices with mma_fragments) through the direct kernels of direct.cu.
FAMILIES = [(MatrixPath.SIMT, False), (MatrixPath.MMA, False), (MatrixPath.MMA, True), (MatrixPath.INT8, False)]


@pytest.fixture(scope="module", params=FAMILIES, ids=["simt", "mma", "direct", "int8"])
def kernels(device: Device, request: pytest.FixtureRequest) -> Iterator[MoeKernels]:
    """Any path on any device: where the hardware lacks matrix cores, mma.cu's generic step runs."""
    path, direct = request.param
    with MoeKernels(device, path, direct=direct) as k:
        yield k
        device.synchronize()


def n_in_for(w_type: GGMLQuantizationType) -> int:
    """768 for quantized types (not a multiple of 512: the padding tail is read); 200 for
    F16/BF16 (not a multiple of the 32-element k step)."""
    return 768 if w_type in QUANTIZED else 200


def check(kernels: MoeKernels, w_type: GGMLQuantizationType, y: np.ndarray, expected: np.ndarray) -> None:
    assert np.isfinite(y).all(), f"{np.count_nonzero(~np.isfinite(y))} outputs unwritten or not finite"
    err = ref.relative_error(y, expected)
    path = kernels.path_for(w_type)
    bound = ref.mul_mat_id_rtol(path)
    assert err < bound, f"relative error {err:.3g} over {bound} ({path.value})"


@pytest.mark.parametrize("x_per_pair", [False, True], ids=["shared_x", "x_per_pair"])
@pytest.mark.parametrize("w_type", ALL_TYPES, ids=lambda t: t.name)
def test_matches_reference(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
    x_per_pair: bool,
) -> None:
    # n_out 150 spans two output tiles, the second partial; expert 5 of 7 stays unused, and
    # expert 6 (the last, whose last row reads the padding tail) is used.
    shape = Shape(n_expert=7, n_out=150, n_in=n_in_for(w_type), n_tokens=13, top_k=3, x_per_pair=x_per_pair)
    ids = tensors.distinct_ids(rng, shape.n_tokens, shape.top_k, np.array([0, 1, 2, 3, 4, 6]))
    if 6 not in ids[0]:
        ids[0, 0] = 6
    problem = tensors.make_problem(device, rng, w_type, shape, ids)
    check(kernels, w_type, tensors.run(kernels, stream, problem), problem.reference())


@pytest.mark.parametrize("w_type", ALL_TYPES, ids=lambda t: t.name)
def test_single_token(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
) -> None:
    shape = Shape(n_expert=4, n_out=64, n_in=n_in_for(w_type), n_tokens=1, top_k=2)
    problem = tensors.make_problem(device, rng, w_type, shape, tensors.distinct_ids(rng, 1, 2, np.arange(4)))
    check(kernels, w_type, tensors.run(kernels, stream, problem), problem.reference())


@pytest.mark.parametrize("w_type", ALL_TYPES, ids=lambda t: t.name)
def test_many_tokens_on_one_expert(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
) -> None:
    # Every token's first choice (k = 0) goes to expert 2: its bucket spans several tiles of either
    # height, and the type's tallest tile is chosen.
    shape = Shape(n_expert=6, n_out=40, n_in=n_in_for(w_type), n_tokens=150, top_k=2, x_per_pair=True)
    fmt = weight_format(w_type)
    assert fmt.tile_for(shape.n_pairs, shape.n_expert, kernels.path_for(w_type)) is max(
        fmt.tiles_on(kernels.path_for(w_type))
    )
    ids = np.empty((shape.n_tokens, 2), np.int32)
    ids[:, 0] = 2
    ids[:, 1] = rng.choice([0, 4, 5], shape.n_tokens)
    problem = tensors.make_problem(device, rng, w_type, shape, ids)
    check(kernels, w_type, tensors.run(kernels, stream, problem), problem.reference())


@pytest.mark.parametrize("n_expert", [16, 600], ids=lambda n: f"{n}-experts")  # 600: more than a block's threads
@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K], ids=lambda t: t.name)
def test_pairs_over_several_grouping_blocks(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
    n_expert: int,
) -> None:
    # 4200 pairs: three grouping blocks, each placing its pairs of a bucket after the earlier
    # blocks' ones; ids out of range among them give NaN rows.
    shape = Shape(n_expert=n_expert, n_out=64, n_in=256, n_tokens=700, top_k=6)
    assert layout.group_blocks(shape.n_pairs) == 3
    ids = tensors.distinct_ids(rng, shape.n_tokens, shape.top_k, np.arange(shape.n_expert))
    ids[::101, 2] = shape.n_expert
    problem = tensors.make_problem(device, rng, w_type, shape, ids)
    y = tensors.run(kernels, stream, problem)
    bad = ids == shape.n_expert
    assert np.isnan(y[bad]).all()
    check(kernels, w_type, y[~bad], problem.reference()[~bad])


@pytest.mark.parametrize("w_type", ALL_TYPES, ids=lambda t: t.name)
def test_bit_identical_across_runs_and_groupings(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
) -> None:
    shape = Shape(n_expert=5, n_out=130, n_in=n_in_for(w_type), n_tokens=150, top_k=2)
    fmt = weight_format(w_type)
    assert fmt.tile_for(shape.n_pairs, shape.n_expert, kernels.path_for(w_type)) is max(
        fmt.tiles_on(kernels.path_for(w_type))
    )
    problem = tensors.make_problem(device, rng, w_type, shape, tensors.distinct_ids(rng, 150, 2, np.arange(5)))
    first = tensors.run(kernels, stream, problem)
    second = tensors.run(kernels, stream, problem)
    assert first.tobytes() == second.tobytes(), "two runs on the same inputs differ"

    # The same first three tokens alone: other tile contents and the short tile kernel.
    few = Shape(shape.n_expert, shape.n_out, shape.n_in, n_tokens=3, top_k=2)
    assert fmt.tile_for(few.n_pairs, few.n_expert, kernels.path_for(w_type)) is TileM.SHORT
    alone = tensors.Problem(
        few,
        w_type,
        problem.w,
        problem.x[:3],
        problem.ids[:3],
        problem.w_buf,
        device.upload(problem.x[:3]),
        device.upload(problem.ids[:3]),
    )
    assert tensors.run(kernels, stream, alone).tobytes() == first[:3].tobytes(), "results depend on grouping"


@pytest.mark.parametrize("w_type", ALL_TYPES, ids=lambda t: t.name)
def test_bit_identical_across_tile_heights(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
) -> None:
    """Every tile height the path has for the type gives the same bytes: a pair's result does
    not depend on which row of which tile computes it."""
    tiles = weight_format(w_type).tiles_on(kernels.path_for(w_type))
    shape = Shape(n_expert=3, n_out=70, n_in=n_in_for(w_type), n_tokens=50, top_k=2)
    problem = tensors.make_problem(device, rng, w_type, shape, tensors.distinct_ids(rng, 50, 2, np.arange(3)))
    results = [tensors.run(kernels, stream, problem, tile_m=tile) for tile in tiles]
    check(kernels, w_type, results[0], problem.reference())
    for tile, y in zip(tiles[1:], results[1:], strict=True):
        assert y.tobytes() == results[0].tobytes(), f"{int(tile)}-row tiles give other bytes than {int(tiles[0])}"


def test_rejects_a_tile_height_the_path_lacks(device: Device, stream: Stream) -> None:
    buf = device.alloc(1 << 16)
    q4_1 = GGMLQuantizationType.Q4_1
    with (
        MoeKernels(device, MatrixPath.SIMT) as simt,
        pytest.raises(InvalidArgument, match="Q4_1 has no 64-row tile on the simt path"),
    ):
        simt.mul_mat_id(stream, buf, q4_1, 2, 8, 256, buf, False, buf, 1, 1, buf, tile_m=TileM.TALL)


_T = GGMLQuantizationType


@pytest.mark.parametrize(
    ("up_type", "down_type"),
    [
        (_T.Q4_K, _T.Q6_K),
        (_T.IQ4_XS, _T.Q8_0),
        (_T.MXFP4, _T.BF16),
        (_T.Q2_K, _T.Q3_K),
        (_T.Q5_K, _T.F32),
        (_T.IQ2_XXS, _T.Q2_K),
        (_T.IQ1_M, _T.IQ3_S),
    ],
    ids=lambda t: t.name,
)
def test_two_types_in_one_call_sequence(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    up_type: GGMLQuantizationType,
    down_type: GGMLQuantizationType,
) -> None:
    """An up projection then a down projection of another type, as mixed quantizations store
    them: one stream, one scratch, the second fed with the first's output."""
    up_shape = Shape(n_expert=5, n_out=512, n_in=768, n_tokens=9, top_k=2)
    ids = tensors.distinct_ids(rng, up_shape.n_tokens, up_shape.top_k, np.arange(5))
    up = tensors.make_problem(device, rng, up_type, up_shape, ids)
    down_shape = Shape(n_expert=5, n_out=768, n_in=512, n_tokens=9, top_k=2, x_per_pair=True)
    w_down = ref.random_weights(rng, down_type, down_shape.n_expert * down_shape.n_out, down_shape.n_in)
    w_down_buf = device.alloc(w_down.nbytes, Usage.WEIGHTS, row_type=down_type, ne0=down_shape.n_in)
    w_down_buf.write(w_down)
    hidden = tensors.poisoned(device, up_shape.n_pairs * up_shape.n_out * 4)
    out = tensors.poisoned(device, down_shape.n_pairs * down_shape.n_out * 4)
    for w_buf, w_type, s, x_buf, y_buf in (
        (up.w_buf, up_type, up_shape, up.x_buf, hidden),
        (w_down_buf, down_type, down_shape, hidden, out),
    ):
        kernels.mul_mat_id(
            stream, w_buf, w_type, s.n_expert, s.n_out, s.n_in, x_buf, s.x_per_pair, up.ids_buf, 9, 2, y_buf
        )
    stream.synchronize()
    y_up = hidden.read().view(np.float32).reshape(9, 2, up_shape.n_out)
    check(kernels, up_type, y_up, up.reference())
    y_down = out.read().view(np.float32).reshape(9, 2, down_shape.n_out)
    check(
        kernels, down_type, y_down, ref.mul_mat_id(w_down, down_type, 5, down_shape.n_out, down_shape.n_in, y_up, ids)
    )


def test_out_of_range_ids_give_nan_rows(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    w_type = GGMLQuantizationType.Q8_0
    shape = Shape(n_expert=4, n_out=48, n_in=256, n_tokens=5, top_k=2)
    ids = tensors.distinct_ids(rng, 5, 2, np.arange(4))
    ids[1, 0] = -1
    ids[3, 1] = 4
    problem = tensors.make_problem(device, rng, w_type, shape, ids)
    y = tensors.run(kernels, stream, problem)
    expected = problem.reference()
    bad = np.zeros(ids.shape, bool)
    bad[1, 0] = bad[3, 1] = True
    assert np.isnan(y[bad]).all(), "rows of out-of-range ids must be NaN"
    check(kernels, w_type, y[~bad], expected[~bad])


@pytest.mark.parametrize("w_type", QUANTIZED, ids=lambda t: t.name)
def test_dirty_padding_tail_is_not_silently_read(
    backend_name: str,
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
) -> None:
    """The kernel really reads the padding tail: garbage there (f16 NaN scales) must show."""
    shape = Shape(n_expert=3, n_out=20, n_in=768, n_tokens=4, top_k=3)
    ids = np.tile(np.arange(3, dtype=np.int32), (4, 1))
    problem = tensors.make_problem(device, rng, w_type, shape, ids)
    y = tensors.run_with_dirty_tail(backend_name, kernels, stream, problem)
    if y is None:
        return
    # Only the last row of the last expert reads into the tail: output column n_out - 1.
    assert np.isnan(y[:, 2, -1]).all(), "a NaN padding tail was not read"
    assert np.isfinite(y[:, :2]).all() and np.isfinite(y[:, 2, :-1]).all()


@pytest.mark.parametrize(
    "w_type",
    [_T.TQ1_0, _T.TQ2_0, _T.Q8_1, _T.Q8_K],
    ids=lambda t: t.name,
)
def test_rejects_unsupported_type_naming_the_supported(
    device: Device, kernels: MoeKernels, stream: Stream, w_type: GGMLQuantizationType
) -> None:
    buf = device.alloc(1 << 16)
    with pytest.raises(InvalidArgument, match=f"{w_type.name}.*supported types: Q4_0, Q4_1, .*Q6_K, .*BF16, F32"):
        kernels.mul_mat_id(stream, buf, w_type, 2, 8, 256, buf, False, buf, 1, 1, buf)


def test_rejects_tensor_without_its_padding(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    w_type = GGMLQuantizationType.Q4_0
    unpadded = 2 * 8 * 768 // 32 * 18
    w = device.alloc(unpadded, Usage.WEIGHTS)  # no row_type: no padding tail allocated
    other = device.alloc(1 << 16)
    with pytest.raises(InvalidArgument, match=rf"w holds {unpadded} bytes but the shapes need \d+"):
        kernels.mul_mat_id(stream, w, w_type, 2, 8, 768, other, False, other, 1, 1, other)


def test_rejects_row_not_a_multiple_of_the_block(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    buf = device.alloc(1 << 16)
    with pytest.raises(InvalidArgument, match="n_in 100 is not a multiple of the Q8_0 block size 32"):
        kernels.mul_mat_id(stream, buf, GGMLQuantizationType.Q8_0, 2, 8, 100, buf, False, buf, 1, 1, buf)


def test_rejects_non_positive_sizes(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    buf = device.alloc(1 << 16)
    with pytest.raises(InvalidArgument, match="n_tokens must be a positive int32, got 0"):
        kernels.mul_mat_id(stream, buf, GGMLQuantizationType.F16, 2, 8, 64, buf, False, buf, 0, 1, buf)
