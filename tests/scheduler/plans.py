"""Random plans of MUL_MAT_ID-like splits over host-resident expert tensors, for scheduler tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from expertstream.backends.base import Backend, Device, DeviceBuffer, HostBuffer, HostMemory, Stream, Usage
from expertstream.ggml import row_size
from expertstream.scheduler import Input, MulMatId, Plan, Split
from expertstream.scheduler.source import HostRegion, HostSource

from . import digest

ROW_TYPES = (Q.Q4_0, Q.Q8_0, Q.F16, Q.BF16)
# Digest words of 0xFFFFFFFF: a skipped split leaves all of its words so, which the digest of its
# several chunks never all is.
POISON = 0xFF


@dataclass(frozen=True)
class LayerSpec:
    device: int
    n_expert: int
    rows: int
    ne0: int
    row_type: Q
    n_ids: int
    host: HostMemory
    resident: bool = False  # the weights live on the device (uploaded once), not in host memory


@dataclass
class BuiltPlan:
    plan: Plan
    outputs: list[tuple[DeviceBuffer, np.ndarray]]  # device output and the digest it must hold
    resources: list[DeviceBuffer | HostBuffer] = field(default_factory=list)

    def poison(self, stream_of: Callable[[Device], Stream]) -> None:
        """Fill every output with POISON on its device's ``stream_of(device)`` and wait, before a run:
        a run that skips a split (or a whole plan) then fails ``check``, not passes on an earlier run's digest."""
        streams = []
        for buf, expected in self.outputs:
            stream = stream_of(buf.device)
            stream.memset(buf, 0, 4 * expected.size, POISON)  # the digest kernel writes every one of these words
            streams.append(stream)
        for stream in streams:
            stream.synchronize()

    def read_outputs(self) -> list[np.ndarray]:
        return [buf.read() for buf, _ in self.outputs]

    def check(self) -> None:
        for index, (buf, expected) in enumerate(self.outputs):
            got = buf.read().view(np.uint32)[: expected.size]
            assert np.array_equal(got, expected), f"split {index}: digest differs from the host bytes"

    def close(self) -> None:
        for res in self.resources:
            res.close()
        for buf, _ in self.outputs:
            buf.close()


def host_buffer(device: Device, data: np.ndarray, kind: HostMemory) -> HostBuffer:
    if kind is HostMemory.PINNED:
        host = device.alloc_pinned(data.nbytes)
        host.numpy(write=True)[:] = data
        return host
    host = device.wrap_host(data)
    if kind is HostMemory.REGISTERED:
        host.register()
    return host


def build(backend: Backend, specs: list[LayerSpec], seed: int) -> BuiltPlan:
    """One split per layer, reading one expert tensor ``w``."""
    return build_splits(backend, [[spec] for spec in specs], seed)


def build_splits(backend: Backend, splits_of: list[list[LayerSpec]], seed: int) -> BuiltPlan:
    """One split per list of specs, reading one expert tensor per spec (``w``, or ``w0``, ``w1``...).

    The first spec of a split gives its device and routing (n_expert, n_ids); each spec gives
    its tensor's shape and where it lives.
    """
    rng = np.random.default_rng(seed)
    splits: list[Split] = []
    built = BuiltPlan(Plan(()), [])
    for index, specs in enumerate(splits_of):
        first = specs[0]
        device = backend.device(first.device)
        kernel = digest.compile_digest(device)
        names = ["w"] if len(specs) == 1 else [f"w{k}" for k in range(len(specs))]
        data = [rng.integers(0, 256, first.n_expert * _expert_nbytes(spec), dtype=np.uint8) for spec in specs]
        ids = rng.integers(0, first.n_expert, first.n_ids, dtype=np.int32)
        ids_buf = device.upload(ids)
        built.resources.append(ids_buf)
        inputs, reads = [], []
        for name, spec, tensor in zip(names, specs, data, strict=True):
            expert_nbytes = _expert_nbytes(spec)
            out = device.alloc(4 * digest.n_outputs(first.n_expert, expert_nbytes))
            padded = device.alloc_size(tensor.nbytes, spec.row_type, spec.ne0)
            built.outputs.append((out, digest.reference(tensor, ids, first.n_expert, expert_nbytes, padded)))
            inputs.append(_input(device, name, spec, tensor, expert_nbytes, built))
            reads.append((name, out, expert_nbytes, tensor.nbytes))

        def compute(stream, bindings, *, kernel=kernel, ids_buf=ids_buf, first=first, reads=reads):  # type: ignore[no-untyped-def]
            for name, out, expert_nbytes, nbytes in reads:
                digest.launch(
                    stream,
                    kernel,
                    bindings[name],
                    out.view(),
                    ids_buf.view(),
                    first.n_ids,
                    first.n_expert,
                    expert_nbytes,
                    nbytes,
                )

        routing = MulMatId(ids_buf.view(), first.n_ids, first.n_expert, tuple(names))
        splits.append(Split(f"layer{index}", device, tuple(inputs), compute, routing))
    built.plan = Plan.of(splits)
    return built


