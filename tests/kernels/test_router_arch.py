"""Per-architecture routing and FFN kernels against the float64 reference (twins on sim, kernels on GPUs)."""

from __future__ import annotations

import numpy as np
import pytest

from expertstream.backends.base import Device, Stream
from expertstream.engine.arch import ARCHS, ffn_config
from expertstream.errors import InvalidArgument
from expertstream.kernels import MoeKernels, routing
from expertstream.kernels import reference as ref
from expertstream.kernels.routing import Gating, Routing

from .tensors import poisoned

# Each architecture's routing as its tiny preset's metadata gives it (deepseek2: V3-style).
ARCH_ROUTING = {
    "qwen3moe": ffn_config("qwen3moe", {}.get).routing,
    "llama": ffn_config("llama", {}.get).routing,
    "qwen2moe": ffn_config("qwen2moe", {}.get).routing,
    "gpt-oss": ffn_config("gpt-oss", {}.get).routing,
    "deepseek2": ffn_config(
        "deepseek2",
        {
            "deepseek2.expert_gating_func": 2,
            "deepseek2.expert_weights_norm": True,
            "deepseek2.expert_weights_scale": 2.5,
            "deepseek2.expert_group_count": 8,
            "deepseek2.expert_group_used_count": 3,
        }.get,
    ).routing,
    "deepseek2-v2": ffn_config("deepseek2", {"deepseek2.expert_weights_scale": 16.0}.get).routing,
    "glm4moe": ffn_config(
        "glm4moe", {"glm4moe.expert_weights_norm": True, "glm4moe.expert_weights_scale": 1.5}.get
    ).routing,
}


def _select(
    device: Device,
    kernels: MoeKernels,
    stream: Stream,
    logits: np.ndarray,
    bias: np.ndarray | None,
    cfg: Routing,
    top_k: int,
) -> tuple[np.ndarray, np.ndarray]:
    n_tokens, n_expert = logits.shape
    ids = poisoned(device, n_tokens * top_k * 4)
    weights = poisoned(device, n_tokens * top_k * 4)
    bias_buf = None if bias is None else device.upload(bias.astype(np.float32))
    routing.router_select(
        kernels, stream, device.upload(logits), bias_buf, cfg, n_tokens, n_expert, top_k, ids, weights
    )
    stream.synchronize()
    return (
        ids.read().view(np.int32).reshape(n_tokens, top_k),
        weights.read().view(np.float32).reshape(n_tokens, top_k),
    )


def test_every_architecture_has_a_routing_case() -> None:
    assert set(ARCHS) - {"qwen3next"} <= {a.split("-v2")[0] for a in ARCH_ROUTING}


@pytest.mark.parametrize("arch", sorted(ARCH_ROUTING))
def test_router_select_matches_reference(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, arch: str
) -> None:
    cfg = ARCH_ROUTING[arch]
    n_tokens, n_expert, top_k = 37, 64, 6
    # Distinct logits a multiple of 1/64 apart: float32 and float64 agree on every selection.
    logits = np.stack([rng.permutation(n_expert) for _ in range(n_tokens)]).astype(np.float32) / 16 - 2
    bias = rng.permutation(n_expert).astype(np.float64) / 4096 if ARCHS[arch.split("-v2")[0]].selection_bias else None
    ids, weights = _select(device, kernels, stream, logits, bias, cfg, top_k)
    ref_ids, ref_weights = ref.route(logits, cfg, top_k, bias)
    np.testing.assert_array_equal(ids, ref_ids)
    err = ref.relative_error(weights, ref_weights)
    assert err < 1e-5, f"relative error {err:.3g}"


