"""Prefill and decode of a GGUF MoE model through the scheduler, on one device or a layer split.

A runner computes the whole model (``transformer``: hparams.Transformer.read of the file) or,
for measuring the expert pipeline by itself, its MoE blocks alone around a weightless stand-in
(standin.py). Each MoE layer is four splits (three where gate and up fuse), in this order:

- ``router``: the whole model's block start (the token embeddings before the first block, the
  layer's attention added into the hidden state: blocks.py), then the norm before the FFN with the
  file's weights (the stand-in: a weightless RMS norm), then the architecture's routing (arch.py)
  with the layer's device-resident router into the routing ids and weights of these tokens: router
  logits (with gpt-oss's router bias), then router_select (gating, selection bias, groups, norm,
  scale; a softmax over the selected logits where that is exact);
- ``gate``: mul_mat_id over the layer's gate experts (+ per-expert biases where the file has them);
- ``up``: mul_mat_id over the up experts (+ biases), then SwiGLU (gpt-oss: its clamped form);
- ``down``: mul_mat_id over the down experts (one input row per (token, k) pair, + biases), the
  shared expert where the file has one (a dense FFN of device-resident weights, run as
  mul_mat_id over one expert, with qwen2moe's sigmoid gate), then one kernel (combine) for the
  routing-weighted sum of the top-k outputs, the shared expert's output and the residual add into the
  hidden state.

A leading dense layer (whole model) is one split of device-resident weights: attention and its
dense FFN. After the last layer, one ``output`` split runs the output norm and head into the
logits of every prompt token (``all_logits``) or of the last one.

Where the device's kernels decode the expert type straight into matrix fragments
(MoeKernels.uses_direct: Q4_0, Q4_K, Q6_K and MXFP4 on NVIDIA sm_80+), the down projection scales each row
by its routing weight as it writes it, so combine only adds the top-k outputs up; and, asked for with
``fuse_gate_up`` where the layer has plain SwiGLU and no expert biases, one ``gate_up`` split
reads both tensors and writes SwiGLU's output in one pass (the same bytes as the two splits).
A few pairs (decode) over experts already on the device take that split unasked, on the
matrix-vector kernels: one launch instead of two, no tensor staged.

Prefill is ONE plan over all ubatches, so the lookahead keeps copying across ubatch boundaries;
where one ubatch can be captured instead (``prefill_step_plan``, run by engine/prefill.py: one device,
no prefetch slot), the full ubatches replay it.
Ubatch-major (the default): each ubatch through every layer, then the next. Layer-major (whole
model): each layer's splits run every ubatch in turn (the router split attends ubatch by ubatch,
reading the keys and values the earlier ones wrote at that layer), so each layer's experts cross
the bus once per prompt; the activations the expert splits read are then held for the whole
prompt (``_Scratch.HELD``). Each (layer, token) has its own routing ids, in one run per layer, so
the stock path's ids read-back is right and the splits sharing them are adjacent. Activation
scratch is shared by all splits: they run in order on one compute stream. Decode runs one plan
per step of one token.

Inputs are the token ids set before a run (``set_prompt``, ``set_decode_token``), or for the
expert blocks alone deterministic embeddings from a seed, so a plan can be run again (warm-up,
then timed) with the same result.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._closing import Closing
from ..backends.base import BufferView, Device, DeviceBuffer, Stream, Usage
from ..errors import InvalidArgument
from ..ggml import padded_size
from ..kernels import MoeKernels, check_path, dense, layout, routing
from ..kernels.layout import MatrixPath
from ..kernels.routing import Activation
from ..model import ModelError, MoeLayer, MoeModel, TensorInfo
from ..scheduler import (
    Bindings,
    Input,
    MulMatId,
    Plan,
    Prediction,
    Split,
    bound_experts,
    expert_ids,
    is_prefill_scale,
)
from ..scheduler.source import HostSource
from . import standin
from .arch import FfnConfig, ffn_config
from .blocks import Blocks
from .hparams import Transformer
from .layersplit import Crossing, LayerSplit, Link
from .uploads import DeviceMemory, Uploads

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
    """Activation buffers shared by every split of a plan.

    ``rows`` tokens (one ubatch) for what a split uses and leaves; ``held_rows`` for what the
    expert splits of a layer read after its router split wrote it (the FFN input, the routing
    weights and the gate/up/act rows): a whole prompt where the prefill runs layer-major.
    """

    HELD = ("x", "route_weights", "gate", "up", "act")

    def __init__(self, device: Device, rows: int, held_rows: int, model: MoeModel, n_ff_shared: int = 0) -> None:
        pairs = rows * model.top_k
        held_pairs = held_rows * model.top_k
        sizes = {
            "logits": rows * model.n_expert * 4,
            "shared_gate": rows * n_ff_shared * 4,
            "shared_up": rows * n_ff_shared * 4,
            "shared_act": rows * n_ff_shared * 4,
            "shared_down": rows * model.n_embd * 4,
            "x": held_rows * model.n_embd * 4,
            "route_weights": held_pairs * 4,
            "gate": held_pairs * model.n_ff * 4,
            "up": held_pairs * model.n_ff * 4,
            "act": held_pairs * model.n_ff * 4,
            "down": pairs * model.n_embd * 4,
        }
        self.buffers: dict[str, DeviceBuffer] = {}
        try:
            for name, size in sizes.items():
                self.buffers[name] = device.alloc(max(size, 4), Usage.COMPUTE)
        except BaseException:
            self.close()
            raise

    def view(self, name: str, nbytes: int, offset: int = 0) -> BufferView:
        return self.buffers[name].view(offset, nbytes)

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()
        self.buffers.clear()


# _mul_mat_id's shared_x: gate rounds and groups the layer's expert input once (_PREPARE); up and down
# after it take what they can of that (_SHARE, MoeKernels.shared_direct).
_PREPARE = "prepare"
_SHARE = "share"


@dataclass(frozen=True)
class _Tokens:
    """The hidden rows of one ubatch (or decode token) in one layer, and where their routing lives."""

    part: _Part
    hidden: BufferView
    count: int
    ids: BufferView
    label: str
    layer: int
    first: int  # the position of the first token
    held: int = 0  # the first row of this ubatch in the scratch a layer's splits hold (layer-major: its first token)
    embed: BufferView | None = None  # stand-in embeddings copied into ``hidden`` before the first layer
    token_ids: BufferView | None = None  # int32 token ids embedded into ``hidden`` before the first layer
    positions: BufferView | None = None  # int32 positions of the tokens (whole model)
    kv_len: int = 0  # cache rows the attention may read (whole model)
    logits: BufferView | None = None  # where the head writes the logits of the last rows (whole model, last block)
    receive: Crossing | None = None  # rows arriving from the previous device before this layer
    send: Crossing | None = None  # rows leaving for the next device after this layer
    decode: bool = False  # a decode step's token: one group of one token, layer after layer

    def held_view(self, name: str, width: int) -> BufferView:
        """This ubatch's rows of held scratch ``name`` (``width`` floats per row of a token or pair)."""
        scratch = self.part.scratch()
        per_token = width * (self.part.model.top_k if name != "x" else 1)
        return scratch.view(name, self.count * per_token * 4, self.held * per_token * 4)


@dataclass(frozen=True)
class _TokenIO:
    """The whole model's token ids and positions in, logits out (logits on the last device only)."""

    token_ids: DeviceBuffer  # int32 [tokens]: the prompt
    positions: DeviceBuffer  # int32 [tokens]: 0..tokens-1
    decode_token_ids: DeviceBuffer  # int32 [steps]: each decode step's token
    decode_positions: DeviceBuffer  # int32 [steps]: tokens..tokens+steps-1
    current_token: DeviceBuffer  # int32 [1]: what a captured decode step reads (decode_step_in)
    current_position: DeviceBuffer
    ubatch_token_ids: DeviceBuffer  # int32 [ubatch]: what a captured prefill ubatch reads (prefill_step_in)
    ubatch_positions: DeviceBuffer  # int32 [ubatch]
    logits: DeviceBuffer | None  # float32 [rows, n_vocab]: every prompt token's, or the last one's
    decode_logits: DeviceBuffer | None  # float32 [steps, n_vocab]
    current_logits: DeviceBuffer | None  # float32 [n_vocab]: what a captured decode step writes


