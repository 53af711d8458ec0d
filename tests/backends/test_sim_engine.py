"""Virtual time on the simulator: the measured event-order case, host clocks, backfill, scale, traces."""

from __future__ import annotations

import dataclasses
import json
import resource
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import HostMemory, Usage
from expertstream.backends.sim import PROFILE_ENV, Access, KernelSpec, Profile, SimBackend, register_kernel
from expertstream.errors import InvalidArgument
from expertstream.timeline import OpKind, to_chrome_trace, write_chrome_trace

MIB = 1 << 20
GIB = 1 << 30


def _open(**options: Any) -> SimBackend:
    backend = expertstream.backend("sim", **options)
    assert isinstance(backend, SimBackend)
    return backend


# -- the event-order case measured on the H200 ------------------------------------------------


def _release_ms(profile: str, kind: HostMemory, wait_before_copy2: bool) -> float:
    """Stream A: copy 64 MiB, record e1, copy 1 GiB; stream B waits e1. Time until B is released."""
    with _open(profile=profile, data=False) as sim:
        dev = sim.device(0)
        a, b = dev.stream(), dev.stream()
        host, slot = dev.placeholder_host(GIB, kind), dev.alloc(GIB)
        t0, e1, released = dev.event(timing=True), dev.event(), dev.event(timing=True)
        a.record(t0)
        a.copy_h2d(slot, 0, host, 0, 64 * MIB)
        a.record(e1)
        if wait_before_copy2:
            b.wait(e1)
            b.record(released)
        a.copy_h2d(slot, 0, host, 0, GIB)
        if not wait_before_copy2:
            b.wait(e1)
            b.record(released)
        released.synchronize()
        return t0.elapsed_ms(released)


def test_pageable_wait_enqueued_after_the_next_copy_is_released_late_on_cuda() -> None:
    before = _release_ms("cuda-h200", HostMemory.PAGEABLE, wait_before_copy2=True)
    after = _release_ms("cuda-h200", HostMemory.PAGEABLE, wait_before_copy2=False)
    assert 7.0 <= before <= 10.5  # measured 9.9 ms, and 7.6..7.8 ms in docs/results/cuda-h200.md
    assert 125 <= after <= 160  # measured 135 ms, and 127..128 ms: the host sat blocked inside copy2's enqueue


def test_pinned_release_does_not_depend_on_the_order() -> None:
    before = _release_ms("cuda-h200", HostMemory.PINNED, wait_before_copy2=True)
    after = _release_ms("cuda-h200", HostMemory.PINNED, wait_before_copy2=False)
    assert 1.1 <= before <= 1.4  # measured 1.26 ms either way
    assert after == pytest.approx(before, abs=0.05)


def test_rocm_pageable_order_case() -> None:
    before = _release_ms("rocm-r9700", HostMemory.PAGEABLE, wait_before_copy2=True)
    after = _release_ms("rocm-r9700", HostMemory.PAGEABLE, wait_before_copy2=False)
    assert 1.2 <= before <= 1.5
    assert 19 <= after <= 23


# -- events in virtual time -------------------------------------------------------------------

SLOW_MEMSET = {"base": "cuda-h200", "memset_bps": 1e6}  # 10 000 bytes take 10 ms


def test_wait_binds_to_the_record_current_when_it_is_enqueued() -> None:
    with _open(profile=SLOW_MEMSET, data=False) as sim:
        dev = sim.device(0)
        a, b, c = dev.stream(), dev.stream(), dev.stream()
        buf = dev.alloc(10_000)
        t0, event, b_done, c_done = (dev.event(timing=True) for _ in range(4))
        a.record(t0)
        a.memset(buf, 0, 10_000, 1)
        a.record(event)
        b.wait(event)
        b.record(b_done)
        a.memset(buf, 0, 10_000, 2)
        a.record(event)  # re-armed: does not move b's wait, does gate c's
        c.wait(event)
        c.record(c_done)
        dev.synchronize()
        assert 9.9 < t0.elapsed_ms(b_done) < 10.2
        assert 19.9 < t0.elapsed_ms(c_done) < 20.3


def test_query_is_false_until_the_host_clock_reaches_the_work() -> None:
    with _open(profile=SLOW_MEMSET, data=False) as sim:
        dev = sim.device(0)
        stream, done = dev.stream(), dev.event()
        stream.memset(dev.alloc(10_000), 0, 10_000, 0)
        stream.record(done)
        assert not done.query() and not stream.query()
        done.synchronize()
        assert done.query() and stream.query()
        assert sim.host_time() >= 10e-3


# -- host threads -----------------------------------------------------------------------------


