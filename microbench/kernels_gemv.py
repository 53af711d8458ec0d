"""mul_mat_id at decode sizes: the matrix-vector kernels of gemv.cu against the tile kernels
(``python -m microbench.kernels --gemv``).

One token's pairs on Qwen3-30B-A3B-shaped tensors (128 experts; gate/up [768][2048] with the token's
activation row shared by its pairs, down [2048][768] with one row per pair): 1 pair (one expert, as a
dense projection runs) and 8 (the token's top-8, distinct experts); then gate, up and SwiGLU in one
launch ("gate+up", both tensors' bytes), and the attention projections of one token (one expert, one
pair: "dense q" [4096][2048], "dense k/v" [512][2048], "dense o" [2048][4096]) and its output head ("dense
head" [151936][2048], 255 MB at Q6_K: the one launch of a step long enough to run at the kernel's steady
rate) on the matrix-vector kernel only; and "gate+up,down": the fused gate launch and the down launch
that reads its output, back to back as a decode step runs them. A row's time is the device
time per call, back to back behind a gate as kernels.py times them, and its GB/s the weight bytes the
call must read (the rows of the experts its pairs use, each expert once) over that time: against the
device's memory bandwidth, how far decode is from reading each weight once at full speed. Calls in
turn read other weights, as a decode step's layers do: the expert rows rotate through disjoint sets
of experts, and a dense row through copies of its tensor, at least ROTATION_BYTES in all (several
times a GPU's L2), so no call finds the rows the calls before it read in L2. "vs gemv"
is each output's relative difference from the matrix-vector kernel's (about 2.4e-3 for the bf16
paths, from their rounding). Last, the device's own reference in the same run: a plain device-to-device
copy (``copy_d2d``) of the largest launch's bytes and of 1 GiB, its GB/s the bytes read and written over
its time (the memory bandwidth a program reaches), so each row's GB/s reads as a share of it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from expertstream._closing import Closing
from expertstream.backends.base import BufferView, Device, DeviceBuffer, Stream, Usage
from expertstream.bench.probes import expert_weights
from expertstream.ggml import padded_size
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
ROTATION_BYTES = 256 << 20  # the weights calls in turn read, at least: past any GPU's L2 (50 MB on an H100)


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
                        x = rng.standard_normal((pairs if shape.x_per_pair else 1, shape.n_in), dtype=np.float32)
                        problem = ([w], w_type, shape, n_expert)
                        ids = rotating_ids(rng, n_expert, pairs)
                        rows += _measure_pairs(device, stream, kernels, problem, x, ids, time_ms)
            rows += _measure_gate_up(device, stream, gemv, w_type, shapes, n_expert, rng, time_ms)
            for name, n_out, n_in in DENSE_SHAPES:
                tensor_bytes = n_out * weight_format(w_type).row_bytes(n_in)
                copies = max(1, -(-ROTATION_BYTES // tensor_bytes))
                with _dense_copies(device, rng, w_type, n_out, n_in, copies) as views:
                    x = rng.standard_normal((1, n_in), dtype=np.float32)
                    dense = (views, w_type, TensorShape(f"dense {name}", n_out, n_in, False), 1)
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


@contextlib.contextmanager
def _dense_copies(
    device: Device, rng: np.random.Generator, w_type: GGMLQuantizationType, n_out: int, n_in: int, copies: int
) -> Iterator[list[BufferView]]:
    """``copies`` copies of one random [n_out][n_in] tensor side by side in one buffer, each followed by
    its padding tail of zeros: one view each."""
    tensor_bytes = n_out * weight_format(w_type).row_bytes(n_in)
    stride = padded_size(tensor_bytes, w_type, n_in)
    with device.alloc(copies * stride, Usage.WEIGHTS, row_type=w_type, ne0=n_in) as buf:
        with device.stream() as stream:
            stream.memset(buf, 0, buf.alloc_size, 0)  # zeros where the backend holds no data
            stream.synchronize()
            if device.backend.host.holds_data:
                one = np.zeros(stride, np.uint8)
                one[:tensor_bytes] = ref.random_weights(rng, w_type, n_out, n_in).reshape(-1)
                buf.write(np.tile(one, copies))
                for i in range(copies if stride > tensor_bytes else 0):  # each tail zeroed after the copy
                    stream.memset(buf, i * stride + tensor_bytes, stride - tensor_bytes, 0)
                stream.synchronize()
        yield [BufferView(buf, i * stride, stride) for i in range(copies)]


def rotating_ids(rng: np.random.Generator, n_expert: int, pairs: int) -> np.ndarray:
    """[n_expert // pairs, pairs] ids: each row a token's distinct experts, no expert in two rows, so
    calls taking the rows in turn read each expert once per n_expert // pairs calls."""
    sets = n_expert // pairs
    return rng.permutation(n_expert)[: sets * pairs].astype(np.int32).reshape(sets, pairs)


class _Turns(Closing):
    """The rows of an [n, ...] array, uploaded, as views taken in turn (one a call), so calls in turn
    read other weights."""

    def __init__(self, device: Device, rows: np.ndarray) -> None:
        self.buf = device.upload(rows)
        self.row_bytes = rows[0].nbytes
        self.n = len(rows)
        self.at = 0

    def row(self, i: int) -> BufferView:
        return BufferView(self.buf, i * self.row_bytes, self.row_bytes)

    def next(self) -> BufferView:
        view = self.row(self.at)
        self.at = (self.at + 1) % self.n
        return view

    def close(self) -> None:
        self.buf.close()


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
    shapes: Sequence[TensorShape],
    n_expert: int,
    rng: np.random.Generator,
    time_ms: Callable[[Callable[[], None]], float],
) -> list[GemvRow]:
    """Gate, up and SwiGLU in one matrix-vector launch (MoeKernels.gate_up) on the gate/up shape (shapes[0]):
    the bytes of both tensors' rows over the time of the one launch. Then for 8 pairs, that launch and
    down's (shapes[1]) on its output."""
    rows = []
    shape, down = shapes[0], shapes[1]
    fmt = weight_format(w_type)
    down_expert_bytes = down.n_out * fmt.row_bytes(down.n_in)
    dims = (n_expert, shape.n_out, shape.n_in)
    with (
        expert_weights(device, rng, w_type, shape.n_out, shape.n_in, n_expert) as w_gate,
        expert_weights(device, rng, w_type, shape.n_out, shape.n_in, n_expert) as w_up,
        expert_weights(device, rng, w_type, down.n_out, down.n_in, n_expert) as w_down,
    ):
        for pairs in PAIRS:
            x = rng.standard_normal((1, shape.n_in), dtype=np.float32)
            weight_bytes = 2 * pairs * shape.n_out * fmt.row_bytes(shape.n_in)
            turns = _Turns(device, rotating_ids(rng, n_expert, pairs))
            with turns, device.upload(x) as x_buf, device.alloc(pairs * shape.n_out * 4) as act:

                def launch(top_k: int = pairs, turns: _Turns = turns) -> None:
                    gemv.gate_up(stream, w_gate, w_up, w_type, *dims, x_buf, turns.next(), 1, top_k, act)

                ms = time_ms(launch)
                device.synchronize()
                rows.append(
                    GemvRow(w_type.name, "gate+up", pairs, "gemv", ms, weight_bytes / 1e6, _gbs(weight_bytes, ms), None)
                )
                if pairs == 1:
                    continue
                both_bytes = weight_bytes + pairs * down_expert_bytes
                with device.alloc(pairs * down.n_out * 4) as y:

                    def launch_both(top_k: int = pairs, turns: _Turns = turns) -> None:
                        ids = turns.next()
                        gemv.gate_up(stream, w_gate, w_up, w_type, *dims, x_buf, ids, 1, top_k, act)
                        gemv.mul_mat_id(
                            stream, w_down, w_type, n_expert, down.n_out, down.n_in, act, True, ids, 1, top_k, y
                        )

                    ms = time_ms(launch_both)
                    device.synchronize()
                row = GemvRow(
                    w_type.name, "gate+up,down", pairs, "gemv", ms, both_bytes / 1e6, _gbs(both_bytes, ms), None
                )
                rows.append(row)
    return rows


