"""How long the simulator's numpy kernels take for a run with data: an estimate, said before a long run.

Without a GPU the simulator computes each expert matmul with numpy (kernels/twins.py): it decodes
every used expert's quantized rows, rounds them to bf16 and multiplies. At real model sizes that
is seconds per ubatch, so a matrix of rows can take hours where --timing-only takes seconds. The
estimate times those steps on one expert of each kind of expert tensor in the model and counts how
often the run repeats them; copies, routing and the rest are left out, and a busy host runs slower
or faster than its sample, so it is rough: on a shared 2-core machine, runs of a 2-layer
Qwen3-30B-A3B file took from half to 2.4 times what it said.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..bench.measure import Settings
from ..kernels.quants import decode_rows
from ..kernels.twins import round_to_bf16
from ..model import MoeModel
from ..model.loader import TensorInfo

SAY_FROM_S = 60.0
# Below this much expert data decoded over the whole run, the run is short whatever numpy's rate:
# not worth timing a sample.
SAMPLE_FROM_BYTES = 200 << 20
SAMPLE_PAIRS = 64  # rows of activations the matmul sample multiplies


@dataclass(frozen=True)
class ExpertCost:
    """What the numpy kernels take for one expert of one kind of tensor."""

    decode_s: float  # decode its rows and round them to bf16
    flops_per_s: float  # the matmul's rate


Kind = tuple[int, tuple[int, ...]]  # a tensor's type and shape
Sampler = Callable[[MoeModel, TensorInfo], ExpertCost]


def time_one_expert(model: MoeModel, tensor: TensorInfo) -> ExpertCost:
    """Time the numpy kernels' steps on the first expert of ``tensor`` (its own bytes)."""
    n_in, n_out = tensor.ne[0], tensor.ne[1]
    rows = np.asarray(model.raw(tensor)[: tensor.slice_nbytes]).reshape(n_out, -1)
    started = time.perf_counter()
    weights = round_to_bf16(decode_rows(rows, tensor.qtype))
    decoded = time.perf_counter()
    acts = np.ones((SAMPLE_PAIRS, weights.shape[1]), np.float32)
    np.einsum("mk,nk->mn", acts, weights)
    multiplied = time.perf_counter()
    flops = 2.0 * SAMPLE_PAIRS * n_in * n_out
    return ExpertCost(decoded - started, flops / max(multiplied - decoded, 1e-9))


def _passes(settings: Settings) -> list[tuple[int, int]]:
    """(how many times, tokens) of every pass over the model's layers that ``measure`` makes."""
    batching = settings.batching
    rows = len(settings.slots) * len(settings.host_memory)
    runs = rows + (1 if settings.compute_only else 0)
    counts = [count for _, count in batching.ubatches()]  # a short last ubatch at its own size
    prefill = [(settings.repeats * runs, count) for count in counts]
    if settings.warmup:
        prefill.append((runs, counts[0]))  # the warm-up runs the first ubatch
    steps = batching.decode_steps
    decode = rows * (settings.repeats * steps + (1 if settings.warmup else 0)) if steps else 0
    return [*prefill, (decode, 1)]


def numpy_seconds(model: MoeModel, runs: Sequence[Settings], sample: Sampler = time_one_expert) -> float:
    """Roughly how long the simulator's numpy kernels compute ``runs`` of ``model`` (0 when surely short)."""
    passes = [p for settings in runs for p in _passes(settings) if p[0]]
    decoded_bytes = sum(
        times * min(t.ne[2], tokens * model.top_k) * t.slice_nbytes
        for times, tokens in passes
        for t in model.expert_tensors
    )
    if decoded_bytes < SAMPLE_FROM_BYTES:
        return 0.0
    costs: dict[Kind, ExpertCost] = {}
    seconds = 0.0
    for tensor in model.expert_tensors:
        kind = (int(tensor.qtype), tensor.ne)
        if kind not in costs:
            costs[kind] = sample(model, tensor)
        cost = costs[kind]
        for times, tokens in passes:
            used = min(tensor.ne[2], tokens * model.top_k)
            flops = 2.0 * tokens * model.top_k * tensor.ne[0] * tensor.ne[1]
            seconds += times * (used * cost.decode_s + flops / cost.flops_per_s)
    return seconds


__all__ = ["SAY_FROM_S", "ExpertCost", "numpy_seconds", "time_one_expert"]
