"""Compute steps written with torch or another array library, run by the scheduler.

A split's compute function receives the scheduler's compute stream and the bound device bytes
(prefetched slots, stock scratch, device-resident inputs). ``torch_compute`` and
``dlpack_compute`` adapt a function over arrays into that shape: the bytes become arrays of
the library without a copy (DLPack), typed by ``layouts``, and the library's work goes to the
scheduler's compute stream, so it is ordered after the copies the split waits for and before
the slot is handed to the next copy.

The arrays alias memory the scheduler reuses: they are valid during the call only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends.base import Stream
from .backends.dlpack import DLDeviceType, TypedView
from .errors import InvalidArgument
from .scheduler.plan import Bindings, ComputeFn

if TYPE_CHECKING:
    import torch

Layout = tuple[Any, "int | Sequence[int]"]
"""(dtype, shape) of one bound input: a numpy dtype-like, "bfloat16" or a torch dtype, and a shape."""

Layouts = Mapping[str, Layout]


def typed_bindings(stream: Stream, bindings: Bindings, layouts: Layouts | None = None) -> dict[str, TypedView]:
    """The bound views as typed views whose producer stream is ``stream``.

    Inputs without a layout are uint8 and 1-D over their bytes; a layout naming no input is an
    InvalidArgument (a misspelt name would otherwise go unnoticed).
    """
    layouts = layouts or {}
    unknown = sorted(set(layouts) - set(bindings))
    if unknown:
        raise InvalidArgument(
            f"layouts name {unknown}, which the split does not bind; it binds {sorted(bindings)}",
            call="typed_bindings",
        )
    typed = {}
    for name, view in bindings.items():
        dtype, shape = layouts.get(name, (np.uint8, None))
        typed[name] = view.as_array(dtype, shape, stream=stream)
    return typed


def dlpack_compute(
    fn: Callable[[dict[str, Any], Stream], None],
    from_dlpack: Callable[[Any], Any],
    layouts: Layouts | None = None,
) -> ComputeFn:
    """A ComputeFn calling ``fn(arrays, stream)`` with arrays made by ``from_dlpack`` (numpy's, CuPy's).

    The consumer is ordered after the producer stream as DLPack says: a GPU consumer passes its
    current stream and has it wait; a CPU consumer (the simulator's memory) makes the host wait
    for the compute stream, so ``fn`` may compute on the host at once.
    """

    def compute(stream: Stream, bindings: Bindings) -> None:
        arrays = {name: from_dlpack(t) for name, t in typed_bindings(stream, bindings, layouts).items()}
        fn(arrays, stream)

    return compute


def torch_compute(
    fn: Callable[[dict[str, torch.Tensor], torch.cuda.Stream | None], None],
    layouts: Layouts | None = None,
) -> ComputeFn:
    """A ComputeFn calling ``fn(tensors, torch_stream)`` with torch tensors over the bound bytes.

    On a GPU, ``torch_stream`` is the scheduler's compute stream wrapped as a
    torch.cuda.ExternalStream and is torch's current stream during the call, so plain torch
    code enqueues there. On the simulator the tensors are CPU tensors over its memory, the
    host has waited for the compute stream, and ``torch_stream`` is None.
    """
    import torch

    def compute(stream: Stream, bindings: Bindings) -> None:
        typed = typed_bindings(stream, bindings, layouts)
        device_type, index = stream.device.dlpack_device
        if device_type is DLDeviceType.CPU:
            fn({name: torch.from_dlpack(t) for name, t in typed.items()}, None)
            return
        torch_stream = torch.cuda.ExternalStream(stream.handle, device=torch.device("cuda", index))
        with torch.cuda.stream(torch_stream):
            # torch passes its current stream, the producer stream itself: no event is needed.
            tensors = {name: torch.from_dlpack(t) for name, t in typed.items()}
            fn(tensors, torch_stream)

    return compute


__all__ = ["Layout", "Layouts", "dlpack_compute", "torch_compute", "typed_bindings"]
