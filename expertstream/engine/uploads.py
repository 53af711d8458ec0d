"""Device-resident copies of a model's tensors and the buffers around them, owned and freed together."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import numpy as np
from gguf import GGMLQuantizationType

from .._closing import Closing
from ..backends.base import BufferView, Device, DeviceBuffer, Usage
from ..ggml import padded_size
from ..model import ModelError, MoeModel, TensorInfo

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def tensor_floats(model: MoeModel, info: TensorInfo) -> np.ndarray:
    """A float tensor's values as float32 (F32, F16 or BF16 in the file)."""
    raw = np.ascontiguousarray(model.raw(info))
    if info.qtype is GGMLQuantizationType.F32:
        return raw.view(np.float32)
    if info.qtype is GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    if info.qtype is GGMLQuantizationType.BF16:  # the high half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ModelError(f"{model.path}: {info.name} is {info.qtype.name}; a float type (F32, F16, BF16) is needed here")


@dataclass(frozen=True)
class DeviceMemory:
    """Device bytes by what they hold; parts and devices add up with ``+``."""

    weights: int = 0  # the model's tensors but the experts: attention, norms, embeddings, head, routers
    kv_cache: int = 0
    activations: int = 0  # hidden rows, token ids, logits, the kernels' scratch
    resident_experts: int = 0  # experts uploaded once and kept (-ncmoe, --gpu-memory)
    # the prefetch slots and the stock copy's scratch for streamed experts (a run's: the most at once)
    staging: int = 0

    def __add__(self, other: DeviceMemory) -> DeviceMemory:
        return DeviceMemory(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


# The model's tensors share backing allocations, and so do the layers' KV caches. A driver maps
# device memory in pages (2 MiB on current NVIDIA GPUs for all but small allocations), so hundreds of
# tensors of a few MiB each would otherwise each round up to whole pages. Each arena (one list per
# usage) doubles the last, up to ARENA_MAX_BYTES; a tensor of more than half that has an allocation
# of its own.
ARENA_FIRST_BYTES = 2 << 20
ARENA_MAX_BYTES = 16 << 20
ARENA_ALIGN = 256  # where each view starts in its arena (a device allocation's own alignment)


@dataclass
class _Arena:
    buffer: DeviceBuffer
    used: int


class Uploads(Closing):
    """Buffers on one device, filled from the model where the backend holds data (zeros where not).
    The model's tensors (``raw``, ``floats``) and ``view``'s are views into shared arenas."""

    def __init__(self, device: Device, model: MoeModel) -> None:
        self.device = device
        self.model = model
        self.data = device.backend.host.holds_data
        self.buffers: list[DeviceBuffer] = []
        self._arenas: dict[Usage, list[_Arena]] = {}

    def alloc(self, nbytes: int, usage: Usage = Usage.COMPUTE) -> DeviceBuffer:
        buf = self.device.alloc(max(nbytes, 4), usage)
        self.buffers.append(buf)
        return buf

    def filled(self, nbytes: int, usage: Usage, make: Callable[[], np.ndarray]) -> DeviceBuffer:
        """A buffer holding ``make()``; zeros where the backend holds no data (nothing reads it unwritten)."""
        buf = self.alloc(nbytes, usage)
        if self.data:
            buf.write(make())
        else:
            self.zero(buf.view(0, buf.alloc_size))
        return buf

    def view(self, nbytes: int, usage: Usage = Usage.COMPUTE) -> BufferView:
        """``nbytes`` of ``usage`` in a shared arena (a KV cache, a state), unwritten."""
        return self._arena_view(nbytes, usage)

    def weight_view(self, nbytes: int, make: Callable[[], np.ndarray]) -> BufferView:
        """``nbytes`` holding ``make()`` (fewer bytes: the rest zeros) in an arena of the model's
        tensors; zeros where the backend holds no data."""
        view = self._arena_view(nbytes, Usage.WEIGHTS)
        if self.data:
            data = make()
            if data.nbytes > nbytes:  # it would run into the next tensor of the arena
                raise ModelError(f"{self.model.path}: a tensor of {data.nbytes} bytes for a place of {nbytes}")
            view.buffer.write(data, view.offset)
            if data.nbytes < nbytes:
                self.zero(view.buffer.view(view.offset + data.nbytes, nbytes - data.nbytes))
        else:
            self.zero(view)
        return view

    def _arena_view(self, nbytes: int, usage: Usage) -> BufferView:
        need = -(-max(nbytes, 4) // ARENA_ALIGN) * ARENA_ALIGN
        arenas = self._arenas.setdefault(usage, [])
        for arena in arenas:
            if arena.used + need <= arena.buffer.alloc_size:
                at, arena.used = arena.used, arena.used + need
                return arena.buffer.view(at, nbytes)
        if need > ARENA_MAX_BYTES // 2:
            return self.alloc(nbytes, usage).view(0, nbytes)
        grown = min(ARENA_MAX_BYTES, ARENA_FIRST_BYTES << len(arenas))
        buffer = self.alloc(max(need, grown), usage)
        arenas.append(_Arena(buffer, need))
        return buffer.view(0, nbytes)

    def zero(self, view: BufferView) -> None:
        with self.device.stream() as stream:
            stream.memset(view.buffer, view.offset, view.nbytes, 0)
            stream.synchronize()

    def floats(self, info: TensorInfo) -> BufferView:
        """A float tensor (F32, F16 or BF16 in the file) as float32 on the device."""
        n = info.nbytes // (4 if info.qtype is GGMLQuantizationType.F32 else 2)
        return self.weight_view(n * 4, functools.partial(tensor_floats, self.model, info))

    def raw(self, info: TensorInfo) -> BufferView:
        """A tensor's bytes as the file stores them, with the zero tail kernels read past a quantized row."""
        nbytes = padded_size(info.nbytes, info.qtype, info.ne0)
        return self.weight_view(nbytes, functools.partial(self.model.raw, info))

    def resident(self, info: TensorInfo) -> BufferView:
        """A float tensor as float32, a quantized one as its raw bytes (what the runner's kernels read)."""
        return self.floats(info) if info.qtype in _FLOAT_TYPES else self.raw(info)

    @property
    def device_bytes(self) -> int:
        return sum(buf.alloc_size for buf in self.buffers)

    @property
    def weight_bytes(self) -> int:
        """Of ``device_bytes``, the buffers holding the model's tensors (Usage.WEIGHTS)."""
        return sum(buf.alloc_size for buf in self.buffers if buf.usage is Usage.WEIGHTS)

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()
        self.buffers.clear()
        self._arenas.clear()
