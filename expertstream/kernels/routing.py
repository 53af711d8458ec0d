"""Launchers of the per-architecture routing and FFN kernels of routing.cu.

How an MoE block turns router logits into expert ids and weights differs by architecture
(llama.cpp's build_moe_ffn names the knobs; engine/arch.py reads them from a file):

- ``Gating.SOFTMAX``: probabilities are a softmax over all experts (qwen2moe, qwen3moe,
  mixtral, deepseek-v2);
- ``Gating.SIGMOID``: each expert's probability is sigmoid(logit) (deepseek-v3, glm4moe);
- ``Gating.SOFTMAX_WEIGHT``: experts are selected by logit and the weights are a softmax
  over the selected logits (gpt-oss).

A selection bias (``exp_probs_b``) is added to the probabilities for choosing experts only;
with ``n_group > 1`` only the ``n_group_used`` groups whose two best selection values sum
highest stay selectable. The weights are the chosen probabilities, divided by their sum
(floored at 2^-14) when ``norm``, times ``scale``.

Shapes are float32 row-major: x [n_tokens, n_embd], router [n_expert, n_embd], logits
[n_tokens, n_expert], ids int32 and weights [n_tokens, top_k].
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import KernelArg, Stream
from ..errors import InvalidArgument
from . import layout
from .args import ViewLike, positive, view

if TYPE_CHECKING:
    from .launcher import MoeKernels


SELECT_THREADS = 128  # must match routing.cu
SELECT_MAX_GROUPS = 64
LOGITS_EXPERTS = 4  # router logits: experts per block (one 32-thread wave each) and tokens per block
LOGITS_TOKENS = 8
SHARED_GATE_THREADS = 256
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
WEIGHTS_SUM_MIN = 6.103515625e-5


class Gating(enum.IntEnum):
    """How router logits become expert probabilities; values are llama.cpp's expert_gating_func."""

    SOFTMAX = 1
    SIGMOID = 2
    SOFTMAX_WEIGHT = 3


class Activation(enum.Enum):
    """The gated activation of the experts' gate and up projections."""

    SILU = "silu"  # silu(gate) * up
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: clamped, sigmoid(alpha * gate), (up + 1)


@dataclass(frozen=True)
class Routing:
    """How one architecture selects and weights its experts."""

    gating: Gating = Gating.SOFTMAX
    norm: bool = True
    scale: float = 1.0
    n_group: int = 1
    n_group_used: int = 1

    @property
    def is_softmax_topk(self) -> bool:
        """True when router_topk (softmax over the selected logits) computes exactly this."""
        return self.gating is Gating.SOFTMAX and self.norm and self.scale == 1.0 and self.n_group <= 1


# Experts chosen by logit and weighted by a softmax over the chosen logits: what is_softmax_topk
# routings compute exactly (MoeKernels.router_topk's selection).
SELECTED_SOFTMAX = Routing(Gating.SOFTMAX_WEIGHT, norm=False)


