"""numpy twins of the routing and per-architecture FFN kernels of routing.cu (see routing.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backends.base import BufferView
from ..backends.sim import Access, KernelSpec
from ..backends.sim.kernels import Dim3Tuple
from .routing import WEIGHTS_SUM_MIN, Gating

Args = tuple[Any, ...]
_F32 = np.float32


def _as_view(arg: Any) -> BufferView:
    return arg if isinstance(arg, BufferView) else arg.view()


def _access(*flags: bool) -> Any:
    """Accesses of the leading arguments: True marks a write."""

    def accesses(args: Args) -> Sequence[Access]:
        return [Access(_as_view(a), write=w) for a, w in zip(args, flags, strict=False)]

    return accesses


def top_k_order(values: np.ndarray, top_k: int) -> np.ndarray:
    """Indices of the top_k largest per row: descending, ties to the lower index, NaN last."""
    nan = np.isnan(values)
    index = np.broadcast_to(np.arange(values.shape[1]), values.shape)
    return np.lexsort((index, -np.where(nan, 0, values), nan), axis=1)[:, :top_k]


def _logits_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    x_b, r_b, bias_b, out_b, n_tokens, n_embd, n_expert, has_bias = args
    x = x_b.view(_F32).reshape(int(n_tokens), int(n_embd))
    router = r_b.view(_F32).reshape(int(n_expert), int(n_embd))
    logits = np.einsum("te,xe->tx", x, router)
    if int(has_bias):
        logits += bias_b.view(_F32)[: int(n_expert)]
    out_b.view(_F32)[:] = logits.reshape(-1)


def _select_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    logits_b, bias_b, ids_b, w_b, n_tokens, n_expert, top_k, gating, has_bias, n_group, n_group_used, norm, scale = args
    n_tokens, n_expert, top_k = int(n_tokens), int(n_expert), int(top_k)
    logits = logits_b.view(_F32).reshape(n_tokens, n_expert)
    if int(gating) == Gating.SOFTMAX:
        exps = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = exps / exps.sum(axis=1, keepdims=True)
    elif int(gating) == Gating.SIGMOID:
        probs = _F32(1) / (_F32(1) + np.exp(-logits))
    else:
        probs = logits.copy()
    sel = probs + bias_b.view(_F32)[:n_expert] if int(has_bias) else probs.copy()
    n_group = int(n_group)
    if n_group > 1:
        groups = sel.reshape(n_tokens, n_group, n_expert // n_group)
        best_two = -np.sort(-groups, axis=2)[:, :, :2].sum(axis=2)
        kept = top_k_order(best_two, int(n_group_used))
        mask = np.ones((n_tokens, n_group), bool)
        np.put_along_axis(mask, kept, False, axis=1)
        groups[mask] = -np.inf
        sel = groups.reshape(n_tokens, n_expert)
    order = top_k_order(sel, top_k)
    weights = np.take_along_axis(probs, order, axis=1)
    if int(gating) == Gating.SOFTMAX_WEIGHT:
        exps = np.exp(weights - weights.max(axis=1, keepdims=True))
        weights = exps / exps.sum(axis=1, keepdims=True)
    if int(norm):
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), _F32(WEIGHTS_SUM_MIN))
    ids_b.view(np.int32)[:] = order.reshape(-1)
    w_b.view(_F32)[:] = (weights * _F32(scale)).reshape(-1)


def _swiglu_oai_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    gate_b, up_b, out_b, _n, alpha, limit = args
    g = np.minimum(gate_b.view(_F32), _F32(limit))
    u = np.clip(up_b.view(_F32), -_F32(limit), _F32(limit))
    out_b.view(_F32)[:] = g / (_F32(1) + np.exp(-_F32(alpha) * g)) * (u + _F32(1))


def _expert_bias_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    y_b, bias_b, ids_b, n_pairs, n_out, n_expert = args
    y = y_b.view(_F32).reshape(int(n_pairs), int(n_out))
    bias = bias_b.view(_F32).reshape(int(n_expert), int(n_out))
    ids = ids_b.view(np.int32)
    valid = (ids >= 0) & (ids < int(n_expert))
    y[valid] += bias[ids[valid]]


def _expert_bias_accesses(args: Args) -> Sequence[Access]:
    y = _as_view(args[0])
    return [
        Access(y, write=False),
        Access(_as_view(args[1]), write=False),
        Access(_as_view(args[2]), write=False),
        Access(y, write=True),
    ]


def _shared_gate_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    x_b, w_b, y_b, n_tokens, n_embd, n = args
    x = x_b.view(_F32).reshape(int(n_tokens), int(n_embd))
    gate = _F32(1) / (_F32(1) + np.exp(-(x @ w_b.view(_F32))))
    y = y_b.view(_F32).reshape(int(n_tokens), int(n))
    y *= gate[:, None]


# moe_router_logits_select: x, router, bias, logits, counter, sel_bias, ids, weights, n_tokens, n_embd,
# n_expert, has_bias, top_k, gating, has_sel_bias, n_group, n_group_used, norm, scale


def _logits_select_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    x, router, bias, logits, _counter, sel_bias, ids, weights, n_tokens, n_embd, n_expert, has_bias = args[:12]
    _logits_run((x, router, bias, logits, n_tokens, n_embd, n_expert, has_bias), grid, block)
    _select_run((logits, sel_bias, ids, weights, n_tokens, n_expert, *args[12:]), grid, block)


def _logits_select_accesses(args: Args) -> Sequence[Access]:
    reads = [Access(_as_view(a), write=False) for a in (args[0], args[1], args[2], args[5])]
    writes = [Access(_as_view(a), write=True) for a in (args[3], args[4], args[6], args[7])]
    return [*reads, Access(_as_view(args[4]), write=False), *writes]


def _shared_gate_accesses(args: Args) -> Sequence[Access]:
    y = _as_view(args[2])
    return [
        Access(_as_view(args[0]), write=False),
        Access(_as_view(args[1]), write=False),
        Access(y, write=False),
        Access(y, write=True),
    ]


def twin_specs() -> list[KernelSpec]:
    """The twin of every kernel routing.py launches."""
    return [
        KernelSpec(
            "moe_router_logits",
            _logits_run,
            _access(False, False, False, True),
            lambda a: 2.0 * int(a[4]) * int(a[5]) * int(a[6]),
        ),
        KernelSpec(
            "moe_router_select",
            _select_run,
            _access(False, False, True, True),
            lambda a: 8.0 * int(a[4]) * int(a[5]) * int(a[6]),
        ),
        KernelSpec(
            "moe_router_logits_select",
            _logits_select_run,
            _logits_select_accesses,
            lambda a: 2.0 * int(a[8]) * int(a[9]) * int(a[10]) + 8.0 * int(a[8]) * int(a[10]) * int(a[12]),
        ),
        KernelSpec("moe_swiglu_oai", _swiglu_oai_run, _access(False, False, True), lambda a: 8.0 * int(a[3])),
        KernelSpec("moe_add_expert_bias", _expert_bias_run, _expert_bias_accesses, lambda a: float(a[3]) * float(a[4])),
        KernelSpec(
            "moe_shared_gate",
            _shared_gate_run,
            _shared_gate_accesses,
            lambda a: 2.0 * int(a[3]) * (int(a[4]) + int(a[5])),
        ),
    ]
