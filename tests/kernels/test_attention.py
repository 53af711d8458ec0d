"""Causal attention over an f16 KV cache against the float64 reference (twins on sim, kernels on GPUs).

Every case fills the cache rows no query sees (past the last position up to kv_len, and before
the window) with NaN: a kernel that lets one of them into a result fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from expertstream.backends import sim
from expertstream.backends.base import Device, DeviceBuffer, Stream
from expertstream.errors import InvalidArgument
from expertstream.kernels import MatrixPath, MoeKernels
from expertstream.kernels import reference as ref
from expertstream.kernels.attention import (
    DECODE_CHUNK,
    DECODE_MAX_TOKENS,
    FUSED_MAX_CHUNKS,
    MMA_ROWS_VAR,
    attention,
    prefill_kernel,
    uses_matrix_cores,
    uses_wide_mma,
)
from expertstream.kernels.reference_attention import attention as reference_attention
from expertstream.timeline import OpKind

from .tensors import poisoned

# Worst relative error of one output row (token, head) against the float64 reference. Float32
# accumulation over a few hundred keys stays near 1e-6; the matrix-core kernels (the prefill, and the
# wide heads' prefill and split-K decode) round scale * q and the softmax weights to f16 (11
# significant bits) before their products.
RTOL_F32 = 2e-5
RTOL_F16 = 1e-2


@dataclass(frozen=True)
class Case:
    n_tokens: int
    first_pos: int  # position of the first query; the others follow one by one
    n_head: int
    n_head_kv: int
    head_dim: int
    window: int = 0
    sinks: bool = False
    extra_rows: int = 0  # kv_len past the last position (rows the launch may read but no query sees)
    shared_kv: bool = False  # the values are the keys' rows, one buffer (deepseek2's latent cache)

    @property
    def kv_len(self) -> int:
        return self.first_pos + self.n_tokens + self.extra_rows

    def __str__(self) -> str:
        return (
            f"t{self.n_tokens}-p{self.first_pos}-h{self.n_head}/{self.n_head_kv}-d{self.head_dim}"
            f"-w{self.window}{'-sinks' if self.sinks else ''}-x{self.extra_rows}{'-kv' if self.shared_kv else ''}"
        )


# The wide matrix-core split-K decode over many chunks, 128 heads in two row blocks, a window.
_LATENT_DECODE_WINDOW = Case(1, 1000, 128, 1, 576, window=700, extra_rows=40, shared_kv=True)
CASES = [
    Case(1, 0, 4, 4, 64),
    Case(1, 300, 8, 8, 64, extra_rows=700),
    Case(1, 1000, 32, 4, 128, sinks=True, extra_rows=37),
    Case(3, 517, 16, 4, 64, window=128, sinks=True, extra_rows=300),
    Case(8, 40, 8, 1, 128, window=16),
    Case(9, 1000, 8, 8, 64, extra_rows=100),
    Case(64, 0, 8, 2, 128),
    Case(64, 100, 16, 2, 64, window=32, sinks=True, extra_rows=64),
    Case(200, 300, 8, 2, 128, window=128, extra_rows=513),
    Case(200, 57, 4, 4, 64, sinks=True),
    Case(1, 70, 16, 1, 576, extra_rows=5),  # deepseek2's latent attention: one shared key-value head
    Case(40, 10, 4, 1, 576, extra_rows=20),
    Case(20, 30, 16, 2, 256, extra_rows=3),  # qwen3next's full attention
    Case(3, 600, 8, 1, 576, extra_rows=20),  # the wide split-K decode over 19 chunks
    Case(2, 40, 16, 2, 256, window=16, sinks=True),
    # the wide matrix-core prefill: several row blocks, a block within a token's heads (128 heads, as
    # DeepSeek-V3 has), a window cutting into the tiles, and qwen3next's separate values
    Case(70, 0, 16, 1, 576, extra_rows=9, shared_kv=True),
    Case(40, 100, 128, 1, 576, extra_rows=3, shared_kv=True),
    Case(33, 10, 16, 1, 576, window=20, sinks=True, shared_kv=True),
    Case(100, 5, 16, 2, 256, extra_rows=7),
    Case(12, 0, 8, 1, 576, shared_kv=True),  # one block whose rows end past the last token
    # their split-K decode: one chunk, many chunks past the positions, 128 heads in two row blocks
    Case(1, 20, 16, 1, 576, extra_rows=3, shared_kv=True),
    Case(3, 600, 16, 1, 576, extra_rows=300, shared_kv=True),
    _LATENT_DECODE_WINDOW,
    Case(8, 90, 16, 2, 256, sinks=True, extra_rows=50),
    Case(40, 30, 8, 2, 256, window=24, extra_rows=6),  # qwen3next's heads with a window
    # long launches: a last block of 12 queries of its 64, and a window with sinks over rows past the positions
    Case(1100, 0, 4, 2, 128, extra_rows=9),
    Case(1030, 200, 4, 4, 64, window=128, sinks=True, extra_rows=40),
]


@dataclass
class Inputs:
    """A case's host tensors, and (once uploaded) the device buffers holding them."""

    case: Case
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    sinks: np.ndarray | None
    scale: float
    buffers: dict[str, DeviceBuffer] = field(default_factory=dict)

    def reference(self, kv_len: int | None = None) -> np.ndarray:
        c = self.case
        return reference_attention(
            self.q,
            self.k,
            self.v,
            self.positions,
            kv_len=c.kv_len if kv_len is None else kv_len,
            scale=self.scale,
            window=c.window,
            sinks=self.sinks,
        )

    def upload(self, device: Device) -> Inputs:
        k = device.upload(self.k.view(np.uint16))
        self.buffers = {
            "q": device.upload(self.q),
            "k": k,
            "v": k if self.case.shared_kv else device.upload(self.v.view(np.uint16)),
            "positions": device.upload(self.positions),
        }
        if self.sinks is not None:
            self.buffers["sinks"] = device.upload(self.sinks)
        return self


