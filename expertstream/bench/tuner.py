"""`expertstream tune`: measure this GPU and its host link, and write a simulator profile.

The probes (probes.py) time copies from each kind of host memory, the event-order question,
memcpys from a mapping per thread count and the runner's kernels at several ubatches. ``fit``
turns the timings into profile fields by inverting what the simulator does with each field,
so tuning the simulator against itself gives its own profile back. Then a few decode steps of
the job run on the device and on the simulator, and two costs no single probe sees are solved for
so that they agree: ``calibrate_launch`` fits the device time before each operation of a chain to
steps replayed from one graph, ``calibrate_enqueue`` the host time per call (the scheduler's own
work per split included) to steps issued call by call. Last, one prefill ubatch of the job runs
through the staging ring and through the mapping, and the host's memcpy rates and the pageable
H2D rate are fitted to them (``fit_host_paths``): inside the job those paths reach other rates
than the probes reach on their own.

The profile file holds the measured fields and names the built-in profile ("base") that
supplies the rest: peer copies (one device cannot measure them) and the rate of kernels the
profile has no entry for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..backends import backend as open_backend
from ..backends.base import Backend, Device, HostBuffer, Stream, Vendor
from ..backends.sim.profiles import BUILTIN_PROFILES, RING_FILLS, KernelRate, Profile
from ..engine.runner import Batching
from ..hostmem import DEFAULT_RING_THREADS, HostMemoryMode, default_ring_threads
from ..model import MoeModel, make_model
from . import probes
from .disk import DiskTiming, fit_disk, measure_disk
from .measure import Settings, measure
from .placeholder import write_sparse_model
from .probes import (
    DEFAULT_BOUNDS,
    Bounds,
    EventOrderTiming,
    ExpertShape,
    HostCopyTiming,
    KernelTiming,
    Measurements,
    ModelShape,
    RingCopyTiming,
    copy_fit,
)
from .report import Row

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_UBATCHES = (1, 512, 1024, 2048, 4096)
DEFAULT_PRESET = "qwen3-30b-a3b"
CALIBRATION_LAYERS = 2
CALIBRATION_STEPS = 8
BASE_BY_VENDOR = {"nvidia": "cuda-h200", "amd": "rocm-r9700"}
# A kernel whose compute is less than this share of its measured time is bound by launch
# overhead: its rate cannot be told apart from the latency, and the profile keeps no entry.
MIN_COMPUTE_SHARE = 0.25
# Host copies on N threads are bound by a shared bus when they reach less than this share of
# N times the one-thread rate.
SATURATED_SHARE = 0.9


@dataclass
class Tuned:
    """What a tune run found: the raw timings, the fitted fields and the profile they make."""

    measurements: Measurements
    fields: dict[str, Any]  # the measured profile fields, as the JSON file holds them
    base: str
    profile: Profile
    decode_step_s: float | None = None  # measured on the device, for the enqueue calibration
    phases_s: dict[str, float] = dataclasses.field(default_factory=dict)  # wall seconds per phase, in order
    graph_step_s: float | None = None  # a replayed decode step on the device, for the launch calibration
    host_paths: list[HostPathFit] = dataclasses.field(default_factory=list)  # the ring and mapping fitted to prefill
    decode_layers: int | None = None  # the MoE layers of the decode steps above (spread over the model)
    # The same decode steps with DMAs after reading the routing ids back (call by call: nothing to replay),
    # against which the gather's best step set the profile's decode_gather.
    dma_step_s: float | None = None
    disk: DiskTiming | None = None  # the drive behind the model's file (None on a simulated host)

    def document(self) -> dict[str, Any]:
        """The profile file: the measured fields over a built-in base."""
        return {"base": self.base, **self.fields}


class PhaseClock:
    """Wall seconds per phase: each phase runs from its ``start`` to the next one's (or ``stop``).

    Wall time, not ``backend.host.timestamp()``: what a phase costs the user, compiles included.
    """

    def __init__(self, progress: Callable[[str], None] = lambda what: None) -> None:
        self.seconds: dict[str, float] = {}
        self._progress = progress
        self._current: str | None = None
        self._since = 0.0

    def start(self, phase: str) -> None:
        self.stop()
        self._progress(phase)
        self._current, self._since = phase, time.perf_counter()

    def stop(self) -> None:
        if self._current is not None:
            elapsed = time.perf_counter() - self._since
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + elapsed
            self._current = None


# -- fitting ---------------------------------------------------------------------------------


def fit_copies(copies: Sequence[probes.CopyTiming]) -> dict[str, Any]:
    """Rates from the slope between two sizes; DMA setup from back-to-back pinned copies' fixed cost."""
    slope, setup = copy_fit(copies, "h2d-pinned")
    rates: dict[str, Any] = {
        "h2d_pinned_bps": 1 / slope,
        "h2d_gather_bps": 1 / copy_fit(copies, "h2d-gather")[0],
        "h2d_pageable_bps": 1 / copy_fit(copies, "h2d-pageable")[0],
        "d2h_bps": 1 / copy_fit(copies, "d2h-pinned")[0],
        "d2h_pageable_bps": 1 / copy_fit(copies, "d2h-pageable")[0],
        "d2d_bps": 1 / copy_fit(copies, "d2d")[0],
        "memset_bps": 1 / copy_fit(copies, "memset")[0],
        "copy_latency_s": max(0.0, setup),
    }
    largest = max((c for c in copies if c.what == "h2d-pageable"), key=lambda c: c.nbytes)
    rates["pageable_blocks_host"] = largest.host_blocked_s > 0.5 * largest.nbytes / rates["h2d_pageable_bps"]
    return rates


