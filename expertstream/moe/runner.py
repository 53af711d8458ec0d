"""MoE prefill and decode of a GGUF model through the scheduler, on one device.

Each layer is four splits, in this order for every ubatch of tokens:

- ``router``: a weightless RMS norm of the hidden state (a stand-in for attention and
  normalization, see standin.py), then router_topk with the layer's device-resident router
  into the routing ids and weights of this layer and ubatch;
- ``gate``: mul_mat_id over the layer's gate experts;
- ``up``: mul_mat_id over the up experts, then SwiGLU of gate and up;
- ``down``: mul_mat_id over the down experts (one input row per token and slot), the
  routing-weighted sum over slots, and the residual add into the hidden state.

The routing ids come from the router split before the three expert splits that read them,
and each (layer, ubatch) has its own ids, so the stock path's ids read-back is right and the
three splits sharing them are adjacent. Prefill is ONE plan over all ubatches in order, so the
staging ring keeps copying across ubatch boundaries. Activation scratch is shared by all
splits: they run in order on one compute stream. Decode runs one plan per step of one token.

Inputs are deterministic embeddings from a seed, copied into the hidden state by the first
split of each ubatch, so a plan can be run again (warm-up, then timed) with the same result.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ..backends.base import BufferView, Device, DeviceBuffer, Stream, Usage
from ..errors import InvalidArgument
from ..kernels import MoeKernels
from ..model import MoeLayer, MoeModel, TensorInfo
from ..scheduler import Bindings, Input, MulMatId, Plan, Split
from ..scheduler.source import HostSource
from . import standin

ExpertData = Mapping[str, "HostSource | BufferView"]
"""Expert tensor name -> host-resident source, or device bytes of its padded size."""

GATE, UP, DOWN, ROUTER = "gate", "up", "down", "router"


@dataclass(frozen=True)
class Batching:
    """Prompt tokens, split into ubatches of at most ``ubatch`` tokens, then decode steps of one."""

    tokens: int
    ubatch: int
    decode_steps: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.ubatch < 1 or self.decode_steps < 0:
            raise InvalidArgument(
                f"need tokens >= 1, ubatch >= 1 and decode steps >= 0; got {self.tokens}, {self.ubatch}, "
                f"{self.decode_steps}"
            )

    @property
    def ubatch_tokens(self) -> int:
        """Rows of activation scratch: the largest ubatch."""
        return min(self.ubatch, self.tokens)

    def ubatches(self) -> list[tuple[int, int]]:
        """(first token, token count) of each ubatch."""
        return [(start, min(self.ubatch, self.tokens - start)) for start in range(0, self.tokens, self.ubatch)]


def _router_floats(model: MoeModel, info: TensorInfo) -> np.ndarray:
    raw = model.raw(info)
    if info.qtype is GGMLQuantizationType.F32:
        return np.ascontiguousarray(raw).view(np.float32)
    if info.qtype is GGMLQuantizationType.F16:
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
    # BF16: the high half of a float32
    return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def embeddings(seed: int, first: int, count: int, n_embd: int) -> np.ndarray:
    """Deterministic float32 input embeddings of tokens first..first+count-1 (unit RMS)."""
    rows = [np.random.default_rng([seed, first + i]).standard_normal(n_embd, dtype=np.float32) for i in range(count)]
    return np.stack(rows) if rows else np.empty((0, n_embd), np.float32)


class _Scratch:
    """Activation buffers for up to ``rows`` tokens, shared by every split of a plan."""

    def __init__(self, device: Device, rows: int, model: MoeModel) -> None:
        pairs = rows * model.top_k
        sizes = {
            "x": rows * model.n_embd * 4,
            "route_weights": pairs * 4,
            "gate": pairs * model.n_ff * 4,
            "up": pairs * model.n_ff * 4,
            "act": pairs * model.n_ff * 4,
            "down": pairs * model.n_embd * 4,
            "moe": rows * model.n_embd * 4,
        }
        self.buffers: dict[str, DeviceBuffer] = {}
        try:
            for name, size in sizes.items():
                self.buffers[name] = device.alloc(size, Usage.COMPUTE)
        except BaseException:
            self.close()
            raise

    def view(self, name: str, nbytes: int) -> BufferView:
        return self.buffers[name].view(0, nbytes)

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()
        self.buffers.clear()


@dataclass(frozen=True)
class _Tokens:
    """The hidden rows one split group works on and where their routing lives."""

    hidden: BufferView
    embed: BufferView | None  # copied into ``hidden`` before the first MoE layer; None for later ones
    count: int
    ids: BufferView
    label: str


class MoeRunner:
    """One model's MoE layers on one device: routers, activations, inputs and outputs.

    Expert weights are not owned here: each plan takes them as an ExpertData mapping, so the
    same runner serves every host memory mode and the device-resident (compute-only) case.
    """

    def __init__(self, device: Device, model: MoeModel, batching: Batching, *, seed: int = 0) -> None:
        self.device = device
        self.model = model
        self.batching = batching
        self.seed = seed
        self.data = device.backend.holds_data
        if batching.decode_steps and not self.data:
            raise InvalidArgument(
                "decode needs a backend that holds data: its stock path reads the routing ids back",
                call="MoeRunner",
                hint="run decode steps with data, or leave them out of timing-only runs",
            )
        self.kernels = MoeKernels(device)
        self._buffers: list[DeviceBuffer] = []
        self._scratch: _Scratch | None = None
        try:
            self._allocate()
        except BaseException:
            self.close()
            raise

    # -- setup -------------------------------------------------------------------------------
    def _alloc(self, nbytes: int, usage: Usage = Usage.COMPUTE) -> DeviceBuffer:
        buf = self.device.alloc(max(nbytes, 4), usage)
        self._buffers.append(buf)
        return buf

    def _input(self, nbytes: int, usage: Usage, make: Callable[[], np.ndarray]) -> DeviceBuffer:
        """A buffer holding ``make()``; zeros where the backend holds no data (nothing reads it unwritten)."""
        buf = self._alloc(nbytes, usage)
        if self.data:
            buf.write(make())
        else:
            with self.device.stream() as stream:
                stream.memset(buf, 0, buf.alloc_size)
                stream.synchronize()
        return buf

    def _allocate(self) -> None:
        model, batching, seed = self.model, self.batching, self.seed
        row = model.n_embd * 4
        n_ub = len(batching.ubatches())
        self._routers = {
            layer.index: self._input(
                model.n_expert * row, Usage.WEIGHTS, functools.partial(_router_floats, model, layer.router)
            ).view(0, model.n_expert * row)
            for layer in model.layers
        }
        self._scratch = _Scratch(self.device, batching.ubatch_tokens, model)
        tokens, steps = batching.tokens, batching.decode_steps
        self._embed = self._input(
            tokens * row, Usage.COMPUTE, functools.partial(embeddings, seed, 0, tokens, model.n_embd)
        )
        self._hidden = self._alloc(tokens * row)
        self._ids = self._alloc(model.n_layer * n_ub * batching.ubatch_tokens * model.top_k * 4)
        self._decode_embed = self._input(
            steps * row, Usage.COMPUTE, functools.partial(embeddings, seed, tokens, steps, model.n_embd)
        )
        self._decode_hidden = self._alloc(steps * row)
        self._decode_ids = self._alloc(model.n_layer * model.top_k * 4)

    @property
    def device_bytes(self) -> int:
        """Device memory this runner holds (routers, activations, inputs, outputs)."""
        scratch = self._scratch.buffers.values() if self._scratch is not None else ()
        return sum(buf.alloc_size for buf in (*self._buffers, *scratch))

    # -- plans ---------------------------------------------------------------------------------
    def prefill_plan(self, experts: ExpertData, ubatches: Sequence[int] | None = None) -> Plan:
        """Every layer of the given ubatches (default: all, in order) as one plan."""
        all_ubatches = self.batching.ubatches()
        chosen = range(len(all_ubatches)) if ubatches is None else ubatches
        row = self.model.n_embd * 4
        ids_stride = self.batching.ubatch_tokens * self.model.top_k * 4
        splits: list[Split] = []
        for u in chosen:
            first, count = all_ubatches[u]
            for layer in self.model.layers:
                ids_at = (u * self.model.n_layer + layer.index) * ids_stride
                tokens = _Tokens(
                    hidden=self._hidden.view(first * row, count * row),
                    embed=self._embed.view(first * row, count * row) if layer is self.model.layers[0] else None,
                    count=count,
                    ids=self._ids.view(ids_at, count * self.model.top_k * 4),
                    label=f"ub{u}",
                )
                splits += self._layer_splits(layer, tokens, experts)
        return Plan.of(splits)

    def decode_plan(self, experts: ExpertData, step: int) -> Plan:
        """Every layer for decode step ``step`` (one token)."""
        if not 0 <= step < self.batching.decode_steps:
            raise InvalidArgument(f"decode step {step} is outside 0..{self.batching.decode_steps - 1}")
        row = self.model.n_embd * 4
        ids_bytes = self.model.top_k * 4
        splits: list[Split] = []
        for layer in self.model.layers:
            tokens = _Tokens(
                hidden=self._decode_hidden.view(step * row, row),
                embed=self._decode_embed.view(step * row, row) if layer is self.model.layers[0] else None,
                count=1,
                ids=self._decode_ids.view(layer.index * ids_bytes, ids_bytes),
                label=f"step{step}",
            )
            splits += self._layer_splits(layer, tokens, experts)
        return Plan.of(splits)

    def _layer_splits(self, layer: MoeLayer, tokens: _Tokens, experts: ExpertData) -> list[Split]:
        model = self.model
        name = f"L{layer.index}.{tokens.label}"
        n_ids = tokens.count * model.top_k
        router = Input(ROUTER, layer.router.nbytes, device_data=self._routers[layer.index])
        return [
            Split(f"router.{name}", self.device, (router,), functools.partial(self._route, tokens)),
            *(
                Split(
                    f"{role}.{name}",
                    self.device,
                    (_expert_input(role, info, experts[info.name]),),
                    functools.partial(compute, tokens, info),
                    MulMatId(tokens.ids, n_ids, model.n_expert, (role,)),
                )
                for role, info, compute in (
                    (GATE, layer.gate, self._gate),
                    (UP, layer.up, self._up),
                    (DOWN, layer.down, self._down),
                )
            ),
        ]

    # -- what each split enqueues ------------------------------------------------------------
    def _route(self, tokens: _Tokens, stream: Stream, bindings: Bindings) -> None:
        model, scratch = self.model, self._active_scratch()
        if tokens.embed is not None:
            stream.copy_d2d(
                tokens.hidden.buffer,
                tokens.hidden.offset,
                tokens.embed.buffer,
                tokens.embed.offset,
                tokens.hidden.nbytes,
            )
        x = scratch.view("x", tokens.hidden.nbytes)
        standin.rms_norm(self.kernels, stream, tokens.hidden, x, tokens.count, model.n_embd)
        self.kernels.router_topk(
            stream,
            x,
            bindings[ROUTER],
            tokens.count,
            model.n_embd,
            model.n_expert,
            model.top_k,
            tokens.ids,
            scratch.view("route_weights", tokens.ids.nbytes),
        )

    def _gate(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        self._mul_mat_id(stream, bindings[GATE], info, tokens, "x", False, "gate")

    def _up(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        self._mul_mat_id(stream, bindings[UP], info, tokens, "x", False, "up")
        n = tokens.count * self.model.top_k * self.model.n_ff
        scratch = self._active_scratch()
        self.kernels.swiglu(
            stream, scratch.view("gate", n * 4), scratch.view("up", n * 4), scratch.view("act", n * 4), n
        )

    def _down(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        model, scratch = self.model, self._active_scratch()
        self._mul_mat_id(stream, bindings[DOWN], info, tokens, "act", True, "down")
        pairs = tokens.count * model.top_k
        moe = scratch.view("moe", tokens.hidden.nbytes)
        self.kernels.weighted_sum(
            stream,
            scratch.view("down", pairs * model.n_embd * 4),
            scratch.view("route_weights", pairs * 4),
            moe,
            tokens.count,
            model.top_k,
            model.n_embd,
        )
        standin.add_inplace(self.kernels, stream, tokens.hidden, moe, tokens.count * model.n_embd)

    def _mul_mat_id(
        self,
        stream: Stream,
        w: BufferView,
        info: TensorInfo,
        tokens: _Tokens,
        x: str,
        x_per_slot: bool,
        y: str,
    ) -> None:
        n_in, n_out, n_expert = info.ne[0], info.ne[1], info.ne[2]
        pairs = tokens.count * self.model.top_k
        scratch = self._active_scratch()
        x_rows = pairs if x_per_slot else tokens.count
        self.kernels.mul_mat_id(
            stream,
            w,
            info.qtype,
            n_expert,
            n_out,
            n_in,
            scratch.view(x, x_rows * n_in * 4),
            x_per_slot,
            tokens.ids,
            tokens.count,
            self.model.top_k,
            scratch.view(y, pairs * n_out * 4),
        )

    def _active_scratch(self) -> _Scratch:
        if self._scratch is None:
            raise InvalidArgument("the runner is closed", call="MoeRunner")
        return self._scratch

    # -- outputs -------------------------------------------------------------------------------
    def prefill_output(self) -> np.ndarray:
        """The final hidden state of every prompt token, float32 [tokens, n_embd]."""
        return (
            self._hidden.read(0, self.batching.tokens * self.model.n_embd * 4)
            .view(np.float32)
            .reshape(self.batching.tokens, self.model.n_embd)
        )

    def decode_output(self) -> np.ndarray:
        """The final hidden state of every decode step, float32 [steps, n_embd]."""
        steps = self.batching.decode_steps
        return (
            self._decode_hidden.read(0, steps * self.model.n_embd * 4)
            .view(np.float32)
            .reshape(steps, self.model.n_embd)
        )

    def close(self) -> None:
        """Free the device memory; work that uses it must be finished."""
        self.kernels.close()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()

    def __enter__(self) -> MoeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _expert_input(role: str, info: TensorInfo, data: HostSource | BufferView) -> Input:
    common: dict[str, Any] = {"row_type": info.qtype, "ne0": info.ne0, "expert_nbytes": info.slice_nbytes}
    if isinstance(data, BufferView):
        return Input(role, info.nbytes, device_data=data, **common)
    return Input(role, info.nbytes, host=data, **common)


def sha256(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
