"""Partial offload: the experts of the first MoE layers stream from host memory, the rest stay on the device.

``--n-cpu-moe N`` keeps the experts of the first N MoE layers in host memory (llama.cpp's
option of that name); ``--gpu-memory SIZE|auto`` streams as few leading layers as needed for
the others' experts to fit on the device beside what the scheduler allocates for the streamed
ones (``device_footprint``: its prefetch slots and stock scratch) and a margin. Resident experts
are uploaded once and reach the scheduler as device-resident WEIGHTS inputs, which it neither
prefetches nor copies. With a layer split each layer's experts live on the device that runs
it, and each device's budget is checked on its own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from .._closing import Closing
from ..backends.base import BufferView, Device, DeviceBuffer, Usage
from ..errors import InvalidArgument
from ..model import MoeLayer, MoeModel, TensorInfo
from ..scheduler import device_footprint
from ..scheduler.source import HostSource
from .layersplit import LayerSplit
from .runner import ExpertData

log = logging.getLogger(__name__)

GpuMemory = int | Literal["auto"]

# Room left free for what is allocated later and for allocator rounding: this much, or a
# twentieth of the memory given when that is less.
DEFAULT_MARGIN_BYTES = 256 << 20

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """A size in bytes such as 24G, 512M, 1.5G, 4096 (bytes); binary units."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgument(f"cannot read {text!r} as a memory size", hint="write e.g. 24G or 512M")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def format_size(nbytes: int) -> str:
    """The size as ``parse_size`` reads it back, to three figures: 24G, 512M."""
    unit = next((u for u in ("T", "G", "M", "K") if nbytes >= _UNITS[u]), "")
    return f"{nbytes / _UNITS[unit]:.3g}{unit}"


def parse_gpu_memory(text: str) -> GpuMemory:
    """'auto', or a size (``parse_size``)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_size(text)
    except InvalidArgument:
        raise InvalidArgument(f"cannot read {text!r} as a memory size", hint="write e.g. 24G, 512M or auto") from None


def format_gpu_memory(memory: GpuMemory) -> str:
    """The size as ``parse_gpu_memory`` reads it back, to three figures: 24G, 512M, auto."""
    return "auto" if memory == "auto" else format_size(memory)


@dataclass(frozen=True)
class OffloadPlan:
    """Which MoE layers stream their experts (by block index) and what that costs per ubatch."""

    streamed: tuple[int, ...]
    resident: tuple[int, ...]
    streamed_bytes_per_ubatch: int  # expert bytes copied host -> device for each prefill ubatch
    resident_bytes: int  # device bytes of the resident experts (padded)

    @property
    def layers_streamed(self) -> int:
        return len(self.streamed)

    @property
    def layers_resident(self) -> int:
        return len(self.resident)


def _layer_split(model: MoeModel, where: Device | LayerSplit) -> LayerSplit:
    return where if isinstance(where, LayerSplit) else LayerSplit(model, [where])


def plan_offload(
    model: MoeModel,
    where: Device | LayerSplit,
    *,
    n_cpu_moe: int | None = None,
    gpu_memory: GpuMemory | None = None,
    slots: int = 0,
    host_inputs_per_split: int = 1,
    lookahead_inputs: int = 0,
    lookahead_rows: int = 0,
    in_use: int | Mapping[Device, int] = 0,
    margin: int | None = None,
) -> OffloadPlan:
    """Split the model's MoE layers into streamed (the first ones) and device-resident.

    Without either option every layer streams. ``n_cpu_moe`` streams at least that many;
    ``gpu_memory`` streams as few as fit: a SIZE is the device memory this process may use
    on each device, ``in_use`` of which is already taken (activations); auto is what each
    device has free now. ``host_inputs_per_split``: the streamed tensors one split reads (2 where
    gate and up are fused), each with its own stock scratch (``scheduler.device_footprint``);
    ``lookahead_inputs``: the expert tensors a decode step copies ahead per layer (two scratch sets each),
    ``lookahead_rows`` experts each where packed (0: whole tensors).
    """
    split = _layer_split(model, where)
    used = in_use if isinstance(in_use, Mapping) else {split.devices[0]: in_use}
    n_moe = len(model.layers)
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise InvalidArgument(f"--n-cpu-moe must be >= 0, got {n_cpu_moe}")
    if n_cpu_moe is None and gpu_memory is None:
        n_stream = n_moe
    else:
        n_stream = min(n_moe, n_cpu_moe or 0)
        if gpu_memory is not None:
            budgets = {}
            for device in split.devices:
                total = device.free_memory() if gpu_memory == "auto" else gpu_memory
                budget = total - (0 if gpu_memory == "auto" else used.get(device, 0))
                budgets[device] = budget - (min(DEFAULT_MARGIN_BYTES, total // 20) if margin is None else margin)
            scratch = (host_inputs_per_split, lookahead_inputs, lookahead_rows)
            n_stream = max(n_stream, _fewest_streamed(model, split, budgets, slots, scratch))
    return _plan(model, split, n_stream)


def _padded(device: Device, info: TensorInfo) -> int:
    return device.alloc_size(info.nbytes, info.qtype, info.ne0)


def _ahead_bytes(device: Device, info: TensorInfo, rows: int) -> int:
    """A decode lookahead's scratch for ``info``: ``rows`` experts where packed (fewer than it has)."""
    padded = _padded(device, info)
    if not 0 < rows < info.ne[2]:
        return padded
    return rows * info.slice_nbytes + padded - info.nbytes