class _Part(Closing):
    """What one device of a layer split holds: its layers' routers and extras, activations, outputs,
    and for the whole model its blocks (attention, norms, KV cache, embeddings or head)."""

    def __init__(
        self,
        device: Device,
        model: MoeModel,
        batching: Batching,
        layers: Sequence[int],
        *,
        seed: int,
        first: bool,
        last: bool,
        matrix_path: MatrixPath | None,
        direct: bool = True,
        gemv: bool = True,
        whole: _Whole | None = None,
        blocks: Sequence[int] = (),
    ) -> None:
        self.device = device
        self.model = model
        self.batching = batching
        self.data = device.backend.host.holds_data
        self.position = {index: i for i, index in enumerate(layers)}  # layer index -> its place on this device
        self.kernels = MoeKernels(device, matrix_path, direct=direct, gemv=gemv)
        self._uploads = Uploads(device, model)
        self._scratch: _Scratch | None = None
        self.blocks: Blocks | None = None
        self.io: _TokenIO | None = None  # the whole model's tokens in and logits out
        try:
            self._allocate(seed, first, whole)
            if whole is not None:
                self._allocate_whole(whole, blocks, first, last)
        except BaseException:
            self.close()
            raise

    def _allocate(self, seed: int, first: bool, whole: _Whole | None) -> None:
        model, batching, uploads = self.model, self.batching, self._uploads
        row = model.n_embd * 4
        mine = [layer for layer in model.layers if layer.index in self.position]
        self.routers = {layer.index: uploads.floats(layer.router) for layer in mine}
        self.extras = {layer.index: self._layer_extras(layer.index) for layer in mine}
        n_ff_shared = max((e.shared.gate.ne[1] for e in self.extras.values() if e.shared), default=0)
        held_rows = batching.tokens if whole is not None and whole.layer_major else batching.ubatch_tokens
        self._scratch = _Scratch(self.device, batching.ubatch_tokens, held_rows, model, n_ff_shared)
        rows = batching.ubatch_tokens
        self.zero_ids = uploads.filled(rows * 4, Usage.COMPUTE, functools.partial(np.zeros, rows, np.int32))
        routing.reserve_logits_select(self.kernels)  # before any capture, which may not allocate
        dense.reserve_down_combine_rms_norm(self.kernels, layout.GEMV_MAX_PAIRS)
        tokens, steps = batching.tokens, batching.decode_steps
        self.embed = self.decode_embed = None
        if first and whole is None:
            self.embed = uploads.filled(
                tokens * row, Usage.COMPUTE, functools.partial(embeddings, seed, 0, tokens, model.n_embd)
            )
            self.decode_embed = uploads.filled(
                steps * row, Usage.COMPUTE, functools.partial(embeddings, seed, tokens, steps, model.n_embd)
            )
        self.hidden = uploads.alloc(tokens * row)
        self.ids = uploads.alloc(len(mine) * tokens * model.top_k * 4)  # [layer][token][k]
        self.decode_hidden = uploads.alloc(steps * row)
        self.decode_current = uploads.alloc(row)  # the token of a captured decode step (MoeRunner.decode_step_plan)
        self.decode_ids = uploads.alloc(len(mine) * model.top_k * 4)
        # The decode lookahead: each layer's predicted experts, and what predicting them writes besides.
        self.decode_predicted = uploads.alloc(len(mine) * model.top_k * 4)
        self.decode_ahead_x = uploads.alloc(row)
        self.decode_ahead_weights = uploads.alloc(model.top_k * 4)
        self.ubatch_current: DeviceBuffer | None = None  # whole model: _allocate_whole

    def _allocate_whole(self, whole: _Whole, blocks: Sequence[int], first: bool, last: bool) -> None:
        """Token ids and positions, the blocks around the MoE layers, and on the last device the logits."""
        batching, uploads = self.batching, self._uploads
        tokens, steps = batching.tokens, batching.decode_steps
        n_vocab = whole.spec.n_vocab * 4
        # The hidden rows of a captured prefill ubatch (MoeRunner.prefill_step_plan).
        self.ubatch_current = uploads.alloc(batching.ubatch_tokens * self.model.n_embd * 4)
        self.io = _TokenIO(
            token_ids=uploads.alloc(tokens * 4),
            positions=uploads.filled(tokens * 4, Usage.COMPUTE, lambda: np.arange(tokens, dtype=np.int32)),
            decode_token_ids=uploads.alloc(steps * 4),
            decode_positions=uploads.filled(
                steps * 4, Usage.COMPUTE, lambda: np.arange(tokens, tokens + steps, dtype=np.int32)
            ),
            current_token=uploads.alloc(4),
            current_position=uploads.alloc(4),
            ubatch_token_ids=uploads.alloc(batching.ubatch_tokens * 4),
            ubatch_positions=uploads.alloc(batching.ubatch_tokens * 4),
            logits=uploads.alloc(whole.logit_rows(tokens) * n_vocab) if last else None,
            decode_logits=uploads.alloc(steps * n_vocab) if last else None,
            current_logits=uploads.alloc(n_vocab) if last else None,
        )
        self.blocks = Blocks(
            self.device,
            self.model,
            whole.spec,
            self.kernels,
            blocks,
            rows=batching.ubatch_tokens,
            n_ctx=whole.n_ctx,
            first=first,
            last=last,
        )

    def _layer_extras(self, index: int) -> _LayerExtras:
        def find(name: str) -> TensorInfo | None:
            return self.model.optional_tensor(f"blk.{index}.{name}")

        def resident(name: str) -> BufferView | None:
            info = find(name)
            return None if info is None else self._uploads.resident(info)

        biases = {role: resident(f"ffn_{role}_exps.bias") for role in (GATE, UP, DOWN)}
        expert_bias = {r: b for r, b in biases.items() if b is not None}
        shared = None
        gate, up, down = (find(f"ffn_{role}_shexp.weight") for role in (GATE, UP, DOWN))
        if gate is not None and up is not None and down is not None:
            weights = {role: self._uploads.resident(info) for role, info in ((GATE, gate), (UP, up), (DOWN, down))}
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
        """What this part holds on its device, the kernels' scratch (grown by the runs so far) included."""
        scratch = self._scratch.buffers.values() if self._scratch is not None else ()
        blocks = self.blocks.device_bytes if self.blocks is not None else 0
        held = self._uploads.device_bytes + sum(buf.alloc_size for buf in scratch) + blocks
        return held + self.kernels.scratch_bytes

    def device_memory(self) -> DeviceMemory:
        """``device_bytes`` by what it holds."""
        weights = self._uploads.weight_bytes + (self.blocks.weight_bytes if self.blocks is not None else 0)
        kv = self.blocks.kv_cache_bytes if self.blocks is not None else 0
        return DeviceMemory(weights=weights, kv_cache=kv, activations=self.device_bytes - weights - kv)

    def scratch(self) -> _Scratch:
        if self._scratch is None:
            raise InvalidArgument("the runner is closed", call="MoeRunner")
        return self._scratch

    def close(self) -> None:
        if self.blocks is not None:
            self.blocks.close()
            self.blocks = None
        self.kernels.close()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        self._uploads.close()


@dataclass(frozen=True)
class _Whole:
    """How a runner runs the whole model rather than the expert blocks alone."""

    spec: Transformer
    n_ctx: int
    layer_major: bool
    all_logits: bool  # logits of every prompt token (perplexity, checks), or of the last one only

    def logit_rows(self, tokens: int) -> int:
        return tokens if self.all_logits else 1


