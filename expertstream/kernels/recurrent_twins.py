"""numpy twins of recurrent.cu's kernels (see recurrent.py): what the simulator runs for them, in float32
with the kernels' operations (sums in another order, no fused multiply-adds: within rounding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backends.base import BufferView
from ..backends.sim import Access, KernelSpec
from ..backends.sim.kernels import Dim3Tuple
from .recurrent import CONV_KERNELS, STATE_DIMS

Args = tuple[Any, ...]
_F32 = np.float32


def _as_view(arg: Any) -> BufferView:
    return arg if isinstance(arg, BufferView) else arg.view()


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (_F32(1) + np.exp(-x))


# -- conv_silu: x, state, weight, positions, out, n_tokens, channels --------------------------------


def _conv_runner(kernel: int) -> Any:
    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        x_b, state_b, w_b, pos_b, out_b = args[:5]
        n_tokens, channels = int(args[5]), int(args[6])
        state = state_b.view(_F32).reshape(kernel - 1, channels)
        earlier = np.zeros_like(state) if pos_b.view(np.int32)[0] == 0 else state
        inputs = np.concatenate([earlier, x_b.view(_F32).reshape(n_tokens, channels)])
        w = w_b.view(_F32).reshape(channels, kernel)
        acc = np.zeros((n_tokens, channels), _F32)
        for i in range(kernel):
            acc += inputs[i : i + n_tokens] * w[:, i]
        out_b.view(_F32).reshape(n_tokens, channels)[:] = _silu(acc)
        state[:] = inputs[n_tokens:]

    return run


def _conv_accesses(args: Args) -> Sequence[Access]:
    reads = [Access(_as_view(args[i]), write=False) for i in (0, 1, 2, 3)]
    return [*reads, Access(_as_view(args[1]), write=True), Access(_as_view(args[4]), write=True)]


# -- delta_net: conv, ba, dt, a, z, norm, state, positions, out, n_tokens, n_k, n_v, eps ------------


def _delta_runner(s: int) -> Any:
    def run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
        conv_b, ba_b, dt_b, a_b, z_b, norm_b, state_b, pos_b, out_b = args[:9]
        n_tokens, n_k, n_v = int(args[9]), int(args[10]), int(args[11])
        eps = _F32(args[12])
        group = n_v // n_k
        key_dim = n_k * s
        conv = conv_b.view(_F32).reshape(n_tokens, 2 * key_dim + n_v * s)
        heads = np.arange(n_v) // group  # the key head of each value head
        q = conv[:, :key_dim].reshape(n_tokens, n_k, s)[:, heads]
        k = conv[:, key_dim : 2 * key_dim].reshape(n_tokens, n_k, s)[:, heads]
        v = conv[:, 2 * key_dim :].reshape(n_tokens, n_v, s)
        ba = ba_b.view(_F32).reshape(n_tokens, n_k, 2, group)
        beta = (_F32(1) / (_F32(1) + np.exp(-ba[:, :, 0]))).reshape(n_tokens, n_v)
        biased = ba[:, :, 1].reshape(n_tokens, n_v) + dt_b.view(_F32)
        with np.errstate(over="ignore"):
            softplus = np.where(biased > 20, biased, np.log(_F32(1) + np.exp(np.minimum(biased, _F32(20)))))
        decay = np.exp(softplus * a_b.view(_F32))
        q = q / np.sqrt(np.einsum("thi,thi->th", q, q) + eps)[..., None] * (_F32(1) / np.sqrt(_F32(s)))
        k = k / np.sqrt(np.einsum("thi,thi->th", k, k) + eps)[..., None]
        state = state_b.view(_F32).reshape(n_v, s, s)
        st = np.zeros_like(state) if pos_b.view(np.int32)[0] == 0 else state.copy()
        o = np.empty((n_tokens, n_v, s), _F32)
        for t in range(n_tokens):
            st *= decay[t][:, None, None]
            sk = np.einsum("hji,hi->hj", st, k[t])
            d = (v[t] - sk) * beta[t][:, None]
            st += d[:, :, None] * k[t][:, None, :]
            o[t] = np.einsum("hji,hi->hj", st, q[t])
        state[:] = st
        z = z_b.view(_F32).reshape(n_tokens, n_v, s)
        scale = _F32(1) / np.sqrt(np.einsum("thj,thj->th", o, o) / _F32(s) + eps)
        out = o * scale[..., None] * norm_b.view(_F32) * _silu(z)
        out_b.view(_F32)[: out.size] = out.reshape(-1)

    return run


def _delta_accesses(args: Args) -> Sequence[Access]:
    reads = [Access(_as_view(args[i]), write=False) for i in range(8)]
    return [*reads, Access(_as_view(args[6]), write=True), Access(_as_view(args[8]), write=True)]


def _delta_flops(args: Args) -> float:
    n_tokens, n_v = float(args[9]), float(args[11])
    s = _as_view(args[5]).nbytes / 4
    return 6.0 * n_tokens * n_v * s * s


# -- mul_sigmoid: x, gate, n -----------------------------------------------------------------


def _mul_sigmoid_run(args: Args, grid: Dim3Tuple, block: Dim3Tuple) -> None:
    n = int(args[2])
    x = args[0].view(_F32)[:n]
    x *= _F32(1) / (_F32(1) + np.exp(-args[1].view(_F32)[:n]))


def _mul_sigmoid_accesses(args: Args) -> Sequence[Access]:
    x = _as_view(args[0])
    return [Access(x, write=False), Access(_as_view(args[1]), write=False), Access(x, write=True)]


def _conv_flops(args: Args) -> float:
    kernel = _as_view(args[2]).nbytes // (4 * int(args[6]))
    return 2.0 * kernel * float(args[5]) * float(args[6])


def twin_specs() -> list[KernelSpec]:
    """The twin of every kernel recurrent.py launches."""
    specs = [KernelSpec(f"recur_conv_silu_k{k}", _conv_runner(k), _conv_accesses, _conv_flops) for k in CONV_KERNELS]
    specs += [KernelSpec(f"recur_delta_net_s{s}", _delta_runner(s), _delta_accesses, _delta_flops) for s in STATE_DIMS]
    specs.append(KernelSpec("recur_mul_sigmoid", _mul_sigmoid_run, _mul_sigmoid_accesses, lambda a: 4.0 * a[2]))
    return specs