def fit_event_order(rows: Sequence[EventOrderTiming], pageable_bps: float, blocks_host: bool) -> bool:
    """Whether a wait resolves at the tail of a stream with a pageable copy behind the record.

    A wait issued after copy2 that releases only once copy2 is done, while the copy did not hold
    the host, can only be the runtime binding the wait to the stream's tail. (Where the copy holds
    the host, the late release is the host's, and the profile says so with pageable_blocks_host.)
    """
    released = {r.wait: r for r in rows if r.host_memory == "pageable"}
    if blocks_host or "before" not in released or "after" not in released:
        return False
    late = released["after"].released_s - released["before"].released_s
    return late > 0.5 * released["after"].copy2_bytes / pageable_bps


def fit_host_copies(rows: Sequence[HostCopyTiming]) -> tuple[float, float | None]:
    """(one thread's rate, the shared limit of all threads or None) from the ring's fills on 1..N threads."""
    rate = {r.threads: r.nbytes / r.seconds for r in rows}
    one = rate[min(rate)] / min(rate)  # per thread, from the fewest threads measured
    most = max(rate)
    total = rate[most] if rate[most] < SATURATED_SHARE * most * one else None
    return one, total


def fit_kernel(timing: KernelTiming, launch_s: float, other_rate: float) -> KernelRate | None:
    """The kernel's rate once the launch latencies and the other kernels of the call are taken out."""
    compute = timing.seconds - timing.launches * launch_s - timing.other_flops / other_rate
    if compute < MIN_COMPUTE_SHARE * timing.seconds:
        return None
    return KernelRate(timing.kernel, timing.shape, timing.size, timing.flops / compute)


def fit(m: Measurements, base: Profile, name: str, vendor_like: str) -> dict[str, Any]:
    """The profile fields the measurements determine (enqueue_s before its calibration)."""
    fields: dict[str, Any] = {"name": name, "vendor_like": vendor_like, "device_name": m.device_name}
    fields["memory_bytes"] = int(m.memory_bytes)
    fields.update(fit_copies(m.copies))
    fields["pageable_wait_binds_tail"] = fit_event_order(
        m.event_order, fields["h2d_pageable_bps"], fields["pageable_blocks_host"]
    )
    fields["launch_latency_s"] = m.launch_s
    fields["enqueue_s"] = m.enqueue_s
    fields["call_s"] = m.enqueue_s  # what a call costs alone; enqueue_s becomes the job's per call
    per_thread, total = fit_host_copies(m.host_copies)
    fields["host_memcpy_bps"] = per_thread
    fields["host_memcpy_total_bps"] = total
    fields["host_register"] = m.host_register
    # The path the kernels took, so that the simulator runs (and rates) the same kernels.
    fields["matrix_cores"], fields["int8_matrix_cores"] = m.matrix_cores, m.int8_matrix_cores
    fields["mma_fragments"] = m.mma_fragments
    fields["max_shared_bytes"] = m.max_shared_bytes
    fields["host_register_read_only"] = m.host_register_read_only
    if m.register_bytes_per_s is not None:
        fields["host_register_bps"] = m.register_bytes_per_s
    rates = [fit_kernel(k, m.launch_s, base.flops_per_s) for k in m.kernels]
    fields["kernel_rates"] = [
        {"kernel": r.kernel, "shape": list(r.shape), "size": r.size, "flops_per_s": r.flops_per_s}
        for r in rates
        if r is not None
    ]
    return fields


