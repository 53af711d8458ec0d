"""router_topk: exact ids (ties to the lower id) on integer data, softmax weights, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from expertstream.backends.base import Device, Stream
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels
from expertstream.kernels import reference as ref

from .tensors import poisoned


def route(
    device: Device, kernels: MoeKernels, stream: Stream, x: np.ndarray, router: np.ndarray, top_k: int
) -> tuple[np.ndarray, np.ndarray]:
    n_tokens, n_embd = x.shape
    n_expert = router.shape[0]
    ids = poisoned(device, n_tokens * top_k * 4)
    weights = poisoned(device, n_tokens * top_k * 4)
    kernels.router_topk(
        stream, device.upload(x), device.upload(router), n_tokens, n_embd, n_expert, top_k, ids, weights
    )
    stream.synchronize()
    return (
        ids.read().view(np.int32).reshape(n_tokens, top_k),
        weights.read().view(np.float32).reshape(n_tokens, top_k),
    )


@pytest.mark.parametrize(
    ("n_tokens", "n_embd", "n_expert", "top_k"), [(1, 16, 4, 1), (21, 70, 128, 8), (9, 33, 40, 32)]
)
def test_integer_logits_select_exactly(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    rng: np.random.Generator,
    n_tokens: int,
    n_embd: int,
    n_expert: int,
    top_k: int,
) -> None:
    # Small integers make every float32 logit exact, so ties are real and the ids must
    # match the reference exactly, ties going to the lower id.
    x = rng.integers(-2, 3, (n_tokens, n_embd)).astype(np.float32)
    router = rng.integers(-2, 3, (n_expert, n_embd)).astype(np.float32)
    ids, weights = route(device, kernels, stream, x, router, top_k)
    ref_ids, ref_weights = ref.router_topk(x, router, top_k)
    np.testing.assert_array_equal(ids, ref_ids)
    err = ref.relative_error(weights, ref_weights)
    assert err < ref.ROUTER_WEIGHTS_RTOL, f"relative error {err:.3g}"


def test_all_tied_logits_pick_the_lowest_ids(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    ids, weights = route(device, kernels, stream, np.zeros((3, 8), np.float32), np.ones((50, 8), np.float32), 5)
    np.testing.assert_array_equal(ids, np.tile(np.arange(5, dtype=np.int32), (3, 1)))
    np.testing.assert_allclose(weights, 0.2, rtol=1e-6)


def test_random_logits_are_deterministic_and_sorted(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    x = rng.standard_normal((30, 64)).astype(np.float32)
    router = rng.standard_normal((96, 64)).astype(np.float32)
    ids, weights = route(device, kernels, stream, x, router, 6)
    again_ids, again_weights = route(device, kernels, stream, x, router, 6)
    assert ids.tobytes() == again_ids.tobytes() and weights.tobytes() == again_weights.tobytes()
    logits = x.astype(np.float64) @ router.T.astype(np.float64)
    chosen = np.take_along_axis(logits, ids.astype(np.int64), axis=1)
    kth_best = -np.sort(-logits, axis=1)[:, 5]
    assert (np.diff(chosen, axis=1) <= 1e-4).all(), "ids are not in descending logit order"
    assert (chosen[:, -1] >= kth_best - 1e-4).all(), "a chosen expert is not among the top 6"
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)


def test_rejects_top_k_above_experts(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    buf = device.alloc(1 << 12)
    with pytest.raises(InvalidArgument, match=r"top_k 5 exceeds min\(n_expert, 32\) = 4"):
        kernels.router_topk(stream, buf, buf, 1, 8, 4, 5, buf, buf)
