"""Device-side helpers shared by the kernel tests: upload, poison, run, read back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.backends.base import Device, DeviceBuffer, Stream, Usage
from expertstream.errors import HazardError
from expertstream.kernels import MoeKernels
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS, TileM, weight_format

POISON = 0xFF  # every float32 made of these bytes is a NaN: an unwritten output cannot pass

ALL_TYPES = tuple(FORMATS)
QUANTIZED = tuple(t for t in ALL_TYPES if FORMATS[t].quantized)
FLOAT = tuple(t for t in ALL_TYPES if not FORMATS[t].quantized)


@dataclass(frozen=True)
class Shape:
    n_expert: int
    n_out: int
    n_in: int
    n_tokens: int
    top_k: int
    x_per_pair: bool = False

    @property
    def n_pairs(self) -> int:
        return self.n_tokens * self.top_k


@dataclass
class Problem:
    """One mul_mat_id problem: host inputs and the device buffers holding them."""

    shape: Shape
    w_type: GGMLQuantizationType
    w: np.ndarray
    x: np.ndarray
    ids: np.ndarray
    w_buf: DeviceBuffer
    x_buf: DeviceBuffer
    ids_buf: DeviceBuffer

    def reference(self) -> np.ndarray:
        s = self.shape
        return ref.mul_mat_id(self.w, self.w_type, s.n_expert, s.n_out, s.n_in, self.x, self.ids)

    def gemv_reference(self) -> np.ndarray:
        """The reference of the matrix-vector kernels (their int8 activations where the type has them)."""
        s = self.shape
        return ref.mul_mat_vec_id(self.w, self.w_type, s.n_expert, s.n_out, s.n_in, self.x, self.ids)


def distinct_ids(rng: np.random.Generator, n_tokens: int, top_k: int, experts: np.ndarray) -> np.ndarray:
    """int32 [n_tokens, top_k]: each token picks top_k different experts from ``experts``."""
    return np.stack([rng.choice(experts, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int32)


def poisoned(device: Device, nbytes: int) -> DeviceBuffer:
    buf = device.alloc(nbytes)
    buf.write(np.full(nbytes, POISON, np.uint8))
    return buf


def make_problem(
    device: Device, rng: np.random.Generator, w_type: GGMLQuantizationType, shape: Shape, ids: np.ndarray
) -> Problem:
    s = shape
    w = ref.random_weights(rng, w_type, s.n_expert * s.n_out, s.n_in)
    w_buf = device.alloc(w.nbytes, Usage.WEIGHTS, row_type=w_type, ne0=s.n_in)
    w_buf.write(w)
    x_shape = (s.n_tokens, s.top_k, s.n_in) if s.x_per_pair else (s.n_tokens, s.n_in)
    x = rng.standard_normal(x_shape).astype(np.float32)
    return Problem(s, w_type, w, x, ids, w_buf, device.upload(x), device.upload(np.ascontiguousarray(ids)))


def run(
    kernels: MoeKernels,
    stream: Stream,
    p: Problem,
    ids_buf: DeviceBuffer | None = None,
    tile_m: TileM | None = None,
    gemv: bool | None = None,
) -> np.ndarray:
    """y [n_tokens, top_k, n_out] from a freshly poisoned output buffer."""
    s = p.shape
    y_buf = poisoned(kernels.device, s.n_pairs * s.n_out * 4)
    kernels.mul_mat_id(
        stream,
        p.w_buf,
        p.w_type,
        s.n_expert,
        s.n_out,
        s.n_in,
        p.x_buf,
        s.x_per_pair,
        ids_buf or p.ids_buf,
        s.n_tokens,
        s.top_k,
        y_buf,
        tile_m=tile_m,
        gemv=gemv,
    )
    stream.synchronize()
    y = y_buf.read().view(np.float32).reshape(s.n_tokens, s.top_k, s.n_out)
    y_buf.close()
    return y


def tensor_bytes(w_type: GGMLQuantizationType, shape: Shape) -> int:
    return shape.n_expert * shape.n_out * weight_format(w_type).row_bytes(shape.n_in)


def run_with_dirty_tail(backend_name: str, kernels: MoeKernels, stream: Stream, p: Problem) -> np.ndarray | None:
    """run() after 0xFF bytes are written into the weights' padding tail (past the tensor's bytes); on
    the simulator, whose hazard checker refuses that read, check it does and return None."""
    tail_at = tensor_bytes(p.w_type, p.shape)
    tail = p.w_buf.alloc_size - tail_at
    assert tail > 0, "the weights buffer holds no padding tail"
    p.w_buf.write(np.full(tail, 0xFF, np.uint8), tail_at)
    if backend_name == "sim":
        with pytest.raises(HazardError, match="stale padding"):
            run(kernels, stream, p)
        kernels.device.synchronize()
        return None
    return run(kernels, stream, p)
