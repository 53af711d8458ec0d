"""recurrent.cu's kernels (qwen3next's convolution, gated delta rule and output gate) against their float64
references (reference_recurrent.py), on every backend (twins on sim) and compiled for
this host (the harness of test_kernels_on_host: threads as fibers, rounds in random order)."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from expertstream.backends.base import Device, DeviceBuffer, Stream
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels, kernel_source, recurrent
from expertstream.kernels import reference as ref
from expertstream.kernels import reference_recurrent as ref_recurrent

from .tensors import poisoned
from .test_kernels_on_host import _FIBERS, CXX, build_on_host

RTOL = 2e-5


def _floats(buf: DeviceBuffer, *shape: int) -> np.ndarray:
    return buf.read().view(np.float32)[: int(np.prod(shape))].reshape(shape)


def _inputs(rng: np.random.Generator, n_tokens: int, n_k: int, n_v: int, s: int) -> dict[str, np.ndarray]:
    f = np.float32
    return {
        "conv": rng.standard_normal((n_tokens, (2 * n_k + n_v) * s)).astype(f),
        "ba": (rng.standard_normal((n_tokens, 2 * n_v)) * 3).astype(f),
        "z": rng.standard_normal((n_tokens, n_v * s)).astype(f),
        "dt": rng.standard_normal(n_v).astype(f),
        "a": -np.exp(rng.standard_normal(n_v)).astype(f),
        "norm": rng.standard_normal(s).astype(f),
        "state": rng.standard_normal((n_v, s, s)).astype(f),
    }


@pytest.mark.parametrize("fresh", [True, False], ids=["start", "carried"])
@pytest.mark.parametrize(("n_tokens", "channels"), [(7, 96), (1, 300), (40, 8)])
def test_conv_silu(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    n_tokens: int,
    channels: int,
    fresh: bool,
) -> None:
    x = rng.standard_normal((n_tokens, channels)).astype(np.float32)
    state = rng.standard_normal((3, channels)).astype(np.float32)
    w = rng.standard_normal((channels, 4)).astype(np.float32)
    state_buf, out = device.upload(state), poisoned(device, x.nbytes)
    positions = device.upload(np.arange(n_tokens, dtype=np.int32) + (0 if fresh else 9))
    recurrent.conv_silu(kernels, stream, device.upload(x), state_buf, device.upload(w), positions, out, n_tokens,
                        channels, 4)  # fmt: skip
    stream.synchronize()
    expected, new_state = ref_recurrent.conv_silu(x, state, w, fresh)
    assert ref.relative_error(_floats(out, n_tokens, channels), expected) < RTOL
    assert ref.relative_error(_floats(state_buf, 3, channels), new_state) < RTOL


@pytest.mark.parametrize("fresh", [True, False], ids=["start", "carried"])
@pytest.mark.parametrize(("n_tokens", "n_k", "n_v", "s"), [(9, 2, 4, 32), (1, 1, 2, 128), (3, 2, 2, 64)])
def test_delta_net(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    n_tokens: int,
    n_k: int,
    n_v: int,
    s: int,
    fresh: bool,
) -> None:
    data = _inputs(rng, n_tokens, n_k, n_v, s)
    bufs = {name: device.upload(value) for name, value in data.items()}
    positions = device.upload(np.arange(n_tokens, dtype=np.int32) + (0 if fresh else 5))
    out = poisoned(device, n_tokens * n_v * s * 4)
    rows = recurrent.DeltaNetInputs(bufs["conv"], bufs["ba"], bufs["z"], bufs["dt"], bufs["a"], bufs["norm"], positions)
    recurrent.delta_net(kernels, stream, rows, bufs["state"], out, n_tokens, n_k, n_v, s, 1e-6)
    stream.synchronize()
    expected, state = ref_recurrent.delta_net(
        data["conv"], data["ba"], data["z"], data["dt"], data["a"], data["norm"], data["state"], fresh, n_k, 1e-6
    )
    assert ref.relative_error(_floats(out, n_tokens, n_v * s), expected) < 1e-4
    assert ref.relative_error(_floats(bufs["state"], n_v, s, s), state) < 1e-4


def test_mul_sigmoid(device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator) -> None:
    x, gate = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    x_buf = device.upload(x)
    recurrent.mul_sigmoid(kernels, stream, x_buf, device.upload(gate), 1000)
    stream.synchronize()
    expected = x.astype(np.float64) / (1.0 + np.exp(-gate.astype(np.float64)))
    assert ref.relative_error(_floats(x_buf, 1000), expected) < RTOL


def test_bad_arguments_are_refused(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    big = device.alloc(1 << 16)
    rows = recurrent.DeltaNetInputs(big, big, big, big, big, big, big)
    refused = {
        "spans 3": lambda: recurrent.conv_silu(kernels, stream, big, big, big, big, big, 2, 8, 3),
        "heads 48 wide": lambda: recurrent.delta_net(kernels, stream, rows, big, big, 1, 1, 1, 48, 1e-6),
        "cannot share": lambda: recurrent.delta_net(kernels, stream, rows, big, big, 1, 2, 3, 32, 1e-6),
        "eps": lambda: recurrent.delta_net(kernels, stream, rows, big, big, 1, 1, 1, 32, -1.0),
    }
    for words, launch in refused.items():
        with pytest.raises(InvalidArgument, match=words):
            launch()


_DRIVER = (
    _FIBERS
    + """