def router_logits(
    kernels: MoeKernels,
    stream: Stream,
    x: ViewLike,
    router: ViewLike,
    bias: ViewLike | None,
    logits: ViewLike,
    n_tokens: int,
    n_embd: int,
    n_expert: int,
) -> None:
    """logits = x @ router^T (+ bias per expert)."""
    call = "router_logits"
    positive(call, n_tokens=n_tokens, n_embd=n_embd, n_expert=n_expert)
    args = _logits_args(call, x, router, bias, logits, n_tokens, n_embd, n_expert)
    grid = (-(-n_expert // LOGITS_EXPERTS), -(-n_tokens // LOGITS_TOKENS))
    if grid[1] > layout.MAX_GRID_Y:
        raise InvalidArgument(f"{n_tokens} tokens are more than one launch handles", call=call, hint="split the batch")
    stream.launch(kernels.kernel("moe_router_logits"), grid, LOGITS_EXPERTS * 32, args)


def _logits_args(
    call: str,
    x: ViewLike,
    router: ViewLike,
    bias: ViewLike | None,
    logits: ViewLike,
    n_tokens: int,
    n_embd: int,
    n_expert: int,
) -> tuple[KernelArg, ...]:
    """moe_router_logits' arguments: x, router, bias (the router where there is none: never read),
    logits, n_tokens, n_embd, n_expert, has_bias."""
    router_view = view(call, "router", router, n_expert * n_embd * 4)
    return (
        view(call, "x", x, n_tokens * n_embd * 4),
        router_view,
        router_view if bias is None else view(call, "bias", bias, n_expert * 4),
        view(call, "logits", logits, n_tokens * n_expert * 4),
        np.int32(n_tokens),
        np.int32(n_embd),
        np.int32(n_expert),
        np.int32(0 if bias is None else 1),
    )


def router_select(
    kernels: MoeKernels,
    stream: Stream,
    logits: ViewLike,
    sel_bias: ViewLike | None,
    routing: Routing,
    n_tokens: int,
    n_expert: int,
    top_k: int,
    ids: ViewLike,
    weights: ViewLike,
) -> None:
    """ids, weights of each token from its logits, as ``routing`` says."""
    call = "router_select"
    positive(call, n_tokens=n_tokens, n_expert=n_expert, top_k=top_k)
    _check_selection(call, routing, n_expert, top_k)
    logits_view = view(call, "logits", logits, n_tokens * n_expert * 4)
    selection = _selection_args(call, logits_view, sel_bias, routing, n_tokens, n_expert, top_k, ids, weights)
    args = (logits_view, *selection)
    stream.launch(kernels.kernel("moe_router_select"), n_tokens, SELECT_THREADS, args)


def _check_selection(call: str, routing: Routing, n_expert: int, top_k: int) -> None:
    if n_expert > layout.ROUTER_MAX_EXPERTS or top_k > min(n_expert, layout.ROUTER_MAX_K):
        raise InvalidArgument(
            f"{call} handles at most {layout.ROUTER_MAX_EXPERTS} experts and top_k <= "
            f"min(n_expert, {layout.ROUTER_MAX_K}); got {n_expert} experts, top_k {top_k}",
            call=call,
        )
    if routing.n_group > 1 and (
        routing.n_group > SELECT_MAX_GROUPS
        or n_expert % routing.n_group
        or n_expert // routing.n_group < 2
        or not 1 <= routing.n_group_used <= routing.n_group
    ):
        raise InvalidArgument(
            f"{routing.n_group} expert groups (using {routing.n_group_used}) do not fit {n_expert} experts",
            call=call,
            hint=f"groups must split the experts evenly, at least 2 per group, at most {SELECT_MAX_GROUPS} groups",
        )


def _selection_args(
    call: str,
    stand_in: KernelArg,
    sel_bias: ViewLike | None,
    routing: Routing,
    n_tokens: int,
    n_expert: int,
    top_k: int,
    ids: ViewLike,
    weights: ViewLike,
) -> tuple[KernelArg, ...]:
    """The selection's arguments after the logits: sel_bias (``stand_in``, a buffer written before the
    launch and never read, where there is none), ids, weights, n_tokens, n_expert, top_k and the
    routing's knobs."""
    return (
        stand_in if sel_bias is None else view(call, "sel_bias", sel_bias, n_expert * 4),
        view(call, "ids", ids, n_tokens * top_k * 4),
        view(call, "weights", weights, n_tokens * top_k * 4),
        np.int32(n_tokens),
        np.int32(n_expert),
        np.int32(top_k),
        np.int32(int(routing.gating)),
        np.int32(0 if sel_bias is None else 1),
        np.int32(max(routing.n_group, 1)),
        np.int32(routing.n_group_used),
        np.int32(1 if routing.norm else 0),
        np.float32(routing.scale),
    )


_COUNTER = "router_counter"  # the MoeKernels owner of router_logits_select's counter


def reserve_logits_select(kernels: MoeKernels) -> None:
    """Take now the counter router_logits_select uses by default, so that a call captured into a
    graph later finds it."""
    kernels.zeroed(_COUNTER, 4)


def router_logits_select(
    kernels: MoeKernels,
    stream: Stream,
    x: ViewLike,
    router: ViewLike,
    bias: ViewLike | None,
    logits: ViewLike,
    sel_bias: ViewLike | None,
    routing: Routing,
    n_tokens: int,
    n_embd: int,
    n_expert: int,
    top_k: int,
    ids: ViewLike,
    weights: ViewLike,
    counter: ViewLike | None = None,
) -> None:
    """``router_logits`` then ``router_select`` in one launch, the same bytes, for at most
    LOGITS_TOKENS tokens (decode). ``counter``: a device int32 that holds 0 (each launch leaves it
    so); by default the instance's own (``reserve_logits_select``). Launches that share one run in
    one stream's order."""
    call = "router_logits_select"
    positive(call, n_tokens=n_tokens, n_embd=n_embd, n_expert=n_expert, top_k=top_k)
    if n_tokens > LOGITS_TOKENS:
        raise InvalidArgument(
            f"{n_tokens} tokens: the fused router takes at most {LOGITS_TOKENS}",
            call=call,
            hint="run router_logits and router_select",
        )
    _check_selection(call, routing, n_expert, top_k)
    logit = _logits_args(call, x, router, bias, logits, n_tokens, n_embd, n_expert)
    # Without a selection bias the router stands in for it: never read, and written before the launch.
    selection = _selection_args(call, logit[1], sel_bias, routing, n_tokens, n_expert, top_k, ids, weights)
    counter_view = kernels.zeroed(_COUNTER, 4) if counter is None else view(call, "counter", counter, 4, 4)
    # The kernel's order: logits' pointers, the counter, the selection's pointers, then logits' and the
    # selection's scalars, each named once (n_tokens and n_expert from the logits').
    args = (*logit[:4], counter_view, *selection[:3], *logit[4:], *selection[5:])
    grid = (-(-n_expert // LOGITS_EXPERTS), 1)
    stream.launch(kernels.kernel("moe_router_logits_select"), grid, LOGITS_EXPERTS * 32, args)


def route(
    kernels: MoeKernels,
    stream: Stream,
    x: ViewLike,
    router: ViewLike,
    bias: ViewLike | None,
    logits: ViewLike,
    sel_bias: ViewLike | None,
    routing: Routing,
    n_tokens: int,
    n_embd: int,
    n_expert: int,
    top_k: int,
    ids: ViewLike,
    weights: ViewLike,
) -> None:
    """``router_logits`` then ``router_select``: in one launch (``router_logits_select``, the same bytes)
    for at most LOGITS_TOKENS tokens, as decode has, else in two."""
    if n_tokens <= LOGITS_TOKENS:
        router_logits_select(
            kernels, stream, x, router, bias, logits, sel_bias, routing, n_tokens, n_embd, n_expert, top_k, ids,
            weights,
        )  # fmt: skip
        return
    router_logits(kernels, stream, x, router, bias, logits, n_tokens, n_embd, n_expert)
    router_select(kernels, stream, logits, sel_bias, routing, n_tokens, n_expert, top_k, ids, weights)


def swiglu_oai(
    kernels: MoeKernels,
    stream: Stream,
    gate: ViewLike,
    up: ViewLike,
    out: ViewLike,
    n: int,
    alpha: float = SWIGLU_OAI_ALPHA,
    limit: float = SWIGLU_OAI_LIMIT,
) -> None:
    """out = min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1)."""
    call = "swiglu_oai"
    positive(call, n=n)
    views = [view(call, name, arg, n * 4) for name, arg in (("gate", gate), ("up", up), ("out", out))]
    blocks = min(-(-n // layout.ELEMENTWISE_THREADS), layout.MAX_GRID_Y)
    stream.launch(
        kernels.kernel("moe_swiglu_oai"),
        blocks,
        layout.ELEMENTWISE_THREADS,
        (*views, np.int32(n), np.float32(alpha), np.float32(limit)),
    )


def add_expert_bias(
    kernels: MoeKernels,
    stream: Stream,
    y: ViewLike,
    bias: ViewLike,
    ids: ViewLike,
    n_pairs: int,
    n_out: int,
    n_expert: int,
) -> None:
    """y[p, :] += bias[ids[p], :] for y [n_pairs, n_out] and bias [n_expert, n_out]."""
    call = "add_expert_bias"
    positive(call, n_pairs=n_pairs, n_out=n_out, n_expert=n_expert)
    args = (
        view(call, "y", y, n_pairs * n_out * 4),
        view(call, "bias", bias, n_expert * n_out * 4),
        view(call, "ids", ids, n_pairs * 4),
        np.int32(n_pairs),
        np.int32(n_out),
        np.int32(n_expert),
    )
    grid = (-(-n_out // layout.ELEMENTWISE_THREADS), min(n_pairs, layout.MAX_GRID_Y))
    stream.launch(kernels.kernel("moe_add_expert_bias"), grid, layout.ELEMENTWISE_THREADS, args)


def shared_gate(
    kernels: MoeKernels,
    stream: Stream,
    x: ViewLike,
    w: ViewLike,
    y: ViewLike,
    n_tokens: int,
    n_embd: int,
    n: int,
) -> None:
    """y[t, :] *= sigmoid(x[t, :] . w) for y [n_tokens, n]: the gate of qwen2moe's shared expert."""
    call = "shared_gate"
    positive(call, n_tokens=n_tokens, n_embd=n_embd, n=n)
    args = (
        view(call, "x", x, n_tokens * n_embd * 4),
        view(call, "w", w, n_embd * 4),
        view(call, "y", y, n_tokens * n * 4),
        np.int32(n_tokens),
        np.int32(n_embd),
        np.int32(n),
    )
    stream.launch(
        kernels.kernel("moe_shared_gate"), n_tokens, SHARED_GATE_THREADS, args, shared_mem=SHARED_GATE_THREADS * 4
    )
