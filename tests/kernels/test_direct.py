"""The direct-decode kernels (direct.cu) on every usable backend where they apply: mul_mat_id
against the reference at every tile height, and their two fused epilogues against the launches
they replace, to the bit (gate_up: mul_mat_id of gate and of up, then swiglu; route_weights:
mul_mat_id, then each pair's weight times its row).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

import expertstream
from expertstream.backends.base import Device, Stream
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS, MatrixPath, TileM

from . import tensors
from .tensors import Shape

DIRECT_TYPES = [t for t, fmt in FORMATS.items() if fmt.direct]


def _direct_kernels(kernels: MoeKernels, w_type: GGMLQuantizationType, n_in: int) -> None:
    if not kernels.uses_direct(w_type, n_in):
        pytest.skip(f"{kernels.device.label} takes no direct kernel for {w_type.name} (mma_fragments unset)")


@pytest.mark.parametrize("w_type", DIRECT_TYPES, ids=lambda t: t.name)
def test_tiles_match_reference_and_each_other(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    shape = Shape(n_expert=5, n_out=200, n_in=768, n_tokens=40, top_k=4, x_per_pair=True)
    _direct_kernels(kernels, w_type, shape.n_in)
    problem = tensors.make_problem(device, rng, w_type, shape, tensors.distinct_ids(rng, 40, 4, np.arange(5)))
    outputs = [tensors.run(kernels, stream, problem, tile_m=tile) for tile in FORMATS[w_type].direct_tiles]
    err = ref.relative_error(outputs[0], problem.reference())
    assert err < ref.mul_mat_id_rtol(MatrixPath.MMA), err
    assert all(y.tobytes() == outputs[0].tobytes() for y in outputs)


@pytest.mark.parametrize("w_type", DIRECT_TYPES, ids=lambda t: t.name)
def test_gate_up_and_route_weights_are_the_bytes_of_the_launches_they_replace(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    shape = Shape(n_expert=6, n_out=136, n_in=512, n_tokens=25, top_k=3)
    _direct_kernels(kernels, w_type, shape.n_in)
    ids = tensors.distinct_ids(rng, shape.n_tokens, shape.top_k, np.arange(6))
    gate = tensors.make_problem(device, rng, w_type, shape, ids)
    up = tensors.make_problem(device, rng, w_type, shape, ids)
    up.x_buf.write(gate.x)  # both read the gate problem's activations
    n = shape.n_pairs * shape.n_out
    g, u = (tensors.run(kernels, stream, p) for p in (gate, up))
    with device.upload(g) as g_buf, device.upload(u) as u_buf, tensors.poisoned(device, n * 4) as act:
        kernels.swiglu(stream, g_buf, u_buf, act, n)
        stream.synchronize()
        expected = act.read().view(np.float32)
    with tensors.poisoned(device, n * 4) as y:
        kernels.gate_up(
            stream, gate.w_buf, up.w_buf, w_type, 6, shape.n_out, shape.n_in, gate.x_buf, gate.ids_buf, 25, 3, y
        )
        stream.synchronize()
        assert y.read().view(np.float32).tobytes() == expected.tobytes()
    route = rng.uniform(0.05, 1.0, (shape.n_tokens, shape.top_k)).astype(np.float32)
    with device.upload(route) as route_buf, tensors.poisoned(device, n * 4) as y:
        kernels.mul_mat_id(
            stream,
            gate.w_buf,
            w_type,
            6,
            shape.n_out,
            shape.n_in,
            gate.x_buf,
            False,
            gate.ids_buf,
            25,
            3,
            y,
            route_weights=route_buf,
        )
        stream.synchronize()
        routed = y.read().view(np.float32).reshape(g.shape)
    assert routed.tobytes() == (route[..., None] * g).tobytes()


def test_fused_calls_are_refused_where_no_direct_kernel_applies(device: Device, stream: Stream) -> None:
    w_type = GGMLQuantizationType.Q8_0  # no direct kernel
    with MoeKernels(device) as kernels, device.alloc(1 << 20) as buf:
        assert not kernels.uses_direct(w_type, 512)
        with pytest.raises(InvalidArgument, match="gate_up needs a direct-decode kernel"):
            kernels.gate_up(stream, buf, buf, w_type, 2, 32, 512, buf, buf, 4, 2, buf)
        with pytest.raises(InvalidArgument, match="route_weights needs a direct-decode kernel"):
            kernels.mul_mat_id(stream, buf, w_type, 2, 32, 512, buf, False, buf, 4, 2, buf, route_weights=buf)


def test_activations_past_32_bit_offsets_are_refused() -> None:
    """The direct kernels hold an activation row's start as a 32-bit element offset: a call with 2^32
    activation elements or more is refused, not run with offsets that wrap."""
    w_type = GGMLQuantizationType.Q4_0
    n_expert, n_out, n_in, n_tokens, top_k = 128, 128, 8192, 65536, 8  # 2^19 rows of 2^13: 2^32 elements
    pairs = n_tokens * top_k
    fmt = FORMATS[w_type]
    with expertstream.backend("sim", profile="cuda-h200", data=False) as sim:
        device = sim.device(0)
        with MoeKernels(device) as kernels, device.stream() as stream:
            assert kernels.uses_direct(w_type, n_in)
            with (
                device.alloc(n_expert * n_out * fmt.row_bytes(n_in) + (1 << 20)) as w,
                device.alloc(pairs * n_in * 4) as x,
                device.alloc(pairs * 4) as ids,
                device.alloc(pairs * n_out * 4) as y,
            ):
                with pytest.raises(InvalidArgument, match="over the 2\\^32 elements"):
                    kernels.mul_mat_id(stream, w, w_type, n_expert, n_out, n_in, x, True, ids, n_tokens, top_k, y)
                small = n_tokens // 2  # 2^31 elements: taken
                kernels.mul_mat_id(stream, w, w_type, n_expert, n_out, n_in, x, True, ids, small, top_k, y)
                stream.synchronize()


def test_q6_k_takes_the_64_pair_tile_where_others_take_128(device: Device, stream: Stream) -> None:
    """Q6_K's direct kernels stop at 64 pairs a tile (a 128-pair one would pass 48 KiB of static shared
    memory): at 256 pairs per expert Q4_K takes 128, Q6_K 64, and a 128-pair tile asked for is refused."""
    w_type = GGMLQuantizationType.Q6_K
    with MoeKernels(device) as kernels, device.alloc(1 << 20) as buf:
        _direct_kernels(kernels, w_type, 768)
        n_expert = 8
        assert kernels.tile_for(GGMLQuantizationType.Q4_K, 256 * n_expert, n_expert, 768) == TileM.TALLEST
        assert kernels.tile_for(w_type, 256 * n_expert, n_expert, 768) == TileM.TALL
        with pytest.raises(InvalidArgument, match="no 128-row tile"):
            kernels.mul_mat_id(stream, buf, w_type, 2, 32, 768, buf, False, buf, 4, 2, buf, tile_m=TileM.TALLEST)
        with pytest.raises(InvalidArgument, match="no 128-row tile"):
            kernels.gate_up(stream, buf, buf, w_type, 2, 32, 768, buf, buf, 4, 2, buf, tile_m=TileM.TALLEST)


def test_prepared_inputs_are_the_bytes_of_preparing_each_call(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    """Two weight types over one input, as the Q, K and V projections: rounded and grouped once
    (prepare_direct), each call writes what it writes preparing its own; a call whose inputs or
    tile differ from what was prepared is refused."""
    types = [t for t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K) if kernels.uses_direct(t, 512)]
    if len(types) < 2:
        pytest.skip(f"{kernels.device.label} takes no direct kernels for Q4_K and Q6_K")
    shape = Shape(n_expert=3, n_out=200, n_in=512, n_tokens=70, top_k=2)
    ids = tensors.distinct_ids(rng, shape.n_tokens, shape.top_k, np.arange(3))
    problems = [tensors.make_problem(device, rng, t, shape, ids) for t in types]
    problems[1].x_buf.write(problems[0].x)
    problems[1].ids_buf.write(problems[0].ids)
    x, ids_buf = problems[0].x_buf, problems[0].ids_buf
    tile = kernels.tile_for(types[0], shape.n_pairs, shape.n_expert, shape.n_in)
    assert tile == kernels.tile_for(types[1], shape.n_pairs, shape.n_expert, shape.n_in)
    expected = [tensors.run(kernels, stream, p, ids_buf=ids_buf) for p in problems]
    prepared = kernels.prepare_direct(stream, x, ids_buf, shape.n_tokens, shape.top_k, shape.n_expert, shape.n_in, tile)
    for p, want in zip(problems, expected, strict=True):
        with tensors.poisoned(device, shape.n_pairs * shape.n_out * 4) as y:
            kernels.mul_mat_id(stream, p.w_buf, p.w_type, 3, 200, 512, x, False, ids_buf, 70, 2, y, prepared=prepared)
            stream.synchronize()
            assert y.read().view(np.float32).tobytes() == want.tobytes()
    with tensors.poisoned(device, shape.n_pairs * shape.n_out * 4) as y:
        for wrong in ({"x": problems[1].x_buf}, {"n_tokens": 69}):
            args = {"x": x, "n_tokens": 70, **wrong}
            with pytest.raises(InvalidArgument, match="prepared inputs were made for other"):
                kernels.mul_mat_id(
                    stream,
                    problems[0].w_buf,
                    types[0],
                    3,
                    200,
                    512,
                    args["x"],
                    False,
                    ids_buf,
                    args["n_tokens"],
                    2,
                    y,
                    prepared=prepared,
                )
        kernels.prepare_direct(stream, x, ids_buf, shape.n_tokens, shape.top_k, shape.n_expert, shape.n_in, tile)
        stream.synchronize()  # the kernels' scratch is theirs again, for another stream
        with pytest.raises(InvalidArgument, match="overwritten by a later prepare_direct"):
            kernels.mul_mat_id(
                stream, problems[0].w_buf, types[0], 3, 200, 512, x, False, ids_buf, 70, 2, y, prepared=prepared
            )


def test_prepare_direct_refuses_rows_and_tiles_no_direct_kernel_takes(
    device: Device, kernels: MoeKernels, stream: Stream
) -> None:
    if not kernels.uses_direct(GGMLQuantizationType.Q4_0, 512):
        pytest.skip(f"{kernels.device.label} takes no direct kernels")
    with device.alloc(70 * 512 * 4) as x, device.alloc(70 * 4) as ids:
        with pytest.raises(InvalidArgument, match="multiple of 64 elements"):
            kernels.prepare_direct(stream, x, ids, 70, 1, 1, 500, TileM.SHORT)
        with pytest.raises(InvalidArgument, match="not 512 elements and 7 rows"):
            kernels.prepare_direct(stream, x, ids, 70, 1, 1, 512, 7)  # type: ignore[arg-type]


def test_groups_of_the_last_preparation_serve_a_per_pair_input(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    """A down projection after its gate: the gate's groups, the down's own rows rounded (x per pair),
    the bytes of the call preparing both itself; groups of other ids are refused."""
    w_type = GGMLQuantizationType.Q4_K
    gate_shape = Shape(n_expert=4, n_out=256, n_in=512, n_tokens=30, top_k=2)
    down_shape = Shape(n_expert=4, n_out=192, n_in=256, n_tokens=30, top_k=2, x_per_pair=True)
    if not kernels.uses_direct(w_type, down_shape.n_in):
        pytest.skip(f"{kernels.device.label} takes no direct kernels for {w_type.name}")
    ids = tensors.distinct_ids(rng, 30, 2, np.arange(4))
    gate = tensors.make_problem(device, rng, w_type, gate_shape, ids)
    down = tensors.make_problem(device, rng, w_type, down_shape, ids)
    tile = kernels.tile_for(w_type, 60, 4, 512)
    assert tile == kernels.tile_for(w_type, 60, 4, 256)
    expected = tensors.run(kernels, stream, down, ids_buf=gate.ids_buf)
    first = kernels.prepare_direct(stream, gate.x_buf, gate.ids_buf, 30, 2, 4, 512, tile)
    second = kernels.prepare_direct(
        stream, down.x_buf, gate.ids_buf, 30, 2, 4, 256, tile, x_per_pair=True, groups_of=first
    )
    assert second.groups == first.groups
    with tensors.poisoned(device, 60 * 192 * 4) as y:
        kernels.mul_mat_id(
            stream, down.w_buf, w_type, 4, 192, 256, down.x_buf, True, gate.ids_buf, 30, 2, y, prepared=second
        )
        stream.synchronize()
        assert y.read().view(np.float32).tobytes() == expected.tobytes()
    with pytest.raises(InvalidArgument, match="groups_of is not the last preparation"):
        kernels.prepare_direct(stream, down.x_buf, down.ids_buf, 30, 2, 4, 256, tile, x_per_pair=True, groups_of=second)
    with pytest.raises(InvalidArgument, match="groups_of is not the last preparation"):
        kernels.prepare_direct(stream, down.x_buf, gate.ids_buf, 30, 2, 4, 256, tile, x_per_pair=True, groups_of=first)
    stream.synchronize()
