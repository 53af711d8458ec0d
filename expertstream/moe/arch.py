"""What each architecture's MoE feed-forward block computes, and how a file says so.

llama.cpp's build_moe_ffn is one function with knobs; each architecture sets them, some
from the file's metadata (``{arch}.expert_gating_func``, ``expert_weights_norm``,
``expert_weights_scale``, ``expert_group_count``, ``expert_group_used_count``), some fixed.
``ARCHS`` records the fixed choices and the defaults llama.cpp uses when a key is absent;
``ffn_config`` reads a file's keys over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from ..kernels.routing import Activation, Gating, Routing


@dataclass(frozen=True)
class ArchFfn:
    """The MoE block of one architecture, as llama.cpp builds it."""

    arch: str
    gating: Gating = Gating.SOFTMAX  # default when the file has no expert_gating_func
    norm: bool = True  # default of expert_weights_norm, or the fixed choice
    routing_keys: bool = False  # gating, norm and scale come from the file's keys
    activation: Activation = Activation.SILU
    router_bias: bool = False  # ffn_gate_inp.bias added to the logits
    expert_biases: bool = False  # ffn_{gate,up,down}_exps.bias
    selection_bias: bool = False  # exp_probs_b.bias, for choosing experts only
    shared_experts: bool = False  # ffn_{gate,up,down}_shexp
    shared_gate: bool = False  # ffn_gate_inp_shexp: sigmoid gate of the shared expert
    dense_lead: bool = False  # leading_dense_block_count dense layers come first


ARCHS: dict[str, ArchFfn] = {
    a.arch: a
    for a in (
        # softmax over all experts, top-k, renormalized: equal to a softmax over the selected logits
        ArchFfn("qwen3moe"),
        ArchFfn("llama"),  # mixtral-style experts
        ArchFfn("qwen2moe", norm=False, shared_experts=True, shared_gate=True),
        ArchFfn("qwen3next", shared_experts=True, shared_gate=True),
        ArchFfn("deepseek2", norm=False, routing_keys=True, selection_bias=True, shared_experts=True, dense_lead=True),
        ArchFfn(
            "glm4moe",
            gating=Gating.SIGMOID,
            norm=False,
            routing_keys=True,
            selection_bias=True,
            shared_experts=True,
            dense_lead=True,
        ),
        ArchFfn(
            "gpt-oss",
            gating=Gating.SOFTMAX_WEIGHT,
            norm=False,
            activation=Activation.SWIGLU_OAI,
            router_bias=True,
            expert_biases=True,
        ),
    )
}


@dataclass(frozen=True)
class FfnConfig:
    """One file's MoE block: its architecture's choices and the values its metadata gives."""

    ffn: ArchFfn
    routing: Routing
    n_shared: int  # shared experts folded into one dense FFN (0: none)
    n_dense_lead: int


def arch_ffn(arch: str) -> ArchFfn:
    """The MoE block of ``arch``; InvalidArgument names the known ones otherwise."""
    try:
        return ARCHS[arch]
    except KeyError:
        raise InvalidArgument(
            f"no MoE block is known for architecture {arch!r}", hint=f"known: {', '.join(sorted(ARCHS))}"
        ) from None


def ffn_config(arch: str, metadata: Callable[[str], Any]) -> FfnConfig:
    """The MoE block of a file of ``arch`` whose key ``{arch}.name`` is ``metadata(name)`` (None if absent)."""
    ffn = arch_ffn(arch)

    def key(name: str, default: Any) -> Any:
        value = metadata(f"{arch}.{name}")
        return default if value is None else value

    gating, norm, scale = ffn.gating, ffn.norm, 1.0
    if ffn.routing_keys:
        gating_value = int(key("expert_gating_func", 0))
        gating = Gating(gating_value) if gating_value else ffn.gating  # 0 means unset in llama.cpp
        norm = bool(key("expert_weights_norm", ffn.norm))
        scale = float(key("expert_weights_scale", 1.0))
    n_group = int(key("expert_group_count", 0))
    routing = Routing(gating, norm, scale, n_group if n_group > 1 else 1, int(key("expert_group_used_count", 1)))
    n_shared = int(key("expert_shared_count", 1 if ffn.shared_experts else 0)) if ffn.shared_experts else 0
    n_dense = int(key("leading_dense_block_count", 0)) if ffn.dense_lead else 0
    return FfnConfig(ffn, routing, n_shared, n_dense)
