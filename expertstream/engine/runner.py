"""MoE prefill and decode of a GGUF model through the scheduler, on one device or a layer split.

Each layer is four splits (three where gate and up fuse), in this order for every ubatch of tokens:

- ``router``: a weightless RMS norm of the hidden state (a stand-in for attention and
  normalization, see standin.py), then the architecture's routing (arch.py) with the
  layer's device-resident router into the routing ids and weights of this layer and ubatch:
  router_topk where a softmax over the selected logits is exact, else router logits (with
  gpt-oss's router bias) and router_select (gating, selection bias, groups, norm, scale);
- ``gate``: mul_mat_id over the layer's gate experts (+ per-expert biases where the file has them);
- ``up``: mul_mat_id over the up experts (+ biases), then SwiGLU (gpt-oss: its clamped form);
- ``down``: mul_mat_id over the down experts (one input row per (token, k) pair, + biases), the
  shared expert where the file has one (a dense FFN of device-resident weights, run as
  mul_mat_id over one expert, with qwen2moe's sigmoid gate), then one kernel (combine) for the
  routing-weighted sum of the top-k outputs, the shared expert's output and the residual add into the
  hidden state.

Where the device's kernels decode the expert type straight into matrix fragments
(MoeKernels.uses_direct: Q4_0 and Q4_K on NVIDIA sm_80+), the down projection scales each row
by its routing weight as it writes it, so combine only adds the top-k outputs up; and, asked for with
``fuse_gate_up`` where the layer has plain SwiGLU and no expert biases, one ``gate_up`` split
reads both tensors and writes SwiGLU's output in one pass (the same bytes as the two splits).

The routing ids come from the router split before the three expert splits that read them,
and each (layer, ubatch) has its own ids, so the stock path's ids read-back is right and the
three splits sharing them are adjacent. Prefill is ONE plan over all ubatches in order, so the
lookahead keeps copying across ubatch boundaries. Activation scratch is shared by all
splits: they run in order on one compute stream. Decode runs one plan per step of one token.

Inputs are deterministic embeddings from a seed, copied into the hidden state by the first
split of each ubatch, so a plan can be run again (warm-up, then timed) with the same result.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from .._closing import Closing
from ..backends.base import BufferView, Device, DeviceBuffer, Stream, Usage
from ..errors import InvalidArgument
from ..ggml import padded_size
from ..kernels import MoeKernels, check_path, routing
from ..kernels.layout import MatrixPath
from ..kernels.routing import Activation
from ..model import ModelError, MoeLayer, MoeModel, TensorInfo
from ..scheduler import Bindings, Input, MulMatId, Plan, Split, is_prefill_scale
from ..scheduler.source import HostSource
from . import standin
from .arch import FfnConfig, ffn_config
from .layersplit import Crossing, LayerSplit, Link

ExpertData = Mapping[str, "HostSource | BufferView"]
"""Expert tensor name -> host-resident source, or device bytes of its padded size."""

GATE, UP, DOWN, ROUTER = "gate", "up", "down", "router"

# The byte every output is filled with before a hashed run: 0xFFFFFFFF is a float32 NaN, which no
# correct run leaves (rows count non-finite values), so work left out shows in the hash.
OUTPUT_POISON = 0xFF


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


def stand_in_routing(seed: int, first: int, count: int, layer: int, model: MoeModel) -> np.ndarray | None:
    """top_k distinct experts per token drawn uniformly: what a timing-only run copies at decode scale.

    Only the stock path at decode scale reads routing ids back (at the scheduler's default
    prefill factor); elsewhere there is nothing to stand in for (None).
    """
    if is_prefill_scale(count * model.top_k, model.n_expert):
        return None
    draws = np.random.default_rng([seed, first, layer]).random((count, model.n_expert))
    return np.argsort(draws, axis=1)[:, : model.top_k].astype(np.int32).reshape(-1)


def embeddings(seed: int, first: int, count: int, n_embd: int) -> np.ndarray:
    """Deterministic float32 input embeddings of tokens first..first+count-1 (unit RMS)."""
    rows = [np.random.default_rng([seed, first + i]).standard_normal(n_embd, dtype=np.float32) for i in range(count)]
    return np.stack(rows) if rows else np.empty((0, n_embd), np.float32)


@dataclass(frozen=True)
class _SharedExpert:
    """A layer's shared expert(s): device-resident weights of one dense FFN."""

    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo
    weights: dict[str, BufferView]  # "gate", "up", "down", and "gate_inp" when gated


