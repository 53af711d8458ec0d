"""mul_mat_id at decode sizes: the matrix-vector kernels of gemv.cu against the tile kernels
(``python -m microbench.kernels --gemv``).

One token's pairs on Qwen3-30B-A3B-shaped tensors (128 experts; gate/up [768][2048] with the token's
activation row shared by its pairs, down [2048][768] with one row per pair): 1 pair (one expert, as a
dense projection runs) and 8 (the token's top-8, distinct experts); then gate, up and SwiGLU in one
launch ("gate+up", both tensors' bytes), and the attention projections of one token (one expert, one
pair: "dense q" [4096][2048], "dense k/v" [512][2048], "dense o" [2048][4096]) and its output head ("dense
head" [151936][2048], 255 MB at Q6_K: the one launch of a step long enough to run at the kernel's steady
rate) on the matrix-vector kernel only. A row's time is the device time
per call, back to back behind a gate as kernels.py times them, and its GB/s the weight bytes the call
must read (the rows of the experts its pairs use, each expert once) over that time: against the
device's memory bandwidth, how far decode is from reading each weight once at full speed. "vs gemv"
is each output's relative difference from the matrix-vector kernel's (about 2.4e-3 for the bf16
paths, from their rounding). Last, the device's own reference in the same run: a plain device-to-device
copy (``copy_d2d``) of the largest launch's bytes and of 1 GiB, its GB/s the bytes read and written over
its time (the memory bandwidth a program reaches), so each row's GB/s reads as a share of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from expertstream.backends.base import Device, DeviceBuffer, Stream
from expertstream.bench.probes import expert_weights
from expertstream.kernels import MoeKernels
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import weight_format

from ._common import Column

DEFAULT_TYPES = ("Q4_0", "Q4_K")
PAIRS = (1, 8)
COPY_LARGE_BYTES = 1 << 30  # the plain copy that sets the device's sustained bandwidth
# Qwen3-30B-A3B's attention projections and output head for one token, run as one expert and one pair:
# (name, n_out, n_in).
DENSE_SHAPES = (("q", 4096, 2048), ("k/v", 512, 2048), ("o", 2048, 4096), ("head", 151936, 2048))


@dataclass(frozen=True)
class GemvRow:
    type: str
    tensor: str
    pairs: int
    kernel: str  # "gemv", or the tile kernel family of kernels.FAMILIES
    kernel_ms: float
    weight_mb: float  # bytes of the experts' rows the call reads
    gbs: float
    diff_vs_gemv: float | None  # ||y - y_gemv|| / ||y_gemv|| on the same inputs (None without outputs)


COLUMNS: Sequence[Column] = (
    Column("type", "type"),
    Column("tensor", "tensor"),
    Column("pairs", "pairs"),
    Column("kernel", "kernel"),
    Column("kernel_ms", "kernel ms", "{:.4f}"),
    Column("weight_mb", "weight MB", "{:.2f}"),
    Column("gbs", "GB/s", "{:.0f}"),
    Column("diff_vs_gemv", "vs gemv", "{:.1e}"),
)


def measure(
    device: Device,
    stream: Stream,
    families: dict[str, MoeKernels],
    types: Sequence[str],
    shapes: Sequence[TensorShape],
    n_expert: int,
    seed: int,
    time_ms: Callable[[Callable[[], None]], float],
) -> list[GemvRow]:
    """Every type, shape (TensorShape) and pair count: the matrix-vector kernel, then each
    tile kernel family, on the same weights, routing and activations."""
    rng = np.random.default_rng(seed)
    rows: list[GemvRow] = []
    with MoeKernels(device, gemv=True) as gemv:
        kernels = {"gemv": gemv, **families}
        for type_name in types:
            w_type = GGMLQuantizationType[type_name]
            for shape in shapes:
                with expert_weights(device, rng, w_type, shape.n_out, shape.n_in, n_expert) as w:
                    for pairs in PAIRS:
                        ids = rng.permutation(n_expert)[:pairs].astype(np.int32).reshape(1, pairs)
                        x = rng.standard_normal((pairs if shape.x_per_pair else 1, shape.n_in), dtype=np.float32)
                        problem = (w, w_type, shape, n_expert)
                        rows += _measure_pairs(device, stream, kernels, problem, x, ids, time_ms)
            rows += _measure_gate_up(device, stream, gemv, w_type, shapes[0], n_expert, rng, time_ms)
            for name, n_out, n_in in DENSE_SHAPES:
                with expert_weights(device, rng, w_type, n_out, n_in, 1) as w:
                    x = rng.standard_normal((1, n_in), dtype=np.float32)
                    dense = (w, w_type, TensorShape(f"dense {name}", n_out, n_in, False), 1)
                    ids = np.zeros((1, 1), np.int32)
                    rows += _measure_pairs(device, stream, {"gemv": gemv}, dense, x, ids, time_ms)
    largest = max((r.weight_mb for r in rows), default=0.0)
    return rows + measure_copies(device, stream, (round(largest * 1e6), COPY_LARGE_BYTES), time_ms)


def measure_copies(
    device: Device, stream: Stream, sizes: Sequence[int], time_ms: Callable[[Callable[[], None]], float]
) -> list[GemvRow]:
    """A plain device-to-device copy of each size in bytes: weight_mb the bytes it reads, GB/s the bytes
    it reads and writes over its time."""
    rows = []
    for nbytes in sizes:
        if nbytes <= 0:
            continue
        with device.alloc(nbytes) as src, device.alloc(nbytes) as dst:

            def launch(src: DeviceBuffer = src, dst: DeviceBuffer = dst, nbytes: int = nbytes) -> None:
                stream.copy_d2d(dst, 0, src, 0, nbytes)

            ms = time_ms(launch)
            device.synchronize()
        rows.append(
            GemvRow("-", "copy (read+write)", 0, "copy_d2d", ms, nbytes / 1e6, 2 * nbytes / (ms * 1e-3) / 1e9, None)
        )
    return rows


@dataclass(frozen=True)
class TensorShape:
    """One weight tensor's shape: (n_out, n_in), and whether each pair brings its own activation row."""

    name: str
    n_out: int
    n_in: int
    x_per_pair: bool