# The profile fields a tune run measures (host_register_bps only where registration works).
FITTED_FIELDS = (
    "memory_bytes",
    "h2d_pinned_bps",
    "h2d_gather_bps",
    "decode_gather",
    "h2d_pageable_bps",
    "d2h_bps",
    "d2h_pageable_bps",
    "d2d_bps",
    "memset_bps",
    "copy_latency_s",
    "pageable_blocks_host",
    "pageable_wait_binds_tail",
    "launch_latency_s",
    "enqueue_s",
    "call_s",
    "host_memcpy_bps",
    "host_memcpy_total_bps",
    "host_copy_latency_s",
    "host_register",
    "host_register_read_only",
    "matrix_cores",
    "int8_matrix_cores",
    "mma_fragments",
    "max_shared_bytes",
    "ring_threads",
    "ring_fill",
    "h2d_pageable_latency_s",
    "kernel_rates",
    "disk_read_bps",
    "disk_latency_s",
)


def fields_not_tuned(document: Mapping[str, Any]) -> list[str]:
    """The fields a profile file written by an earlier ``tune`` lacks that tune measures now (its
    base's values stand in for them); none for a profile not written by tune."""
    if "kernel_rates" not in document or "device_name" not in document:
        return []  # written by hand: what it leaves out is meant to come from its base
    return [f for f in FITTED_FIELDS if f not in document]


# What fit_host_paths sets.
HOST_PATH_FIELDS = (
    "host_memcpy_bps",
    "host_memcpy_total_bps",
    "host_copy_latency_s",
    "h2d_pageable_bps",
    "h2d_pageable_latency_s",
    "ring_fill",
)


# -- the decode calibration ------------------------------------------------------------------


def decode_step_seconds(
    backend: Backend,
    device: Device,
    model: MoeModel,
    mode: HostMemoryMode,
    *,
    graphs: bool = False,
    gather: bool = True,
) -> float | None:
    """The median decode step of the job.

    Without ``graphs`` each step's calls are issued one by one: what the host's time per call
    sets. With them, one captured step is replayed: what the device's time per operation sets
    (None where the step could not be captured). ``gather``: the experts' copies made by the
    device (Scheduler.gather), else DMAs after the host reads the routing ids back.
    """
    settings = Settings(
        Batching(8, 8, CALIBRATION_STEPS), (0,), (mode,), repeats=1, graphs=graphs, compute_only=False, gather=gather
    )
    row = measure(backend, device, model, settings).rows[0]
    assert row.decode_step_s is not None
    if graphs and row.decode_path != "graph":
        return None
    return row.decode_step_s


def _simulated(profile: Profile, job: Callable[[Backend, Device], _T | None], what: str) -> _T:
    """``job`` on a timing-only simulated device with ``profile``; it must give a result (``what`` says why)."""
    with open_backend("sim", profile=profile, data=False, check_hazards=False) as sim:
        result = job(sim, sim.device(0))
        assert result is not None, what
        return result


def predicted_decode_step(profile: Profile, model: MoeModel, mode: HostMemoryMode, *, graphs: bool = False) -> float:
    return _simulated(
        profile,
        lambda sim, device: decode_step_seconds(sim, device, model, mode, graphs=graphs),
        "the simulator captures what the device captured",
    )


# How close to the measured time the calibrations solve.
SOLVE_TOLERANCE = 1e-3


def solve(simulated: Callable[[float], float], measured: float, x0: float, x1: float) -> float:
    """The x >= 0 for which ``simulated(x)`` is ``measured``: secant steps from x0 and x1.

    What the calibrations solve is piecewise linear in x, so three steps land within a
    fraction of a percent.
    """
    y0 = simulated(x0)
    for _ in range(3):
        if abs(y0 - measured) <= SOLVE_TOLERANCE * measured:
            return x0
        y1 = simulated(x1)
        if y1 == y0:
            return x0
        x0, y0, x1 = x1, y1, max(0.0, x1 + (measured - y1) * (x1 - x0) / (y1 - y0))
    return x1


def calibrate_enqueue(profile: Profile, model: MoeModel, mode: HostMemoryMode, measured_s: float) -> float:
    """The host seconds per call for which the simulator's decode step takes ``measured_s``."""

    def step(enqueue_s: float) -> float:
        return predicted_decode_step(dataclasses.replace(profile, enqueue_s=enqueue_s), model, mode)

    x0 = profile.enqueue_s
    return solve(step, measured_s, x0, x0 * 2 if x0 > 0 else 10e-6)


# Turns at most of fitting the device's time per operation and the host's time per call, each to its
# decode steps (it stops once the first stays put). Where a step has few operations, as decode's
# matrix-vector kernels make it, the calls around a replay weigh more and the turns take longer to settle.
CALL_FIT_ROUNDS = 8