def test_each_host_thread_has_its_own_clock() -> None:
    with _open(data=False) as sim:
        dev = sim.device(0)
        host, buf = dev.placeholder_host(64 * MIB), dev.alloc(64 * MIB)
        main_before = sim.host_time()
        seen: dict[str, Any] = {}

        def worker() -> None:
            dev.stream().copy_h2d(buf, 0, host, 0, 64 * MIB)  # pageable: blocks this thread only
            seen["time"] = sim.host_time()
            seen["stamp"] = sim.host.timestamp()

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert seen["time"] >= 64 * MIB / sim.profile.h2d_pageable_bps
        assert sim.host_time() == main_before
        sim.host.resume_at(seen["stamp"])
        assert sim.host_time() == seen["time"]


def test_enqueue_costs_and_blocking_calls_move_the_host_clock() -> None:
    with _open(data=False) as sim:
        dev, profile = sim.device(0), sim.profile
        stream = dev.stream()
        pinned, buf = dev.alloc_pinned(GIB), dev.alloc(GIB)
        t = sim.host_time()
        stream.copy_h2d(buf, 0, pinned, 0, GIB)
        assert sim.host_time() == pytest.approx(t + profile.enqueue_s)  # pinned: returns at once
        stream.synchronize()
        assert sim.host_time() >= GIB / profile.h2d_pinned_bps
        t = sim.host_time()
        sim.host.copy(pinned, 0, dev.placeholder_host(MIB), 0, MIB)
        assert sim.host_time() == pytest.approx(t + MIB / profile.host_memcpy_bps)


@pytest.mark.parametrize("sharing", [1, 4, 12])
def test_host_copies_take_their_share_of_the_memory_bus_whatever_order_threads_run(sharing: int) -> None:
    """Copies that run at once each take 1 / sharing of the bus (or one thread's rate, if lower),
    however the OS orders their threads: here one after another, last part first (each thread
    lets the next one go once it has copied)."""
    base = expertstream.backends.sim.BUILTIN_PROFILES["cuda-h200"]
    profile = dataclasses.replace(base, host_memcpy_bps=5e9, host_memcpy_total_bps=20e9, host_copy_latency_s=0.0)
    with _open(profile=profile, data=False) as sim:
        dev = sim.device(0)
        src, dst = dev.placeholder_host(sharing * MIB), dev.placeholder_host(sharing * MIB)
        start = sim.host.timestamp()
        ends: list[float] = []

        go = [threading.Event() for _ in range(sharing)]

        def part(i: int) -> None:
            go[i].wait()
            sim.host.resume_at(start)
            sim.host.copy(dst, i * MIB, src, i * MIB, MIB, sharing=sharing)
            ends.append(sim.host_time())
            if i > 0:
                go[i - 1].set()

        threads = [threading.Thread(target=part, args=(i,)) for i in range(sharing)]
        for thread in threads:
            thread.start()
        go[-1].set()
        for thread in threads:
            thread.join()
        expected = start + MIB / min(5e9, 20e9 / sharing)
        assert ends == [pytest.approx(expected)] * sharing


@pytest.mark.parametrize("sharing", [0, -1, 1.5, True])
def test_host_copy_refuses_a_sharing_that_is_not_a_count(sharing: Any) -> None:
    with _open(data=False) as sim:
        dev = sim.device(0)
        host = dev.placeholder_host(MIB)
        with pytest.raises(InvalidArgument, match="sharing"):
            sim.host.copy(host, 0, host, 0, 16, sharing=sharing)


# -- engines ----------------------------------------------------------------------------------


def _ops(sim: SimBackend, kind: OpKind, stream: int) -> list[Any]:
    return [op for op in sim.timeline if op.kind is kind and op.stream == stream]


def test_short_copy_backfills_an_idle_gap_of_the_copy_engine() -> None:
    with _open(profile=SLOW_MEMSET, data=False) as sim:
        dev = sim.device(0)
        a, b, c, d = (dev.stream() for _ in range(4))
        pinned, buf = dev.alloc_pinned(GIB), dev.alloc(GIB)
        gate = dev.event()
        b.memset(dev.alloc(10_000), 0, 10_000, 0)  # 10 ms on stream b
        b.record(gate)
        a.wait(gate)
        a.copy_h2d(buf, 0, pinned, 0, MIB)  # ready at 10 ms
        c.copy_h2d(buf, MIB, pinned, 0, MIB)  # enqueued later, fits before it
        d.copy_h2d(buf, 2 * MIB, pinned, 0, GIB - 2 * MIB)  # too long for the gap: after a's copy
        (late,), (early,), (long,) = (
            _ops(sim, OpKind.H2D, a.handle),
            _ops(sim, OpKind.H2D, c.handle),
            _ops(sim, OpKind.H2D, d.handle),
        )
        assert early.end <= late.start and late.start >= 10e-3
        assert long.start >= late.end