def _gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _measure_pairs(
    device: Device,
    stream: Stream,
    kernels: dict[str, MoeKernels],
    problem: tuple[Sequence[DeviceBuffer | BufferView], GGMLQuantizationType, TensorShape, int],
    x: np.ndarray,
    ids: np.ndarray,
    time_ms: Callable[[Callable[[], None]], float],
) -> list[GemvRow]:
    """One problem, (copies of the weights, their type, TensorShape, experts), through each of ``kernels``
    (the first the matrix-vector one): each call the next copy and the next row of ``ids`` ([turns,
    pairs]), in turn; the outputs compared after one more call on the first of both."""
    copies, w_type, shape, n_expert = problem
    pairs = ids.shape[1]
    weight_bytes = pairs * shape.n_out * weight_format(w_type).row_bytes(shape.n_in)  # distinct experts
    rows = []
    gemv_output: np.ndarray | None = None
    turns, weights = _Turns(device, ids), itertools.cycle(copies)
    with turns, device.upload(x) as x_buf, device.alloc(pairs * shape.n_out * 4) as y:
        for name, family in kernels.items():
            if family.uses_gemv(pairs) != (name == "gemv"):
                raise AssertionError(f"{name}: the launcher's choice is not the kernel this row names")

            def call(w: DeviceBuffer | BufferView, ids_view: BufferView, family: MoeKernels = family) -> None:
                family.mul_mat_id(
                    stream, w, w_type, n_expert, shape.n_out, shape.n_in, x_buf, shape.x_per_pair, ids_view, 1, pairs, y
                )

            def launch(call: Callable[[DeviceBuffer | BufferView, BufferView], None] = call) -> None:
                call(next(weights), turns.next())

            ms = time_ms(launch)
            diff = None
            if device.backend.host.holds_data:
                call(copies[0], turns.row(0))
                stream.synchronize()
                output = y.read().view(np.float32)
                gemv_output = output if gemv_output is None else gemv_output
                diff = ref.relative_error(output, gemv_output)
            rows.append(
                GemvRow(w_type.name, shape.name, pairs, name, ms, weight_bytes / 1e6, _gbs(weight_bytes, ms), diff)
            )
    return rows