def calibrate_calls(
    profile: Profile, model: MoeModel, mode: HostMemoryMode, graph_s: float | None, step_s: float
) -> Profile:
    """``profile`` with the device's time per operation fitted to decode steps replayed from one graph
    (``graph_s``, where the device captured one) and the host's time per call to steps issued call by call.

    The host's time per call shows in the replayed steps too (the calls around each replay), and
    it starts at what a call costs alone: the two are fitted in turn until the device's stays put.
    """
    for turn in range(CALL_FIT_ROUNDS):
        if graph_s is not None:  # the host's time per call is fitted on top of the device's
            latency = calibrate_launch(profile, model, mode, graph_s)
            moved = abs(latency - profile.launch_latency_s) > SOLVE_TOLERANCE * latency
            profile = dataclasses.replace(profile, launch_latency_s=latency)
            if turn and not moved:
                break
        profile = dataclasses.replace(profile, enqueue_s=calibrate_enqueue(profile, model, mode, step_s))
        if graph_s is None:
            break
    return profile


def calibrate_launch(profile: Profile, model: MoeModel, mode: HostMemoryMode, measured_s: float) -> float:
    """The device seconds before each operation for which a replayed decode step takes ``measured_s``.

    A decode step is a chain of small dependent operations: each waits for the one before to
    finish and then for the device to start it, which back-to-back launches of one kernel
    (launch_s) do not show.
    """

    def step(latency_s: float) -> float:
        return predicted_decode_step(dataclasses.replace(profile, launch_latency_s=latency_s), model, mode, graphs=True)

    x0 = profile.launch_latency_s
    return solve(step, measured_s, x0, x0 * 2 if x0 > 0 else 5e-6)


def _on_simulator(
    profile: Profile, nbytes: int, probe: Callable[[Backend, Device, Stream, HostBuffer], float]
) -> float:
    """``probe`` on a timing-only simulator with ``profile``, over a sparse mapping of ``nbytes``."""
    with open_backend("sim", profile=profile, data=False, check_hazards=False) as sim:
        device = sim.device(0)
        with device.stream() as stream, probes.file_mapping(device, nbytes) as host:
            return probe(sim, device, stream, host)


def calibrate_host_copy_latency(profile: Profile, timing: RingCopyTiming) -> float:
    """The fixed host seconds per memcpy for which the simulator's small ring copies take what they
    took on the device: what a copy costs beyond its bytes (the handoff to a ring thread, the calls)."""

    def per_copy(latency_s: float) -> float:
        return _on_simulator(
            dataclasses.replace(profile, host_copy_latency_s=latency_s),
            2 * timing.copies * timing.nbytes,
            lambda be, dev, stream, host: probes.ring_small_copies(
                be, dev, stream, host, 0, timing.nbytes, timing.copies
            ),
        )

    at_zero = per_copy(0.0)
    if timing.seconds_per_copy <= at_zero:
        return 0.0
    return solve(per_copy, timing.seconds_per_copy, timing.seconds_per_copy - at_zero, 0.0)


# -- the host paths' calibration -------------------------------------------------------------

# The prefill the host paths are fitted to: one ubatch of this many tokens without lookahead, so
# that every expert tensor is copied once, one after another, and the copies set its time; over
# as many layers as hold HOST_PATH_BYTES of experts, so that tune's time stays bounded whatever the
# model (the rates are per byte: the tensors' sizes are what matters), spread from the first layer
# to the last, so that the pages read lie across the whole file as the job's do (the 4 GB of a
# 16 GB file's leading layers once copied from its mapping 30% faster than the whole file did).
CALIBRATION_UBATCH = 512
HOST_PATH_BYTES = 4 << 30


@dataclass(frozen=True)
class HostPathFit:
    """One host path fitted to the job: a prefill ubatch and decode steps measured through it, and
    the rate and the fixed cost per copy that reproduce them."""

    mode: HostMemoryMode
    prefill_s: float  # one ubatch of the job through this host memory, on the device
    probe_bps: float  # what the probes gave (the ring: all its threads together)
    fitted_bps: float
    decode_step_s: float | None = None  # the median decode step of the job through it, on the device
    probe_latency_s: float | None = None  # the fixed cost per copy before the decode fit
    # Fitted to the decode steps: the ring's host_copy_latency_s or the mapping's h2d_pageable_latency_s
    # (None where the copies are too small a part of a decode step to tell).
    fitted_latency_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mode": self.mode.value}


