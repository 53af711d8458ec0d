"""Launchers of recurrent.cu: qwen3next's gated delta net layers and its gated attention's output gate.

- ``conv_silu``: the causal convolution of a token batch's projected q, k and v channels over the
  last ``CONV_KERNELS`` inputs, its state carried between batches, then silu;
- ``delta_net``: the gated delta rule of every value head over the batch's tokens in order, its
  state carried between batches, ending in the head's gated RMS norm;
- ``mul_sigmoid``: x *= sigmoid(gate).

A batch whose first position is 0 starts a sequence: both states are taken as zeros there (the
kernels read the position on the device, so a captured decode step replays right). Every function
only enqueues work on the given stream; shapes are float32 row-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import Stream
from ..errors import InvalidArgument
from . import layout
from .args import ViewLike, fits_int32, positive, view

if TYPE_CHECKING:
    from .launcher import MoeKernels

CONV_KERNELS = (4,)  # convolution widths with a kernel instance
STATE_DIMS = (32, 64, 128)  # head widths of the delta rule with a kernel instance
CONV_THREADS = 128


def conv_silu(
    kernels: MoeKernels,
    stream: Stream,
    x: ViewLike,
    state: ViewLike,
    weight: ViewLike,
    positions: ViewLike,
    out: ViewLike,
    n_tokens: int,
    channels: int,
    kernel: int,
) -> None:
    """out[t, c] = silu(sum_i inputs[t + i, c] * weight[c, i]), inputs the state's kernel - 1 rows
    (zeros where positions[0] is 0) then x [n_tokens, channels]; state [kernel - 1, channels]
    becomes the last kernel - 1 inputs. weight [channels, kernel] (ssm_conv1d)."""
    call = "conv_silu"
    positive(call, n_tokens=n_tokens, channels=channels)
    if kernel not in CONV_KERNELS:
        raise InvalidArgument(f"no convolution kernel spans {kernel} tokens", call=call, hint=f"spans: {CONV_KERNELS}")
    fits_int32(call, x=n_tokens * channels)
    args = (
        view(call, "x", x, n_tokens * channels * 4),
        view(call, "state", state, (kernel - 1) * channels * 4),
        view(call, "weight", weight, channels * kernel * 4),
        view(call, "positions", positions, 4),
        view(call, "out", out, n_tokens * channels * 4),
        np.int32(n_tokens),
        np.int32(channels),
    )
    grid = -(-channels // CONV_THREADS)
    stream.launch(kernels.kernel(f"recur_conv_silu_k{kernel}"), grid, CONV_THREADS, args)


@dataclass(frozen=True)
class DeltaNetInputs:
    """A batch's rows for ``delta_net``: conv [n_tokens, 2 * n_k * S + n_v * S] (conv_silu's q, k, v),
    ba [n_tokens, 2 * n_v] (ssm_ba's), z [n_tokens, n_v * S] (attn_gate's); the layer's dt, a [n_v]
    and norm [S] weights; the positions int32 [n_tokens]."""

    conv: ViewLike
    ba: ViewLike
    z: ViewLike
    dt: ViewLike
    a: ViewLike
    norm: ViewLike
    positions: ViewLike


def delta_net(
    kernels: MoeKernels,
    stream: Stream,
    rows: DeltaNetInputs,
    state: ViewLike,
    out: ViewLike,
    n_tokens: int,
    n_k: int,
    n_v: int,
    head_dim: int,
    eps: float,
) -> None:
    """out [n_tokens, n_v * head_dim]: each value head h's gated delta rule over the tokens in order, as
    llama.cpp's qwen3next computes it. Key head h // (n_v // n_k) gives its q and k, L2-normed (q then
    over sqrt(head_dim)); beta = sigmoid(b), decay = exp(softplus(alpha + dt[h]) * a[h]) from the ba
    row (per key head: its value heads' b, then their alpha); state [n_v, head_dim, head_dim] (value
    row, key column; zeros where positions[0] is 0): S = decay S, S += beta (v - S k) k^T, o = S q; out
    = o over its RMS times norm and silu(z)."""
    call = "delta_net"
    positive(call, n_tokens=n_tokens, n_k=n_k, n_v=n_v, head_dim=head_dim)
    if head_dim not in STATE_DIMS:
        hint = f"widths: {STATE_DIMS}"
        raise InvalidArgument(f"no delta-rule kernel for heads {head_dim} wide", call=call, hint=hint)
    if n_v % n_k:
        raise InvalidArgument(f"{n_v} value heads cannot share {n_k} key heads evenly", call=call)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise InvalidArgument(f"eps must be a finite number >= 0, got {eps!r}", call=call)
    width = (2 * n_k + n_v) * head_dim
    fits_int32(call, conv=n_tokens * width)
    value = n_tokens * n_v * head_dim * 4
    args = (
        view(call, "conv", rows.conv, n_tokens * width * 4),
        view(call, "ba", rows.ba, n_tokens * 2 * n_v * 4),
        view(call, "dt", rows.dt, n_v * 4),
        view(call, "a", rows.a, n_v * 4),
        view(call, "z", rows.z, value),
        view(call, "norm", rows.norm, head_dim * 4),
        view(call, "state", state, n_v * head_dim * head_dim * 4),
        view(call, "positions", rows.positions, n_tokens * 4),
        view(call, "out", out, value),
        np.int32(n_tokens),
        np.int32(n_k),
        np.int32(n_v),
        np.float32(eps),
    )
    stream.launch(kernels.kernel(f"recur_delta_net_s{head_dim}"), n_v, head_dim, args)


def mul_sigmoid(kernels: MoeKernels, stream: Stream, x: ViewLike, gate: ViewLike, n: int) -> None:
    """x[i] *= 1 / (1 + exp(-gate[i])) for i < n."""
    call = "mul_sigmoid"
    positive(call, n=n)
    fits_int32(call, x=n)
    args = (view(call, "x", x, n * 4), view(call, "gate", gate, n * 4), np.int32(n))
    blocks = min(-(-n // layout.ELEMENTWISE_THREADS), layout.MAX_GRID_Y)
    stream.launch(kernels.kernel("recur_mul_sigmoid"), blocks, layout.ELEMENTWISE_THREADS, args)


__all__ = ["CONV_KERNELS", "STATE_DIMS", "DeltaNetInputs", "conv_silu", "delta_net", "mul_sigmoid"]
