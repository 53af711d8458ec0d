"""Checks every kernel launcher applies to its arguments before anything is enqueued."""

from __future__ import annotations

import numpy as np

from ..backends.base import BufferView, DeviceBuffer
from ..errors import InvalidArgument
from ..ggml import padded_size
from . import layout

ViewLike = DeviceBuffer | BufferView


def positive(call: str, **values: int) -> None:
    """Each value a positive int32, else InvalidArgument naming it."""
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or not 1 <= value <= layout.MAX_INT32:
            raise InvalidArgument(f"{name} must be a positive int32, got {value!r}", call=call)


def view(call: str, name: str, arg: ViewLike, nbytes: int, align: int = 4) -> BufferView:
    """``arg`` as a view of exactly ``nbytes``, checked for size and alignment."""
    if isinstance(arg, DeviceBuffer):
        arg = arg.view()
    if not isinstance(arg, BufferView):
        raise InvalidArgument(f"{name} must be a DeviceBuffer or BufferView, got {type(arg).__name__}", call=call)
    if arg.nbytes < nbytes:
        raise InvalidArgument(f"{name} holds {arg.nbytes} bytes but the shapes need {nbytes}", call=call)
    if arg.offset % align:
        raise InvalidArgument(f"{name} starts at byte offset {arg.offset}, not a multiple of {align}", call=call)
    return BufferView(arg.buffer, arg.offset, nbytes)


def weight_view(
    call: str, name: str, w: ViewLike, fmt: layout.WeightFormat, n_expert: int, n_out: int, n_in: int, align: int
) -> BufferView:
    """``w`` as a view of ``n_expert`` tensors of ``n_out`` rows of ``n_in`` elements of ``fmt``, with
    ggml's padding tail after the last row, checked as ``view`` checks."""
    return view(call, name, w, padded_size(n_expert * n_out * fmt.row_bytes(n_in), fmt.qtype, n_in), align)


def fits_int32(call: str, **counts: int) -> None:
    """Each count of elements indexable by int32, else InvalidArgument naming it."""
    for name, count in counts.items():
        if count > layout.MAX_INT32:
            raise InvalidArgument(f"{name} has {count} elements, more than int32 indexing allows", call=call)
