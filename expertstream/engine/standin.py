"""Launchers of the two kernels the runner puts around each MoE block in place of the rest of a model.

A transformer layer normalizes the hidden state and runs attention before the MoE block; the
runner replaces both with a weightless RMS norm (cheap, deterministic, and it keeps the hidden
state at unit scale layer after layer). After the block, the residual add.
"""

from __future__ import annotations

import numpy as np

from ..backends.base import BufferView, Stream
from ..errors import InvalidArgument
from ..kernels import MoeKernels

_NORM_THREADS = 256  # a power of two: the kernel's tree reduction halves it
_ADD_THREADS = 256
_MAX_ADD_BLOCKS = 65535


def _exact(call: str, name: str, view: BufferView, nbytes: int) -> BufferView:
    if view.nbytes < nbytes or view.offset % 4:
        raise InvalidArgument(
            f"{name} must be a 4-byte aligned view of at least {nbytes} bytes, got {view.nbytes} at offset "
            f"{view.offset}",
            call=call,
        )
    return BufferView(view.buffer, view.offset, nbytes)


def rms_norm(kernels: MoeKernels, stream: Stream, h: BufferView, x: BufferView, n_tokens: int, n: int) -> None:
    """x[t, :] = h[t, :] / sqrt(mean(h[t, :] ** 2) + 1e-6), float32 rows of n elements."""
    call = "rms_norm"
    nbytes = n_tokens * n * 4
    stream.launch(
        kernels.kernel("moe_rms_norm"),
        n_tokens,
        _NORM_THREADS,
        (_exact(call, "h", h, nbytes), _exact(call, "x", x, nbytes), np.int32(n_tokens), np.int32(n)),
        shared_mem=_NORM_THREADS * 4,
    )


def add_inplace(kernels: MoeKernels, stream: Stream, h: BufferView, delta: BufferView, n: int) -> None:
    """h[i] += delta[i] for n float32 elements."""
    call = "add_inplace"
    blocks = min(-(-n // _ADD_THREADS), _MAX_ADD_BLOCKS)
    stream.launch(
        kernels.kernel("moe_add_inplace"),
        blocks,
        _ADD_THREADS,
        (_exact(call, "h", h, n * 4), _exact(call, "delta", delta, n * 4), np.int32(n)),
    )