def _job_row(
    backend: Backend, device: Device, model: MoeModel, mode: HostMemoryMode, decode_steps: int = CALIBRATION_STEPS
) -> Row | None:
    """One prefill ubatch and ``decode_steps`` decode steps of the job through ``mode`` (None where
    the mode fell back)."""
    batching = Batching(CALIBRATION_UBATCH, CALIBRATION_UBATCH, decode_steps)
    row = measure(backend, device, model, Settings(batching, (0,), (mode,), repeats=1, compute_only=False)).rows[0]
    return row if row.host_memory == mode.value else None


def prefill_seconds(backend: Backend, device: Device, model: MoeModel, mode: HostMemoryMode) -> float | None:
    """Time to first token of one ubatch of the job through ``mode`` (None where the mode fell back)."""
    row = _job_row(backend, device, model, mode, decode_steps=0)
    return None if row is None else row.ttft_s


def predicted_prefill(profile: Profile, model: MoeModel, mode: HostMemoryMode) -> float:
    return _simulated(
        profile,
        lambda sim, device: prefill_seconds(sim, device, model, mode),
        f"the simulator places {mode.value} memory",
    )


def ring_rates(profile: Profile, scale: float) -> Profile:
    """``profile`` with its host memcpy rates, per thread and shared, times ``scale``."""
    total = profile.host_memcpy_total_bps
    return dataclasses.replace(
        profile,
        host_memcpy_bps=profile.host_memcpy_bps * scale,
        host_memcpy_total_bps=None if total is None else total * scale,
    )


def ring_bps(profile: Profile) -> float:
    """What the ring's threads copy together, by the profile."""
    threads = profile.ring_threads or DEFAULT_RING_THREADS
    together = profile.host_memcpy_bps * threads
    total = profile.host_memcpy_total_bps
    return together if total is None else min(together, total)


# What each host path's rate and fixed cost per copy are in a profile.
_PATH_FIELDS = {
    HostMemoryMode.RING: (ring_bps, "host_copy_latency_s"),
    HostMemoryMode.MMAP: (lambda p: p.h2d_pageable_bps, "h2d_pageable_latency_s"),
}


# Turns of fitting a host path's rate to prefill and its fixed cost per copy to decode.
PATH_FIT_ROUNDS = 4

# A host path is fitted only where its copies take at least this share of the prefill, measured
# (what the simulator leaves of it with the copies made free) or predicted at the probes' rate:
# below both the fit would take the kernels' or the host's other costs for the copies'. Either
# will do: a ring that nearly keeps up with its DMAs leaves little above them, though its rate
# decides how fast it goes once compute overlaps it.
MIN_COPY_SHARE = 0.3


def _fit_inverse_rate(simulated: Callable[[float], float], measured_s: float, x0: float) -> float | None:
    """The x (time per unit of copying; ``x0`` the probes') for which ``simulated(x)`` is ``measured_s``,
    or None where copying is less than MIN_COPY_SHARE of the measured and of the predicted prefill."""
    cache: dict[float, float] = {}

    def cached(x: float) -> float:
        if x not in cache:
            cache[x] = simulated(x)
        return cache[x]

    free = cached(0.0)
    measured_share = (measured_s - free) / measured_s
    predicted_share = (cached(x0) - free) / cached(x0)
    if measured_s <= free or max(measured_share, predicted_share) < MIN_COPY_SHARE:
        return None
    return solve(cached, measured_s, x0, 0.8 * x0)


def calibrate_ring(profile: Profile, model: MoeModel, measured_s: float) -> float | None:
    """The factor on the host's memcpy rates for which the simulator's ring prefill takes ``measured_s``.

    The probes time memcpys on their own; in the job the ring's threads share the host with the
    DMAs, the launching thread and the copy worker. Solved in the inverse of the factor, which the
    prefill's time is close to linear in. None where the ring's copies barely show in the prefill.
    """

    def prefill(inverse: float) -> float:
        return predicted_prefill(ring_rates(profile, 1 / max(inverse, 1e-3)), model, HostMemoryMode.RING)

    inverse = _fit_inverse_rate(prefill, measured_s, 1.0)
    return None if inverse is None else 1 / max(inverse, 1e-3)


def calibrate_pageable(profile: Profile, model: MoeModel, measured_s: float) -> float | None:
    """The pageable H2D rate for which the simulator's prefill from the mapping takes ``measured_s``.

    The probe copies from a temporary file; the job copies whole expert tensors from the model's
    mapping, with kernels and their launches in between. Solved in seconds per byte. None where
    the pageable copies barely show in the prefill.
    """

    def prefill(per_byte: float) -> float:
        rate = 1 / max(per_byte, 1e-15)
        return predicted_prefill(dataclasses.replace(profile, h2d_pageable_bps=rate), model, HostMemoryMode.MMAP)

    per_byte = _fit_inverse_rate(prefill, measured_s, 1 / profile.h2d_pageable_bps)
    return None if per_byte is None else 1 / max(per_byte, 1e-15)