@dataclass(frozen=True)
class _LayerExtras:
    """The optional per-layer tensors an architecture adds, device-resident (float32 biases)."""

    router_bias: BufferView | None = None
    selection_bias: BufferView | None = None
    expert_bias: dict[str, BufferView] | None = None  # role -> [n_expert, n_out]
    shared: _SharedExpert | None = None


class _Scratch:
    """Activation buffers for up to ``rows`` tokens, shared by every split of a plan."""

    def __init__(self, device: Device, rows: int, model: MoeModel, n_ff_shared: int = 0) -> None:
        pairs = rows * model.top_k
        sizes = {
            "logits": rows * model.n_expert * 4,
            "shared_gate": rows * n_ff_shared * 4,
            "shared_up": rows * n_ff_shared * 4,
            "shared_act": rows * n_ff_shared * 4,
            "shared_down": rows * model.n_embd * 4,
            "x": rows * model.n_embd * 4,
            "route_weights": pairs * 4,
            "gate": pairs * model.n_ff * 4,
            "up": pairs * model.n_ff * 4,
            "act": pairs * model.n_ff * 4,
            "down": pairs * model.n_embd * 4,
        }
        self.buffers: dict[str, DeviceBuffer] = {}
        try:
            for name, size in sizes.items():
                self.buffers[name] = device.alloc(max(size, 4), Usage.COMPUTE)
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

    part: _Part
    hidden: BufferView
    embed: BufferView | None  # copied into ``hidden`` before the first MoE layer; None for later ones
    count: int
    ids: BufferView
    label: str
    layer: int
    receive: Crossing | None = None  # rows arriving from the previous device before this layer
    send: Crossing | None = None  # rows leaving for the next device after this layer