def _expert_nbytes(spec: LayerSpec) -> int:
    return spec.rows * row_size(spec.row_type, spec.ne0)


def _input(device: Device, name: str, spec: LayerSpec, data: np.ndarray, expert_nbytes: int, built: BuiltPlan) -> Input:
    where: dict[str, Any]
    if spec.resident:
        resident = device.alloc(data.nbytes, Usage.WEIGHTS, row_type=spec.row_type, ne0=spec.ne0)
        resident.write(data)
        built.resources.append(resident)
        where = {"device_data": resident.view()}
    else:
        host = host_buffer(device, data, spec.host)
        built.resources.append(host)
        where = {"host": HostRegion(host, 0, data.nbytes)}
    return Input(name, data.nbytes, row_type=spec.row_type, ne0=spec.ne0, expert_nbytes=expert_nbytes, **where)


def random_specs(
    rng: np.random.Generator, n_layers: int, n_devices: int, prefill_share: float, resident_share: float = 0.0
) -> list[LayerSpec]:
    """Random layers; with ``resident_share`` > 0 that share of them keeps its weights on the device."""
    specs = []
    for _ in range(n_layers):
        n_expert = int(rng.integers(2, 9))
        prefill = rng.random() < prefill_share
        n_ids = int(rng.integers(2 * n_expert, 4 * n_expert + 1)) if prefill else int(rng.integers(1, 2 * n_expert))
        specs.append(
            LayerSpec(
                device=int(rng.integers(0, n_devices)),
                n_expert=n_expert,
                rows=int(rng.integers(1, 4)),
                ne0=int(rng.choice([64, 96, 160, 512, 544, 768])),
                row_type=ROW_TYPES[int(rng.integers(0, len(ROW_TYPES)))],
                n_ids=n_ids,
                host=(HostMemory.PAGEABLE, HostMemory.PINNED, HostMemory.REGISTERED)[int(rng.integers(0, 3))],
                # Drawn only when asked for, so that the layers of existing seeds stay what they were.
                resident=bool(resident_share) and bool(rng.random() < resident_share),
            )
        )
    return specs


def uniform_specs(
    n_layers: int, *, prefill: bool = True, host: HostMemory = HostMemory.PINNED, device: int = 0
) -> list[LayerSpec]:
    """Layers whose padded sizes alternate, so rotating slots see larger and smaller tensors."""
    shapes = [(Q.Q4_0, 768, 3), (Q.Q8_0, 160, 2), (Q.Q4_0, 544, 1), (Q.F16, 96, 2)]
    specs = []
    for i in range(n_layers):
        row_type, ne0, rows = shapes[i % len(shapes)]
        n_expert = 4
        specs.append(LayerSpec(device, n_expert, rows, ne0, row_type, 2 * n_expert if prefill else 3, host))
    return specs


class FailingSource:
    """A pageable source whose ``fail_on``-th copy (counted over every source sharing ``counter``) fails,
    as a vanished file mapping would."""

    def __init__(self, inner: HostSource, counter: dict[str, int], fail_on: int) -> None:
        self._inner = inner
        self._counter = counter
        self._fail_on = fail_on

    @property
    def nbytes(self) -> int:
        return int(self._inner.nbytes)

    @property
    def blocks_host(self) -> bool:
        return True

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        self._counter["n"] = self._counter.get("n", 0) + 1
        if self._counter["n"] == self._fail_on:
            raise OSError("the weights file went away")
        self._inner.enqueue_h2d(stream, dst, dst_offset, offset, nbytes)