def test_copies_overlap_compute_but_share_their_engine() -> None:
    with _open(data=False) as sim:
        dev = sim.device(0)
        s1, s2, s3 = dev.stream(), dev.stream(), dev.stream()
        pinned, x, y, z = dev.alloc_pinned(GIB), dev.alloc(GIB), dev.alloc(GIB), dev.alloc(GIB)
        s1.copy_h2d(x, 0, pinned, 0, GIB)
        s2.copy_h2d(y, 0, pinned, 0, GIB)
        s3.memset(z, 0, GIB, 0)
        (c1,), (c2,), (m,) = (
            _ops(sim, OpKind.H2D, s1.handle),
            _ops(sim, OpKind.H2D, s2.handle),
            _ops(sim, OpKind.MEMSET, s3.handle),
        )
        assert c2.start >= c1.end  # one H2D engine
        assert m.start < c1.end  # the compute engine runs alongside


BUSY = register_kernel(
    KernelSpec(
        "engine_test_busy",
        run=lambda args, grid, block: None,
        accesses=lambda args: [Access(args[0], write=True)],
        flops=lambda args: float(args[1]),
    )
)


@pytest.mark.parametrize("engine", ["fill-kernel", "copy-engine"])
def test_a_tail_clear_on_a_copy_stream_never_holds_back_a_kernel(engine: str) -> None:
    # 10 000 bytes of memset take 10 ms, 20 MB of device-local copy 20 ms.
    profile = {"base": "cuda-h200", "memset_bps": 1e6, "d2d_bps": 1e9, "memset_engine": engine}
    with _open(profile=profile, data=False) as sim:
        dev = sim.device(0)
        copy, compute, other = dev.stream(), dev.stream(), dev.stream()
        pinned, slot, out = dev.alloc_pinned(GIB), dev.alloc(GIB), dev.alloc(64)
        copy.copy_h2d(slot, 0, pinned, 0, GIB - 10_000)
        copy.memset(slot, GIB - 10_000, 10_000, 0)  # behind the copy: from ~19 ms
        compute.launch(dev.compile("", BUSY.name), 1, 1, (out.view(), np.float64(0.02 * sim.profile.flops_per_s)))
        other.copy_d2d(dev.alloc(20 * 10**6), 0, dev.alloc(20 * 10**6), 0, 20 * 10**6)
        (memset,), (kernel,), (d2d,) = (
            _ops(sim, OpKind.MEMSET, copy.handle),
            _ops(sim, OpKind.KERNEL, compute.handle),
            _ops(sim, OpKind.D2D, other.handle),
        )
        assert memset.start >= 19e-3
        assert kernel.start < 1e-3  # ready first, so first: the memset is no kernel's obstacle
        assert (d2d.start >= memset.end) == (engine == "copy-engine")  # a copy engine is shared


# -- timing-only mode at full scale -----------------------------------------------------------

EXPERT_TENSOR = 72 * 10**9 // 144  # 48 layers x 3 expert tensors, 72 GB in all
UBATCH = 4096


def _expert_matmul_flops(args: tuple[Any, ...]) -> float:
    # 2 flops per weight per token for the 10 of 512 experts a token uses, at ~4.8 bits per weight.
    weights = args[0].nbytes * 8 / 4.8
    return 2.0 * weights * 10 / 512 * UBATCH


EXPERT_MATMUL = register_kernel(
    KernelSpec(
        "engine_test_expert_matmul",
        run=lambda args, grid, block: None,
        accesses=lambda args: [Access(args[0], write=False), Access(args[1], write=True)],
        flops=_expert_matmul_flops,
    )
)