def make_inputs_on_host(rng: np.random.Generator, case: Case) -> Inputs:
    """Random inputs of ``case``, NaN in every cache row no query sees."""
    c = case
    cache_rows = c.kv_len + 5  # rows >= kv_len
    shape = (cache_rows, c.n_head_kv, c.head_dim)
    k = rng.standard_normal(shape).astype(np.float16)
    v = k if c.shared_kv else rng.standard_normal(shape).astype(np.float16)
    positions = np.arange(c.first_pos, c.first_pos + c.n_tokens, dtype=np.int32)
    unseen = np.arange(cache_rows) > positions[-1]
    if c.window:
        unseen |= np.arange(cache_rows) < positions[0] - c.window + 1
    k[unseen] = np.nan
    v[unseen] = np.nan  # (the same array where shared_kv)
    q = (2 * rng.standard_normal((c.n_tokens, c.n_head, c.head_dim))).astype(np.float32)
    sinks = (rng.standard_normal(c.n_head) * 2).astype(np.float32) if c.sinks else None
    return Inputs(case, q, k, v, positions, sinks, float(1 / np.sqrt(c.head_dim)))


def make_inputs(device: Device, rng: np.random.Generator, case: Case) -> Inputs:
    return make_inputs_on_host(rng, case).upload(device)


def run(
    kernels: MoeKernels, stream: Stream, inputs: Inputs, kv_len: int | None = None, fused: bool = True
) -> np.ndarray:
    """out [n_tokens, n_head, head_dim] from a freshly poisoned buffer."""
    c = inputs.case
    b = inputs.buffers
    out = poisoned(kernels.device, c.n_tokens * c.n_head * c.head_dim * 4)
    attention(
        kernels,
        stream,
        b["q"],
        b["k"],
        b["v"],
        out,
        b["positions"],
        n_tokens=c.n_tokens,
        kv_len=c.kv_len if kv_len is None else kv_len,
        n_head=c.n_head,
        n_head_kv=c.n_head_kv,
        head_dim=c.head_dim,
        scale=inputs.scale,
        window=c.window,
        sinks=b.get("sinks"),
        fused=fused,
    )
    stream.synchronize()
    result = out.read().view(np.float32).reshape(c.n_tokens, c.n_head, c.head_dim).copy()
    out.close()
    return result


def worst_row_error(out: np.ndarray, expected: np.ndarray) -> float:
    """The largest relative error of one (token, head) row (NaN anywhere makes it NaN)."""
    diff = np.linalg.norm(out.astype(np.float64) - expected, axis=-1)
    return float(np.max(diff / np.maximum(np.linalg.norm(expected, axis=-1), 1e-30)))


