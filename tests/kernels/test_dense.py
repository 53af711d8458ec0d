"""The dense kernels (get_rows, rms_norm, add_rows, rope, store_rows_f16, copy_columns,
mla_rope_store) against their float64 references (twins on sim, kernels on GPUs), and the
arguments they refuse."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.backends.base import Device, DeviceBuffer, Stream
from expertstream.engine import standin
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels, dense
from expertstream.kernels import reference as ref
from expertstream.kernels import reference_dense as ref_dense
from expertstream.kernels.dense import Rope
from expertstream.kernels.layout import MAX_GRID_Y

from .tensors import ALL_TYPES, FLOAT, poisoned

_T = GGMLQuantizationType


def _floats(buf: DeviceBuffer, *shape: int) -> np.ndarray:
    return buf.read().view(np.float32)[: int(np.prod(shape))].reshape(shape)


def _ints(device: Device, values: list[int] | np.ndarray) -> DeviceBuffer:
    return device.upload(np.asarray(values, np.int32))


def _get_rows(
    device: Device, kernels: MoeKernels, stream: Stream, table: np.ndarray, table_type: _T, n_cols: int, ids: np.ndarray
) -> np.ndarray:
    n_table_rows = table.shape[0]
    out = poisoned(device, ids.size * n_cols * 4)
    dense.get_rows(
        kernels, stream, device.upload(table), table_type, n_cols, n_table_rows, _ints(device, ids), ids.size, out
    )
    stream.synchronize()
    return _floats(out, ids.size, n_cols)


def _check_rows(got: np.ndarray, expected: np.ndarray) -> None:
    bad = np.isnan(expected).all(axis=1)
    assert np.isnan(got[bad]).all(), "rows of out-of-range ids must be NaN"
    assert np.isfinite(got[~bad]).all()
    err = ref.relative_error(got[~bad], expected[~bad])
    assert err < ref_dense.GET_ROWS_RTOL, f"relative error {err:.3g}"


@pytest.mark.parametrize("table_type", ALL_TYPES, ids=lambda t: t.name)
def test_get_rows_of_every_type(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, table_type: _T
) -> None:
    # 4608 columns: a whole 4096-element chunk of a block row and a partial one.
    n_table_rows, n_cols = 7, 4608
    table = ref.random_weights(rng, table_type, n_table_rows, n_cols)
    ids = np.array([3, 0, 6, -1, 7, 3, 2**31 - 1, 5, -(2**31), 1], np.int32)
    got = _get_rows(device, kernels, stream, table, table_type, n_cols, ids)
    _check_rows(got, ref_dense.get_rows(table, table_type, n_cols, n_table_rows, ids))


@pytest.mark.parametrize("table_type", FLOAT, ids=lambda t: t.name)
def test_get_rows_of_float_tables_takes_any_width(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, table_type: _T
) -> None:
    n_table_rows, n_cols = 5, 45
    table = ref.random_weights(rng, table_type, n_table_rows, n_cols)
    ids = np.array([4, 4, 0, 5, 2], np.int32)
    got = _get_rows(device, kernels, stream, table, table_type, n_cols, ids)
    _check_rows(got, ref_dense.get_rows(table, table_type, n_cols, n_table_rows, ids))


def test_get_rows_of_more_ids_than_one_grid_row_holds(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    n_table_rows, n_cols = 50, 32
    table = ref.random_weights(rng, _T.Q8_0, n_table_rows, n_cols)
    ids = rng.integers(-2, n_table_rows + 2, MAX_GRID_Y + 1000).astype(np.int32)
    got = _get_rows(device, kernels, stream, table, _T.Q8_0, n_cols, ids)
    _check_rows(got, ref_dense.get_rows(table, _T.Q8_0, n_cols, n_table_rows, ids))


@pytest.mark.parametrize(("n_rows", "n"), [(5, 4096), (37 * 8, 128), (3, 45), (2, 1), (1, 300)])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
def test_rms_norm(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    n_rows: int,
    n: int,
    with_weight: bool,
) -> None:
    # Rows of very different scales: each must be normalized by its own mean square.
    x = (rng.standard_normal((n_rows, n)) * 10.0 ** rng.integers(-3, 4, (n_rows, 1))).astype(np.float32)
    weight = rng.standard_normal(n).astype(np.float32) if with_weight else None
    out = poisoned(device, x.nbytes)
    w_buf = None if weight is None else device.upload(weight)
    dense.rms_norm(kernels, stream, device.upload(x), w_buf, out, n_rows, n, 1e-5)
    stream.synchronize()
    err = ref.relative_error(_floats(out, n_rows, n), ref_dense.rms_norm(x, weight, 1e-5))
    assert err < ref_dense.RMS_NORM_RTOL, f"relative error {err:.3g}"


def test_rms_norm_in_place_and_eps(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    n_rows, n, eps = 9, 200, 0.5  # rows of mean square ~1e-2: eps moves every value
    x = (rng.standard_normal((n_rows, n)) * 0.1).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, n).astype(np.float32)
    buf = device.alloc(x.nbytes + 64)
    buf.write(x.view(np.uint8), offset=64)
    rows = buf.view(64, x.nbytes)
    dense.rms_norm(kernels, stream, rows, device.upload(weight), rows, n_rows, n, eps)
    stream.synchronize()
    got = buf.read().view(np.float32)[16:].reshape(n_rows, n)
    err = ref.relative_error(got, ref_dense.rms_norm(x, weight, eps))
    assert err < ref_dense.RMS_NORM_RTOL, f"relative error {err:.3g}"


@pytest.mark.parametrize(("n_rows", "n"), [(1, 2048), (4, 4096), (3, 45)])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
def test_add_rms_norm_is_the_add_then_the_norm(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    n_rows: int,
    n: int,
    with_weight: bool,
) -> None:
    """The fused residual add and norm writes the bytes of add_inplace then rms_norm, in both outputs."""
    hidden = (rng.standard_normal((n_rows, n)) * 10.0 ** rng.integers(-2, 3, (n_rows, 1))).astype(np.float32)
    delta = rng.standard_normal((n_rows, n)).astype(np.float32)
    weight = rng.standard_normal(n).astype(np.float32) if with_weight else None
    w_buf = None if weight is None else device.upload(weight)
    delta_buf = device.upload(delta)
    two_h, fused_h = device.upload(hidden), device.upload(hidden)
    two_out, fused_out = poisoned(device, hidden.nbytes), poisoned(device, hidden.nbytes)
    standin.add_inplace(kernels, stream, two_h.view(0, hidden.nbytes), delta_buf.view(0, delta.nbytes), n_rows * n)
    dense.rms_norm(kernels, stream, two_h, w_buf, two_out, n_rows, n, 1e-6)
    dense.add_rms_norm(kernels, stream, fused_h, delta_buf, w_buf, fused_out, n_rows, n, 1e-6)
    stream.synchronize()
    assert np.array_equal(_floats(fused_h, n_rows, n), hidden + delta), "hidden is not hidden + delta"
    assert _floats(fused_out, n_rows, n).tobytes() == _floats(two_out, n_rows, n).tobytes()
    err = ref.relative_error(_floats(fused_out, n_rows, n), ref_dense.rms_norm(hidden + delta, weight, 1e-6))
    assert err < ref_dense.RMS_NORM_RTOL, f"relative error {err:.3g}"


def test_add_rms_norm_refuses_overlapping_rows(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    buf = device.alloc(4 * 256)
    with pytest.raises(InvalidArgument, match=r"out .* overlaps hidden"):
        dense.add_rms_norm(kernels, stream, buf.view(0, 256), buf.view(256, 256), None, buf.view(128, 256), 1, 64, 1e-6)
    with pytest.raises(InvalidArgument, match=r"hidden .* overlaps delta"):
        dense.add_rms_norm(kernels, stream, buf.view(0, 256), buf.view(128, 256), None, buf.view(512, 256), 1, 64, 1e-6)


@pytest.mark.parametrize(("n_rows", "n"), [(3, 5), (70, 1000), (MAX_GRID_Y + 3, 2)])
def test_add_rows(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, n_rows: int, n: int
) -> None:
    y = rng.standard_normal((n_rows, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    y_buf = device.upload(y)
    dense.add_rows(kernels, stream, y_buf, device.upload(bias), n_rows, n)
    stream.synchronize()
    err = ref.relative_error(_floats(y_buf, n_rows, n), y.astype(np.float64) + bias)
    assert err < ref_dense.BIAS_RTOL, f"relative error {err:.3g}"


# gpt-oss as llama.cpp runs it: YaRN, factor 32 over a 4096-token training context.
GPT_OSS = Rope(64, True, 150000.0, 1 / 32, 1.0, 1.0, 32.0, 1.0, 4096)
ROPES = {
    "normal": Rope(64, False, 10000.0),
    "neox": Rope(128, True, 1e6),
    "neox-partial": Rope(32, True, 10000.0),
    "normal-partial": Rope(16, False, 500000.0, freq_scale=0.5),
    "yarn-gpt-oss": GPT_OSS,
    "yarn-normal-partial": Rope(48, False, 10000.0, 0.25, 0.5, 0.9, 32.0, 1.0, 2048),
}
HEAD_DIM = {"normal": 64, "neox": 128, "neox-partial": 64, "normal-partial": 48, "yarn-gpt-oss": 64}


@pytest.mark.parametrize("case", sorted(ROPES))
def test_rope(device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, case: str) -> None:
    params = ROPES[case]
    n_tokens, n_heads, head_dim = 13, 5, HEAD_DIM.get(case, 80)
    positions = rng.permutation(3000)[:n_tokens].astype(np.int32)
    positions[:2] = (0, 2999)
    x = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    x_buf = device.upload(x)
    dense.rope(kernels, stream, x_buf, _ints(device, positions), n_tokens, n_heads, head_dim, params)
    stream.synchronize()
    got = _floats(x_buf, n_tokens, n_heads, head_dim)
    expected = ref_dense.rope(x, positions, params)
    rotated = slice(0, params.n_rot)
    err = ref.relative_error(got[..., rotated], expected[..., rotated])
    assert err < ref_dense.rope_rtol(int(positions.max())), f"relative error {err:.3g}"
    np.testing.assert_array_equal(got[..., params.n_rot :], x[..., params.n_rot :])


def test_rope_of_more_tokens_than_one_grid_row_holds(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    n_tokens, n_heads, head_dim = MAX_GRID_Y + 7, 1, 4
    positions = rng.integers(0, 100, n_tokens).astype(np.int32)
    x = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    x_buf = device.upload(x)
    params = Rope(4, False, 10000.0)
    dense.rope(kernels, stream, x_buf, _ints(device, positions), n_tokens, n_heads, head_dim, params)
    stream.synchronize()
    err = ref.relative_error(_floats(x_buf, n_tokens, n_heads, head_dim), ref_dense.rope(x, positions, params))
    assert err < ref_dense.rope_rtol(100), f"relative error {err:.3g}"


def test_yarn_correction_dims() -> None:
    """gpt-oss's ramp runs over pairs 8..18 (worked by hand from ggml_rope_yarn_corr_dims), and the
    launcher's float32 dims agree with the float64 reference's for every YaRN case here."""
    assert dense.yarn_corr_dims(GPT_OSS) == (8.0, 18.0)
    assert dense.rope_mscale(GPT_OSS) == pytest.approx(1.0 + 0.1 * np.log(32.0))
    for params in ROPES.values():
        if params.ext_factor:
            assert dense.yarn_corr_dims(params) == ref_dense.yarn_corr_dims(params)


# float32 values around float16's edges: the largest half and the tie above it, subnormal ties,
# a normal tie either way, and what must stay infinite, NaN or negative zero.
F16_EDGES = np.array(
    [
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        1e10,
        2.0**-24,
        2.0**-25,
        3 * 2.0**-25,
        2.0**-14 - 2.0**-25,
        2.0**-14 - 2.0**-26,
        1e-8,
        1e-40,
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        -0.0,
        np.inf,
        -np.inf,
        np.nan,
    ],
    np.float32,
)


@pytest.mark.parametrize("width", [len(F16_EDGES), 300])
def test_store_rows_f16_at_scattered_positions(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, width: int
) -> None:
    n_cache_rows = 20
    positions = np.array([17, 3, 0, 19, -1, 20, 5, 2**31 - 1], np.int32)
    src = (rng.standard_normal((positions.size, width)) * 100).astype(np.float32)
    src[:, : len(F16_EDGES)] = F16_EDGES
    cache = rng.standard_normal((n_cache_rows, width)).astype(np.float16)
    cache_buf = device.alloc(cache.nbytes)
    cache_buf.write(cache.view(np.uint8))
    dense.store_rows_f16(
        kernels, stream, device.upload(src), cache_buf, _ints(device, positions), positions.size, width
    )
    stream.synchronize()
    got = cache_buf.read().view(np.float16).reshape(n_cache_rows, width)
    expected = ref_dense.store_rows_f16(cache, src, positions)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])


def test_store_rows_f16_of_more_tokens_than_one_grid_row_holds(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    n_tokens, width = MAX_GRID_Y + 5, 2
    positions = rng.permutation(n_tokens).astype(np.int32)
    src = rng.standard_normal((n_tokens, width)).astype(np.float32)
    cache_buf = poisoned(device, n_tokens * width * 2)
    dense.store_rows_f16(kernels, stream, device.upload(src), cache_buf, _ints(device, positions), n_tokens, width)
    stream.synchronize()
    got = cache_buf.read().view(np.float16).reshape(n_tokens, width)
    expected = ref_dense.store_rows_f16(np.zeros((n_tokens, width), np.float16), src, positions)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize(("n_rows", "src_width", "first", "width"), [(12, 96, 0, 32), (5, 600, 512, 64), (3, 7, 2, 5)])
def test_copy_columns(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    n_rows: int,
    src_width: int,
    first: int,
    width: int,
) -> None:
    src = rng.standard_normal((n_rows, src_width)).astype(np.float32)
    dst = poisoned(device, n_rows * width * 4)
    dense.copy_columns(kernels, stream, device.upload(src), src_width, first, width, dst, n_rows)
    stream.synchronize()
    np.testing.assert_array_equal(_floats(dst, n_rows, width), src[:, first : first + width])


# deepseek2's latent attention: V2-Lite's widths (normal-mode rotation, YaRN factor 40 over 4096
# positions) and the tiny preset's.
MLA_CASES = {
    "v2-lite": (512, 128, Rope(64, False, 10000.0, 1 / 40, 0.7, 1.0, 32.0, 1.0, 4096), True),
    "tiny": (96, 32, Rope(32, False, 10000.0), False),
}


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_rope_store_is_the_norm_rotation_and_store(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, case: str
) -> None:
    rank, nope, params, weighted = MLA_CASES[case]
    n_tokens, n_head, n_cache_rows, eps = 5, 3, 12, 1e-6
    n_rot, width = params.n_rot, rank + params.n_rot
    positions = np.array([3, 0, 11, 12, 7], np.int32)  # 12 is past the cache: nothing written
    q = rng.standard_normal((n_tokens, n_head, nope + n_rot)).astype(np.float32)
    q_abs = rng.standard_normal((n_tokens, n_head, rank)).astype(np.float32)
    kv = (rng.standard_normal((n_tokens, width)) * 3).astype(np.float32)
    kv_norm = rng.standard_normal(rank).astype(np.float32) if weighted else None
    cache = rng.standard_normal((n_cache_rows, width)).astype(np.float16)
    cache_buf = device.alloc(cache.nbytes)
    cache_buf.write(cache.view(np.uint8))
    q_out = poisoned(device, n_tokens * n_head * width * 4)
    rows = dense.LatentInputs(
        device.upload(q),
        device.upload(q_abs),
        device.upload(kv),
        None if kv_norm is None else device.upload(kv_norm),
        _ints(device, positions),
    )
    dense.mla_rope_store(kernels, stream, rows, q_out, cache_buf, n_tokens, n_head, rank, nope, params, eps)
    stream.synchronize()
    got_q = _floats(q_out, n_tokens, n_head, width)
    np.testing.assert_array_equal(got_q[:, :, :rank], q_abs)
    tol = ref_dense.rope_rtol(int(positions.max()))
    err = ref.relative_error(got_q[:, :, rank:], ref_dense.rope(q[:, :, nope:], positions, params))
    assert err < tol, f"rotated query: relative error {err:.3g}"
    key = np.concatenate(
        [ref_dense.rms_norm(kv[:, :rank], kv_norm, eps), ref_dense.rope(kv[:, None, rank:], positions, params)[:, 0]],
        axis=1,
    )
    expected = ref_dense.store_rows_f16(cache, key, positions).astype(np.float32)
    got = cache_buf.read().view(np.float16).reshape(n_cache_rows, width).astype(np.float32)
    untouched = [r for r in range(n_cache_rows) if r not in positions]
    np.testing.assert_array_equal(got[untouched], cache[untouched].astype(np.float32))
    err = ref.relative_error(got[positions[positions < n_cache_rows]], expected[positions[positions < n_cache_rows]])
    assert err < 2e-3, f"key rows: relative error {err:.3g}"  # float16 rounding of both


def test_bad_arguments_are_refused_before_launch(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    small = device.alloc(64)
    big = device.alloc(1 << 16)
    ids = _ints(device, [0, 1])
    latent = dense.LatentInputs(big, big, big, None, ids)
    refused = {
        "no decoder": lambda: dense.get_rows(kernels, stream, big, _T.Q8_1, 32, 2, ids, 2, big),
        "block size": lambda: dense.get_rows(kernels, stream, big, _T.Q4_K, 32, 2, ids, 2, big),
        "table holds": lambda: dense.get_rows(kernels, stream, small, _T.F32, 32, 2, ids, 2, big),
        "out holds": lambda: dense.get_rows(kernels, stream, big, _T.F16, 32, 2, ids, 2, small),
        "n_ids": lambda: dense.get_rows(kernels, stream, big, _T.F16, 32, 2, ids, 0, big),
        "x holds": lambda: dense.rms_norm(kernels, stream, small, None, big, 2, 64, 1e-6),
        "weight holds": lambda: dense.rms_norm(kernels, stream, big, small, big.view(8192, 8192), 2, 64, 1e-6),
        "eps": lambda: dense.rms_norm(kernels, stream, big, None, big, 2, 64, -1.0),
        "partly overlaps": lambda: dense.rms_norm(kernels, stream, big.view(0, 512), None, big.view(4, 512), 2, 64, 0),
        "bias holds": lambda: dense.add_rows(kernels, stream, big, small, 2, 64),
        "n_rot": lambda: dense.rope(kernels, stream, big, ids, 2, 1, 64, Rope(33, False, 1e4)),
        "head_dim": lambda: dense.rope(kernels, stream, big, ids, 2, 1, 16, Rope(32, False, 1e4)),
        "freq_base": lambda: dense.rope(kernels, stream, big, ids, 2, 1, 16, Rope(16, False, 0.0)),
        "YaRN": lambda: dense.rope(kernels, stream, big, ids, 2, 1, 16, Rope(16, True, 1e4, 0.25, 1.0)),
        "positions holds": lambda: dense.rope(kernels, stream, big, ids, 3, 1, 16, Rope(16, True, 1e4)),
        "one row": lambda: dense.store_rows_f16(kernels, stream, big, small, ids, 2, 64),
        "src holds": lambda: dense.store_rows_f16(kernels, stream, small, big, ids, 2, 64),
        "outside rows of 8": lambda: dense.copy_columns(kernels, stream, big, 8, 4, 5, big.view(4096, 64), 2),
        "dst .* overlaps": lambda: dense.copy_columns(kernels, stream, big, 8, 0, 4, big.view(0, 64), 2),
        "nope": lambda: dense.mla_rope_store(kernels, stream, latent, big, big, 2, 1, 32, -1, Rope(16, False, 1e4), 0),
    }
    for words, launch in refused.items():
        with pytest.raises(InvalidArgument, match=words):
            launch()
    stream.synchronize()


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "scaled"])
def test_combine_rms_norm_is_the_bytes_of_combine_then_rms_norm(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, weighted: bool
) -> None:
    """The end of an MoE layer and the next norm in one launch write what combine then rms_norm
    write, and the norm may not be written over the rows it reads."""
    n_tokens, top_k, n, eps = 2, 4, 300, 1e-6
    y = device.upload(rng.standard_normal((n_tokens, top_k, n)).astype(np.float32))
    weights = device.upload(rng.random((n_tokens, top_k)).astype(np.float32)) if weighted else None
    extra = device.upload(rng.standard_normal((n_tokens, n)).astype(np.float32))
    start = rng.standard_normal((n_tokens, n)).astype(np.float32)
    norm = device.upload(rng.standard_normal(n).astype(np.float32))
    results = []
    for fused in (False, True):
        hidden, out = device.upload(start), poisoned(device, n_tokens * n * 4)
        if fused:
            dense.combine_rms_norm(kernels, stream, y, weights, extra, hidden, norm, out, n_tokens, top_k, n, eps)
        else:
            kernels.combine(stream, y, weights, extra, hidden, n_tokens, top_k, n)
            dense.rms_norm(kernels, stream, hidden, norm, out, n_tokens, n, eps)
        stream.synchronize()
        results.append((hidden.read().tobytes(), out.read().tobytes()))
    assert np.isfinite(np.frombuffer(results[0][1], np.float32)).all()
    assert results[1] == results[0]
    with pytest.raises(InvalidArgument, match="overlap"):
        dense.combine_rms_norm(kernels, stream, y, weights, extra, hidden, norm, hidden, n_tokens, top_k, n, eps)


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_0], ids=lambda t: t.name)
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled-rows", "combine-weights"])
def test_down_combine_rms_norm_is_the_bytes_of_down_then_combine_rms_norm(
    device: Device, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType, scaled: bool
) -> None:
    """Decode's down projection, the MoE combine (a shared expert's rows too) and the next norm in one
    launch write what mul_mat_id then combine_rms_norm write, again on a second launch (its counters
    back to 0), with the last expert (the padding tail) among the pairs; more pairs than the
    matrix-vector kernels take are refused."""
    n_tokens, top_k, n_expert, n, n_in, eps = 2, 3, 4, 300, 256, 1e-6
    w = ref.random_weights(rng, w_type, n_expert * n, n_in)
    act = device.upload(rng.standard_normal((n_tokens * top_k, n_in)).astype(np.float32))
    ids = device.upload(np.array([3, 0, 2, 1, 3, 0], np.int32))
    route = device.upload(rng.random((n_tokens, top_k)).astype(np.float32))
    extra = device.upload(rng.standard_normal((n_tokens, n)).astype(np.float32))
    start = rng.standard_normal((n_tokens, n)).astype(np.float32)
    norm = device.upload(rng.standard_normal(n).astype(np.float32))
    row_weights, combine_weights = (route, None) if scaled else (None, route)
    with MoeKernels(device, gemv=True) as kernels, device.alloc(w.nbytes, row_type=w_type, ne0=n_in) as w_buf:
        if scaled and not kernels.uses_direct(w_type, n_in):
            pytest.skip(f"mul_mat_id scales {w_type.name} rows only where a direct kernel runs them")
        w_buf.write(w)
        results = []
        for fused in (False, True, True):
            hidden, out = device.upload(start), poisoned(device, start.nbytes)
            y = poisoned(device, n_tokens * top_k * n * 4)
            if fused:
                dense.down_combine_rms_norm(
                    kernels, stream, w_buf, w_type, n_expert, n_in, act, ids, n_tokens, top_k, y, row_weights,
                    combine_weights, extra, hidden, norm, out, n, eps,
                )  # fmt: skip
            else:
                kernels.mul_mat_id(
                    stream, w_buf, w_type, n_expert, n, n_in, act, True, ids, n_tokens, top_k, y,
                    route_weights=row_weights,
                )  # fmt: skip
                dense.combine_rms_norm(
                    kernels, stream, y, combine_weights, extra, hidden, norm, out, n_tokens, top_k, n, eps
                )
            stream.synchronize()
            results.append([buf.read().tobytes() for buf in (y, hidden, out)])
        assert np.isfinite(np.frombuffer(results[0][2], np.float32)).all()
        assert results[1] == results[0], "the fused launch wrote other bytes than down then combine_rms_norm"
        assert results[2] == results[0], "a second fused launch (the counters reused) wrote other bytes"
        with pytest.raises(InvalidArgument, match="tile kernels"):
            dense.down_combine_rms_norm(
                kernels, stream, w_buf, w_type, n_expert, n_in, act, ids, 16, top_k, y, row_weights,
                combine_weights, extra, hidden, norm, out, n, eps,
            )  # fmt: skip
        with pytest.raises(InvalidArgument, match="overlap"):
            dense.down_combine_rms_norm(
                kernels, stream, w_buf, w_type, n_expert, n_in, act, ids, n_tokens, top_k, y, row_weights,
                combine_weights, extra, hidden, norm, hidden, n, eps,
            )  # fmt: skip


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_project_add_rms_norm_is_the_bytes_of_the_projection_then_add_rms_norm(
    device: Device, stream: Stream, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """Decode's attention output, residual add and FFN norm in one launch write what the projection
    then add_rms_norm write, again on a second launch (its counters back to 0); more rows than the
    matrix-vector kernels take are refused."""
    n_tokens, n, n_in, eps = 2, 300, 256, 1e-6
    w = ref.random_weights(rng, w_type, n, n_in)
    x = device.upload(rng.standard_normal((n_tokens, n_in)).astype(np.float32))
    start = rng.standard_normal((n_tokens, n)).astype(np.float32)
    norm = device.upload(rng.standard_normal(n).astype(np.float32))
    ids = device.upload(np.zeros(n_tokens, np.int32))
    with MoeKernels(device, gemv=True) as kernels, device.alloc(w.nbytes, row_type=w_type, ne0=n_in) as w_buf:
        w_buf.write(w)
        results = []
        for fused in (False, True, True):
            hidden, y, out = device.upload(start), poisoned(device, start.nbytes), poisoned(device, start.nbytes)
            if fused:
                dense.project_add_rms_norm(
                    kernels, stream, w_buf, w_type, n_in, x, n_tokens, y, hidden, norm, out, n, eps
                )
            else:
                kernels.mul_mat_id(stream, w_buf, w_type, 1, n, n_in, x, False, ids, n_tokens, 1, y)
                dense.add_rms_norm(kernels, stream, hidden, y, norm, out, n_tokens, n, eps)
            stream.synchronize()
            results.append([buf.read().tobytes() for buf in (y, hidden, out)])
        assert np.isfinite(np.frombuffer(results[0][2], np.float32)).all()
        assert results[1] == results[0] and results[2] == results[0]
        with pytest.raises(InvalidArgument, match="tile kernels"):
            rows = 64
            dense.project_add_rms_norm(kernels, stream, w_buf, w_type, n_in, x, rows, y, hidden, norm, out, n, eps)
