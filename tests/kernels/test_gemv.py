"""The matrix-vector mul_mat_id (gemv.cu) against the float64 reference on every usable backend, for
every weight type: odd n_out, rows that read the padding tail, ids out of range, x per pair, routing
weights, and the launcher's choice between it and the tile kernels.

Fresh random inputs each run; outputs are poisoned with NaN before each launch, so an element the
kernel did not write fails the finiteness check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.backends.base import Device, Stream, Usage
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels, layout
from expertstream.kernels import reference as ref
from expertstream.kernels.launcher import gemv_launch
from expertstream.kernels.layout import TileM, weight_format

from . import tensors
from .tensors import ALL_TYPES, QUANTIZED, Shape


@pytest.fixture(scope="module")
def kernels(device: Device) -> Iterator[MoeKernels]:
    with MoeKernels(device, gemv=True) as k:
        yield k
        device.synchronize()


def n_in_for(w_type: GGMLQuantizationType) -> int:
    """768 for quantized types (not a multiple of 512: rows read the padding tail); 200 for the
    float types (not a multiple of the 32-element slice: the last slice is partial)."""
    return 768 if w_type in QUANTIZED else 200


def check(y: np.ndarray, expected: np.ndarray) -> None:
    assert np.isfinite(y).all(), f"{np.count_nonzero(~np.isfinite(y))} outputs unwritten or not finite"
    err = ref.relative_error(y, expected)
    assert err < ref.MUL_MAT_ID_RTOL, f"relative error {err:.3g} over {ref.MUL_MAT_ID_RTOL}"


@pytest.mark.parametrize("x_per_pair", [False, True], ids=["shared_x", "x_per_pair"])
@pytest.mark.parametrize("w_type", ALL_TYPES, ids=lambda t: t.name)
def test_matches_reference(
    kernels: MoeKernels,
    device: Device,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
    x_per_pair: bool,
) -> None:
    # n_out 37: odd, the last block of rows partial; the last expert (whose last row reads the
    # padding tail) is used; one id past the experts and one below zero give NaN rows.
    shape = Shape(n_expert=5, n_out=37, n_in=n_in_for(w_type), n_tokens=2, top_k=4, x_per_pair=x_per_pair)
    assert shape.n_pairs <= layout.GEMV_MAX_PAIRS
    ids = np.array([[4, 0, 7, 2], [1, -1, 4, 3]], np.int32)
    problem = tensors.make_problem(device, rng, w_type, shape, ids)
    assert kernels.mul_mat_id_kernel(w_type, shape.n_pairs, shape.n_expert, shape.n_in, shape.n_out) == (
        weight_format(w_type).gemv_one_row_kernel_name  # 296 rows in all: one row a wave
    )
    y = tensors.run(kernels, stream, problem)
    bad = (ids < 0) | (ids >= shape.n_expert)
    assert np.isnan(y[bad]).all(), "rows of ids out of range are not NaN"
    check(y[~bad], problem.gemv_reference()[~bad])


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4], ids=lambda t: t.name)
def test_a_dirty_padding_tail_on_the_int8_path(
    backend_name: str,
    kernels: MoeKernels,
    device: Device,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
) -> None:
    """0xFF bytes in ggml's padding tail, read by the last expert's last row against zero activations:
    Q8_0's NaN scales show there; MXFP4's E8M0 scales are all finite, so its rows are a clean tail's.
    The simulator's hazard checker refuses the read."""
    shape = Shape(n_expert=2, n_out=5, n_in=768, n_tokens=1, top_k=2, x_per_pair=False)
    problem = tensors.make_problem(device, rng, w_type, shape, np.array([[0, 1]], np.int32))
    clean = tensors.run(kernels, stream, problem)
    dirty = tensors.run_with_dirty_tail(backend_name, kernels, stream, problem)
    if dirty is None:
        return
    assert np.isfinite(clean).all()
    if w_type == GGMLQuantizationType.MXFP4:
        assert dirty.tobytes() == clean.tobytes()
    else:
        assert np.isnan(dirty[0, 1, -1]), "a NaN padding tail was not read"
        assert (
            dirty[0, :, :-1].tobytes() == clean[0, :, :-1].tobytes() and dirty[0, 0].tobytes() == clean[0, 0].tobytes()
        )


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K], ids=lambda t: t.name)
def test_one_pair_over_a_dense_projection(
    kernels: MoeKernels, device: Device, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """A dense projection as decode runs it: one expert, one token, many rows."""
    shape = Shape(n_expert=1, n_out=1029, n_in=2560, n_tokens=1, top_k=1)
    problem = tensors.make_problem(device, rng, w_type, shape, np.zeros((1, 1), np.int32))
    check(tensors.run(kernels, stream, problem), problem.gemv_reference())


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.F16], ids=lambda t: t.name)
def test_launches_of_few_rows_take_one_row_a_wave_with_the_same_bytes(
    kernels: MoeKernels, device: Device, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """Under GEMV_ONE_ROW_UNDER rows in all a launch takes one row a wave (``gemv_launch``), and each row's
    sum is the one two rows a wave make: 8 pairs of 520 rows (two a wave) and their first 4 pairs (one a
    wave), the last expert's padding tail read in both."""
    many = Shape(n_expert=4, n_out=520, n_in=n_in_for(w_type), n_tokens=1, top_k=8)
    few = dataclasses.replace(many, top_k=4)
    assert many.n_pairs * many.n_out >= layout.GEMV_ONE_ROW_UNDER > few.n_pairs * few.n_out
    fmt = weight_format(w_type)
    assert kernels.mul_mat_id_kernel(w_type, many.n_pairs, 4, many.n_in, many.n_out) == fmt.gemv_kernel_name
    assert kernels.mul_mat_id_kernel(w_type, few.n_pairs, 4, few.n_in, few.n_out) == fmt.gemv_one_row_kernel_name
    ids = np.array([[3, 0, 2, 1, 3, 2, 1, 0]], np.int32)
    problem = tensors.make_problem(device, rng, w_type, many, ids)
    two = tensors.run(kernels, stream, problem)
    check(two, problem.gemv_reference())
    with device.upload(np.ascontiguousarray(ids[:, :4])) as few_ids:
        fewer = dataclasses.replace(problem, shape=few, ids=ids[:, :4])
        one = tensors.run(kernels, stream, fewer, ids_buf=few_ids)
    assert one.tobytes() == np.ascontiguousarray(two[:, :4]).tobytes()


def test_agrees_with_the_tile_kernels_beyond_its_pairs(
    kernels: MoeKernels, device: Device, stream: Stream, rng: np.random.Generator
) -> None:
    """Past GEMV_MAX_PAIRS, or with a tile height given, the tile kernels run: same function."""
    w_type = GGMLQuantizationType.Q4_K
    few = Shape(n_expert=10, n_out=40, n_in=1024, n_tokens=1, top_k=layout.GEMV_MAX_PAIRS)
    many = Shape(n_expert=10, n_out=40, n_in=1024, n_tokens=3, top_k=layout.GEMV_MAX_PAIRS // 2 + 1)
    assert many.n_pairs > layout.GEMV_MAX_PAIRS
    name = weight_format(w_type).gemv_kernel_name
    assert kernels.mul_mat_id_kernel(w_type, few.n_pairs, few.n_expert, few.n_in) == name
    assert kernels.mul_mat_id_kernel(w_type, many.n_pairs, many.n_expert, many.n_in) != name
    for shape in (few, many):
        ids = tensors.distinct_ids(rng, shape.n_tokens, shape.top_k, np.arange(shape.n_expert))
        problem = tensors.make_problem(device, rng, w_type, shape, ids)
        chosen = tensors.run(kernels, stream, problem)
        tiled = tensors.run(kernels, stream, problem, tile_m=TileM.SHORT)
        tile_bound = ref.mul_mat_id_rtol(kernels.path_for(w_type))
        if shape is few:
            check(chosen, problem.gemv_reference())
        else:
            assert chosen.tobytes() == tiled.tobytes(), "past GEMV_MAX_PAIRS the tile kernel should run"
        assert ref.relative_error(tiled, problem.reference()) < tile_bound


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_0], ids=lambda t: t.name)
def test_asked_for_it_takes_any_number_of_pairs(
    kernels: MoeKernels, device: Device, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """gemv=True: one token's 16 heads through per-head tensors (deepseek2's attn_k_b in decode) in one
    matrix-vector launch, past GEMV_MAX_PAIRS; gemv=False keeps the tile kernels for a few pairs."""
    heads = Shape(n_expert=16, n_out=64, n_in=512, n_tokens=1, top_k=16, x_per_pair=True)
    assert heads.n_pairs > layout.GEMV_MAX_PAIRS
    problem = tensors.make_problem(device, rng, w_type, heads, np.arange(16, dtype=np.int32)[None, :])
    timeline = device.backend.timeline  # the simulator's; None on a GPU backend not tracing
    mark = None if timeline is None else len(timeline)
    asked = tensors.run(kernels, stream, problem, gemv=True)
    check(asked, problem.gemv_reference())
    timeline = device.backend.timeline
    if mark is not None and timeline is not None:
        launched = [op.name for op in timeline[mark:] if op.kind.name == "KERNEL"]
        assert launched == [gemv_launch(weight_format(w_type), heads.n_out, heads.n_pairs)[0]]
    tiled = tensors.run(kernels, stream, problem, gemv=False)
    assert ref.relative_error(tiled, problem.reference()) < ref.mul_mat_id_rtol(kernels.path_for(w_type))
    with MoeKernels(device) as plain:  # an instance without the matrix-vector kernels keeps its tiles
        assert tensors.run(plain, stream, problem, gemv=True).tobytes() == tiled.tobytes()


def test_asked_for_past_a_launch_s_pairs_is_refused(kernels: MoeKernels, device: Device, stream: Stream) -> None:
    pairs = layout.MAX_GRID_Y + 1
    x, y, ids = device.alloc(pairs * 32 * 4), device.alloc(pairs * 4 * 4), device.alloc(pairs * 4)
    w = device.alloc(4 * 32 * 4, Usage.WEIGHTS, row_type=GGMLQuantizationType.F32, ne0=32)
    with pytest.raises(InvalidArgument, match=r"65536 pairs are more than one matrix-vector launch takes"):
        kernels.mul_mat_id(stream, w, GGMLQuantizationType.F32, 1, 4, 32, x, True, ids, 1, pairs, y, gemv=True)


def test_off_by_default(device: Device) -> None:
    with MoeKernels(device) as plain:
        assert not plain.uses_gemv(1)
        name = plain.mul_mat_id_kernel(GGMLQuantizationType.Q4_0, 1, 8, 2048)
        assert name != weight_format(GGMLQuantizationType.Q4_0).gemv_kernel_name


def test_route_weights_scale_each_row(
    kernels: MoeKernels, device: Device, stream: Stream, rng: np.random.Generator
) -> None:
    """Where the direct kernels would scale rows by routing weights, the matrix-vector one does."""
    w_type = GGMLQuantizationType.Q4_K
    shape = Shape(n_expert=4, n_out=33, n_in=512, n_tokens=1, top_k=3, x_per_pair=True)
    if not kernels.uses_direct(w_type, shape.n_in):
        pytest.skip(f"{device.label} takes no direct-decode kernel, so mul_mat_id refuses route_weights")
    problem = tensors.make_problem(device, rng, w_type, shape, np.array([[3, 0, 2]], np.int32))
    weights = rng.uniform(0.1, 1.0, (1, 3)).astype(np.float32)
    y_buf = tensors.poisoned(device, shape.n_pairs * shape.n_out * 4)
    with device.upload(weights) as weights_buf:
        kernels.mul_mat_id(
            stream,
            problem.w_buf,
            w_type,
            shape.n_expert,
            shape.n_out,
            shape.n_in,
            problem.x_buf,
            True,
            problem.ids_buf,
            1,
            3,
            y_buf,
            route_weights=weights_buf,
        )
        stream.synchronize()
    y = y_buf.read().view(np.float32).reshape(1, 3, shape.n_out)
    y_buf.close()
    check(y, weights[..., None] * problem.gemv_reference())


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K], ids=lambda t: t.name)
def test_silu_gate_is_the_bytes_of_the_call_then_swiglu(
    kernels: MoeKernels, device: Device, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """Up and SwiGLU in one launch, as decode runs them, write what up then swiglu write; the epilogue
    belongs to the matrix-vector kernels and is refused elsewhere or with routing weights."""
    shape = Shape(n_expert=5, n_out=37, n_in=768, n_tokens=1, top_k=4)
    ids = np.array([[4, 0, 2, 1]], np.int32)
    problem = tensors.make_problem(device, rng, w_type, shape, ids)
    n = shape.n_pairs * shape.n_out
    gate = (rng.standard_normal(n) * 30).astype(np.float32)  # some below -88: silu is -0 there
    up = tensors.run(kernels, stream, problem)
    args = (problem.w_buf, w_type, 5, 37, 768, problem.x_buf, False, problem.ids_buf, 1, 4)
    with (
        device.upload(gate) as gate_buf,
        device.upload(up) as up_buf,
        tensors.poisoned(device, n * 4) as act,
        tensors.poisoned(device, n * 4) as fused,
    ):
        kernels.swiglu(stream, gate_buf, up_buf, act, n)
        kernels.mul_mat_id(stream, *args, fused, silu_gate=gate_buf)
        stream.synchronize()
        assert fused.read().tobytes() == act.read().tobytes()
        with pytest.raises(InvalidArgument, match="epilogue of the matrix-vector kernels"):
            kernels.mul_mat_id(stream, *args, fused, tile_m=TileM.SHORT, silu_gate=gate_buf)


@pytest.mark.parametrize(
    "w_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0], ids=lambda t: t.name
)
def test_gate_up_of_a_few_pairs_is_the_bytes_of_gate_then_up(
    kernels: MoeKernels, device: Device, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """gate_up of a few pairs takes the matrix-vector gate_up (no direct kernel needed): the bytes of
    the gate launch followed by the up launch with SwiGLU, NaN rows for ids out of range."""
    shape = Shape(n_expert=5, n_out=37, n_in=768, n_tokens=2, top_k=3)
    ids = np.array([[4, 0, 2], [1, 9, 4]], np.int32)
    bad = (ids < 0) | (ids >= shape.n_expert)
    gate_p = tensors.make_problem(device, rng, w_type, shape, ids)
    up_w = ref.random_weights(rng, w_type, shape.n_expert * shape.n_out, shape.n_in)
    n = shape.n_pairs * shape.n_out
    dims = (shape.n_expert, shape.n_out, shape.n_in)
    with (
        device.alloc(up_w.nbytes, Usage.WEIGHTS, row_type=w_type, ne0=shape.n_in) as up_buf,
        tensors.poisoned(device, n * 4) as gate_y,
        tensors.poisoned(device, n * 4) as two_launches,
        tensors.poisoned(device, n * 4) as fused,
    ):
        up_buf.write(up_w)
        common = (gate_p.x_buf, False, gate_p.ids_buf, shape.n_tokens, shape.top_k)
        kernels.mul_mat_id(stream, gate_p.w_buf, w_type, *dims, *common, gate_y)
        kernels.mul_mat_id(stream, up_buf, w_type, *dims, *common, two_launches, silu_gate=gate_y)
        kernels.gate_up(stream, gate_p.w_buf, up_buf, w_type, *dims, gate_p.x_buf, gate_p.ids_buf, 2, 3, fused)
        stream.synchronize()
        y = fused.read().view(np.float32).reshape(2, 3, shape.n_out)
        assert fused.read().tobytes() == two_launches.read().tobytes()
    assert np.isnan(y[bad]).all(), "rows of ids out of range are not NaN"
    g = gate_p.gemv_reference()
    u = ref.mul_mat_vec_id(up_w, w_type, *dims, gate_p.x, ids)
    err = ref.relative_error(y[~bad], (g / (1.0 + np.exp(-g)) * u)[~bad])
    assert err < 2 * ref.MUL_MAT_ID_RTOL, f"relative error {err:.3g}"


@pytest.mark.parametrize(
    "w_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0], ids=lambda t: t.name
)
@pytest.mark.parametrize("n_parts", [1, 2, 3])
def test_parts_are_the_bytes_of_one_launch_per_projection(
    kernels: MoeKernels,
    device: Device,
    stream: Stream,
    rng: np.random.Generator,
    w_type: GGMLQuantizationType,
    n_parts: int,
) -> None:
    """mul_mat_vec_parts (attention's Q, K and V of decode in one launch) writes, for each part, what
    mul_mat_id of that projection alone writes, row lengths that read the padding tail included, and
    near the float64 reference; it is refused for rows the tile kernels take."""
    n_tokens, n_in = 2, 768
    n_outs = [45, 16, 37][:n_parts]
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    zeros = np.zeros(n_tokens, np.int32)
    ws = [ref.random_weights(rng, w_type, n_out, n_in) for n_out in n_outs]
    with contextlib.ExitStack() as held:
        x_buf = held.enter_context(device.upload(x))
        ids = held.enter_context(device.upload(zeros))
        w_bufs, alone, fused = [], [], []
        for w, n_out in zip(ws, n_outs, strict=True):
            w_buf = held.enter_context(device.alloc(w.nbytes, Usage.WEIGHTS, row_type=w_type, ne0=n_in))
            w_buf.write(w)
            w_bufs.append(w_buf)
            alone.append(held.enter_context(tensors.poisoned(device, n_tokens * n_out * 4)))
            fused.append(held.enter_context(tensors.poisoned(device, n_tokens * n_out * 4)))
        for w_buf, n_out, y in zip(w_bufs, n_outs, alone, strict=True):
            kernels.mul_mat_id(stream, w_buf, w_type, 1, n_out, n_in, x_buf, False, ids, n_tokens, 1, y)
        kernels.mul_mat_vec_parts(stream, w_type, n_in, x_buf, n_tokens, list(zip(w_bufs, n_outs, fused, strict=True)))
        stream.synchronize()
        for w, n_out, one, both in zip(ws, n_outs, alone, fused, strict=True):
            assert both.read().tobytes() == one.read().tobytes()
            expected = ref.mul_mat_vec_id(w, w_type, 1, n_out, n_in, x, zeros[:, None])
            check(both.read().view(np.float32).reshape(expected.shape), expected)
        with pytest.raises(InvalidArgument, match="take the tile kernels"):
            kernels.mul_mat_vec_parts(
                stream, w_type, n_in, x_buf, layout.GEMV_MAX_PAIRS + 1, [(w_bufs[0], 45, fused[0])]
            )