def tolerance(kernels: MoeKernels, case: Case) -> float:
    """f16's where Q and P are rounded: the matrix-core prefill, and the wide heads' matrix-core kernels
    (their split-K decode too)."""
    if uses_wide_mma(kernels, case.head_dim, case.shared_kv):
        return RTOL_F16
    return RTOL_F16 if case.n_tokens > DECODE_MAX_TOKENS and uses_matrix_cores(kernels) else RTOL_F32


@pytest.fixture(scope="module")
def simt_kernels(device: Device) -> Iterator[MoeKernels]:
    with MoeKernels(device, MatrixPath.SIMT) as k:
        yield k
        device.synchronize()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_reference(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, case: Case
) -> None:
    inputs = make_inputs(device, rng, case)
    err = worst_row_error(run(kernels, stream, inputs), inputs.reference())
    assert err < tolerance(kernels, case), f"worst row relative error {err:.3g}"


@pytest.mark.parametrize("case", [c for c in CASES if c.n_tokens > DECODE_MAX_TOKENS], ids=str)
def test_simt_prefill_matches_reference(
    device: Device, simt_kernels: MoeKernels, stream: Stream, rng: np.random.Generator, case: Case
) -> None:
    """The float32 prefill kernel, which devices with matrix cores take only when asked for."""
    inputs = make_inputs(device, rng, case)
    err = worst_row_error(run(simt_kernels, stream, inputs), inputs.reference())
    assert err < RTOL_F32, f"worst row relative error {err:.3g}"


@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[8], _LATENT_DECODE_WINDOW], ids=str)
def test_kv_len_past_the_positions_changes_no_byte(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, case: Case
) -> None:
    """A captured decode step replays with kv_len = the cache size: the bytes must be those of a
    launch with just enough rows, and the same on every run."""
    inputs = make_inputs(device, rng, case)
    just_enough = run(kernels, stream, inputs, kv_len=case.first_pos + case.n_tokens)
    whole_cache = run(kernels, stream, inputs, kv_len=case.kv_len + 5)
    again = run(kernels, stream, inputs, kv_len=case.kv_len + 5)
    assert np.isfinite(just_enough).all()
    np.testing.assert_array_equal(whole_cache.view(np.uint32), just_enough.view(np.uint32))
    np.testing.assert_array_equal(again.view(np.uint32), just_enough.view(np.uint32))


@pytest.mark.parametrize("case", [c for c in CASES if c.n_tokens <= DECODE_MAX_TOKENS], ids=str)
def test_fused_decode_is_the_bytes_of_two_launches(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, case: Case
) -> None:
    """Decode's attention in one launch (the last block of a KV head's rows combines them) writes
    what the decode and combine launches write, again on a second launch (its counters back to 0)."""
    inputs = make_inputs(device, rng, case)
    two_launches = run(kernels, stream, inputs, fused=False)
    assert np.isfinite(two_launches).all()
    for _ in range(2):
        np.testing.assert_array_equal(run(kernels, stream, inputs).view(np.uint32), two_launches.view(np.uint32))


