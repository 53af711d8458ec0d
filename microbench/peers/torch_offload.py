"""A PyTorch peer: the prefetch offloader of vLLM and SGLang, on the plan expertstream runs.

The offloader's shape: every offloaded weight sits in pinned host memory; a static pool of
``prefetch_step`` device buffers receives them, weight i going to buffer ``i % prefetch_step``;
one copy stream carries the copies, each followed by a copy-done event that the compute stream
waits on before the layer that reads the weight. The copy into a buffer waits for the event
recorded after the last layer that read it, and the copies for up to ``prefetch_step - 1``
later layers are in flight while a layer computes.

Compute: the peer does not redo the MoE math. Each weight-consuming split runs a device spin
(``torch.cuda._sleep``) calibrated to last as long as one split of expertstream's own kernels
took in the compute-only run of the same plan. Both sides then move the same bytes in the same
order against the same compute time, so the comparison measures the streaming machinery alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_CALIBRATION_CYCLES = 50_000_000


@dataclass(frozen=True)
class PeerResult:
    prefetch_step: int
    splits: int
    wall_s: float
    bytes_h2d: int
    compute_s_per_split: float

    @property
    def h2d_gbps(self) -> float:
        return self.bytes_h2d / self.wall_s / 1e9


class PrefetchOffloader:
    """Pinned host copies of some weights and a pool of device buffers they are streamed into."""

    def __init__(self, pinned: Sequence[Any], prefetch_step: int, device_index: int = 0) -> None:
        import torch

        if prefetch_step < 1:
            raise ValueError(f"prefetch_step must be >= 1, got {prefetch_step}")
        self._torch = torch
        self.device = torch.device("cuda", device_index)
        self.prefetch_step = prefetch_step
        self.host = list(pinned)
        largest = max(h.numel() for h in self.host)
        self.pool = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(prefetch_step)]
        self.copy_stream = torch.cuda.Stream(self.device)
        self._cycles_per_s = self._calibrate()

    def _calibrate(self) -> float:
        """Spin cycles per second of ``torch.cuda._sleep`` on this device."""
        torch = self._torch
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_CALIBRATION_CYCLES // 10)  # warm-up
            start.record()
            torch.cuda._sleep(_CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            return _CALIBRATION_CYCLES / (start.elapsed_time(end) * 1e-3)

    def run(self, order: Sequence[int], compute_s_per_split: float) -> PeerResult:
        """Stream ``host[order[i]]`` for split i and spin ``compute_s_per_split`` on it; wall time."""
        torch = self._torch
        cycles = max(1, int(compute_s_per_split * self._cycles_per_s))
        step = self.prefetch_step
        with torch.cuda.device(self.device):
            compute = torch.cuda.current_stream(self.device)
            copy_done = [torch.cuda.Event() for _ in order]
            buffer_free = [torch.cuda.Event() for _ in range(step)]
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()

            def fire(i: int) -> None:
                source = self.host[order[i]]
                with torch.cuda.stream(self.copy_stream):
                    self.copy_stream.wait_event(buffer_free[i % step])  # no-op before its first record
                    self.pool[i % step][: source.numel()].copy_(source, non_blocking=True)
                    copy_done[i].record(self.copy_stream)

            for i in range(min(step, len(order))):
                fire(i)
            for i in range(len(order)):
                compute.wait_event(copy_done[i])
                torch.cuda._sleep(cycles)
                buffer_free[i % step].record(compute)
                if i + step < len(order):
                    fire(i + step)
            torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - start
        moved = sum(int(self.host[j].numel()) for j in order)
        return PeerResult(step, len(order), wall, moved, compute_s_per_split)


def pin(weights: Sequence[np.ndarray]) -> list[Any]:
    """Pinned host copies of the weights (torch uint8 tensors), as the offloader keeps them."""
    import torch

    pinned = []
    for weight in weights:
        tensor = torch.empty(weight.nbytes, dtype=torch.uint8, pin_memory=True)
        tensor.numpy()[:] = weight.reshape(-1).view(np.uint8)
        pinned.append(tensor)
    return pinned


def run_peer(
    weights: Sequence[np.ndarray],
    order: Sequence[int],
    prefetch_steps: Sequence[int],
    compute_s_per_split: float,
    device_index: int = 0,
) -> list[PeerResult]:
    """One timed run per prefetch step (after a warm-up over the first few splits)."""
    pinned = pin(weights)
    results = []
    for step in prefetch_steps:
        offloader = PrefetchOffloader(pinned, step, device_index)
        offloader.run(order[: 2 * step], compute_s_per_split)
        result = offloader.run(order, compute_s_per_split)
        logger.info("torch peer, prefetch_step %d: %.3f s, %.1f GB/s", step, result.wall_s, result.h2d_gbps)
        results.append(result)
        del offloader
    return results