def _measure_gate_up(
    device: Device,
    stream: Stream,
    gemv: MoeKernels,
    w_type: GGMLQuantizationType,
    shape: TensorShape,
    n_expert: int,
    rng: np.random.Generator,
    time_ms: Callable[[Callable[[], None]], float],
) -> list[GemvRow]:
    """Gate, up and SwiGLU in one matrix-vector launch (MoeKernels.gate_up) on the gate/up shape: the
    bytes of both tensors' rows over the time of the one launch."""
    rows = []
    with (
        expert_weights(device, rng, w_type, shape.n_out, shape.n_in, n_expert) as w_gate,
        expert_weights(device, rng, w_type, shape.n_out, shape.n_in, n_expert) as w_up,
    ):
        for pairs in PAIRS:
            ids = rng.permutation(n_expert)[:pairs].astype(np.int32).reshape(1, pairs)
            x = rng.standard_normal((1, shape.n_in), dtype=np.float32)
            weight_bytes = 2 * pairs * shape.n_out * weight_format(w_type).row_bytes(shape.n_in)
            with device.upload(x) as x_buf, device.upload(ids) as ids_buf, device.alloc(pairs * shape.n_out * 4) as y:

                def launch(top_k: int = pairs) -> None:
                    gemv.gate_up(
                        stream, w_gate, w_up, w_type, n_expert, shape.n_out, shape.n_in, x_buf, ids_buf, 1, top_k, y
                    )

                ms = time_ms(launch)
                device.synchronize()
            gbs = weight_bytes / (ms * 1e-3) / 1e9
            rows.append(GemvRow(w_type.name, "gate+up", pairs, "gemv", ms, weight_bytes / 1e6, gbs, None))
    return rows


def _measure_pairs(
    device: Device,
    stream: Stream,
    kernels: dict[str, MoeKernels],
    problem: tuple[DeviceBuffer, GGMLQuantizationType, TensorShape, int],
    x: np.ndarray,
    ids: np.ndarray,
    time_ms: Callable[[Callable[[], None]], float],
) -> list[GemvRow]:
    """One problem, (weights, their type, TensorShape, experts), through each of ``kernels``
    (the first the matrix-vector one)."""
    w, w_type, shape, n_expert = problem
    pairs = ids.size
    weight_bytes = pairs * shape.n_out * weight_format(w_type).row_bytes(shape.n_in)  # distinct experts
    rows = []
    gemv_output: np.ndarray | None = None
    with device.upload(x) as x_buf, device.upload(ids) as ids_buf, device.alloc(pairs * shape.n_out * 4) as y:
        for name, family in kernels.items():
            if family.uses_gemv(pairs) != (name == "gemv"):
                raise AssertionError(f"{name}: the launcher's choice is not the kernel this row names")

            def launch(family: MoeKernels = family) -> None:
                family.mul_mat_id(
                    stream, w, w_type, n_expert, shape.n_out, shape.n_in, x_buf, shape.x_per_pair, ids_buf, 1, pairs, y
                )

            ms = time_ms(launch)
            diff = None
            if device.backend.host.holds_data:
                output = y.read().view(np.float32)
                gemv_output = output if gemv_output is None else gemv_output
                diff = ref.relative_error(output, gemv_output)
            gbs = weight_bytes / (ms * 1e-3) / 1e9
            rows.append(GemvRow(w_type.name, shape.name, pairs, name, ms, weight_bytes / 1e6, gbs, diff))
    return rows