class MoeRunner(Closing):
    """One model's layers on one device, or split over several: routers, activations, outputs.

    With several devices the layers are split in order (``LayerSplit``): each device holds its
    layers' routers, its own activations and routing, and runs its splits on its own compute
    stream; the hidden state crosses between devices once per ubatch (layersplit.py).

    Expert weights are not owned here: each plan takes them as an ExpertData mapping, so the
    same runner serves every host memory mode and the device-resident (compute-only) case.
    Device-resident experts must be on their layer's device (``device_of``).

    With ``transformer`` (hparams.Transformer.read of the model) the runner computes the whole
    model: token ids in (``set_prompt``, ``set_decode_token``), logits out (``prompt_logits``,
    ``decode_logits``). Without it, the expert blocks alone around a weightless stand-in
    (standin.py), for measuring the expert pipeline by itself.
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
        gemv: bool = True,
        transformer: Transformer | None = None,
        n_ctx: int | None = None,
        layer_major: bool = False,
        all_logits: bool = False,
        decode_lookahead: int | None = None,
    ) -> None:
        self.devices: tuple[Device, ...] = (devices,) if isinstance(devices, Device) else tuple(devices)
        # Decode plans name each streamed layer's predicted experts (Prediction): the first this many its
        # router ranks on the FFN input of the MoE layer before it (the hidden state moves little in one
        # layer), predicted in that layer's router split and copied once its last expert split is
        # launched. None: half of top_k; 0: none.
        self.decode_lookahead = lookahead_experts(model, decode_lookahead)
        # direct: whether the MMA path takes direct.cu's kernels where they apply (MoeKernels.direct);
        # gemv: whether a few pairs take the matrix-vector kernels (MoeKernels.gemv).
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
        self.whole = None if transformer is None else _whole(transformer, batching, n_ctx, layer_major, all_logits)
        if layer_major and transformer is None:
            raise InvalidArgument("layer-major prefill needs the whole model (attention decides the order)")
        self.layer_major = layer_major
        self._parts: list[_Part] = []
        self._links: list[Link] = []
        try:
            blocks = self._blocks_by_device()
            for i, device in enumerate(self.devices):
                self._parts.append(
                    _Part(
                        device,
                        model,
                        batching,
                        self.layer_split.layers[device],
                        seed=seed,
                        first=i == 0,
                        last=i == len(self.devices) - 1,
                        matrix_path=matrix_path,
                        direct=direct,
                        gemv=gemv,
                        whole=self.whole,
                        blocks=blocks[i],
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

    def _blocks_by_device(self) -> list[list[int]]:
        """The blocks (MoE and dense) each device computes: a dense block goes with the next MoE layer."""
        found: list[list[int]] = [[] for _ in self.devices]
        if self.whole is None:
            return found
        moe = {layer.index: self.devices.index(self.layer_split.device_of(layer.index)) for layer in self.model.layers}
        n_blocks = self.whole.spec.n_layer
        for block in range(n_blocks):
            later = [moe[i] for i in range(block, n_blocks) if i in moe]
            if block not in moe and any(i in moe for i in range(block)):
                raise ModelError(
                    f"{self.model.path}: block {block} has no experts but follows MoE layers; only leading dense "
                    "layers are supported"
                )
            found[later[0] if later else len(self.devices) - 1].append(block)
        return found

    @property
    def experts_only(self) -> bool:
        """Whether the runner computes the expert blocks alone (around the stand-in), not the whole model."""
        return self.whole is None

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
        """Device memory this runner holds on all its devices (weights but the experts, KV cache, activations)."""
        return sum(part.device_bytes for part in self._parts)

    def device_bytes_on(self, device: Device) -> int:
        """Device memory this runner holds on ``device``."""
        return sum(part.device_bytes for part in self._parts if part.device is device)

    def device_memory(self) -> DeviceMemory:
        """What this runner holds on all its devices, by kind (``DeviceMemory``)."""
        return sum((part.device_memory() for part in self._parts), DeviceMemory())

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the F16 KV cache on all devices (0 for the expert blocks alone)."""
        return sum(part.blocks.kv_cache_bytes for part in self._parts if part.blocks is not None)

    # -- tokens in ------------------------------------------------------------------------------
    def set_prompt(self, tokens: Sequence[int] | np.ndarray) -> None:
        """The prompt's token ids, which the next prefill plan embeds (whole model only)."""
        ids = self._token_array(tokens, self.batching.tokens, "prompt")
        self._io(self._parts[0]).token_ids.write(ids)

    def set_decode_token(self, step: int, token: int) -> None:
        """The token decode step ``step`` embeds (whole model only): the one sampled after the step before."""
        self._check_step(step)
        ids = self._token_array([token], 1, "decode token")
        self._io(self._parts[0]).decode_token_ids.write(ids, offset=step * 4)

    def _token_array(self, tokens: Sequence[int] | np.ndarray, count: int, what: str) -> np.ndarray:
        if self.whole is None:
            raise InvalidArgument(f"a {what} is for the whole model; this runner runs the expert blocks alone")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size != count:
            raise InvalidArgument(f"the {what} has {ids.size} tokens; the runner was sized for {count}")
        n_vocab = self.whole.spec.n_vocab
        if ids.size and not 0 <= ids.min() <= ids.max() < n_vocab:
            raise InvalidArgument(f"the {what} holds token ids outside the vocabulary 0..{n_vocab - 1}")
        return ids.astype(np.int32)

    # -- plans ---------------------------------------------------------------------------------
    def prefill_plan(self, experts: ExpertData, ubatches: Sequence[int] | None = None) -> Plan:
        """Every layer of the given ubatches (default: all, in order) as one plan.

        Ubatch-major (the default): each ubatch through every layer, then the next. Layer-major
        (``layer_major``): every ubatch through layer l, then layer l + 1, so each layer's experts
        are read once per prompt; every token's arithmetic is the same either way.
        """
        chosen = list(range(len(self.batching.ubatches())) if ubatches is None else ubatches)
        self._check_ubatches(chosen, len(self.batching.ubatches()))
        return self._prefill_plan(experts, chosen)

    def ubatch_plan(self, experts: ExpertData, u: int) -> Plan:
        """Every layer of ubatch ``u`` alone, its logits included, ubatch-major: for a caller that has
        run ubatches 0..u-1 already (``Prefill``, which replays some of them)."""
        if self.layer_major or not 0 <= u < len(self.batching.ubatches()):
            raise InvalidArgument(f"ubatch_plan runs one ubatch of 0..{len(self.batching.ubatches()) - 1} "
                                  f"ubatch-major; got {u}{' (layer-major)' if self.layer_major else ''}")  # fmt: skip
        return self._prefill_plan(experts, [u])

    def _prefill_plan(self, experts: ExpertData, chosen: Sequence[int]) -> Plan:
        all_ubatches = self.batching.ubatches()
        row = self.model.n_embd * 4
        splits: list[Split] = []

        def group(block: int, us: Sequence[int]) -> list[_Tokens]:
            return [self._prompt_tokens(block, u, all_ubatches[u], row) for u in us]

        if self.layer_major:
            for block in self._blocks():
                splits += self._block_splits(block, group(block, chosen), experts)
        else:
            for u in chosen:
                for block in self._blocks():
                    splits += self._block_splits(block, group(block, [u]), experts)
        return Plan.of(splits)

    def prefill_step_plan(self, experts: ExpertData) -> Plan:
        """Every block for one full ubatch (``batching.ubatch_tokens`` tokens) on the runner's own
        rows, without the output head: the same plan for every such ubatch of the prompt.

        What ``Scheduler.capture`` captures once and replays per ubatch (``Prefill``):
        ``prefill_step_in`` puts ubatch ``u``'s token ids and positions where it reads them,
        ``prefill_step_out`` copies its hidden rows to where ``prefill_plan`` leaves them, bit for
        bit, and ``head_plan`` writes the ubatch's logits where it has any. The attention reads
        the cache rows up to each token's position, so one bound (the context) serves every
        ubatch. The routing ids of every such ubatch go to the first ubatch's place. Whole model,
        ubatch-major, on one device.
        """
        part = self._step_part("prefill step")
        if self.layer_major:
            raise InvalidArgument("a prefill step plan runs one ubatch through every layer: ubatch-major only")
        io = self._io(part)
        assert self.whole is not None  # as _io says
        count = self.batching.ubatch_tokens
        rows = count * self.model.n_embd * 4
        assert part.ubatch_current is not None
        splits: list[Split] = []
        for block in self._blocks():
            place = part.position.get(block)
            ids_at = (place or 0) * self.batching.tokens * self.model.top_k * 4
            tokens = _Tokens(
                part=part,
                hidden=part.ubatch_current.view(0, rows),
                count=count,
                ids=part.ids.view(ids_at, count * self.model.top_k * 4),
                label="ubatch",
                layer=block,
                first=0,
                token_ids=io.ubatch_token_ids.view(0, count * 4) if block == 0 else None,
                positions=io.ubatch_positions.view(0, count * 4),
                kv_len=self.whole.n_ctx,  # a bound: the attention reads the rows up to each position
            )
            splits += self._block_splits(block, [tokens], experts, head=False)
        return Plan.of(splits)

    def prefill_step_in(self, stream: Stream, u: int) -> None:
        """Enqueue the copy of ubatch ``u``'s token ids and positions into what prefill_step_plan reads."""
        part, (first, count) = self._step_part("prefill step"), self._full_ubatch(u)
        io = self._io(part)
        stream.copy_d2d(io.ubatch_token_ids, 0, io.token_ids, first * 4, count * 4)
        stream.copy_d2d(io.ubatch_positions, 0, io.positions, first * 4, count * 4)

    def prefill_step_out(self, stream: Stream, u: int) -> None:
        """Enqueue the copy of prefill_step_plan's hidden rows to ubatch ``u``'s place in prefill_output."""
        part, (first, count) = self._step_part("prefill step"), self._full_ubatch(u)
        row = self.model.n_embd * 4
        assert part.ubatch_current is not None
        stream.copy_d2d(part.hidden, first * row, part.ubatch_current, 0, count * row)

    def head_plan(self, u: int) -> Plan | None:
        """The output head of ubatch ``u`` (after prefill_step_out put its rows in place): its logits
        where it has any (every ubatch's with ``all_logits``, else the last one's); None elsewhere."""
        part = self._step_part("prefill step")
        tokens = self._prompt_tokens(self._last_block, u, self.batching.ubatches()[u], self.model.n_embd * 4)
        if tokens.logits is None:
            return None
        return Plan.of([Split(f"output.ub{u}", part.device, (), functools.partial(self._output, [tokens]))])

    def full_ubatches(self) -> list[int]:
        """The ubatches of ``batching.ubatch_tokens`` tokens: the ones prefill_step_plan runs."""
        return [u for u, (_, count) in enumerate(self.batching.ubatches()) if count == self.batching.ubatch_tokens]

    def _full_ubatch(self, u: int) -> tuple[int, int]:
        if u not in self.full_ubatches():
            raise InvalidArgument(f"ubatch {u} is not one of the full ubatches {self.full_ubatches()}")
        return self.batching.ubatches()[u]

    def _step_part(self, what: str) -> _Part:
        if len(self._parts) != 1:
            raise InvalidArgument(
                f"a {what} plan runs on one device; this runner's layers span {len(self._parts)}",
                hint="run the plan of every step instead",
            )
        return self._parts[0]

    def _check_ubatches(self, chosen: Sequence[int], count: int) -> None:
        """Ubatches a plan may run: in range; for the whole model a run from the first (attention reads
        the keys the earlier ones wrote); layer-major, ascending and adjacent (their routing ids in one run)."""
        if not chosen or any(not 0 <= u < count for u in chosen):
            raise InvalidArgument(f"ubatches must be some of 0..{count - 1}; got {list(chosen)}")
        if self.whole is not None and list(chosen) != list(range(len(chosen))):
            raise InvalidArgument(
                f"the whole model runs ubatches from the first, in order (0..k); got {list(chosen)}",
                hint="attention reads the keys and values every earlier ubatch wrote",
            )

    def _blocks(self) -> list[int]:
        """The blocks a plan runs: every one for the whole model, the MoE layers for the expert blocks alone."""
        if self.whole is not None:
            return list(range(self.whole.spec.n_layer))
        return [layer.index for layer in self.model.layers]

    @property
    def _last_block(self) -> int:
        return self._blocks()[-1]

    def _prompt_tokens(self, block: int, u: int, ubatch: tuple[int, int], row: int) -> _Tokens:
        first, count = ubatch
        part = self._part_of_block(block)
        rows = (first * row, count * row)
        place = part.position.get(block)
        top_k = self.model.top_k
        ids = part.ids.view(((place or 0) * self.batching.tokens + first) * top_k * 4, count * top_k * 4)
        whole: dict[str, Any] = {}
        if self.whole is not None:
            io = self._io(part)
            whole = {
                "token_ids": io.token_ids.view(first * 4, count * 4) if block == 0 else None,
                "positions": io.positions.view(first * 4, count * 4),
                "kv_len": first + count,
                "logits": self._prompt_logits_view(part, first, count) if block == self._last_block else None,
            }
        return _Tokens(
            part=part,
            hidden=part.hidden.view(*rows),
            count=count,
            ids=ids,
            label=f"ub{u}",
            layer=block,
            first=first,
            held=first if self.layer_major else 0,
            embed=part.embed.view(*rows) if part.embed is not None and place == 0 else None,
            **whole,
            **(self._crossings(part, place, rows, decode=False) if place is not None else {}),
        )

    def _prompt_logits_view(self, part: _Part, first: int, count: int) -> BufferView | None:
        """Where the head writes this ubatch's logits: all its rows' (``all_logits``), or only the prompt's last."""
        logits = self._io(part).logits
        assert self.whole is not None and logits is not None
        n_vocab = self.whole.spec.n_vocab * 4
        if self.whole.all_logits:
            return logits.view(first * n_vocab, count * n_vocab)
        return logits.view(0, n_vocab) if first + count == self.batching.tokens else None

    def decode_plan(self, experts: ExpertData, step: int) -> Plan:
        """Every layer for decode step ``step`` (one token)."""
        self._check_step(step)
        row = self.model.n_embd * 4
        splits: list[Split] = []
        position = self.batching.tokens + step
        for block in self._blocks():
            part = self._part_of_block(block)
            place = part.position.get(block)
            whole: dict[str, Any] = {}
            if self.whole is not None:
                io = self._io(part)
                whole = {
                    "token_ids": io.decode_token_ids.view(step * 4, 4) if block == 0 else None,
                    "positions": io.decode_positions.view(step * 4, 4),
                    "kv_len": position + 1,
                    "logits": self._decode_logits_view(part, step) if block == self._last_block else None,
                }
            tokens = _Tokens(
                part=part,
                hidden=part.decode_hidden.view(step * row, row),
                count=1,
                ids=self._decode_ids(part, place),
                label=f"step{step}",
                layer=block,
                first=position,
                embed=part.decode_embed.view(step * row, row) if part.decode_embed is not None and place == 0 else None,
                decode=True,
                **whole,
                **(self._crossings(part, place, (step * row, row), decode=True) if place is not None else {}),
            )
            splits += self._block_splits(block, [tokens], experts)
        return Plan.of(splits)

    def decode_step_plan(self, experts: ExpertData) -> Plan:
        """Every layer for one decode token on the runner's own row: the same plan for every step.

        What ``Scheduler.capture`` captures once and replays per step: ``decode_step_in`` puts
        step ``k``'s input into that row first, ``decode_step_out`` copies the layers' result to
        where ``decode_plan(experts, k)`` leaves it, bit for bit. On one device only.
        """
        part = self._step_part("decode step")
        row = self.model.n_embd * 4
        splits: list[Split] = []
        for block in self._blocks():
            whole: dict[str, Any] = {}
            if self.whole is not None:
                io = self._io(part)
                n_vocab = self.whole.spec.n_vocab * 4
                last = block == self._last_block
                whole = {
                    "token_ids": io.current_token.view(0, 4) if block == 0 else None,
                    "positions": io.current_position.view(0, 4),
                    "kv_len": self.whole.n_ctx,  # a bound: the attention reads the rows up to the position
                    "logits": io.current_logits.view(0, n_vocab) if io.current_logits is not None and last else None,
                }
            tokens = _Tokens(
                part=part,
                hidden=part.decode_current.view(0, row),
                count=1,
                ids=self._decode_ids(part, part.position.get(block)),
                label="step",
                layer=block,
                first=self.batching.tokens,
                decode=True,
                **whole,
            )
            splits += self._block_splits(block, [tokens], experts)
        return Plan.of(splits)

    def _decode_logits_view(self, part: _Part, step: int) -> BufferView | None:
        logits = self._io(part).decode_logits
        if self.whole is None or logits is None:
            return None
        n_vocab = self.whole.spec.n_vocab * 4
        return logits.view(step * n_vocab, n_vocab)

    @staticmethod
    def _io(part: _Part) -> _TokenIO:
        if part.io is None:
            raise InvalidArgument("tokens and logits are for the whole model; this runner runs the expert blocks alone")
        return part.io

    def _decode_ids(self, part: _Part, place: int | None) -> BufferView:
        ids_bytes = self.model.top_k * 4
        return part.decode_ids.view((place or 0) * ids_bytes, ids_bytes)

    def decode_step_in(self, stream: Stream, step: int) -> None:
        """Enqueue the copy of step ``step``'s input (embedding, or token and position) into what
        decode_step_plan reads."""
        part, row = self._one_part(step), self.model.n_embd * 4
        if self.whole is not None:
            io = self._io(part)
            stream.copy_d2d(io.current_token, 0, io.decode_token_ids, step * 4, 4)
            stream.copy_d2d(io.current_position, 0, io.decode_positions, step * 4, 4)
            return
        assert part.decode_embed is not None
        stream.copy_d2d(part.decode_current, 0, part.decode_embed, step * row, row)

    def decode_step_out(self, stream: Stream, step: int) -> None:
        """Enqueue the copy of decode_step_plan's result to step ``step``'s place in decode_output
        (and decode_logits)."""
        part, row = self._one_part(step), self.model.n_embd * 4
        stream.copy_d2d(part.decode_hidden, step * row, part.decode_current, 0, row)
        if self.whole is not None:
            n_vocab = self.whole.spec.n_vocab * 4
            io = self._io(part)
            assert io.decode_logits is not None and io.current_logits is not None
            stream.copy_d2d(io.decode_logits, step * n_vocab, io.current_logits, 0, n_vocab)

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.batching.decode_steps:
            raise InvalidArgument(f"decode step {step} is outside 0..{self.batching.decode_steps - 1}")

    def _one_part(self, step: int) -> _Part:
        self._check_step(step)
        return self._step_part("decode step")

    def _part_of_block(self, block: int) -> _Part:
        part = self._part_of.get(block)
        if part is not None:
            return part
        return next(p for p in self._parts if p.blocks is not None and block in p.blocks.attention)

    def _crossings(self, part: _Part, place: int, rows: tuple[int, int], *, decode: bool) -> dict[str, Any]:
        """The crossing into this layer (first on a later device) and out of it (last on an earlier one)."""

        def hidden(p: _Part) -> BufferView:
            return (p.decode_hidden if decode else p.hidden).view(*rows)

        i = self._parts.index(part)
        found: dict[str, Any] = {}
        if place == 0 and i > 0:
            found["receive"] = self._links[i - 1].crossing(hidden(self._parts[i - 1]), hidden(part), int(decode))
        if place == len(part.position) - 1 and i < len(self._parts) - 1:
            found["send"] = self._links[i].crossing(hidden(part), hidden(self._parts[i + 1]), int(decode))
        return found

    def _block_splits(
        self, block: int, group: Sequence[_Tokens], experts: ExpertData, *, head: bool = True
    ) -> list[Split]:
        """The splits of block ``block`` for ``group`` (ubatches in order), the output head after the
        last (unless ``head`` is False: ``prefill_step_plan``'s callers run it on their own)."""
        layer = next((layer for layer in self.model.layers if layer.index == block), None)
        part = group[0].part
        if layer is None:  # a leading dense layer (whole model only)
            name = f"dense.L{block}.{group[0].label}"
            splits = [Split(name, part.device, (), functools.partial(self._dense_block, group))]
        else:
            splits = self._layer_splits(layer, group, experts)
        if head and self.whole is not None and block == self._last_block:
            splits.append(Split(f"output.{group[0].label}", part.device, (), functools.partial(self._output, group)))
        return splits

    def _layer_splits(self, layer: MoeLayer, group: Sequence[_Tokens], experts: ExpertData) -> list[Split]:
        """The layer's four splits for ``group`` (three where gate and up fuse)."""
        model, part = self.model, group[0].part
        name = _layer_name(layer.index, group)
        count = sum(t.count for t in group)
        n_ids = count * model.top_k
        ids = BufferView(group[0].ids.buffer, group[0].ids.offset, n_ids * 4)  # the group's ids lie in one run
        stand_in_ids = None if self.data else stand_in_routing(self.seed, group[0].first, count, layer.index, model)
        router = Input(ROUTER, layer.router.nbytes, device_data=part.routers[layer.index])

        def split(roles: tuple[str, ...], compute: Callable[[_Tokens, TensorInfo, Stream, Bindings], None]) -> Split:
            infos = [getattr(layer, role) for role in roles]

            def run(stream: Stream, bindings: Bindings) -> None:
                for tokens in group:
                    compute(tokens, infos[0], stream, _ubatch_bindings(bindings, roles, ids, tokens.ids))

            return Split(
                f"{'_'.join(roles)}.{name}",
                part.device,
                tuple(_expert_input(role, info, experts[info.name]) for role, info in zip(roles, infos, strict=True)),
                run,
                MulMatId(ids, n_ids, model.n_expert, roles, stand_in_ids, predicted, packed=True),
            )

        ahead = self._predicted_by(layer, group, experts)

        def route(stream: Stream, bindings: Bindings) -> None:
            for tokens in group:
                self._route(tokens, stream, bindings)
                if ahead is not None:
                    self._predict(tokens, ahead, stream)

        predicted = None
        before = self._predicted_from(layer, group, experts)
        if before is not None:
            ids_bytes = model.top_k * 4
            place = part.position[layer.index]
            ranked = part.decode_predicted.view(place * ids_bytes, ids_bytes)  # best first
            # Copied once the layer before has read its own experts: its missed ones go first on the link.
            predicted = Prediction(ranked, self.decode_lookahead, f"{DOWN}.{_layer_name(before, group)}")

        first_splits = (
            [split((GATE, UP), self._gate_up)]
            if self._fuses_gate_up(part, layer) or self._gemv_fuses_gate_up(part, layer, experts, n_ids)
            else [
                split((GATE,), self._gate),
                split((UP,), self._up),
            ]
        )
        return [
            Split(f"router.{name}", part.device, (router,), route),
            *first_splits,
            split((DOWN,), self._down),
        ]

    def _predicted_by(self, layer: MoeLayer, group: Sequence[_Tokens], experts: ExpertData) -> MoeLayer | None:
        """The MoE layer whose experts ``layer``'s router split predicts for ``group``: the next one,
        in a decode step of the whole model, on the same device, its experts streamed from the host."""
        tokens = group[0]
        if not (self.decode_lookahead and tokens.decode and tokens.part.blocks is not None):
            return None
        layers = self.model.layers
        i = layers.index(layer)
        if i + 1 == len(layers):
            return None
        after = layers[i + 1]
        streamed = not any(isinstance(experts[t.name], BufferView) for t in after.experts)
        same_part = self._part_of.get(layer.index) is self._part_of.get(after.index) is tokens.part
        return after if streamed and same_part else None

    def _predicted_from(self, layer: MoeLayer, group: Sequence[_Tokens], experts: ExpertData) -> int | None:
        """The index of the layer whose router split predicts ``layer``'s experts (``_predicted_by``)."""
        layers = self.model.layers
        i = layers.index(layer)
        if i == 0 or self._predicted_by(layers[i - 1], group, experts) is not layer:
            return None
        return layers[i - 1].index

    def _predict(self, tokens: _Tokens, after: MoeLayer, stream: Stream) -> None:
        """``after``'s router on this layer's FFN input, normed with ``after``'s weights: the experts it
        will likely choose, into its predicted ids (the hidden state moves little in one layer)."""
        model, part = self.model, tokens.part
        assert part.blocks is not None
        x = part.decode_ahead_x.view()
        part.blocks.ffn_input(stream, after.index, tokens.hidden, 1, x)
        ids = part.decode_predicted.view(part.position[after.index] * model.top_k * 4, model.top_k * 4)
        # The weights to a buffer of their own: this layer's experts have yet to read its own.
        out = (ids, part.decode_ahead_weights.view())
        self._select(part, after.index, x, part.routers[after.index], 1, out, stream)

    @property
    def lookahead_inputs(self) -> int:
        """The expert tensors of a streamed layer its decode steps copy ahead (0: none): what each of
        the scheduler's two lookahead scratch sets holds (``device_footprint``)."""
        if not (self.decode_lookahead and self.whole is not None and self.batching.decode_steps):
            return 0
        return len(self.model.layers[0].experts)

    @property
    def lookahead_rows(self) -> int:
        """The experts each lookahead scratch holds where its decode copies are packed (the
        predicted and the chosen ones of a one-token step; 0: whole tensors)."""
        rows = self.decode_lookahead + self.model.top_k
        return rows if self.lookahead_inputs and rows < self.model.n_expert else 0

    def fuses_gate_up(self) -> bool:
        """Whether any layer runs gate, up and SwiGLU as one split (see the module's docstring)."""
        return any(self._fuses_gate_up(self._part_of[layer.index], layer) for layer in self.model.layers)

    def _fuses_gate_up(self, part: _Part, layer: MoeLayer) -> bool:
        """Whether gate, up and SwiGLU of ``layer`` run as one pass (MoeKernels.gate_up) on ``part``."""
        gate = layer.gate
        return (
            self.fuse_gate_up
            and self._gate_up_fusable(part, layer)
            and part.kernels.uses_direct(gate.qtype, gate.ne[0])
        )

    def _gemv_fuses_gate_up(self, part: _Part, layer: MoeLayer, experts: ExpertData, n_pairs: int) -> bool:
        """Whether gate, up and SwiGLU of ``layer`` for ``n_pairs`` pairs run as one matrix-vector launch
        (MoeKernels.gate_up): a few pairs (decode) over experts already on the device, so no split
        stages two tensors at once."""
        return (
            part.kernels.uses_gemv(n_pairs)
            and isinstance(experts[layer.gate.name], BufferView)
            and isinstance(experts[layer.up.name], BufferView)
            and self._gate_up_fusable(part, layer)
        )

    def _gate_up_fusable(self, part: _Part, layer: MoeLayer) -> bool:
        """Whether ``layer``'s gate and up can be one gate_up call at all: the same type and shape, plain
        SwiGLU, no expert biases."""
        gate, up = layer.gate, layer.up
        return (
            gate.qtype == up.qtype
            and gate.ne == up.ne
            and self.ffn.ffn.activation is Activation.SILU
            and part.extras[layer.index].expert_bias is None
        )

    # -- what each split enqueues ------------------------------------------------------------
    def _enter_block(self, tokens: _Tokens, stream: Stream, ffn_x: BufferView | None = None) -> None:
        """The hidden rows ready for this block: embedded (first block), received (first on a later
        device), then, for the whole model, the block's attention added in (and, given ``ffn_x``, the
        FFN's norm of the result written there)."""
        if tokens.embed is not None:
            stream.copy_d2d(
                tokens.hidden.buffer,
                tokens.hidden.offset,
                tokens.embed.buffer,
                tokens.embed.offset,
                tokens.hidden.nbytes,
            )
        blocks = tokens.part.blocks
        if blocks is not None and tokens.token_ids is not None:
            blocks.embed(stream, tokens.token_ids, tokens.count, tokens.hidden)
        if tokens.receive is not None:
            tokens.receive.receive(stream)
        if blocks is not None:
            assert tokens.positions is not None
            normed = self._normed_before(tokens)
            blocks.attend(
                stream, tokens.layer, tokens.hidden, tokens.count, tokens.positions, tokens.kv_len, ffn_x, normed
            )

    def _dense_block(self, group: Sequence[_Tokens], stream: Stream, bindings: Bindings) -> None:
        for tokens in group:
            self._enter_block(tokens, stream)
            blocks = tokens.part.blocks
            assert blocks is not None
            blocks.run_dense_ffn(stream, tokens.layer, tokens.hidden, tokens.count)

    def _output(self, group: Sequence[_Tokens], stream: Stream, bindings: Bindings) -> None:
        """The logits of the rows each ubatch asks for: all of them, or its last (see ``_prompt_logits_view``)."""
        row = self.model.n_embd * 4
        assert self.whole is not None
        n_vocab = self.whole.spec.n_vocab * 4
        for tokens in group:
            blocks = tokens.part.blocks
            if tokens.logits is None or blocks is None:
                continue
            rows = tokens.logits.nbytes // n_vocab
            start = tokens.hidden.offset + tokens.hidden.nbytes - rows * row
            normed = rows == tokens.count and self._combine_norm(tokens) is not None
            blocks.head(stream, BufferView(tokens.hidden.buffer, start, rows * row), rows, tokens.logits, normed)

    def _route(self, tokens: _Tokens, stream: Stream, bindings: Bindings) -> None:
        model = self.model
        x = tokens.held_view("x", model.n_embd)
        self._enter_block(tokens, stream, ffn_x=x)  # attention's residual add also writes the FFN's norm
        if tokens.part.blocks is None:
            standin.rms_norm(tokens.part.kernels, stream, tokens.hidden, x, tokens.count, model.n_embd)
        route_weights = tokens.held_view("route_weights", 1)
        self._select(tokens.part, tokens.layer, x, bindings[ROUTER], tokens.count, (tokens.ids, route_weights), stream)

    def _select(
        self,
        part: _Part,
        layer: int,
        x: BufferView,
        router: BufferView,
        count: int,
        out: tuple[BufferView, BufferView],
        stream: Stream,
    ) -> None:
        """Layer ``layer``'s routing of ``count`` rows of ``x`` (normed) with ``router``: each row's
        top-k expert ids and their weights into ``out``."""
        model, extras = self.model, part.extras[layer]
        selection = self.ffn.routing
        if selection.is_softmax_topk and extras.router_bias is None and extras.selection_bias is None:
            selection = routing.SELECTED_SOFTMAX  # the same experts and weights in exact arithmetic, fewer operations
        routing.route(
            part.kernels,
            stream,
            x,
            router,
            extras.router_bias,
            part.scratch().view("logits", count * model.n_expert * 4),
            extras.selection_bias,
            selection,
            count,
            model.n_embd,
            model.n_expert,
            model.top_k,
            *out,
        )

    def _gate(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        self._mul_mat_id(stream, bindings, GATE, info, tokens, "x", False, "gate", shared_x=_PREPARE)
        self._add_expert_bias(stream, tokens, GATE, "gate", info.ne[1])

    def _up(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        n_ff = self.model.n_ff
        biases = tokens.part.extras[tokens.layer].expert_bias
        if (
            self.ffn.ffn.activation is Activation.SILU
            and not (biases and UP in biases)
            and tokens.part.kernels.uses_gemv(tokens.count * self.model.top_k)
        ):
            # A few rows (decode): the matrix-vector kernel writes SwiGLU's output itself.
            gate = tokens.held_view("gate", n_ff)
            self._mul_mat_id(stream, bindings, UP, info, tokens, "x", False, "act", silu_gate=gate)
            return
        self._mul_mat_id(stream, bindings, UP, info, tokens, "x", False, "up", shared_x=_SHARE)
        self._add_expert_bias(stream, tokens, UP, "up", info.ne[1])
        views = (tokens.held_view("gate", n_ff), tokens.held_view("up", n_ff), tokens.held_view("act", n_ff))
        n = tokens.count * self.model.top_k * n_ff
        if self.ffn.ffn.activation is Activation.SWIGLU_OAI:
            routing.swiglu_oai(tokens.part.kernels, stream, *views, n)
        else:
            tokens.part.kernels.swiglu(stream, *views, n)

    def _add_expert_bias(self, stream: Stream, tokens: _Tokens, role: str, y: str, n_out: int) -> None:
        biases = tokens.part.extras[tokens.layer].expert_bias
        if biases is None or role not in biases:
            return
        pairs = tokens.count * self.model.top_k
        out = tokens.held_view(y, n_out) if y in _Scratch.HELD else tokens.part.scratch().view(y, pairs * n_out * 4)
        routing.add_expert_bias(
            tokens.part.kernels,
            stream,
            out,
            biases[role],
            tokens.ids,
            pairs,
            n_out,
            self.model.n_expert,
        )

    def _shared_expert(self, stream: Stream, tokens: _Tokens, shared: _SharedExpert) -> None:
        """shared_down = the shared expert's FFN of x (times sigmoid(x . gate_inp) where gated)."""
        model, part = self.model, tokens.part
        scratch = part.scratch()
        ids = part.zero_ids.view(0, tokens.count * 4)
        x = tokens.held_view("x", model.n_embd)
        fused = part.kernels.uses_gemv(tokens.count)  # a few rows: up's kernel writes SwiGLU's output itself
        for role, info in ((GATE, shared.gate), (UP, shared.up), (DOWN, shared.down)):
            n_in, n_out = info.ne[0], info.ne[1]
            source = x if role != DOWN else scratch.view("shared_act", tokens.count * n_in * 4)
            n = tokens.count * n_out
            into = "shared_act" if role == UP and fused else f"shared_{role}"
            part.kernels.mul_mat_id(
                stream,
                shared.weights[role],
                info.qtype,
                1,
                n_out,
                n_in,
                source,
                False,
                ids,
                tokens.count,
                1,
                scratch.view(into, n * 4),
                silu_gate=scratch.view("shared_gate", n * 4) if role == UP and fused else None,
            )
            if role == UP and not fused:
                gate, up, act = (scratch.view(name, n * 4) for name in ("shared_gate", "shared_up", "shared_act"))
                part.kernels.swiglu(stream, gate, up, act, n)
        if "gate_inp" in shared.weights:
            routing.shared_gate(
                part.kernels,
                stream,
                x,
                shared.weights["gate_inp"],
                scratch.view("shared_down", tokens.hidden.nbytes),
                tokens.count,
                model.n_embd,
                model.n_embd,
            )

    def _gate_up(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        n_in, n_out = info.ne[0], info.ne[1]
        gate, ids, n_expert = _bound(bindings, GATE, info)
        up, up_ids, _ = _bound(bindings, UP, info)
        assert up_ids == ids, "a split's packed weights share their slot ids"
        tokens.part.kernels.gate_up(
            stream,
            gate,
            up,
            info.qtype,
            n_expert,
            n_out,
            n_in,
            tokens.held_view("x", n_in),
            ids,
            tokens.count,
            self.model.top_k,
            tokens.held_view("act", n_out),
        )

    def _down(self, tokens: _Tokens, info: TensorInfo, stream: Stream, bindings: Bindings) -> None:
        model, scratch, kernels = self.model, tokens.part.scratch(), tokens.part.kernels
        pairs = tokens.count * model.top_k
        route_weights = tokens.held_view("route_weights", 1)
        biases = tokens.part.extras[tokens.layer].expert_bias
        down_bias = bool(biases and DOWN in biases)
        # Rows scaled as the kernel writes them, where it can and no bias is added after it.
        routed = kernels.uses_direct(info.qtype, info.ne[0]) and not down_bias
        shared = tokens.part.extras[tokens.layer].shared
        # Down scales its rows by the routing weights (scales), or the combine weighs them (weights); the
        # combine adds them and the shared expert's rows into the hidden rows.
        scales, weights = (route_weights, None) if routed else (None, route_weights)
        rows = scratch.view("down", pairs * model.n_embd * 4)
        extra = None if shared is None else scratch.view("shared_down", tokens.hidden.nbytes)
        blocks, norm = tokens.part.blocks, self._combine_norm(tokens)
        if (
            blocks is not None
            and norm is not None
            and not down_bias
            and kernels.uses_gemv(pairs)
            and kernels.decode_epilogues
        ):
            # Decode: the shared expert first, then down, the combine and the next norm in one launch.
            if shared is not None:
                self._shared_expert(stream, tokens, shared)
            w, ids, n_expert = _bound(bindings, DOWN, info)
            dense.down_combine_rms_norm(
                kernels, stream, w, info.qtype, n_expert, info.ne[0],
                tokens.held_view("act", info.ne[0]), ids, tokens.count, model.top_k, rows,
                scales, weights, extra, tokens.hidden, norm, blocks.norm_rows(tokens.count),
                model.n_embd, blocks.spec.eps,
            )  # fmt: skip
            return
        self._mul_mat_id(
            stream,
            bindings,
            DOWN,
            info,
            tokens,
            "act",
            True,
            "down",
            scales,
            shared_x=_SHARE,
        )
        self._add_expert_bias(stream, tokens, DOWN, "down", model.n_embd)
        if shared is not None:
            self._shared_expert(stream, tokens, shared)
        combine = (rows, weights, extra, tokens.hidden)
        if blocks is not None and norm is not None:  # and the norm of what reads the rows next
            out = blocks.norm_rows(tokens.count)
            eps = blocks.spec.eps
            dense.combine_rms_norm(kernels, stream, *combine, norm, out, tokens.count, model.top_k, model.n_embd, eps)
        else:
            kernels.combine(stream, *combine, tokens.count, model.top_k, model.n_embd)
        if tokens.send is not None:
            tokens.send.send(stream)

    @staticmethod
    def _combine_norm(tokens: _Tokens, layer: int | None = None) -> BufferView | None:
        """The weights of the norm the combine of MoE layer ``layer`` (``tokens.layer`` by default)
        also writes into ``Blocks.norm_rows``, for a decode token: the norm of what reads its rows next
        on this device (``Blocks.norm_after``). None where that layer is not an MoE layer on this
        device, or the rows go on to another one, or in prefill: the reader norms them itself."""
        layer = tokens.layer if layer is None else layer
        blocks = tokens.part.blocks
        if blocks is None or not tokens.decode or layer not in tokens.part.position:
            return None
        return blocks.norm_after(layer)

    def _normed_before(self, tokens: _Tokens) -> bool:
        """Whether the layer before ``tokens.layer`` left this layer's attention norm in
        ``Blocks.norm_rows``: its ``_combine_norm``."""
        return self._combine_norm(tokens, tokens.layer - 1) is not None

    def _mul_mat_id(
        self,
        stream: Stream,
        bindings: Bindings,
        role: str,
        info: TensorInfo,
        tokens: _Tokens,
        x: str,
        x_per_pair: bool,
        y: str,
        route_weights: BufferView | None = None,
        shared_x: str | None = None,
        silu_gate: BufferView | None = None,
    ) -> None:
        """``shared_x``: _PREPARE rounds and groups the input once (``MoeKernels.prepare_direct``) where
        the call takes a direct kernel; _SHARE takes what the last such preparation gives this call
        (``MoeKernels.shared_direct``: gate's whole for up right after it on the same ubatch, its groups
        for down; in layer-major order only the last ubatch's gate is still there); else the call
        prepares as usual."""
        n_in, n_out = info.ne[0], info.ne[1]
        w, ids, n_expert = _bound(bindings, role, info)
        pairs = tokens.count * self.model.top_k
        scratch = tokens.part.scratch()
        kernels = tokens.part.kernels
        x_view = tokens.held_view(x, n_in)
        y_view = tokens.held_view(y, n_out) if y in _Scratch.HELD else scratch.view(y, pairs * n_out * 4)
        prepared = None
        tile = None if shared_x is None else kernels.direct_tile(info.qtype, pairs, n_expert, n_in)
        if tile is not None:
            inputs = (stream, x_view, ids, tokens.count, self.model.top_k, n_expert, n_in, tile, x_per_pair)
            share = kernels.prepare_direct if shared_x == _PREPARE else kernels.shared_direct
            prepared = share(*inputs)
        kernels.mul_mat_id(
            stream,
            w,
            info.qtype,
            n_expert,
            n_out,
            n_in,
            x_view,
            x_per_pair,
            ids,
            tokens.count,
            self.model.top_k,
            y_view,
            route_weights=route_weights,
            prepared=prepared,
            silu_gate=silu_gate,
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
            logits = None if part.io is None else part.io.decode_logits if decode else part.io.logits
            if logits is not None:
                stream.memset(logits, 0, logits.nbytes, OUTPUT_POISON)
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

    def prompt_logits(self) -> np.ndarray:
        """float32 [rows, n_vocab]: every prompt token's next-token logits (``all_logits``), else the last's."""
        whole, part = self._require_whole("prompt logits"), self._parts[-1]
        logits = self._io(part).logits
        assert logits is not None
        rows = whole.logit_rows(self.batching.tokens)
        return logits.read(0, rows * whole.spec.n_vocab * 4).view(np.float32).reshape(rows, whole.spec.n_vocab)

    def decode_logits(self, step: int) -> np.ndarray:
        """float32 [n_vocab]: the logits decode step ``step`` produced."""
        self._check_step(step)
        whole, part = self._require_whole("decode logits"), self._parts[-1]
        logits = self._io(part).decode_logits
        assert logits is not None
        n_vocab = whole.spec.n_vocab
        return logits.read(step * n_vocab * 4, n_vocab * 4).view(np.float32).copy()

    def _require_whole(self, what: str) -> _Whole:
        if self.whole is None:
            raise InvalidArgument(f"{what} come from the whole model; this runner runs the expert blocks alone")
        return self.whole

    def close(self) -> None:
        """Free the device memory; work that uses it must be finished."""
        for closing in (*self._links, *self._parts):
            closing.close()
        self._links.clear()
        self._parts.clear()


# Layer-major prefill holds every prompt token's FFN rows per layer (_Scratch.HELD): "auto" takes it
# only while those take no more than this share of the device's free memory.
LAYER_MAJOR_SHARE = 0.25


def _layer_name(index: int, group: Sequence[_Tokens]) -> str:
    """What names layer ``index``'s splits for ``group`` (after their roles: "router.", "down.")."""
    return f"L{index}.{group[0].label}" + (f"-{group[-1].label}" if len(group) > 1 else "")


def lookahead_experts(model: MoeModel, asked: int | None) -> int:
    """How many predicted experts a decode step copies ahead per streamed layer (``MoeRunner``)."""
    if asked is None:
        return (model.top_k + 1) // 2
    if isinstance(asked, bool) or not isinstance(asked, int) or not 0 <= asked <= model.top_k:
        raise InvalidArgument(
            f"decode lookahead {asked} is outside 0..{model.top_k}, the experts a token of this model uses",
            hint="give 0 (off) up to the model's experts per token, or leave it to the default (half of them)",
        )
    return asked


def held_bytes(model: MoeModel, tokens: int) -> int:
    """Device bytes layer-major prefill holds for a prompt of ``tokens`` (the FFN input, routing
    weights and gate/up/act rows of every token)."""
    return tokens * (model.n_embd + model.top_k * (1 + 3 * model.n_ff)) * 4


PREFILL_ORDERS = ("auto", "layer", "ubatch")


def check_prefill_order(order: str) -> None:
    if order not in PREFILL_ORDERS:
        raise InvalidArgument(f"prefill order must be one of {', '.join(PREFILL_ORDERS)}; got {order!r}")


def prefers_layer_major(
    order: str, model: MoeModel, batching: Batching, devices: Sequence[Device], *, streams: bool = True
) -> bool:
    """Whether prefill runs layer-major: ``order`` "layer", "ubatch", or "auto" (layer-major for a
    prompt of several ubatches whose held rows fit LAYER_MAJOR_SHARE of every device's free memory,
    where some layer's experts stream: ``streams``. With every expert on the device, the order saves
    no copy, and ubatch-major replays one captured ubatch: engine.prefill)."""
    check_prefill_order(order)
    if order != "auto":
        return order == "layer"
    if len(batching.ubatches()) < 2 or not streams:
        return False
    need = held_bytes(model, batching.tokens)
    return all(need <= LAYER_MAJOR_SHARE * device.free_memory() for device in devices)


def _whole(spec: Transformer, batching: Batching, n_ctx: int | None, layer_major: bool, all_logits: bool) -> _Whole:
    need = batching.tokens + batching.decode_steps
    n_ctx = need if n_ctx is None else n_ctx
    if need > n_ctx:
        raise InvalidArgument(
            f"the prompt ({batching.tokens} tokens) and {batching.decode_steps} generated tokens need a context of "
            f"{need}; it is {n_ctx}",
            hint="raise -c or shorten the prompt",
        )
    return _Whole(spec, n_ctx, layer_major, all_logits)


def _ubatch_bindings(bindings: Bindings, roles: Sequence[str], group_ids: BufferView, ids: BufferView) -> Bindings:
    """A split's bindings for one ubatch of its group, whose routing ids ``ids`` lie within the
    group's ``group_ids``: each weight's ids (``expert_ids``) cut to the same ones."""
    at = ids.offset - group_ids.offset
    if at == 0 and ids.nbytes == group_ids.nbytes:
        return bindings
    cut = dict(bindings)
    for role in roles:
        whole = bindings[expert_ids(role)]
        cut[expert_ids(role)] = BufferView(whole.buffer, whole.offset + at, ids.nbytes)
    return cut


def _bound(bindings: Bindings, role: str, info: TensorInfo) -> tuple[BufferView, BufferView, int]:
    """Expert weights ``role`` as bound, the ids their kernels index them by, and how many experts
    the binding holds (fewer than the tensor's where the scheduler packed a decode step's)."""
    w = bindings[role]
    if w.nbytes >= info.nbytes:  # the whole tensor (a packed binding holds fewer experts than it has)
        return w, bindings[expert_ids(role)], info.ne[2]
    tail = padded_size(info.nbytes, info.qtype, info.ne0) - info.nbytes
    return w, bindings[expert_ids(role)], bound_experts(w, info.slice_nbytes, tail)


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