@pytest.mark.parametrize("n_expert", [1, 31, 33, 64, 100, 128, 200, 256, 300, 512])
def test_every_width_of_selection_matches_reference(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, n_expert: int
) -> None:
    """Every count of experts a lane (NVIDIA's one-warp selection holds 1 to 16) against the reference:
    integer logits tie for real (the lower id wins), and under selection by logit a NaN loses to every
    number and -0 ties +0."""
    top_k = min(n_expert, 8 if n_expert < 300 else 32)
    logits = rng.integers(-3, 4, (5, n_expert)).astype(np.float32)
    ids, weights = _select(device, kernels, stream, logits, None, ARCH_ROUTING["qwen3moe"], top_k)
    ref_ids, ref_weights = ref.route(logits, ARCH_ROUTING["qwen3moe"], top_k)
    np.testing.assert_array_equal(ids, ref_ids)
    assert ref.relative_error(weights, ref_weights) < 1e-5
    by_logit = Routing(Gating.SOFTMAX_WEIGHT, norm=False)
    special = rng.permutation(n_expert)
    logits[:, special[: n_expert // 4]] = np.nan
    logits[:, special[n_expert // 4 :][::2]] = -0.0
    logits[:, special[n_expert // 4 :][1::2]] = 0.0
    top_k = max(1, min(top_k, n_expert - n_expert // 4))
    ids, weights = _select(device, kernels, stream, logits, None, by_logit, top_k)
    ref_ids, ref_weights = ref.route(logits, by_logit, top_k)
    np.testing.assert_array_equal(ids, ref_ids)
    assert ref.relative_error(weights, ref_weights) < 1e-5


def test_groups_limit_the_selection(device: Device, kernels: MoeKernels, stream: Stream) -> None:
    # 4 groups of 4; group 3 holds the single best expert, groups 0 and 1 the best pairs.
    logits = np.array([[5, 4.5, 0, 0, 4, 4, 0, 0, 1, 1, 1, 1, 6, 0, 0, 0]], np.float32)
    cfg = Routing(Gating.SOFTMAX_WEIGHT, norm=False, n_group=4, n_group_used=2)
    ids, _ = _select(device, kernels, stream, logits, None, cfg, 4)
    np.testing.assert_array_equal(ids, [[0, 1, 4, 5]])
    np.testing.assert_array_equal(ids, ref.route(logits, cfg, 4)[0])


def test_router_logits_with_bias(device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator) -> None:
    x = rng.standard_normal((19, 70)).astype(np.float32)
    router = rng.standard_normal((40, 70)).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    out = poisoned(device, 19 * 40 * 4)
    routing.router_logits(
        kernels, stream, device.upload(x), device.upload(router), device.upload(bias), out, 19, 70, 40
    )
    stream.synchronize()
    expected = x.astype(np.float64) @ router.T.astype(np.float64) + bias
    assert ref.relative_error(out.read().view(np.float32).reshape(19, 40), expected) < 1e-5


@pytest.mark.parametrize("arch", sorted(ARCH_ROUTING))
def test_router_logits_select_is_the_bytes_of_the_two_launches(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator, arch: str
) -> None:
    """Decode's router in one launch writes the logits, ids and weights of router_logits then
    router_select, leaves its counter at 0 (a second launch gives the same bytes), and refuses more
    tokens than one block row of logits holds."""
    cfg = ARCH_ROUTING[arch]
    n_tokens, n_embd, n_expert, top_k = 3, 70, 40, 6
    x = device.upload(rng.standard_normal((n_tokens, n_embd)).astype(np.float32))
    router = device.upload(rng.standard_normal((n_expert, n_embd)).astype(np.float32))
    bias = device.upload(rng.standard_normal(n_expert).astype(np.float32))
    sel_bias = device.upload(rng.standard_normal(n_expert).astype(np.float32)) if cfg.n_group > 1 else None
    counter = device.upload(np.zeros(1, np.int32))
    outputs = []
    for fused in (False, True, True):
        logits = poisoned(device, n_tokens * n_expert * 4)
        ids, weights = poisoned(device, n_tokens * top_k * 4), poisoned(device, n_tokens * top_k * 4)
        if fused:
            routing.router_logits_select(
                kernels, stream, x, router, bias, logits, sel_bias, cfg, n_tokens, n_embd, n_expert, top_k, ids,
                weights, counter,
            )  # fmt: skip
        else:
            routing.router_logits(kernels, stream, x, router, bias, logits, n_tokens, n_embd, n_expert)
            routing.router_select(kernels, stream, logits, sel_bias, cfg, n_tokens, n_expert, top_k, ids, weights)
        stream.synchronize()
        outputs.append([buf.read().tobytes() for buf in (logits, ids, weights)])
    assert np.isfinite(np.frombuffer(outputs[0][2], np.float32)).all()
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert counter.read().view(np.int32).tolist() == [0]
    with pytest.raises(InvalidArgument, match="at most 8"):
        routing.router_logits_select(
            kernels, stream, x, router, bias, logits, sel_bias, cfg, 9, n_embd, n_expert, top_k, ids, weights, counter
        )


def test_swiglu_oai(device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator) -> None:
    gate = (rng.standard_normal(3000) * 6).astype(np.float32)  # beyond the limit of 7 on both sides
    up = (rng.standard_normal(3000) * 6).astype(np.float32)
    out = poisoned(device, 3000 * 4)
    routing.swiglu_oai(kernels, stream, device.upload(gate), device.upload(up), out, 3000)
    stream.synchronize()
    err = ref.relative_error(out.read().view(np.float32), ref.swiglu_oai(gate, up))
    assert err < ref.ELEMENTWISE_RTOL * 4, f"relative error {err:.3g}"


def test_expert_bias_and_shared_gate(
    device: Device, kernels: MoeKernels, stream: Stream, rng: np.random.Generator
) -> None:
    n_pairs, n_out, n_expert = 12, 50, 5
    y = rng.standard_normal((n_pairs, n_out)).astype(np.float32)
    bias = rng.standard_normal((n_expert, n_out)).astype(np.float32)
    ids = rng.integers(0, n_expert, n_pairs).astype(np.int32)
    y_buf = device.upload(y)
    routing.add_expert_bias(kernels, stream, y_buf, device.upload(bias), device.upload(ids), n_pairs, n_out, n_expert)
    x = rng.standard_normal((n_pairs, 33)).astype(np.float32)
    w = rng.standard_normal(33).astype(np.float32)
    routing.shared_gate(kernels, stream, device.upload(x), device.upload(w), y_buf, n_pairs, 33, n_out)
    stream.synchronize()
    gate = 1 / (1 + np.exp(-(x.astype(np.float64) @ w)))
    expected = (y.astype(np.float64) + bias[ids]) * gate[:, None]
    assert ref.relative_error(y_buf.read().view(np.float32).reshape(n_pairs, n_out), expected) < 1e-5
