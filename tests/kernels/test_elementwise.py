"""swiglu and weighted_sum against the float64 reference, with poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest

from expertstream.backends.base import Device, DeviceBuffer, Stream
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels
from expertstream.kernels import reference as ref

from .tensors import poisoned


def read_f32(buf: DeviceBuffer, shape: tuple[int, ...]) -> np.ndarray:
    return buf.read().view(np.float32).reshape(shape)


@pytest.mark.parametrize("n", [1, 1000, 70_001])
def test_swiglu(device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, n: int) -> None:
    gate = (rng.standard_normal(n) * 4).astype(np.float32)
    up = rng.standard_normal(n).astype(np.float32)
    out = poisoned(device, n * 4)
    kernels.swiglu(stream, device.upload(gate), device.upload(up), out, n)
    stream.synchronize()
    got = read_f32(out, (n,))
    assert np.isfinite(got).all()
    err = ref.relative_error(got, ref.swiglu(gate, up))
    assert err < ref.ELEMENTWISE_RTOL, f"relative error {err:.3g}"


@pytest.mark.parametrize(("n_tokens", "top_k", "n"), [(1, 1, 7), (5, 8, 300), (33, 3, 1027)])
def test_weighted_sum(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    n_tokens: int,
    top_k: int,
    n: int,
) -> None:
    y = rng.standard_normal((n_tokens, top_k, n)).astype(np.float32)
    weights = rng.random((n_tokens, top_k)).astype(np.float32)
    out = poisoned(device, n_tokens * n * 4)
    kernels.weighted_sum(stream, device.upload(y), device.upload(weights), out, n_tokens, top_k, n)
    stream.synchronize()
    got = read_f32(out, (n_tokens, n))
    assert np.isfinite(got).all()
    err = ref.relative_error(got, ref.weighted_sum(y, weights))
    assert err < ref.ELEMENTWISE_RTOL, f"relative error {err:.3g}"


def test_weighted_sum_rejects_short_output(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    y = device.alloc(2 * 3 * 10 * 4)
    with pytest.raises(InvalidArgument, match="out holds 40 bytes but the shapes need 80"):
        kernels.weighted_sum(stream, y, device.alloc(6 * 4), device.alloc(40), 2, 3, 10)