def test_full_expert_set_in_timing_only_mode_pipelines_copies_under_compute() -> None:
    n_slots, passes, n_tensors = 3, 2, 144
    with _open(profile="cuda-h200", data=False, check_hazards=True) as sim:
        dev = sim.device(0)
        experts = dev.placeholder_host(n_tensors * EXPERT_TENSOR, HostMemory.PINNED)
        slots = [dev.alloc(EXPERT_TENSOR, Usage.COMPUTE) for _ in range(n_slots)]
        ready, free = [dev.event() for _ in slots], [dev.event() for _ in slots]
        out = dev.alloc(MIB, Usage.COMPUTE)
        copy, compute = dev.stream(name="prefetch"), dev.stream(name="compute")
        kernel = dev.compile("", EXPERT_MATMUL.name)

        def fire(i: int) -> None:
            k = i % n_slots
            copy.wait(free[k])
            copy.copy_h2d(slots[k], 0, experts, (i % n_tensors) * EXPERT_TENSOR, EXPERT_TENSOR)
            copy.record(ready[k])

        total = passes * n_tensors
        fire(0)
        fire(1)
        for i in range(total):
            k = i % n_slots
            compute.wait(ready[k])
            compute.launch(kernel, 1, 1, (slots[k].view(), out.view()))
            compute.record(free[k])
            if i + 2 < total:  # the consumer's wait is enqueued before the next lookahead copy
                fire(i + 2)
        compute.synchronize()
        copy_s = EXPERT_TENSOR / sim.profile.h2d_pinned_bps
        kernel_s = _expert_matmul_flops((slots[0].view(),)) / sim.profile.flops_per_s
        steady = total * max(copy_s, kernel_s)
        assert steady <= sim.host_time() <= steady + copy_s + 0.01 * steady  # overlapped, not the sum
    kib_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert kib_peak < 4 * 1024 * 1024  # 72 GB of weights and 1.5 GB of slots were never touched


def test_timing_only_buffers_hold_no_data() -> None:
    with _open(data=False) as sim, pytest.raises(InvalidArgument, match="timing-only"):
        sim.device(0).alloc(16).read()


# -- profiles ---------------------------------------------------------------------------------


def test_user_profile_from_dict_and_json(tmp_path: Path) -> None:
    custom = Profile.from_dict({"base": "rocm-r9700", "name": "my-card", "h2d_pinned_bps": 25e9})
    assert custom.h2d_pinned_bps == 25e9 and custom.memory_bytes == 32 * GIB
    path = tmp_path / "card.json"
    path.write_text(json.dumps({"base": "cuda-h200", "name": "json-card", "memory_bytes": 1 << 30}))
    with _open(profile=str(path)) as sim:
        assert sim.profile.name == "json-card" and sim.device(0).arch == "json-card"
        assert sim.device(0).total_memory == 1 << 30
    with _open(profile=custom) as sim:
        assert sim.device(0).arch == "my-card"
    # Profiles written before memset_engine existed still load, with the fill-kernel default.
    older = {k: v for k, v in dataclasses.asdict(custom).items() if k != "memset_engine"}
    assert Profile.from_dict(older).memset_engine == "fill-kernel"


def test_bad_profiles_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="warp_size"):
        Profile.from_dict({"base": "cuda-h200", "warp_size": 32})
    with pytest.raises(InvalidArgument, match="missing field"):
        Profile.from_dict({"name": "half"})
    with pytest.raises(InvalidArgument, match="h2d_pinned_bps"):
        Profile.from_dict({"base": "cuda-h200", "h2d_pinned_bps": -1})
    with pytest.raises(InvalidArgument, match="memset_engine must be one of"):
        Profile.from_dict({"base": "cuda-h200", "memset_engine": "dma"})
    with pytest.raises(InvalidArgument, match="cuda-h200"):
        expertstream.backend("sim", profile="no-such-card")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match=r"bad.json"):
        expertstream.backend("sim", profile=str(bad))


def test_profile_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROFILE_ENV, "rocm-r9700")
    with _open() as sim:
        assert sim.profile.name == "rocm-r9700" and sim.device(0).arch == "rocm-r9700"
        assert not sim.device(0).capabilities.host_register_read_only


# -- trace export -----------------------------------------------------------------------------


def test_chrome_trace_has_one_track_per_stream_and_the_host(tmp_path: Path) -> None:
    with _open() as sim:
        dev = sim.device(0)
        names = ("prefetch", "compute", "readback")
        copy, compute, readback = (dev.stream(name=n) for n in names)
        buf = dev.alloc(MIB)
        ready = dev.event()
        copy.copy_h2d(buf, 0, dev.wrap_host(np.ones(MIB, dtype=np.uint8)), 0, MIB)  # pageable: blocks the host
        copy.record(ready)
        compute.wait(ready)
        compute.memset(buf, 0, 16, 0)
        compute.synchronize()
        readback.copy_d2h(dev.alloc_pinned(16), 0, buf, 0, 16)
        readback.synchronize()
        path = tmp_path / "trace.json"
        write_chrome_trace(sim.timeline, path)
        trace = json.loads(path.read_text())
        assert trace == json.loads(json.dumps(to_chrome_trace(sim.timeline)))
    events = trace["traceEvents"]
    device_tracks = {(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "i") and e["pid"] != 0}
    assert len(device_tracks) == 3
    track_names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) <= track_names and "host thread 0" in track_names
    host_spans = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert any(e["name"].startswith("blocked in h2d") for e in host_spans)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