def _largest(device: Device, tensors: Iterable[TensorInfo]) -> int:
    return max((_padded(device, t) for t in tensors), default=0)


def _fewest_streamed(
    model: MoeModel, split: LayerSplit, budgets: Mapping[Device, int], slots: int, scratch: tuple[int, int, int]
) -> int:
    """The smallest count of leading layers to stream so that the rest fit in every device's budget."""
    layers = model.layers
    for n_stream in range(len(layers) + 1):
        need = dict.fromkeys(split.devices, 0)
        largest = dict.fromkeys(split.devices, 0)
        ahead_bytes = dict.fromkeys(split.devices, 0)
        per_split, ahead, rows = scratch
        for layer in layers[n_stream:]:
            device = split.device_of(layer.index)
            need[device] += sum(_padded(device, t) for t in layer.experts)
        for layer in layers[:n_stream]:
            device = split.device_of(layer.index)
            largest[device] = max(largest[device], _largest(device, layer.experts))
            ahead_bytes[device] = max(ahead_bytes[device], *(_ahead_bytes(device, t, rows) for t in layer.experts))
        footprint = {
            d: device_footprint(
                slots,
                largest[d],
                host_inputs_per_split=per_split,
                lookahead_inputs=ahead,
                lookahead_bytes=ahead_bytes[d],
            )
            for d in need
        }
        if all(need[d] + footprint[d] <= budgets[d] for d in split.devices):
            return n_stream
    for device in split.devices:
        log.warning(
            "%s: %d bytes left for weights (after activations and a margin) do not hold the %d prefetch slots and "
            "the stock scratch of %d bytes each; every layer streams",
            device.label,
            budgets[device],
            slots,
            _largest(device, model.expert_tensors),
        )
    return len(layers)


def _plan(model: MoeModel, split: LayerSplit, n_stream: int) -> OffloadPlan:
    streamed, resident = model.layers[:n_stream], model.layers[n_stream:]
    plan = OffloadPlan(
        streamed=tuple(layer.index for layer in streamed),
        resident=tuple(layer.index for layer in resident),
        streamed_bytes_per_ubatch=sum(t.nbytes for layer in streamed for t in layer.experts),
        resident_bytes=sum(_padded(split.device_of(layer.index), t) for layer in resident for t in layer.experts),
    )
    log.info(
        "%s: experts of %d MoE layers stream (%d bytes per ubatch), %d stay on the device (%d bytes)",
        ", ".join(d.label for d in split.devices),
        plan.layers_streamed,
        plan.streamed_bytes_per_ubatch,
        plan.layers_resident,
        plan.resident_bytes,
    )
    return plan


class UploadedExperts(Closing):
    """The expert tensors of some layers, copied once to the device that runs each; close() frees them."""

    def __init__(
        self, model: MoeModel, where: Device | LayerSplit, layers: Iterable[MoeLayer], *, upload_data: bool
    ) -> None:
        self.views: dict[str, BufferView] = {}
        self._buffers: list[DeviceBuffer] = []
        split = _layer_split(model, where)
        try:
            for layer in layers:
                device = split.device_of(layer.index)
                for info in layer.experts:
                    buf = device.alloc(info.nbytes, Usage.WEIGHTS, row_type=info.qtype, ne0=info.ne0)
                    self._buffers.append(buf)
                    if upload_data:
                        buf.write(model.raw(info))
                    self.views[info.name] = buf.view()
        except BaseException:
            for device in split.devices:
                device.synchronize()  # an upload may still be reading into a buffer about to be freed
            self.close()
            raise

    @property
    def device_bytes(self) -> int:
        """Device memory the uploaded experts hold."""
        return sum(buf.alloc_size for buf in self._buffers)

    def close(self) -> None:
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()
        self.views.clear()


class ResidentExperts(UploadedExperts):
    """The experts of an OffloadPlan's resident layers, uploaded once; close() frees them."""

    def __init__(
        self, model: MoeModel, where: Device | LayerSplit, plan: OffloadPlan, *, upload_data: bool = True
    ) -> None:
        self.plan = plan
        resident = set(plan.resident)
        layers = [layer for layer in model.layers if layer.index in resident]
        super().__init__(model, where, layers, upload_data=upload_data)

    def experts(self, host: Mapping[str, HostSource]) -> ExpertData:
        """Resident experts as device views, every other tensor from ``host``."""
        return {name: self.views.get(name, source) for name, source in host.items()}
