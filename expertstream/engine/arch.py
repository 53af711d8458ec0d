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
from ..model import ModelError


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


def ffn_config(arch: str, metadata: Callable[[str], Any], source: str | None = None) -> FfnConfig:
    """The MoE block of a file of ``arch`` whose key ``{arch}.name`` is ``metadata(name)`` (None if absent).

    A key of the wrong type or out of range is a ModelError naming the key (and ``source``, the file).
    """
    ffn = arch_ffn(arch)
    keys = ArchKeys(arch, metadata, source)
    gating, norm, scale = ffn.gating, ffn.norm, 1.0
    if ffn.routing_keys:
        gating_value = keys.integer("expert_gating_func", 0)
        if gating_value:  # 0 means unset in llama.cpp
            if gating_value not in Gating._value2member_map_:
                known = ", ".join(f"{g.value} ({g.name.lower()})" for g in Gating)
                raise keys.error("expert_gating_func", gating_value, f"one of {known}")
            gating = Gating(gating_value)
        norm = keys.boolean("expert_weights_norm", ffn.norm)
        scale = keys.real("expert_weights_scale", 1.0)
    n_group = keys.integer("expert_group_count", 0)
    n_group_used = keys.integer("expert_group_used_count", 1)
    if n_group > 1 and not 1 <= n_group_used <= n_group:
        raise keys.error("expert_group_used_count", n_group_used, f"1..{n_group} (the expert group count)")
    routing = Routing(gating, norm, scale, n_group if n_group > 1 else 1, n_group_used)
    n_shared = keys.integer("expert_shared_count", 1) if ffn.shared_experts else 0
    n_dense = keys.integer("leading_dense_block_count", 0) if ffn.dense_lead else 0
    return FfnConfig(ffn, routing, n_shared, n_dense)


class ArchKeys:
    """Typed reads of one file's ``{arch}.*`` keys, with llama.cpp's defaults when absent."""

    def __init__(self, arch: str, metadata: Callable[[str], Any], source: str | None) -> None:
        self.arch = arch
        self.metadata = metadata
        self.source = source

    def value(self, name: str) -> Any:
        """The raw value of ``{arch}.name``, or None when the file lacks it."""
        return self.metadata(f"{self.arch}.{name}")

    def integer(self, name: str, default: int | None = None, *, per_layer: bool = False) -> int:
        """A non-negative integer; ``default`` when absent (ModelError when absent without one).
        ``per_layer``: an array of one value per layer is taken where every layer has the same."""
        value = self.value(name)
        if value is None:
            if default is None:
                raise ModelError(f"{self._where}metadata key {self._key(name)!r} is missing")
            return default
        if per_layer and isinstance(value, list):
            if len(set(value)) != 1:
                raise self.error(name, value, "the same value for every layer")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(name, value, "a non-negative integer")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.value(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, value, "a boolean")
        return value

    def real(self, name: str, default: float) -> float:
        value = self.value(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(name, value, "a number")
        return float(value)

    def error(self, name: str, value: Any, expected: str) -> ModelError:
        return ModelError(f"{self._where}metadata key {self._key(name)!r} is {value!r}; expected {expected}")

    def _key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    @property
    def _where(self) -> str:
        return f"{self.source}: " if self.source else ""