class _Part(Closing):
    """What one device of a layer split holds: its layers' routers and extras, activations, outputs."""

    def __init__(
        self,
        device: Device,
        model: MoeModel,
        batching: Batching,
        layers: Sequence[int],
        *,
        seed: int,
        first: bool,
        matrix_path: MatrixPath | None,
        direct: bool = True,
    ) -> None:
        self.device = device
        self.model = model
        self.batching = batching
        self.data = device.backend.host.holds_data
        self.position = {index: i for i, index in enumerate(layers)}  # layer index -> its place on this device
        self.kernels = MoeKernels(device, matrix_path, direct=direct)
        self._buffers: list[DeviceBuffer] = []
        self._scratch: _Scratch | None = None
        try:
            self._allocate(seed, first)
        except BaseException:
            self.close()
            raise

    def _alloc(self, nbytes: int, usage: Usage = Usage.COMPUTE) -> DeviceBuffer:
        buf = self.device.alloc(max(nbytes, 4), usage)
        self._buffers.append(buf)
        return buf

    def _input(
        self, nbytes: int, usage: Usage, make: Callable[[], np.ndarray], alloc_bytes: int | None = None
    ) -> DeviceBuffer:
        """A buffer holding ``make()``; zeros where the backend holds no data (nothing reads it unwritten)."""
        buf = self._alloc(max(nbytes, alloc_bytes or 0), usage)
        if self.data:
            buf.write(make())
        else:
            with self.device.stream() as stream:
                stream.memset(buf, 0, buf.alloc_size)
                stream.synchronize()
        return buf

    def _allocate(self, seed: int, first: bool) -> None:
        model, batching = self.model, self.batching
        row = model.n_embd * 4
        n_ub = len(batching.ubatches())
        mine = [layer for layer in model.layers if layer.index in self.position]
        self.routers = {
            layer.index: self._input(
                model.n_expert * row, Usage.WEIGHTS, functools.partial(_router_floats, model, layer.router)
            ).view(0, model.n_expert * row)
            for layer in mine
        }
        self.extras = {layer.index: self._layer_extras(layer.index) for layer in mine}
        n_ff_shared = max((e.shared.gate.ne[1] for e in self.extras.values() if e.shared), default=0)
        self._scratch = _Scratch(self.device, batching.ubatch_tokens, model, n_ff_shared)
        rows = batching.ubatch_tokens
        self.zero_ids = self._input(rows * 4, Usage.COMPUTE, functools.partial(np.zeros, rows, np.int32))
        tokens, steps = batching.tokens, batching.decode_steps
        self.embed = self.decode_embed = None
        if first:
            self.embed = self._input(
                tokens * row, Usage.COMPUTE, functools.partial(embeddings, seed, 0, tokens, model.n_embd)
            )
            self.decode_embed = self._input(
                steps * row, Usage.COMPUTE, functools.partial(embeddings, seed, tokens, steps, model.n_embd)
            )
        self.hidden = self._alloc(tokens * row)
        self.ids = self._alloc(len(mine) * n_ub * batching.ubatch_tokens * model.top_k * 4)
        self.decode_hidden = self._alloc(steps * row)
        self.decode_current = self._alloc(row)  # the token of a captured decode step (MoeRunner.decode_step_plan)
        self.decode_ids = self._alloc(len(mine) * model.top_k * 4)

    def _resident(self, info: TensorInfo) -> BufferView:
        """A device copy of a float tensor as float32, or of a quantized one with its zero tail."""
        if info.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            n = info.nbytes // (4 if info.qtype is GGMLQuantizationType.F32 else 2)
            return self._input(n * 4, Usage.WEIGHTS, functools.partial(_router_floats, self.model, info)).view(0, n * 4)
        nbytes = padded_size(info.nbytes, info.qtype, info.ne0)
        buf = self._input(info.nbytes, Usage.WEIGHTS, functools.partial(self.model.raw, info), alloc_bytes=nbytes)
        if nbytes > info.nbytes:  # mul_mat_id reads the tail of quantized rows: it must be zeros
            with self.device.stream() as stream:
                stream.memset(buf, info.nbytes, nbytes - info.nbytes, 0)
                stream.synchronize()
        return buf.view(0, nbytes)

    def _layer_extras(self, index: int) -> _LayerExtras:
        def find(name: str) -> TensorInfo | None:
            return self.model.optional_tensor(f"blk.{index}.{name}")

        def resident(name: str) -> BufferView | None:
            info = find(name)
            return None if info is None else self._resident(info)

        biases = {role: resident(f"ffn_{role}_exps.bias") for role in (GATE, UP, DOWN)}
        expert_bias = {r: b for r, b in biases.items() if b is not None}
        shared = None
        gate, up, down = (find(f"ffn_{role}_shexp.weight") for role in (GATE, UP, DOWN))
        if gate is not None and up is not None and down is not None:
            weights = {role: self._resident(info) for role, info in ((GATE, gate), (UP, up), (DOWN, down))}
            gate_inp = resident("ffn_gate_inp_shexp.weight")
            if gate_inp is not None:
                weights["gate_inp"] = gate_inp
            shared = _SharedExpert(gate, up, down, weights)
        return _LayerExtras(
            router_bias=resident("ffn_gate_inp.bias"),
            selection_bias=resident("exp_probs_b.bias"),
            expert_bias=expert_bias or None,
            shared=shared,
        )

    @property
    def device_bytes(self) -> int:
        scratch = self._scratch.buffers.values() if self._scratch is not None else ()
        return sum(buf.alloc_size for buf in (*self._buffers, *scratch))

    def scratch(self) -> _Scratch:
        if self._scratch is None:
            raise InvalidArgument("the runner is closed", call="MoeRunner")
        return self._scratch

    def close(self) -> None:
        self.kernels.close()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()