def test_rows_past_kv_len_stay_unseen(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    """kv_len below a position cuts the rows that query sees: it reads none past kv_len."""
    case = Case(12, 50, 4, 2, 64)
    inputs = make_inputs(device, rng, case)
    err = worst_row_error(run(kernels, stream, inputs, kv_len=55), inputs.reference(kv_len=55))
    assert err < tolerance(kernels, case), f"worst row relative error {err:.3g}"
    decode = Case(3, 50, 4, 2, 64)
    inputs = make_inputs(device, rng, decode)
    err = worst_row_error(run(kernels, stream, inputs, kv_len=51), inputs.reference(kv_len=51))
    assert err < RTOL_F32, f"worst row relative error {err:.3g}"


# RDNA4 (WMMA, no mma.sync fragments) and the same card stripped of its matrix cores, like RDNA2.
_RDNA4 = sim.BUILTIN_PROFILES["rocm-r9700"]
_NO_MATRIX_CORES = dataclasses.replace(_RDNA4, name="rocm-no-matrix-cores", matrix_cores=False)


@pytest.mark.parametrize(
    ("profile", "path", "expected"),
    [
        (_RDNA4, None, "attn_prefill_mma_d64"),
        (_RDNA4, MatrixPath.SIMT, "attn_prefill_simt_d64"),
        (_NO_MATRIX_CORES, None, "attn_prefill_simt_d64"),
        (sim.BUILTIN_PROFILES["cuda-h200"], None, "attn_prefill_mma_d64"),
    ],
    ids=["rdna4", "rdna4-simt-asked", "no-matrix-cores", "h200"],
)
def test_prefill_takes_the_matrix_core_kernel_where_the_device_has_matrix_cores(
    profile: sim.Profile, path: MatrixPath | None, expected: str
) -> None:
    """Capabilities.matrix_cores picks the f16 matrix-core prefill on AMD as on NVIDIA, whether or
    not the device has NVIDIA's mma.sync fragments; MatrixPath.SIMT keeps the float32 kernel."""
    case = Case(12, 0, 2, 1, 64)
    with sim.open(profile=profile) as backend, MoeKernels(backend.device(0), path) as kernels:
        device = backend.device(0)
        inputs = make_inputs(device, np.random.default_rng(2), case)
        with device.stream() as stream:
            out = run(kernels, stream, inputs)
        launched = [op.name for op in backend.timeline if op.kind is OpKind.KERNEL and op.name.startswith("attn")]
        assert launched == [expected]
        assert uses_matrix_cores(kernels) == expected.startswith("attn_prefill_mma")
        assert worst_row_error(out, inputs.reference()) < tolerance(kernels, case)


# Prefill cases for the 128-query blocks: a last block cut short, windows cutting into tiles with sinks,
# keys past the positions, and one block's warps each on a different mix of masked and whole tiles.
_TALL_CASES = [
    Case(1100, 0, 4, 2, 128, extra_rows=9),
    Case(1030, 200, 4, 4, 64, window=128, sinks=True, extra_rows=40),
    Case(200, 300, 8, 2, 128, window=128, extra_rows=513),
    Case(130, 900, 8, 1, 128, sinks=True),
    Case(64, 100, 16, 2, 64, window=32, sinks=True, extra_rows=64),
]


@pytest.mark.parametrize("case", _TALL_CASES, ids=str)
def test_128_query_blocks_write_the_bytes_of_64_query_blocks(
    device: Device, kernels: MoeKernels, stream: Stream, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVIDIA's matrix-core prefill in blocks of eight warps (the default for heads 128 wide) and of four
    ($EXPERTSTREAM_ATTN_MMA_ROWS): every query's arithmetic is its warp's, so the bytes must not move,
    and both stay within the reference's band."""
    inputs = make_inputs(device, np.random.default_rng(5), case)
    outputs = {}
    kernel_names = {}
    for rows in ("64", "128"):
        monkeypatch.setenv(MMA_ROWS_VAR, rows)
        kernel_names[rows] = prefill_kernel(kernels, case.head_dim, False)
        outputs[rows] = run(kernels, stream, inputs)
    if uses_matrix_cores(kernels) and device.capabilities.mma_fragments:
        assert kernel_names == {
            "64": f"attn_prefill_mma_d{case.head_dim}",
            "128": f"attn_prefill_mma128_d{case.head_dim}",
        }
    else:
        assert kernel_names["64"] == kernel_names["128"]
    np.testing.assert_array_equal(outputs["128"].view(np.uint32), outputs["64"].view(np.uint32))
    assert worst_row_error(outputs["128"], inputs.reference()) < tolerance(kernels, case)


@pytest.mark.parametrize(
    ("profile", "head_dim", "expected"),
    [
        (sim.BUILTIN_PROFILES["cuda-h200"], 128, "attn_prefill_mma128_d128"),
        (sim.BUILTIN_PROFILES["cuda-h200"], 64, "attn_prefill_mma_d64"),
        (_RDNA4, 128, "attn_prefill_mma_d128"),
    ],
    ids=["h200-d128", "h200-d64", "rdna4-d128"],
)
def test_heads_128_wide_take_eight_warps_a_block_where_the_device_has_fragments(
    profile: sim.Profile, head_dim: int, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MMA_ROWS_VAR, raising=False)
    with sim.open(profile=profile) as backend, MoeKernels(backend.device(0)) as kernels:
        assert prefill_kernel(kernels, head_dim, False) == expected


def test_an_8_warp_block_asked_of_a_device_without_fragments_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """AMD's matrix cores run the 4-warp block whatever the override asks: the log says so once."""
    monkeypatch.setenv(MMA_ROWS_VAR, "128")
    profile = dataclasses.replace(_RDNA4, name="rocm-said-once")
    with sim.open(profile=profile) as backend, MoeKernels(backend.device(0)) as kernels, caplog.at_level("WARNING"):
        names = {prefill_kernel(kernels, d, False) for d in (64, 128, 128)}
        said = [r.getMessage() for r in caplog.records if MMA_ROWS_VAR in r.getMessage()]
    assert names == {"attn_prefill_mma_d64", "attn_prefill_mma_d128"}
    assert len(said) == 1 and "no mma.sync fragments" in said[0] and "64-query blocks" in said[0]


def test_a_prefill_block_height_the_kernels_lack_is_named(
    device: Device, kernels: MoeKernels, stream: Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = make_inputs(device, np.random.default_rng(6), Case(16, 0, 4, 2, 64))
    monkeypatch.setenv(MMA_ROWS_VAR, "100")
    with pytest.raises(InvalidArgument, match=f"{MMA_ROWS_VAR}='100' is not a prefill block height"):
        run(kernels, stream, inputs)


_H200 = sim.BUILTIN_PROFILES["cuda-h200"]
_SM86_SHARED = dataclasses.replace(_H200, name="cuda-99k-shared", max_shared_bytes=99 * 1024)


_LATENT_DECODE = Case(1, 40, 16, 1, 576, shared_kv=True)
_COMBINE = "attn_decode_combine"


@pytest.mark.parametrize(
    ("profile", "path", "case", "expected"),
    [
        (_H200, None, Case(12, 3, 16, 1, 576, shared_kv=True), ["attn_wide_mma_d576"]),
        (_H200, None, Case(12, 3, 16, 1, 576), ["attn_wide_d576"]),
        (_H200, None, Case(12, 3, 4, 2, 256), ["attn_wide_mma_d256"]),
        (_H200, MatrixPath.SIMT, Case(12, 3, 16, 1, 576, shared_kv=True), ["attn_wide_d576"]),
        (_RDNA4, None, Case(12, 3, 16, 1, 576, shared_kv=True), ["attn_wide_d576"]),
        (_SM86_SHARED, None, Case(12, 3, 16, 1, 576, shared_kv=True), ["attn_wide_d576"]),
        (_SM86_SHARED, None, Case(12, 3, 4, 2, 256), ["attn_wide_d256"]),
        (_H200, None, _LATENT_DECODE, ["attn_wide_mma_decode_d576", _COMBINE]),
        (_H200, None, Case(2, 40, 4, 2, 256), ["attn_wide_mma_decode_d256", _COMBINE]),
        (_H200, None, dataclasses.replace(_LATENT_DECODE, shared_kv=False), ["attn_wide_decode_d576", _COMBINE]),
        (_RDNA4, None, _LATENT_DECODE, ["attn_wide_decode_d576", _COMBINE]),
    ],
    ids=[
        "h200-latent",
        "h200-576-own-values",
        "h200-256",
        "h200-simt-asked",
        "rdna4",
        "99k-576",
        "99k-256",
        "h200-latent-decode",
        "h200-256-decode",
        "h200-576-own-values-decode",
        "rdna4-decode",
    ],
)
def test_wide_heads_take_the_matrix_cores_where_fragments_shared_memory_and_values_allow(
    profile: sim.Profile, path: MatrixPath | None, case: Case, expected: list[str]
) -> None:
    """The wide mma.sync kernels (prefill and split-K decode) need NVIDIA's fragments, their block's
    shared memory (165 KB at 576, 116 KB at 256) and, at 576, the values in the keys' own rows;
    anything else takes the float32 ones."""
    with sim.open(profile=profile) as backend, MoeKernels(backend.device(0), path) as kernels:
        device = backend.device(0)
        inputs = make_inputs(device, np.random.default_rng(3), case)
        with device.stream() as stream:
            out = run(kernels, stream, inputs)
        launched = [op.name for op in backend.timeline if op.kind is OpKind.KERNEL and op.name.startswith("attn")]
        assert launched == expected
        assert uses_wide_mma(kernels, case.head_dim, case.shared_kv) == ("mma" in expected[0])
        assert worst_row_error(out, inputs.reference()) < RTOL_F32


@pytest.mark.parametrize("case", [Case(20, 200, 16, 1, 576, window=8, sinks=True, shared_kv=True)], ids=str)
def test_queries_that_see_no_row_get_zeros(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, case: Case
) -> None:
    """kv_len below every query's window: no row is seen, not even a NaN one, and every output is zero
    (a sink takes its share of nothing)."""
    inputs = make_inputs(device, rng, case)
    out = run(kernels, stream, inputs, kv_len=150)
    assert not out.any()


def test_sinks_take_weight_from_the_values(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    """One key whose value is all ones: out = 1 / (1 + exp(sink - logit)) exactly as the softmax says."""
    case = Case(1, 0, 2, 1, 64, sinks=True)
    inputs = make_inputs_on_host(np.random.default_rng(1), case)
    inputs.k[0] = 0  # logit 0
    inputs.v[0] = 1
    inputs.sinks = np.array([0.0, np.log(3.0)], np.float32)
    out = run(kernels, stream, inputs.upload(device))
    np.testing.assert_allclose(out[0, 0], 0.5, rtol=1e-6)
    np.testing.assert_allclose(out[0, 1], 0.25, rtol=1e-6)
    assert ref.relative_error(out, inputs.reference()) < 1e-6


def _call(kernels: MoeKernels, stream: Stream, device: Device, **changes: object) -> None:
    """attention with small valid arguments, some of them replaced by ``changes``."""
    n_tokens, n_head, n_head_kv, head_dim, kv_len = 2, 4, 2, 64, 16
    args: dict[str, object] = {
        "q": device.alloc(n_tokens * n_head * head_dim * 4),
        "k_cache": device.alloc(kv_len * n_head_kv * head_dim * 2),
        "v_cache": device.alloc(kv_len * n_head_kv * head_dim * 2),
        "out": device.alloc(n_tokens * n_head * head_dim * 4),
        "positions": device.alloc(n_tokens * 4),
        "n_tokens": n_tokens,
        "kv_len": kv_len,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "scale": 0.125,
    }
    args.update(changes)
    attention(kernels, stream, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"head_dim": 96}, "head_dim 96"),
        ({"n_head_kv": 3}, "not a multiple of n_head_kv"),
        ({"n_tokens": 0}, "n_tokens"),
        ({"kv_len": 17}, "k_cache holds"),
        ({"window": -1}, "window"),
        ({"scale": float("nan")}, "scale"),
        ({"n_head": 70000, "n_head_kv": 1}, "70000 heads"),
    ],
)
def test_bad_arguments_are_named(
    device: Device, kernels: MoeKernels, stream: Stream, changes: dict[str, object], names: str
) -> None:
    with pytest.raises(InvalidArgument, match=names):
        _call(kernels, stream, device, **changes)


def test_misaligned_cache_and_small_sinks_are_named(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    cache = device.alloc(16 * 2 * 64 * 2 + 16)
    with pytest.raises(InvalidArgument, match="k_cache starts at byte offset 8"):
        _call(kernels, stream, device, k_cache=cache.view(8, 16 * 2 * 64 * 2))
    with pytest.raises(InvalidArgument, match="sinks holds 8 bytes"):
        _call(kernels, stream, device, sinks=device.alloc(8))


@pytest.mark.parametrize(
    ("kv_len", "kernels_run"), [(64, ["attn_decode_fused_d64"]), (4160, ["attn_decode_d64", "attn_decode_combine"])]
)
def test_decode_combines_in_its_own_launch_past_the_fused_bound(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, kv_len: int, kernels_run: list[str]
) -> None:
    """Up to FUSED_MAX_CHUNKS chunks the last block of a KV head's rows combines them; past that (4160
    rows: 65 chunks) one block would merge them in turn, and a launch of one block per row does."""
    assert FUSED_MAX_CHUNKS * DECODE_CHUNK < 4160
    case = Case(1, kv_len - 1, 4, 2, 64)
    inputs = make_inputs(device, rng, case)
    backend = device.backend
    backend.start_trace()
    before = len(backend.timeline or ())
    out = run(kernels, stream, inputs)
    launched = [op.name for op in (backend.timeline or ())[before:] if op.name.startswith("attn_")]
    assert launched == kernels_run
    assert worst_row_error(out, inputs.reference()) < RTOL_F32
