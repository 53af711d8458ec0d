"""float64 references of recurrent.cu's kernels, written from llama.cpp's qwen3next graph (its
ggml_ssm_conv and autoregressive delta net): what tests hold the kernels and their twins to."""

from __future__ import annotations

import numpy as np


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def conv_silu(x: np.ndarray, state: np.ndarray, w: np.ndarray, fresh: bool) -> tuple[np.ndarray, np.ndarray]:
    """(out, new state) of ggml_ssm_conv then silu: out[t, c] = silu(sum_i inputs[t + i, c] w[c, i])."""
    kernel = w.shape[1]
    earlier = np.zeros_like(state) if fresh else state
    inputs = np.concatenate([earlier, x]).astype(np.float64)
    out = sum(inputs[i : i + len(x)] * w[:, i] for i in range(kernel))
    return _silu(out), inputs[len(x) :]


def delta_net(
    conv: np.ndarray,
    ba: np.ndarray,
    z: np.ndarray,
    dt: np.ndarray,
    a: np.ndarray,
    norm: np.ndarray,
    state: np.ndarray,
    fresh: bool,
    n_k: int,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(out, new state) in float64, token by token as llama.cpp's autoregressive delta net."""
    n_v, s = state.shape[0], state.shape[1]
    group, key_dim = n_v // n_k, n_k * s
    st = np.zeros((n_v, s, s)) if fresh else state.astype(np.float64)
    out = np.empty((len(conv), n_v, s))
    for t, row in enumerate(conv.astype(np.float64)):
        for h in range(n_v):
            kh = h // group
            q = row[kh * s : (kh + 1) * s]
            k = row[key_dim + kh * s : key_dim + (kh + 1) * s]
            v = row[2 * key_dim + h * s : 2 * key_dim + (h + 1) * s]
            q = q / np.sqrt(q @ q + eps) / np.sqrt(s)
            k = k / np.sqrt(k @ k + eps)
            b, alpha = ba[t, kh * 2 * group + h % group], ba[t, kh * 2 * group + group + h % group]
            beta = 1.0 / (1.0 + np.exp(-b))
            biased = alpha + dt[h]
            decay = np.exp((biased if biased > 20 else np.log1p(np.exp(biased))) * a[h])
            st[h] *= decay
            d = (v - st[h] @ k) * beta
            st[h] += np.outer(d, k)
            o = st[h] @ q
            out[t, h] = o / np.sqrt(o @ o / s + eps) * norm * _silu(z[t, h * s : (h + 1) * s].astype(np.float64))
    return out.reshape(len(conv), -1), st
