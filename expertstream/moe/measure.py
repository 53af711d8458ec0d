"""One prefill (and decode) measurement per slot setting and host memory mode, with its baselines.

Every time is ``backend.host_timestamp()`` read around ``Scheduler.run`` (which drains the
devices before it returns): virtual seconds on the simulator, wall seconds on a GPU. The
baselines come from the same run: the pinned H2D peak through the backend, and the same
prefill plan with every expert tensor already on the device (compute only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import Backend, BufferView, Device, DeviceBuffer, Usage
from ..hostmem import HostMemoryMode, HostWeights
from ..model import MoeModel
from ..scheduler import Plan, RunStats, Scheduler
from .offload import GpuMemory, ResidentExperts, plan_offload
from .report import Row
from .runner import Batching, ExpertData, MoeRunner, sha256

log = logging.getLogger(__name__)

PROBE_MIN_BYTES = 16 << 20
PROBE_MAX_BYTES = 256 << 20
PROBE_REPEATS = 4


@dataclass(frozen=True)
class Settings:
    batching: Batching
    slots: tuple[int, ...]
    host_memory: tuple[HostMemoryMode, ...]
    seed: int = 0
    warmup: bool = True  # run the first ubatch once per row before timing (compiles, allocates slots)
    repeats: int = 1  # timed prefill runs per row; the fastest counts
    ring_threads: int | None = None  # host threads filling the staging ring (None: hostmem's default)
    n_cpu_moe: int | None = None  # experts of the first N MoE layers stream; None: all, unless gpu_memory
    gpu_memory: GpuMemory | None = None  # stream only as many leading layers as needed to fit the rest


@dataclass(frozen=True)
class Baselines:
    h2d_peak_gbps: float
    compute_only_s: float
    compute_only_all_layers: bool  # False: one layer's weights stood in for every layer (did not fit)
    compute_only_sha256: str | None  # the outputs when every layer's own weights were used


@dataclass
class Measurement:
    baselines: Baselines
    rows: list[Row] = field(default_factory=list)


def measure_h2d_peak(backend: Backend, device: Device, nbytes: int) -> float:
    """Pinned host -> device bandwidth in GB/s: the best of a few copies of ``nbytes``."""
    host = device.alloc_pinned(nbytes)
    dst = device.alloc(nbytes, Usage.COMPUTE)
    stream = device.stream()
    try:
        stream.copy_h2d(dst, 0, host, 0, nbytes)  # warm-up: first-touch and mapping costs
        stream.synchronize()
        best = float("inf")
        for _ in range(PROBE_REPEATS):
            start = backend.host_timestamp()
            stream.copy_h2d(dst, 0, host, 0, nbytes)
            stream.synchronize()
            best = min(best, backend.host_timestamp() - start)
        return nbytes / best / 1e9
    finally:
        stream.close()
        dst.close()
        host.close()


def probe_bytes(model: MoeModel) -> int:
    largest = max(t.nbytes for t in model.expert_tensors)
    return int(np.clip(4 * largest, PROBE_MIN_BYTES, PROBE_MAX_BYTES))


class _DeviceExperts:
    """Every expert tensor uploaded once (or layer 0's standing in for all when memory is short)."""

    def __init__(self, runner: MoeRunner) -> None:
        model, device = runner.model, runner.device
        self.views: dict[str, BufferView] = {}
        self._buffers: list[DeviceBuffer] = []
        padded = sum(device.alloc_size(t.nbytes, t.qtype, t.ne0) for t in model.expert_tensors)
        # Half of what is free: the staging slots and activations of later runs need the rest.
        self.all_layers = padded <= device.free_memory() // 2
        layers = model.layers if self.all_layers else model.layers[:1]
        try:
            for layer in layers:
                for info in layer.experts:
                    buf = device.alloc(info.nbytes, Usage.WEIGHTS, row_type=info.qtype, ne0=info.ne0)
                    self._buffers.append(buf)
                    if runner.data:
                        buf.write(model.raw(info))
                    self.views[info.name] = buf.view()
        except BaseException:
            self.close()
            raise
        if not self.all_layers:
            log.warning(
                "%d bytes of experts do not fit in half of %s's free memory: the compute-only baseline uses "
                "layer 0's experts for every layer",
                padded,
                device.label,
            )
            for layer in model.layers[1:]:
                for info, first in zip(layer.experts, model.layers[0].experts, strict=True):
                    self.views[info.name] = self.views[first.name]

    def close(self) -> None:
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()


def _timed_run(backend: Backend, scheduler: Scheduler, plan: Plan, repeats: int = 1) -> tuple[float, RunStats]:
    """The fastest of ``repeats`` runs of ``plan``, and the stats of the last."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = backend.host_timestamp()
        stats = scheduler.run(plan)
        best = min(best, backend.host_timestamp() - start)
    return best, stats


def measure_compute_only(
    backend: Backend, runner: MoeRunner, warmup: bool, repeats: int = 1
) -> tuple[float, bool, str | None]:
    experts = _DeviceExperts(runner)
    try:
        with Scheduler(slots=0) as scheduler:
            if warmup:
                scheduler.run(runner.prefill_plan(experts.views, [0]))
            wall, _ = _timed_run(backend, scheduler, runner.prefill_plan(experts.views), repeats)
        digest = sha256(runner.prefill_output()) if runner.data and experts.all_layers else None
        return wall, experts.all_layers, digest
    finally:
        experts.close()


def measure(
    backend: Backend,
    device: Device,
    model: MoeModel,
    settings: Settings,
    progress: Callable[[str], None] = lambda what: None,
) -> Measurement:
    """Baselines, then one Row per (host memory mode, slot count), modes outermost."""
    with MoeRunner(device, model, settings.batching, seed=settings.seed) as runner:
        peak = measure_h2d_peak(backend, device, probe_bytes(model))
        progress("H2D peak")
        compute_s, all_layers, compute_sha = measure_compute_only(backend, runner, settings.warmup, settings.repeats)
        progress("compute only")
        result = Measurement(Baselines(peak, compute_s, all_layers, compute_sha))
        offload = plan_offload(
            model,
            device,
            n_cpu_moe=settings.n_cpu_moe,
            gpu_memory=settings.gpu_memory,
            slots=max(settings.slots, default=0),
            in_use=runner.device_bytes,
        )
        with ResidentExperts(model, device, offload, upload_data=runner.data) as resident:
            for mode in settings.host_memory:
                ring = {} if settings.ring_threads is None else {"ring_threads": settings.ring_threads}
                with HostWeights.open(model, device, mode, **ring) as weights:
                    for slots in settings.slots:
                        row = _measure_row(backend, runner, weights, resident, slots, settings, result.baselines)
                        result.rows.append(row)
                        progress(f"slots {slots}, {weights.mode.value}")
        return result


def _measure_row(
    backend: Backend,
    runner: MoeRunner,
    weights: HostWeights,
    resident: ResidentExperts,
    slots: int,
    settings: Settings,
    base: Baselines,
) -> Row:
    batching = settings.batching
    experts: ExpertData = resident.experts(weights)
    with Scheduler(slots=slots) as scheduler:
        if settings.warmup:
            scheduler.run(runner.prefill_plan(experts, [0]))
        wall, stats = _timed_run(backend, scheduler, runner.prefill_plan(experts), settings.repeats)
        decode_step_s, decode_bytes = _decode(backend, runner, scheduler, experts)
    prefill_out = runner.prefill_output() if runner.data else None
    decode_out = runner.decode_output() if runner.data and batching.decode_steps else None
    moved = int(stats.total("bytes_prefetched") + stats.total("bytes_stock"))
    transfer_s = moved / (base.h2d_peak_gbps * 1e9)
    stall_ms = stats.total("ready_wait_ms") if slots else max(0.0, wall - base.compute_only_s) * 1e3
    fallbacks: dict[str, int] = {}
    for dev in stats.devices.values():
        for key, count in dev.fallbacks.items():
            fallbacks[key] = fallbacks.get(key, 0) + count
    for fallback in weights.stats.fallbacks:
        fallbacks[f"host_memory_{fallback.requested.value}"] = 1
    h2d_gbps = moved / wall / 1e9
    return Row(
        slots=slots,
        host_memory=weights.mode.value,
        tokens=batching.tokens,
        ubatch=batching.ubatch,
        ttft_s=wall,
        prefill_tokens_per_s=batching.tokens / wall,
        h2d_bytes=moved,
        h2d_gbps=h2d_gbps,
        h2d_pct_of_peak=100.0 * h2d_gbps / base.h2d_peak_gbps,
        transfer_only_s=transfer_s,
        compute_only_s=base.compute_only_s,
        overlap_efficiency=max(transfer_s, base.compute_only_s) / wall,
        stall_ms=stall_ms,
        fires=int(stats.total("fires")),
        fallbacks=fallbacks,
        prefill_sha256=sha256(prefill_out) if prefill_out is not None else "",
        decode_steps=batching.decode_steps,
        decode_tokens_per_s=1.0 / decode_step_s if batching.decode_steps else None,
        decode_bytes=decode_bytes,
        decode_sha256=sha256(decode_out) if decode_out is not None else None,
        output_sha256=sha256(*(a for a in (prefill_out, decode_out) if a is not None)) if runner.data else "",
        nonfinite=sum(int(np.count_nonzero(~np.isfinite(a))) for a in (prefill_out, decode_out) if a is not None),
        layers_streamed=resident.plan.layers_streamed,
        layers_resident=resident.plan.layers_resident,
        streamed_bytes_per_ubatch=resident.plan.streamed_bytes_per_ubatch,
    )


def _decode(backend: Backend, runner: MoeRunner, scheduler: Scheduler, experts: ExpertData) -> tuple[float, int]:
    """Median seconds of one decode step (each its own plan) and the expert bytes of all steps.

    The median, not the sum: a few steps that a busy host delays would otherwise decide a
    comparison whose target band (+-2%) is narrower than such noise.
    """
    step_s: list[float] = []
    moved = 0
    for step in range(runner.batching.decode_steps):
        plan = runner.decode_plan(experts, step)  # built outside the timed region, as a runtime caches it
        wall, stats = _timed_run(backend, scheduler, plan)
        step_s.append(wall)
        moved += int(stats.total("bytes_prefetched") + stats.total("bytes_stock"))
    return (float(np.median(step_s)) if step_s else 0.0), moved