static void launch(unsigned blocks, unsigned threads, const std::function<void()>& body) {
    gridDim = EsDim3{blocks, 1, 1};
    blockDim = EsDim3{threads, 1, 1};
    for (unsigned x = 0; x < blocks; ++x) {
        blockIdx = EsDim3{x, 0, 0};
        run_block(threads, body);
    }
}

// stdin: n_tokens, n_k, n_v, s, first position, eps, conv, ba, z, dt, a, norm, state. stdout: out, state.
int main() {
    std::vector<int> shape = read_array<int>(5);
    const int n_tokens = shape[0], n_k = shape[1], n_v = shape[2], s = shape[3];
    const float eps = read_array<float>(1)[0];
    std::vector<float> conv = read_array<float>((size_t)n_tokens * (2 * n_k + n_v) * s);
    std::vector<float> ba = read_array<float>((size_t)n_tokens * 2 * n_v);
    std::vector<float> z = read_array<float>((size_t)n_tokens * n_v * s);
    std::vector<float> dt = read_array<float>(n_v), a = read_array<float>(n_v), norm = read_array<float>(s);
    std::vector<float> state = read_array<float>((size_t)n_v * s * s);
    std::vector<int> positions(n_tokens);
    for (int t = 0; t < n_tokens; ++t) positions[t] = shape[4] + t;
    std::vector<float> out((size_t)n_tokens * n_v * s, NAN);
    launch(n_v, s, [&] {
        if (s == 32) {
            recur_delta_net_s32(conv.data(), ba.data(), dt.data(), a.data(), z.data(), norm.data(), state.data(),
                                positions.data(), out.data(), n_tokens, n_k, n_v, eps);
        } else {
            recur_delta_net_s64(conv.data(), ba.data(), dt.data(), a.data(), z.data(), norm.data(), state.data(),
                                positions.data(), out.data(), n_tokens, n_k, n_v, eps);
        }
    });
    fwrite(out.data(), sizeof(float), out.size(), stdout);
    fwrite(state.data(), sizeof(float), state.size(), stdout);
    return 0;
}
"""
)


@pytest.fixture(scope="module")
def recurrent_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    return build_on_host(tmp_path_factory.mktemp("recurrent_kernels"), kernel_source(()), _DRIVER)


@pytest.mark.parametrize(("first", "s"), [(0, 32), (4, 64)], ids=["start-32", "carried-64"])
def test_delta_net_on_host(recurrent_kernels: Path, rng: np.random.Generator, first: int, s: int) -> None:
    n_tokens, n_k, n_v, eps = 6, 2, 4, 1e-6
    data = _inputs(rng, n_tokens, n_k, n_v, s)
    order = ("conv", "ba", "z", "dt", "a", "norm", "state")
    stdin = struct.pack("5if", n_tokens, n_k, n_v, s, first, eps) + b"".join(data[n].tobytes() for n in order)
    run = subprocess.run([str(recurrent_kernels)], input=stdin, capture_output=True, check=True)
    got = np.frombuffer(run.stdout, np.float32)
    expected, state = ref_recurrent.delta_net(
        data["conv"], data["ba"], data["z"], data["dt"], data["a"], data["norm"], data["state"], first == 0, n_k, eps
    )
    assert ref.relative_error(got[: expected.size].reshape(expected.shape), expected) < 1e-4
    assert ref.relative_error(got[expected.size :].reshape(state.shape), state) < 1e-4