def calibrate_copy_latency(profile: Profile, model: MoeModel, mode: HostMemoryMode, measured_s: float) -> float:
    """The fixed cost per copy (``_PATH_FIELDS``) for which the simulator's decode step through
    ``mode`` takes ``measured_s``: a decode step copies each expert it uses on its own, so the cost
    of a copy beyond its bytes (the ring's handoff to a worker, the runtime's staging of a pageable
    copy) is what such steps add up.
    """
    field = _PATH_FIELDS[mode][1]

    @functools.cache
    def step(latency_s: float) -> float:
        changes: dict[str, Any] = {field: latency_s}
        row = _simulated(
            dataclasses.replace(profile, **changes),
            lambda sim, device: _job_row(sim, device, model, mode),
            f"the simulator places {mode.value} memory",
        )
        assert row.decode_step_s
        return row.decode_step_s

    if measured_s <= step(0.0) * (1 + SOLVE_TOLERANCE):
        return 0.0  # not told apart from no cost
    # From the probes' cost and no cost (simulated already): the step is close to linear in the
    # cost, and the secant through those two lands on it in one more step.
    x0 = getattr(profile, field) or 20e-6
    return solve(step, measured_s, x0, 0.0)


def fit_host_paths(
    backend: Backend, device: Device, model: MoeModel, profile: Profile
) -> tuple[Profile, list[HostPathFit]]:
    """The ring's and the mapping's rates and fixed costs per copy fitted to one prefill ubatch and a
    few decode steps of the job through each; the profile's ``ring_fill`` set to who filled the
    device's ring.

    A path whose mode falls back on this device, or whose copies are too small a part of the
    prefill to tell (a small model), keeps the probes' rates and is not listed.
    """
    with model.spread_layers(_host_path_layers(model)) as sample:
        samples = []
        for mode in (HostMemoryMode.RING, HostMemoryMode.MMAP):
            row = _job_row(backend, device, sample, mode)
            if row is None:
                continue
            if mode is HostMemoryMode.RING and row.ring_fill in RING_FILLS:
                # The simulator schedules its ring as the device's was filled (a ring whose
                # processes failed midway names both fills: no change then).
                profile = dataclasses.replace(profile, ring_fill=row.ring_fill)
            step_s = row.decode_step_s
            samples.append((mode, row.ttft_s, step_s))
        return _fit_samples(profile, sample, samples)


def refit_host_paths(
    profile: Profile, model: MoeModel, fits: Sequence[HostPathFit]
) -> tuple[Profile, list[HostPathFit]]:
    """``fit_host_paths`` again from what an earlier run measured (``fits``), on this simulator,
    starting, as that run did, from the probes' figures: ``profile`` (one that run fitted) already
    holds its fits, and whether a path is fitted at all depends on where the fit starts."""
    for fit in fits:
        profile = _with_path(profile, fit.mode, fit.probe_bps, fit.probe_latency_s)
    with model.spread_layers(_host_path_layers(model)) as sample:
        return _fit_samples(profile, sample, [(f.mode, f.prefill_s, f.decode_step_s) for f in fits])


def _with_path(profile: Profile, mode: HostMemoryMode, bps: float, latency_s: float | None) -> Profile:
    """``profile`` with host path ``mode``'s rate, and its fixed cost per copy where given."""
    if mode is HostMemoryMode.RING:
        profile = ring_rates(profile, bps / ring_bps(profile))
    else:
        profile = dataclasses.replace(profile, h2d_pageable_bps=bps)
    if latency_s is None:
        return profile
    changes: dict[str, Any] = {_PATH_FIELDS[mode][1]: latency_s}
    return dataclasses.replace(profile, **changes)


def _host_path_layers(model: MoeModel) -> int:
    """How many layers (counting from the first) hold at most HOST_PATH_BYTES of experts (at least one)."""
    total = 0
    for count, layer in enumerate(model.layers):
        total += sum(t.nbytes for t in layer.experts)
        if total > HOST_PATH_BYTES:
            return max(count, 1)
    return len(model.layers)


