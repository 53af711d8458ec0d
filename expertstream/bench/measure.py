"""One prefill (and decode) measurement per slot setting and host memory mode, with its baselines.

Every time is ``backend.host.timestamp()`` read around ``Scheduler.run`` (which drains the
devices before it returns): virtual seconds on the simulator, wall seconds on a GPU. The
baselines come from the same run: the pinned H2D peak through the backend, and the same
prefill plan with every expert tensor already on the device (compute only).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.base import Backend, Device, Usage
from ..engine.decoding import capture_decode_step
from ..engine.hparams import Transformer
from ..engine.offload import GpuMemory, ResidentExperts, UploadedExperts, plan_offload
from ..engine.prefill import Prefill, reporting
from ..engine.runner import Batching, ExpertData, MoeRunner, prefers_layer_major, sha256
from ..engine.uploads import DeviceMemory
from ..hostmem import HostMemoryMode, HostWeights, RingFill, RingOptions, RingStats
from ..hostmem.memlimit import model_too_big
from ..kernels.layout import MatrixPath
from ..model import MoeModel
from ..scheduler import Plan, RunStats, Scheduler
from .disk import page_cache_as_found
from .report import Row

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
    warmup: bool = True  # run the first ubatch (and decode step) once per row before timing
    repeats: int = 1  # timed runs per row; rows report their median and standard deviation
    # Who fills the staging ring and its geometry, where a mode uses one.
    ring: RingOptions = field(default_factory=RingOptions)
    n_cpu_moe: int | None = None  # experts of the first N MoE layers stream; None: all, unless gpu_memory
    gpu_memory: GpuMemory | None = None  # stream only as many leading layers as needed to fit the rest
    host_cache: int | None = None  # mode disk: bytes of RAM for the first layers' tensors (HostWeights.open)
    matrix_path: MatrixPath | None = None  # mul_mat_id's path for every type; None: each type's default
    direct: bool = True  # the direct-decode kernels where they apply (MoeKernels.direct)
    gemv: bool = True  # a few pairs (decode) on the matrix-vector kernels (MoeKernels.gemv)
    fuse_gate_up: bool = False  # gate, up and SwiGLU as one split where the kernels can (MoeRunner)
    # The whole model (the commands' default), or the expert blocks alone around the stand-in: what
    # the tuner calibrates the streaming costs on, and what the microbenches of the expert pipeline run.
    whole: bool = False
    # "layer", "ubatch" or "auto" (engine.runner.prefers_layer_major); whole model. None: auto where a row
    # reads the experts from the file (mode disk: layer-major reads each layer's once a prompt), else ubatch.
    prefill_order: str | None = None
    gather: bool = True  # decode's expert copies from page-locked memory made by the device (Scheduler.gather)
    # decode: how many of each streamed layer's predicted experts are copied while the layer before
    # computes (MoeRunner.decode_lookahead); None: half the experts a token uses; 0: off
    decode_lookahead: int | None = None
    # decode steps, and a prompt's full ubatches, replayed from one captured graph where the scheduler can
    graphs: bool = True
    # The compute-only baseline (every expert on the device) that rows compare to; without it rows
    # leave what they would compare to it empty (tune times the job's rows and needs only theirs).
    compute_only: bool = True


Progress = Callable[[str], None]
"""Called as each ubatch (or decode step) is enqueued, with a label; it may raise KeyboardInterrupt."""


@dataclass(frozen=True)
class Spread:
    """Median, mean and sample standard deviation of repeated measurements (sd 0 for one)."""

    median: float
    sd: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        data = np.asarray(values, dtype=np.float64)
        sd = float(data.std(ddof=1)) if data.size > 1 else 0.0
        return cls(float(np.median(data)), sd, float(data.mean()))


@dataclass(frozen=True)
class PeakProbe:
    """The pinned host-to-device rate: the median of a few timed copies, with the lowest and highest."""

    gbps: float
    low_gbps: float
    high_gbps: float
    copies: int


@dataclass(frozen=True)
class Baselines:
    h2d_peak: PeakProbe
    compute_only_s: float | None  # median over the repetitions; None where not measured (Settings.compute_only)
    compute_only_all_layers: bool | None  # False: one layer's weights stood in for every layer (did not fit)
    compute_only_sha256: str | None  # the outputs when every layer's own weights were used


@dataclass
class Measurement:
    baselines: Baselines
    rows: list[Row] = field(default_factory=list)
    matrix_paths: dict[str, str] = field(default_factory=dict)  # mul_mat_id's path per expert type name
    kernel_families: dict[str, str] = field(default_factory=dict)  # its kernels: the path, or "direct"
    gate_up_fused: bool = False  # whether gate, up and SwiGLU ran as one split


def measure_h2d_peak(backend: Backend, devices: Device | Sequence[Device], nbytes: int) -> PeakProbe:
    """Pinned host -> device bandwidth: the median of a few timed copies of ``nbytes``, with their range.

    With several devices every device copies ``nbytes`` at once and the rate is their sum:
    what a layer split can draw from host memory together (links that share a host
    bottleneck show here, not as the sum of each alone).
    """
    targets = (devices,) if isinstance(devices, Device) else tuple(devices)
    with ExitStack() as stack:
        copies = []
        for device in targets:
            host = device.alloc_pinned(nbytes)
            stack.callback(host.close)
            dst = device.alloc(nbytes, Usage.COMPUTE)
            stack.callback(dst.close)
            stream = device.stream()
            stack.callback(stream.close)
            copies.append((stream, dst, host))

        def copy_all() -> None:
            for stream, dst, host in copies:
                stream.copy_h2d(dst, 0, host, 0, nbytes)
            for stream, _, _ in copies:
                stream.synchronize()

        copy_all()  # warm-up: first-touch and mapping costs
        rates = []
        for _ in range(PROBE_REPEATS):
            start = backend.host.timestamp()
            copy_all()
            rates.append(len(targets) * nbytes / (backend.host.timestamp() - start) / 1e9)
        return PeakProbe(float(np.median(rates)), min(rates), max(rates), PROBE_REPEATS)


def probe_bytes(model: MoeModel) -> int:
    largest = max(t.nbytes for t in model.expert_tensors)
    return int(np.clip(4 * largest, PROBE_MIN_BYTES, PROBE_MAX_BYTES))


class _DeviceExperts(UploadedExperts):
    """Every expert tensor uploaded once (or layer 0's standing in for all when memory is short)."""

    def __init__(self, runner: MoeRunner) -> None:
        model, split = runner.model, runner.layer_split
        padded = dict.fromkeys(split.devices, 0)
        for layer in model.layers:
            device = split.device_of(layer.index)
            padded[device] += sum(device.alloc_size(t.nbytes, t.qtype, t.ne0) for t in layer.experts)
        # Half of what is free: the prefetch slots and activations of later runs need the rest.
        self.all_layers = all(padded[d] <= d.free_memory() // 2 for d in split.devices)
        # Short of memory, each device's first layer stands in for its others.
        firsts = {split.device_of(layer.index): layer for layer in reversed(model.layers)}
        layers = model.layers if self.all_layers else list(firsts.values())
        super().__init__(model, split, layers, upload_data=runner.data)
        if not self.all_layers:
            log.warning(
                "%s bytes of experts do not fit in half of the free memory of %s: the compute-only baseline uses "
                "each device's first layer's experts for its every layer",
                "+".join(str(n) for n in padded.values()),
                ", ".join(d.label for d in split.devices),
            )
            for layer in model.layers:
                first = firsts[split.device_of(layer.index)]
                for info, stand_in in zip(layer.experts, first.experts, strict=True):
                    self.views[info.name] = self.views[stand_in.name]


def _ticking(plan: Plan, progress: Progress, what: str) -> Plan:
    """``plan`` whose first split of each ubatch (layer 0's router) reports progress before it is enqueued."""
    return reporting(plan, _labelled(progress, what))


def _timed_runs(
    backend: Backend, run: Callable[[], RunStats], repeats: int = 1, poison: Callable[[], None] = lambda: None
) -> tuple[list[float], RunStats]:
    """Seconds of each of ``repeats`` calls of ``run``, and the stats of the last.

    ``poison`` fills the outputs before each run, untimed (MoeRunner.poison_prefill_output waits
    for its fill), so that every run, the hashed last one too, starts from poison.
    """
    times: list[float] = []
    for _ in range(max(1, repeats)):
        poison()
        start = backend.host.timestamp()
        stats = run()
        times.append(backend.host.timestamp() - start)
    return times, stats


def ticks(settings: Settings, batching: Batching) -> int:
    """How many times ``measure`` calls its progress callback for one batching (a progress bar's total)."""
    warm = 1 if settings.warmup else 0
    prefill = settings.repeats * len(batching.ubatches()) + warm
    decode = settings.repeats * batching.decode_steps + (warm if batching.decode_steps else 0)
    return prefill + len(settings.slots) * len(settings.host_memory) * (prefill + decode)


def _rows_read_disk(settings: Settings, model: MoeModel) -> bool:
    """Whether a row reads the experts through mode disk: asked for, or what the preferred rule takes
    where the tensors do not fit the memory the process may fill."""
    modes = settings.host_memory
    return HostMemoryMode.DISK in modes or (HostMemoryMode.PREFERRED in modes and model_too_big(model) is not None)


def _labelled(progress: Progress, what: str) -> Progress:
    return lambda label: progress(f"{what} {label}")


def measure_compute_only(
    backend: Backend,
    runner: MoeRunner,
    warmup: bool,
    repeats: int = 1,
    progress: Progress = lambda what: None,
    graphs: bool = True,
) -> tuple[float, bool, str | None]:
    experts = _DeviceExperts(runner)
    try:
        with (
            Scheduler(slots=0) as scheduler,
            Prefill(runner, scheduler, experts.views, graphs=graphs) as prefill,
        ):
            if warmup:
                prefill.warm(_labelled(progress, "compute only, warm-up"))
            ticked = _labelled(progress, "compute only")
            poison = functools.partial(runner.poison_prefill_output, scheduler.stream)
            times, _ = _timed_runs(backend, functools.partial(prefill.run, ticked), repeats, poison)
        digest = sha256(runner.prefill_output()) if runner.data and experts.all_layers else None
        return Spread.of(times).median, experts.all_layers, digest
    finally:
        experts.close()


def default_prefill_order(settings: Settings) -> str:
    """The prefill order asked for, or where none was: auto (layer-major where the prompt's rows fit)
    when a row reads its experts from the file (mode disk), since layer-major reads each layer's experts
    once a prompt instead of once a ubatch; else ubatch."""
    if settings.prefill_order is not None:
        return settings.prefill_order
    return "auto" if HostMemoryMode.DISK in settings.host_memory else "ubatch"


def measure(
    backend: Backend,
    devices: Device | Sequence[Device],
    model: MoeModel,
    settings: Settings,
    progress: Progress = lambda what: None,
    h2d_peak: PeakProbe | None = None,
) -> Measurement:
    """Baselines, then one Row per (host memory mode, slot count), modes outermost.

    ``h2d_peak`` reuses a peak measured before (one per device set is enough for a matrix of
    runs). Several devices split the layers between them (layersplit.py).
    """
    targets = (devices,) if isinstance(devices, Device) else tuple(devices)
    free_before = {device: device.free_memory() for device in targets}
    with MoeRunner(
        targets,
        model,
        settings.batching,
        seed=settings.seed,
        matrix_path=settings.matrix_path,
        direct=settings.direct,
        gemv=settings.gemv,
        fuse_gate_up=settings.fuse_gate_up,
        decode_lookahead=settings.decode_lookahead,
        transformer=Transformer.read(model) if settings.whole else None,
        layer_major=settings.whole
        and prefers_layer_major(
            default_prefill_order(settings), model, settings.batching, targets, streams=settings.n_cpu_moe != 0
        ),
    ) as runner:
        if settings.whole:
            _random_tokens(runner, settings.seed)
        split = runner.layer_split
        peak = h2d_peak or measure_h2d_peak(backend, split.devices, probe_bytes(model))
        compute_s: float | None = None
        all_layers: bool | None = None
        compute_sha: str | None = None
        if settings.compute_only:
            # Mode disk's rows read what a run of their own would, not what the baseline's uploads left.
            keep = page_cache_as_found(model) if _rows_read_disk(settings, model) else nullcontext()
            with keep:
                compute_s, all_layers, compute_sha = measure_compute_only(
                    backend, runner, settings.warmup, settings.repeats, progress, settings.graphs
                )
        paths = {name: path.value for name, path in runner.matrix_path_by_type.items()}
        result = Measurement(
            Baselines(peak, compute_s, all_layers, compute_sha),
            matrix_paths=paths,
            kernel_families=runner.kernel_family_by_type,
            gate_up_fused=runner.fuses_gate_up(),
        )
        offload = plan_offload(
            model,
            split,
            n_cpu_moe=settings.n_cpu_moe,
            gpu_memory=settings.gpu_memory,
            slots=max(settings.slots, default=0),
            host_inputs_per_split=2 if runner.fuses_gate_up() else 1,
            lookahead_inputs=runner.lookahead_inputs,
            lookahead_rows=runner.lookahead_rows,
            in_use={d: runner.device_bytes_on(d) for d in split.devices},
        )
        with ResidentExperts(model, split, offload, upload_data=runner.data) as resident:
            for mode in settings.host_memory:
                with HostWeights.open(
                    model,
                    split.devices[0],
                    mode,
                    ring=settings.ring,
                    copied_to=split.expert_devices,
                    host_cache=settings.host_cache,
                ) as weights:
                    for slots in settings.slots:
                        row = _measure_row(
                            backend, runner, weights, resident, slots, settings, result.baselines, progress, free_before
                        )
                        result.rows.append(row)
        return result


def _random_tokens(runner: MoeRunner, seed: int) -> None:
    """Prompt and decode tokens drawn from the vocabulary by ``seed``, as llama-bench feeds random tokens."""
    assert runner.whole is not None
    batching, n_vocab = runner.batching, runner.whole.spec.n_vocab
    draws = np.random.default_rng([seed, 1]).integers(0, n_vocab, batching.tokens + batching.decode_steps)
    runner.set_prompt(draws[: batching.tokens])
    for step in range(batching.decode_steps):
        runner.set_decode_token(step, int(draws[batching.tokens + step]))


def _measure_row(
    backend: Backend,
    runner: MoeRunner,
    weights: HostWeights,
    resident: ResidentExperts,
    slots: int,
    settings: Settings,
    base: Baselines,
    progress: Progress,
    free_before: Mapping[Device, int],
) -> Row:
    batching = settings.batching
    experts: ExpertData = resident.experts(weights)
    what = f"slots {slots}, {weights.mode.value}"
    with (
        Scheduler(slots=slots, gather=settings.gather) as scheduler,
        Prefill(runner, scheduler, experts, graphs=settings.graphs) as prefill,
    ):
        if settings.warmup:
            prefill.warm(_labelled(progress, f"{what}, warm-up"))
        ring_before = weights.ring_stats()
        ticked = _labelled(progress, what)
        poison = functools.partial(runner.poison_prefill_output, scheduler.stream)
        times, stats = _timed_runs(backend, functools.partial(prefill.run, ticked), settings.repeats, poison)
        prefill_path = prefill.path
        ring_after = weights.ring_stats()
        prompt_staging = scheduler.device_bytes() + prefill.replay_bytes

        def used() -> int:
            return sum(free - device.free_memory() for device, free in free_before.items())

        used_by_prompt = used()
        decode_rates, decode_steps_s, (decode_bytes, ahead_bytes), decode_path, decode_disk_bytes, held = _decode(
            backend, runner, scheduler, experts, settings, progress, what, weights, used
        )
        staging = max(prompt_staging, held.staging + prefill.replay_bytes)  # the most held at once
        memory = runner.device_memory() + DeviceMemory(resident_experts=resident.device_bytes, staging=staging)
        device_used = max(used_by_prompt, held.used, used())  # the most the devices gave at once
    prefill_out = runner.prefill_output() if runner.data else None
    decode_out = runner.decode_output() if runner.data and batching.decode_steps else None
    moved = stats.bytes_moved()
    wall = Spread.of(times)
    rate = Spread.of([batching.tokens / t for t in times])
    decode_rate = Spread.of(decode_rates) if decode_rates else None
    transfer_s = moved / (base.h2d_peak.gbps * 1e9)
    compute_s = base.compute_only_s
    fallbacks: dict[str, int] = {}
    for dev in stats.devices.values():
        for key, count in dev.fallbacks.items():
            fallbacks[key] = fallbacks.get(key, 0) + count
    for fallback in weights.stats.fallbacks:
        fallbacks[f"host_memory_{fallback.requested.value}"] = 1
    h2d_gbps = moved / wall.median / 1e9
    return Row(
        slots=slots,
        host_memory=weights.mode.value,
        tokens=batching.tokens,
        ubatch=batching.ubatch,
        repetitions=len(times),
        ttft_s=wall.median,
        ttft_sd_s=wall.sd,
        prefill_tokens_per_s=rate.median,
        prefill_tokens_per_s_sd=rate.sd,
        bytes_per_ubatch=moved // len(batching.ubatches()),
        h2d_bytes=moved,
        h2d_gbps=h2d_gbps,
        h2d_peak_gbps=base.h2d_peak.gbps,
        h2d_pct_of_peak=100.0 * h2d_gbps / base.h2d_peak.gbps,
        transfer_only_s=transfer_s,
        compute_only_s=compute_s,
        overlap_efficiency=None if compute_s is None else max(transfer_s, compute_s) / wall.median,
        slot_wait_ms=stats.total("ready_wait_ms") / len(times) if slots else None,
        over_compute_ms=None if compute_s is None else (wall.median - compute_s) * 1e3,
        fires=int(stats.total("fires")),
        fallbacks=fallbacks,
        prefill_sha256=sha256(prefill_out) if prefill_out is not None else "",
        decode_steps=batching.decode_steps,
        # As llama-bench reports tg: the mean of the repetitions' rates, beside their sd.
        decode_tokens_per_s=decode_rate.mean if decode_rate else None,
        decode_tokens_per_s_sd=decode_rate.sd if decode_rate else None,
        decode_median_step_ms=Spread.of(decode_steps_s).median * 1e3 if decode_steps_s else None,
        decode_bytes=decode_bytes,
        decode_lookahead=runner.decode_lookahead if ahead_bytes else 0,
        decode_lookahead_bytes=ahead_bytes,
        decode_path=decode_path,
        prefill_path=prefill_path,
        decode_sha256=sha256(decode_out) if decode_out is not None else None,
        output_sha256=sha256(*(a for a in (prefill_out, decode_out) if a is not None)) if runner.data else "",
        nonfinite=sum(int(np.count_nonzero(~np.isfinite(a))) for a in (prefill_out, decode_out) if a is not None),
        layers_streamed=resident.plan.layers_streamed,
        layers_resident=resident.plan.layers_resident,
        streamed_bytes_per_ubatch=resident.plan.streamed_bytes_per_ubatch,
        devices=len(runner.devices),
        crossing=",".join(runner.crossings),
        work="experts" if runner.experts_only else "whole",
        prefill_order="layer" if runner.layer_major else "ubatch",
        device_bytes=runner.device_bytes + resident.device_bytes,
        kv_cache_bytes=runner.kv_cache_bytes,
        device_memory=memory.as_dict(),
        device_used_bytes=device_used,
        **_ring_fields(weights, ring_before, ring_after, sum(times)),
        **_tier_fields(weights, ring_before, ring_after, moved, len(times)),
        **_decode_tier_fields(weights, decode_bytes, decode_disk_bytes),
    )


def _ring_fields(
    weights: HostWeights, before: RingStats | None, after: RingStats | None, wall_s: float
) -> dict[str, Any]:
    """Where the staging ring's workers spent the timed prefills (nothing outside mode ring).

    Threads wait for a chunk's DMA themselves; for fill processes the ring's caller waits before it
    sends a fill, so their chunk waits are shared over the callers (one per ring), not the workers.
    """
    if before is None or after is None or wall_s <= 0:
        return {}
    used = after - before
    threads = sum(ring.threads for ring in weights.rings)
    fills = {ring.fill for ring in weights.rings}
    waiters = len(weights.rings) if fills == {RingFill.PROCESSES} else threads
    return {
        "ring_threads": threads,
        "ring_fill": ",".join(sorted(fill.value for fill in fills)),
        "ring_copy_pct": 100.0 * used.fill_s / (threads * wall_s),
        "ring_chunk_wait_pct": 100.0 * used.chunk_wait_s / (waiters * wall_s),
        "ring_thread_gbps": used.thread_gbps,
    }


def _tier_fields(
    weights: HostWeights, before: RingStats | None, after: RingStats | None, moved: int, runs: int
) -> dict[str, Any]:
    """Mode disk's tiers per timed prefill: the bytes its host cache served (those copied that its
    rings did not stage), the bytes its rings read from the drive and those they found in the page
    cache, and the share served from RAM
    (nothing outside mode disk). ``moved``: the bytes one prefill copied; ``runs``: the timed prefills."""
    if weights.mode is not HostMemoryMode.DISK:
        return {}
    used = after - before if before is not None and after is not None else RingStats()  # no ring: all cached
    staged = used.bytes_staged // runs
    # Rings that copy from the mappings (the files lay in the page cache at open) read no drive.
    cached = used.bytes_cached if any(ring.reads_files for ring in weights.rings) else used.bytes_filled
    return {
        "host_cache_bytes": max(0, moved - staged),
        "disk_bytes_read": (used.bytes_filled - cached) // runs,
        "page_cache_bytes": cached // runs,
        "host_cache_hit_pct": _ram_share(moved, staged),
    }


def _decode_tier_fields(weights: HostWeights, decode_bytes: int, staged: int) -> dict[str, Any]:
    """Mode disk's tiers per repetition of the decode steps: the share of the used experts' bytes its
    host cache served (nothing outside mode disk, or without decode steps)."""
    if weights.mode is not HostMemoryMode.DISK or not decode_bytes:
        return {}
    return {"decode_host_cache_hit_pct": _ram_share(decode_bytes, staged)}


def _ram_share(moved: int, staged: int) -> float:
    """Percent of ``moved`` bytes copied that the rings did not stage: the host cache served them."""
    return 100.0 * max(0, moved - staged) / moved if moved else 0.0


@dataclass(frozen=True)
class _Held:
    """The most a run's decode steps held at once: their copies' scratch (the scheduler's, or a
    replay's), and what the devices' free memory had fallen by (``measure``'s count)."""

    staging: int
    used: int

    def most(self, staging: int, used: int) -> _Held:
        return _Held(max(self.staging, staging), max(self.used, used))


def _decode(
    backend: Backend,
    runner: MoeRunner,
    scheduler: Scheduler,
    experts: ExpertData,
    settings: Settings,
    progress: Progress,
    what: str,
    weights: HostWeights,
    used: Callable[[], int],
) -> tuple[list[float], list[float], tuple[int, int], str | None, int, _Held]:
    """Decode tokens/s of each repetition (its tokens over the time all its steps took), each
    repetition's median step in seconds, the bytes of the experts one repetition used and those it
    copied ahead on a prediction (the decode lookahead; at most, each), how the steps ran:
    "graph" (one captured step replayed) or "calls" (each step's calls issued), and the bytes the
    staging rings handed to copies per repetition (mode disk: those read from the drive), and what
    the steps held (``_Held``: the prompt's slots and scratch are freed when decode begins).

    The median step is what a prediction is held to: a few steps that a busy host delays would
    otherwise decide a comparison whose target band (+-2%) is narrower than such noise. A warm-up
    step first, so that the first row does not pay for what the first decode plan sets up.
    """
    steps = runner.batching.decode_steps
    if not steps:
        return [], [], (0, 0), None, 0, _Held(0, 0)
    backend.mark(f"{what}: prefill ends, decode begins")
    scheduler.release_scratch()  # the prompt's slots and scratch: the steps need their own
    held = _Held(0, 0)
    if settings.warmup:
        scheduler.run(_ticking(runner.decode_plan(experts, 0), progress, f"{what}, decode warm-up"))
        held = held.most(scheduler.device_bytes(), used())
    rings_before = weights.ring_stats()
    with ExitStack() as stack:
        replay = capture_decode_step(runner, scheduler, experts, what) if settings.graphs else None
        if replay is not None:
            stack.enter_context(replay)
            held = held.most(replay.device_bytes, used())
        rates: list[float] = []
        median_steps: list[float] = []
        moved = ahead = 0
        for _ in range(settings.repeats):
            runner.poison_decode_output(scheduler.stream)  # the steps write a row each: poison them once, untimed
            step_s: list[float] = []
            moved = ahead = 0
            for step in range(steps):
                if replay is None:
                    plan = _ticking(runner.decode_plan(experts, step), progress, f"{what}, decode")  # built untimed
                    (wall,), stats = _timed_runs(backend, functools.partial(scheduler.run, plan))
                    held = held.most(scheduler.device_bytes(), used())
                else:
                    progress(f"{what}, decode")
                    start = backend.host.timestamp()
                    runner.decode_step_in(replay.stream, step)
                    replay.launch()
                    runner.decode_step_out(replay.stream, step)
                    stats = replay.finish()
                    wall = backend.host.timestamp() - start
                step_s.append(wall)
                copied_ahead = int(stats.total("bytes_lookahead_at_most"))
                ahead += copied_ahead
                moved += stats.bytes_moved() - copied_ahead  # the link's limit counts the used experts only
            # A run's rate is its tokens over the whole time its steps took; its median step beside it.
            rates.append(steps / float(np.sum(step_s)))
            median_steps.append(float(np.median(step_s)))
    rings_after = weights.ring_stats()
    staged = 0
    if rings_before is not None and rings_after is not None:
        staged = (rings_after - rings_before).bytes_staged // max(1, settings.repeats)
    return rates, median_steps, (moved, ahead), "calls" if replay is None else "graph", staged, held