class MoeRunner(Closing):
    """One model's MoE layers on one device, or split over several: routers, activations, outputs.

    With several devices the layers are split in order (``LayerSplit``): each device holds its
    layers' routers, its own activations and routing, and runs its splits on its own compute
    stream; the hidden state crosses between devices once per ubatch (layersplit.py).

    Expert weights are not owned here: each plan takes them as an ExpertData mapping, so the
    same runner serves every host memory mode and the device-resident (compute-only) case.
    Device-resident experts must be on their layer's device (``device_of``).
    """

    def __init__(
        self,
        devices: Device | Sequence[Device],
        model: MoeModel,
        batching: Batching,
        *,
        seed: int = 0,
        matrix_path: MatrixPath | None = None,
        fuse_gate_up: bool = False,
        direct: bool = True,
    ) -> None:
        self.devices: tuple[Device, ...] = (devices,) if isinstance(devices, Device) else tuple(devices)
        # direct: whether the MMA path takes direct.cu's kernels where they apply (MoeKernels.direct).
        # One gate_up split per layer where the kernels can (fuses_gate_up). Off by default: the
        # split's two tensors take two prefetch slots at once, so with fewer than 3 slots one of them
        # falls back to the stock copy (the scheduler counts it as too_many_inputs).
        self.fuse_gate_up = fuse_gate_up
        for device in self.devices:
            check_path(device, matrix_path)
        self.model = model
        self.batching = batching
        self.seed = seed
        self.layer_split = LayerSplit(model, self.devices)
        self.device = self.devices[0]
        self.data = self.device.backend.host.holds_data
        _check_uniform_layers(model)
        self.ffn: FfnConfig = ffn_config(model.arch, model.metadata, str(model.path))
        self._parts: list[_Part] = []
        self._links: list[Link] = []
        try:
            for i, device in enumerate(self.devices):
                layers = self.layer_split.layers[device]
                self._parts.append(
                    _Part(
                        device,
                        model,
                        batching,
                        layers,
                        seed=seed,
                        first=i == 0,
                        matrix_path=matrix_path,
                        direct=direct,
                    )
                )
            row = model.n_embd * 4
            bounce = (batching.tokens * row, batching.decode_steps * row)
            for sender, receiver in itertools.pairwise(self.devices):
                self._links.append(Link(sender, receiver, bounce))
        except BaseException:
            self.close()
            raise
        self._part_of = {index: part for part in self._parts for index in part.position}

    def device_of(self, layer_index: int) -> Device:
        """The device that runs MoE layer ``layer_index`` (where its resident experts must be)."""
        return self.layer_split.device_of(layer_index)

    @property
    def kernel_family_by_type(self) -> dict[str, str]:
        """The mul_mat_id kernels each expert type takes, by type name: its matrix path's name, or
        "direct" where the bf16 path decodes the type straight into matrix fragments (direct.cu);
        both, comma-separated, where the type's tensors differ (rows of other lengths)."""
        kernels = self._parts[0].kernels
        found: dict[str, set[str]] = {}
        for layer in self.model.layers:
            for info in layer.experts:
                direct = kernels.uses_direct(info.qtype, info.ne[0])
                found.setdefault(info.qtype.name, set()).add("direct" if direct else kernels.path_for(info.qtype).value)
        return {name: ",".join(sorted(families)) for name, families in sorted(found.items())}

    @property
    def matrix_path_by_type(self) -> dict[str, MatrixPath]:
        """The expert matmul path the kernels take for each of the model's expert types, by type name
        (one kind of device per run)."""
        kernels = self._parts[0].kernels
        types = {t.qtype.name: t.qtype for layer in self.model.layers for t in layer.experts}
        return {name: kernels.path_for(qtype) for name, qtype in sorted(types.items())}

    @property
    def matrix_paths(self) -> frozenset[MatrixPath]:
        """The expert matmul paths the kernels take for the model's expert types."""
        return frozenset(self.matrix_path_by_type.values())

    @property
    def crossings(self) -> tuple[str, ...]:
        """How the hidden state crosses each device boundary: "peer" or "host"."""
        return tuple(link.via for link in self._links)

    @property
    def device_bytes(self) -> int:
        """Device memory this runner holds on all its devices (routers, activations, inputs, outputs)."""
        return sum(part.device_bytes for part in self._parts)

    def device_bytes_on(self, device: Device) -> int:
        """Device memory this runner holds on ``device``."""
        return sum(part.device_bytes for part in self._parts if part.device is device)

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
            rows = (first * row, count * row)
            for layer in self.model.layers:
                part = self._part_of[layer.index]
                place = part.position[layer.index]
                ids_at = (u * len(part.position) + place) * ids_stride
                tokens = _Tokens(
                    part=part,
                    hidden=part.hidden.view(*rows),
                    embed=part.embed.view(*rows) if part.embed is not None and place == 0 else None,
                    count=count,
                    ids=part.ids.view(ids_at, count * self.model.top_k * 4),
                    label=f"ub{u}",
                    layer=layer.index,
                    **self._crossings(part, place, rows, decode=False),
                )
                splits += self._layer_splits(layer, tokens, experts, first)
        return Plan.of(splits)

    def decode_plan(self, experts: ExpertData, step: int) -> Plan:
        """Every layer for decode step ``step`` (one token)."""
        self._check_step(step)
        row = self.model.n_embd * 4
        ids_bytes = self.model.top_k * 4
        splits: list[Split] = []
        token = self.batching.tokens + step  # the position of the decoded token
        for layer in self.model.layers:
            part = self._part_of[layer.index]
            place = part.position[layer.index]
            tokens = _Tokens(
                part=part,
                hidden=part.decode_hidden.view(step * row, row),
                embed=part.decode_embed.view(step * row, row) if part.decode_embed is not None and place == 0 else None,
                count=1,
                ids=part.decode_ids.view(place * ids_bytes, ids_bytes),
                label=f"step{step}",
                layer=layer.index,
                **self._crossings(part, place, (step * row, row), decode=True),
            )
            splits += self._layer_splits(layer, tokens, experts, token)
        return Plan.of(splits)

    def decode_step_plan(self, experts: ExpertData) -> Plan:
        """Every layer for one decode token on the runner's own row: the same plan for every step.

        What ``Scheduler.capture`` captures once and replays per step: ``decode_step_in`` puts
        step ``k``'s input into that row first, ``decode_step_out`` copies the layers' result to
        where ``decode_plan(experts, k)`` leaves it, bit for bit. On one device only.
        """
        if len(self._parts) != 1:
            raise InvalidArgument(
                f"a decode step plan runs on one device; this runner's layers span {len(self._parts)}",
                hint="run decode_plan(experts, step) per step",
            )
        (part,) = self._parts
        row = self.model.n_embd * 4
        ids_bytes = self.model.top_k * 4
        splits: list[Split] = []
        for layer in self.model.layers:
            place = part.position[layer.index]
            tokens = _Tokens(
                part=part,
                hidden=part.decode_current.view(0, row),
                embed=None,  # decode_step_in copies it
                count=1,
                ids=part.decode_ids.view(place * ids_bytes, ids_bytes),
                label="step",
                layer=layer.index,
            )
            splits += self._layer_splits(layer, tokens, experts, self.batching.tokens)
        return Plan.of(splits)

    def decode_step_in(self, stream: Stream, step: int) -> None:
        """Enqueue the copy of step ``step``'s input embedding into the row decode_step_plan works on."""
        part, row = self._one_part(step), self.model.n_embd * 4
        assert part.decode_embed is not None
        stream.copy_d2d(part.decode_current, 0, part.decode_embed, step * row, row)

    def decode_step_out(self, stream: Stream, step: int) -> None:
        """Enqueue the copy of decode_step_plan's result to step ``step``'s place in decode_output."""
        part, row = self._one_part(step), self.model.n_embd * 4
        stream.copy_d2d(part.decode_hidden, step * row, part.decode_current, 0, row)

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.batching.decode_steps:
            raise InvalidArgument(f"decode step {step} is outside 0..{self.batching.decode_steps - 1}")

    def _one_part(self, step: int) -> _Part:
        self._check_step(step)
        if len(self._parts) != 1:
            raise InvalidArgument("a decode step plan runs on one device")
        return self._parts[0]

    def _crossings(self, part: _Part, place: int, rows: tuple[int, int], *, decode: bool) -> dict[str, Crossing]:
        """The crossing into this layer (first on a later device) and out of it (last on an earlier one)."""

        def hidden(p: _Part) -> BufferView:
            return (p.decode_hidden if decode else p.hidden).view(*rows)

        i = self._parts.index(part)
        found: dict[str, Crossing] = {}
        if place == 0 and i > 0:
            found["receive"] = self._links[i - 1].crossing(hidden(self._parts[i - 1]), hidden(part), int(decode))
        if place == len(part.position) - 1 and i < len(self._parts) - 1:
            found["send"] = self._links[i].crossing(hidden(part), hidden(self._parts[i + 1]), int(decode))
        return found

    def _layer_splits(self, layer: MoeLayer, tokens: _Tokens, experts: ExpertData, first: int) -> list[Split]:
        """The layer's four splits for ``tokens``, the first of which is at position ``first``."""
        model = self.model
        name = f"L{layer.index}.{tokens.label}"
        n_ids = tokens.count * model.top_k
        stand_in_ids = None if self.data else stand_in_routing(self.seed, first, tokens.count, layer.index, model)
        router = Input(ROUTER, layer.router.nbytes, device_data=tokens.part.routers[layer.index])

        def split(roles: tuple[str, ...], compute: Callable[[_Tokens, TensorInfo, Stream, Bindings], None]) -> Split:
            infos = [getattr(layer, role) for role in roles]
            return Split(
                f"{'_'.join(roles)}.{name}",
                tokens.part.device,
                tuple(_expert_input(role, info, experts[info.name]) for role, info in zip(roles, infos, strict=True)),
                functools.partial(compute, tokens, infos[0]),
                MulMatId(tokens.ids, n_ids, model.n_expert, roles, stand_in_ids),
            )

        first_splits = (
            [split((GATE, UP), self._gate_up)]
            if self._fuses_gate_up(tokens.part, layer)
            else [
                split((GATE,), self._gate),
                split((UP,), self._up),
            ]
        )
        return [
            Split(f"router.{name}", tokens.part.device, (router,), functools.partial(self._route, tokens)),
            *first_splits,
            split((DOWN,), self._down),
        ]

    def fuses_gate_up(self) -> bool:
        """Whether any layer runs gate, up and SwiGLU as one split (see the module's docstring)."""
        return any(self._fuses_gate_up(self._part_of[layer.index], layer) for layer in self.model.layers)

    def _fuses_gate_up(self, part: _Part, layer: MoeLayer) -> bool:
        """Whether gate, up and SwiGLU of ``layer`` run as one pass (MoeKernels.gate_up) on ``part``."""
        gate, up = layer.gate, layer.up
        return (
            self.fuse_gate_up
            and gate.qtype == up.qtype
            and gate.ne == up.ne
            and self.ffn.ffn.activation is Activation.SILU
            and part.extras[layer.index].expert_bias is None
            and part.kernels.uses_direct(gate.qtype, gate.ne[0])
        )

    # -- what each split enqueues ------------------------------------------------------------
    def _route(self, tokens: _Tokens, stream: Stream, bindings: Bindings) -> None:
        model, scratch = self.model, tokens.part.scratch()
        if tokens.embed is not None:
            stream.copy_d2d(
                tokens.hidden.buffer,
                tokens.hidden.offset,
                tokens.embed.buffer,
                tokens.embed.offset,
                tokens.hidden.nbytes,
            )
        if tokens.receive is not None:
            tokens.receive.receive(stream)
        x = scratch.view("x", tokens.hidden.nbytes)
        standin.rms_norm(tokens.part.kernels, stream, tokens.hidden, x, tokens.count, model.n_embd)
        extras = tokens.part.extras[tokens.layer]
        route_weights = scratch.view("route_weights", tokens.ids.nbytes)
        if self.ffn.routing.is_softmax_topk and extras.router_bias is None and extras.selection_bias is None:
            tokens.part.kernels.router_topk(
                stream,
                x,
                bindings[ROUTER],
                tokens.count,
                model.n_embd,
                model.n_expert,
                model.top_k,
                tokens.ids,
                route_weights,
            )
            return
        logits = scratch.view("logits", tokens.count * model.n_expert * 4)
        routing.router_logits(
            tokens.part.kernels,
            stream,
            x,
            bindings[ROUTER],
            extras.router_bias,
            logits,
            tokens.count,
            model.n_embd,
            model.n_expert,
        )
        routing.router_select(
            tokens.part.kernels,
            stream,
            logits,
            extras.selection_bias,
            self.ffn.routing,
            tokens.count,
            model.n_expert,
            model.top_k,
            tokens.ids,
            route_weights,
        )

    def _gate(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        self._mul_mat_id(stream, bindings[GATE], info, tokens, "x", False, "gate")
        self._add_expert_bias(stream, tokens, GATE, "gate", info.ne[1])

    def _up(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        self._mul_mat_id(stream, bindings[UP], info, tokens, "x", False, "up")
        self._add_expert_bias(stream, tokens, UP, "up", info.ne[1])
        n = tokens.count * self.model.top_k * self.model.n_ff
        self._activation(tokens.part, n, "gate", "up", "act", stream)

    def _activation(self, part: _Part, n: int, gate: str, up: str, out: str, stream: Stream, oai: bool = True) -> None:
        scratch = part.scratch()
        views = (scratch.view(gate, n * 4), scratch.view(up, n * 4), scratch.view(out, n * 4))
        if oai and self.ffn.ffn.activation is Activation.SWIGLU_OAI:
            routing.swiglu_oai(part.kernels, stream, *views, n)
        else:
            part.kernels.swiglu(stream, *views, n)

    def _add_expert_bias(self, stream: Stream, tokens: _Tokens, role: str, y: str, n_out: int) -> None:
        biases = tokens.part.extras[tokens.layer].expert_bias
        if biases is None or role not in biases:
            return
        pairs = tokens.count * self.model.top_k
        scratch = tokens.part.scratch()
        routing.add_expert_bias(
            tokens.part.kernels,
            stream,
            scratch.view(y, pairs * n_out * 4),
            biases[role],
            tokens.ids,
            pairs,
            n_out,
            self.model.n_expert,
        )

    def _shared_expert(self, stream: Stream, tokens: _Tokens, shared: _SharedExpert) -> None:
        """shared_down = the shared expert's FFN of x (times sigmoid(x . gate_inp) where gated)."""
        model, scratch = self.model, tokens.part.scratch()
        ids = tokens.part.zero_ids.view(0, tokens.count * 4)
        for role, info, x, y in (
            (GATE, shared.gate, "x", "shared_gate"),
            (UP, shared.up, "x", "shared_up"),
            (DOWN, shared.down, "shared_act", "shared_down"),
        ):
            n_in, n_out = info.ne[0], info.ne[1]
            tokens.part.kernels.mul_mat_id(
                stream,
                shared.weights[role],
                info.qtype,
                1,
                n_out,
                n_in,
                scratch.view(x, tokens.count * n_in * 4),
                False,
                ids,
                tokens.count,
                1,
                scratch.view(y, tokens.count * n_out * 4),
            )
            if role == UP:
                self._activation(
                    tokens.part, tokens.count * n_out, "shared_gate", "shared_up", "shared_act", stream, oai=False
                )
        out = scratch.view("shared_down", tokens.hidden.nbytes)
        if "gate_inp" in shared.weights:
            routing.shared_gate(
                tokens.part.kernels,
                stream,
                scratch.view("x", tokens.hidden.nbytes),
                shared.weights["gate_inp"],
                out,
                tokens.count,
                model.n_embd,
                model.n_embd,
            )

    def _gate_up(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        n_in, n_out, n_expert = info.ne[0], info.ne[1], info.ne[2]
        scratch, pairs = tokens.part.scratch(), tokens.count * self.model.top_k
        tokens.part.kernels.gate_up(
            stream,
            bindings[GATE],
            bindings[UP],
            info.qtype,
            n_expert,
            n_out,
            n_in,
            scratch.view("x", tokens.count * n_in * 4),
            tokens.ids,
            tokens.count,
            self.model.top_k,
            scratch.view("act", pairs * n_out * 4),
        )

    def _down(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        model, scratch = self.model, tokens.part.scratch()
        pairs = tokens.count * model.top_k
        route_weights = scratch.view("route_weights", pairs * 4)
        biases = tokens.part.extras[tokens.layer].expert_bias
        # Rows scaled as the kernel writes them, where it can and no bias is added after it.
        routed = tokens.part.kernels.uses_direct(info.qtype, info.ne[0]) and not (biases and DOWN in biases)
        self._mul_mat_id(stream, bindings[DOWN], info, tokens, "act", True, "down", route_weights if routed else None)
        self._add_expert_bias(stream, tokens, DOWN, "down", model.n_embd)
        shared = tokens.part.extras[tokens.layer].shared
        if shared is not None:
            self._shared_expert(stream, tokens, shared)
        tokens.part.kernels.combine(
            stream,
            scratch.view("down", pairs * model.n_embd * 4),
            None if routed else route_weights,
            None if shared is None else scratch.view("shared_down", tokens.hidden.nbytes),
            tokens.hidden,
            tokens.count,
            model.top_k,
            model.n_embd,
        )
        if tokens.send is not None:
            tokens.send.send(stream)

    def _mul_mat_id(
        self,
        stream: Stream,
        w: BufferView,
        info: TensorInfo,
        tokens: _Tokens,
        x: str,
        x_per_pair: bool,
        y: str,
        route_weights: BufferView | None = None,
    ) -> None:
        n_in, n_out, n_expert = info.ne[0], info.ne[1], info.ne[2]
        pairs = tokens.count * self.model.top_k
        scratch = tokens.part.scratch()
        x_rows = pairs if x_per_pair else tokens.count
        tokens.part.kernels.mul_mat_id(
            stream,
            w,
            info.qtype,
            n_expert,
            n_out,
            n_in,
            scratch.view(x, x_rows * n_in * 4),
            x_per_pair,
            tokens.ids,
            tokens.count,
            self.model.top_k,
            scratch.view(y, pairs * n_out * 4),
            route_weights=route_weights,
        )

    # -- outputs -------------------------------------------------------------------------------
    def poison_prefill_output(self, stream_of: Callable[[Device], Stream]) -> None:
        """Fill every device's prefill hidden state with OUTPUT_POISON on ``stream_of(device)``, and wait.

        Before a run whose output is hashed: a run that skips a ubatch, a layer's residual add or
        a crossing then leaves NaN there, not what an earlier run left. Waiting keeps the fill out
        of a timer started after it.
        """
        self._poison(stream_of, decode=False)

    def poison_decode_output(self, stream_of: Callable[[Device], Stream]) -> None:
        """The same for the rows every decode step writes (before the first of the steps hashed together)."""
        self._poison(stream_of, decode=True)

    def _poison(self, stream_of: Callable[[Device], Stream], *, decode: bool) -> None:
        nbytes = (self.batching.decode_steps if decode else self.batching.tokens) * self.model.n_embd * 4
        streams = []
        for i, part in enumerate(self._parts):
            rows, stream = (part.decode_hidden if decode else part.hidden), stream_of(part.device)
            stream.memset(rows, 0, nbytes, OUTPUT_POISON)
            # A later device reads an earlier one's rows, through host memory where they are not peers.
            if i < len(self._links) and self._links[i].bounce:
                stream.copy_d2h(self._links[i].bounce[int(decode)], 0, rows, 0, nbytes)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()

    def prefill_output(self) -> np.ndarray:
        """The final hidden state of every prompt token, float32 [tokens, n_embd]."""
        return (
            self._parts[-1]
            .hidden.read(0, self.batching.tokens * self.model.n_embd * 4)
            .view(np.float32)
            .reshape(self.batching.tokens, self.model.n_embd)
        )

    def decode_output(self) -> np.ndarray:
        """The final hidden state of every decode step, float32 [steps, n_embd]."""
        steps = self.batching.decode_steps
        return (
            self._parts[-1]
            .decode_hidden.read(0, steps * self.model.n_embd * 4)
            .view(np.float32)
            .reshape(steps, self.model.n_embd)
        )

    def close(self) -> None:
        """Free the device memory; work that uses it must be finished."""
        for closing in (*self._links, *self._parts):
            closing.close()
        self._links.clear()
        self._parts.clear()


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


def _check_uniform_layers(model: MoeModel) -> None:
    """The runner sizes routing and activations once per model: refuse layers of other widths."""
    widths = {(layer.n_expert, layer.n_ff) for layer in model.layers}
    if len(widths) > 1:
        shown = ", ".join(f"{n_expert} experts x {n_ff}" for n_expert, n_ff in sorted(widths))
        raise ModelError(
            f"{model.path}: MoE layers differ in expert count or width ({shown}); the prefill runner "
            "needs one expert shape for every MoE layer"
        )