def _fit_samples(
    profile: Profile, model: MoeModel, samples: Sequence[tuple[HostMemoryMode, float, float | None]]
) -> tuple[Profile, list[HostPathFit]]:
    """Each (mode, prefill seconds, decode step seconds) measured of the job, fitted in turn."""
    fits = []
    for mode, prefill_s, step_s in samples:

        def fit_rate(p: Profile, mode: HostMemoryMode = mode, prefill_s: float = prefill_s) -> Profile | None:
            if mode is HostMemoryMode.RING:
                scale = calibrate_ring(p, model, prefill_s)
                return None if scale is None else ring_rates(p, scale)
            rate = calibrate_pageable(p, model, prefill_s)
            return None if rate is None else dataclasses.replace(p, h2d_pageable_bps=rate)

        profile, fit = _fit_path(profile, model, mode, prefill_s, step_s, fit_rate)
        fits += [fit] if fit is not None else []
    return profile, fits


def _fit_path(
    profile: Profile,
    model: MoeModel,
    mode: HostMemoryMode,
    prefill_s: float,
    step_s: float | None,
    fit_rate: Callable[[Profile], Profile | None],
) -> tuple[Profile, HostPathFit | None]:
    """One host path's rate fitted to its measured prefill (``fit_rate``) and its fixed cost per copy
    to its decode steps.

    Both show in both, so they are fitted in turn until the rate stays put, the fixed cost first:
    decode's small copies are mostly that, while a fixed cost far off (the probes') can leave no
    rate that would fit the prefill. Where the copies are too small a part of the prefill to tell
    (``fit_rate`` gives None), ``profile`` as it was and no fit.
    """
    rate, latency_field = _PATH_FIELDS[mode]
    probe_bps, probe_latency = rate(profile), getattr(profile, latency_field)
    start = profile
    latency: float | None = None
    for turn in range(PATH_FIT_ROUNDS):
        if step_s is not None:
            latency = calibrate_copy_latency(profile, model, mode, step_s)
            changes: dict[str, Any] = {latency_field: latency}
            profile = dataclasses.replace(profile, **changes)
        fitted = fit_rate(profile)
        if fitted is None:
            if not turn:
                return start, None
            break  # the fits so far stand
        moved = abs(rate(fitted) / rate(profile) - 1)
        profile = fitted
        if step_s is None or moved <= SOLVE_TOLERANCE:
            break
    return profile, HostPathFit(mode, prefill_s, probe_bps, rate(profile), step_s, probe_latency, latency)


# -- the whole run ---------------------------------------------------------------------------


def model_shape(model: MoeModel, types: Sequence[Any] = ()) -> ModelShape:
    """The runner's kernel shapes for ``model``; ``types`` replaces its expert types when given."""
    experts: dict[tuple[Any, int, int, bool], ExpertShape] = {}
    for layer in model.layers:
        for info, per_pair in ((layer.gate, False), (layer.up, False), (layer.down, True)):
            for w_type in types or (info.qtype,):
                shape = ExpertShape(w_type, info.ne[1], info.ne0, per_pair)
                experts[(int(w_type), shape.n_out, shape.n_in, per_pair)] = shape
    return ModelShape(model.n_embd, model.n_ff, model.n_expert, model.top_k, tuple(experts.values()))


def vendor_of(backend: Backend) -> str:
    if backend.vendor is Vendor.SIM:
        return str(backend.describe()["profile"]["vendor_like"])
    return backend.vendor.value


def tune(
    backend: Backend,
    device: Device,
    model: MoeModel,
    *,
    types: Sequence[Any] = (),
    ubatches: Sequence[int] = DEFAULT_UBATCHES,
    host_threads: Sequence[int] | None = None,
    bounds: Bounds = DEFAULT_BOUNDS,
    name: str | None = None,
    progress: Callable[[str], None] = lambda what: None,
) -> Tuned:
    """Probe ``device``, fit a profile, and calibrate its host cost on the job's decode steps.

    ``progress`` is told each phase as it starts; ``Tuned.phases_s`` says how long each took.
    """
    ring_threads = default_ring_threads(device)
    threads = host_threads or sorted({1, 2, 4, 8, ring_threads} & set(range(1, ring_threads + 1)))
    shape = model_shape(model, types)
    largest = max(model.mappings, key=len)
    clock = PhaseClock(progress)
    with contextlib.closing(device.wrap_host(largest)) as pageable:
        measured = probes.measure(backend, device, shape, ubatches, threads, bounds, clock.start, pageable)
    vendor = vendor_of(backend)
    base = BUILTIN_PROFILES[BASE_BY_VENDOR[vendor]]
    fields = fit(measured, base, name or _profile_name(device.name), vendor)
    fields["ring_threads"] = ring_threads
    profile = Profile.from_dict({"base": base.name, **fields})
    mode = HostMemoryMode.REGISTERED if profile.host_register_read_only else HostMemoryMode.PINNED
    # Decode steps of the layers the host paths sample: every layer's step is alike, and the
    # simulator repeats each calibration's steps several times over.
    with model.spread_layers(_host_path_layers(model)) as sample:
        clock.start("decode steps")
        graph_s = decode_step_seconds(backend, device, sample, mode, graphs=True)
        step_s = decode_step_seconds(backend, device, sample, mode)
        assert step_s is not None
        dma_s = decode_step_seconds(backend, device, sample, mode, gather=False)
        assert dma_s is not None
        fields["decode_gather"] = decode_gather_wins(graph_s, step_s, dma_s)
        profile = dataclasses.replace(profile, decode_gather=fields["decode_gather"])
        clock.start("calibrating on the simulator")
        profile = calibrate_calls(profile, sample, mode, graph_s, step_s)
        decode_layers = len(sample.layers)
    fields["launch_latency_s"], fields["enqueue_s"] = profile.launch_latency_s, profile.enqueue_s
    if measured.ring_small is not None:
        fields["host_copy_latency_s"] = calibrate_host_copy_latency(profile, measured.ring_small)
        profile = dataclasses.replace(profile, host_copy_latency_s=fields["host_copy_latency_s"])
    clock.start("prefill and decode through the ring and the mapping")
    profile, host_paths = fit_host_paths(backend, device, model, profile)
    for name in HOST_PATH_FIELDS:
        fields[name] = getattr(profile, name)
    ring_fit = next((path for path in host_paths if path.mode is HostMemoryMode.RING), None)
    if measured.ring_small is not None and ring_fit is not None and ring_fit.fitted_latency_s is None:
        # No decode to fit it to: the probe's small copies' fixed cost again, over the memcpy rates
        # just fitted, so that what they took stays what the simulator's take.
        fields["host_copy_latency_s"] = calibrate_host_copy_latency(profile, measured.ring_small)
        profile = dataclasses.replace(profile, host_copy_latency_s=fields["host_copy_latency_s"])
    clock.start("reads from the drive")
    disk = disk_fields(backend, model, fields)
    profile = dataclasses.replace(profile, **{name: fields[name] for name in DISK_FIELDS})
    clock.stop()
    return Tuned(
        measured,
        fields,
        base.name,
        profile,
        decode_step_s=step_s,
        phases_s=clock.seconds,
        graph_step_s=graph_s,
        host_paths=host_paths,
        decode_layers=decode_layers,
        disk=disk,
        dma_step_s=dma_s,
    )


def gather_step_seconds(graph_s: float | None, step_s: float) -> float:
    """The gather's best decode step: replayed from one graph where the device captured one, else call by call."""
    return step_s if graph_s is None else min(graph_s, step_s)


def decode_gather_wins(graph_s: float | None, step_s: float, dma_s: float) -> bool:
    """Whether decode should copy its experts with the device's gather: its best step against the DMAs',
    which the host's reading of the routing ids keeps call by call. A tie goes to the gather (no host
    round trip)."""
    return gather_step_seconds(graph_s, step_s) <= dma_s


# What disk_fields sets.
DISK_FIELDS = ("disk_read_bps", "disk_latency_s")


def disk_fields(backend: Backend, model: MoeModel, fields: dict[str, Any]) -> DiskTiming | None:
    """Set the drive's fields in ``fields``: measured on the largest of the model's files (mode disk's
    reads), or, on a simulator, the figures of the machine its profile describes (its host has no
    drive of its own to measure). The timings, where measured."""
    if backend.host.virtual_time:
        described = backend.describe()["profile"]
        fields["disk_read_bps"] = [list(pair) for pair in described["disk_read_bps"]]
        fields["disk_latency_s"] = described["disk_latency_s"]
        return None
    largest = max(model.paths, key=lambda path: path.stat().st_size)
    timing = measure_disk(largest)
    fields.update(fit_disk(timing))
    return timing


def calibration_model(backend: Backend, folder: Path, preset: str, qtype: str) -> Path:
    """A few layers of ``preset`` to calibrate on: with data on a GPU, a sparse file on a timing-only simulator."""
    path = folder / f"{preset}-{qtype}-{CALIBRATION_LAYERS}l.gguf"
    if backend.host.holds_data:
        return make_model(preset, qtype, path, layers=CALIBRATION_LAYERS)
    return write_sparse_model(preset, qtype, path, layers=CALIBRATION_LAYERS)


def _profile_name(device_name: str) -> str:
    return "tuned-" + "-".join(device_name.lower().split())
