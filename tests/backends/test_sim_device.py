"""Simulator specifics: garbage memory, racy data, memory accounting, kernel twins, handles, registration."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType

import expertstream
from expertstream.backends.base import Stream, Usage
from expertstream.backends.sim import Access, KernelSpec, SimBackend, register_kernel
from expertstream.errors import DeviceError, InvalidArgument, KernelCompileError, OutOfDeviceMemory, UseAfterClose


def _open(**options: Any) -> SimBackend:
    backend = expertstream.backend("sim", **options)
    assert isinstance(backend, SimBackend)
    return backend


def _copy_twin(args: tuple[Any, ...], grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    src, dst = args
    dst[:] = src


COPY = register_kernel(
    KernelSpec(
        "device_test_copy",
        run=_copy_twin,
        flops=lambda args: 0.0,
        accesses=lambda args: [Access(args[0].view(), write=False), Access(args[1].view(), write=True)],
    )
)


def _broken_twin(args: tuple[Any, ...], grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    raise ValueError("index out of range in the twin")


BROKEN = register_kernel(KernelSpec("device_test_broken", run=_broken_twin, accesses=lambda a: [], flops=lambda a: 0))


def test_device_memory_starts_as_garbage_and_padding_as_zeros() -> None:
    with _open(check_hazards=False) as sim:
        dev = sim.device(0)
        assert dev.alloc(64, Usage.COMPUTE).read().tolist() == [0xCD] * 64
        weights = dev.alloc(432, Usage.WEIGHTS, row_type=GGMLQuantizationType.Q4_0, ne0=768)
        data = weights.read()
        assert data[:432].tolist() == [0xCD] * 432 and not data[432:].any()


def test_a_racy_schedule_reads_the_bytes_a_real_gpu_could_read() -> None:
    """Without the wait the kernel starts before the slot's copy: it sees the old bytes."""
    with _open(check_hazards=False) as sim:
        dev = sim.device(0)
        copy, compute = dev.stream(), dev.stream()
        slot, out, other = dev.alloc(4096), dev.alloc(4096), dev.alloc(64 << 20)
        copy.memset(slot, 0, 4096, 0xAA)
        copy.synchronize()
        host, big = dev.alloc_pinned(4096), dev.alloc_pinned(64 << 20)
        host.array[:] = 0x55
        copy.copy_h2d(other, 0, big, 0, 64 << 20)  # keeps the copy engine busy for ~1.2 ms
        copy.copy_h2d(slot, 0, host, 0, 4096)
        compute.launch(dev.compile("", COPY.name), 1, 1, (slot, out))  # no wait: a race
        dev.synchronize()
        assert out.read().tolist() == [0xAA] * 4096
        assert slot.read().tolist() == [0x55] * 4096


def test_memory_accounting_and_out_of_memory() -> None:
    with _open(profile={"base": "cuda-h200", "name": "tiny", "memory_bytes": 1 << 20}) as sim:
        dev = sim.device(0)
        first = dev.alloc(700 * 1024)
        assert dev.free_memory() == (1 << 20) - 700 * 1024
        with pytest.raises(OutOfDeviceMemory, match=rf"{400 * 1024} bytes: {(1 << 20) - 700 * 1024} of"):
            dev.alloc(400 * 1024)
        first.close()
        assert dev.free_memory() == 1 << 20
        dev.alloc(400 * 1024).close()


def test_calls_inside_bare_calls_cost_the_profile_s_call_s() -> None:
    """The job's calls cost enqueue_s (its own work between them included); calls made back to
    back (a staging ring's DMAs and records) cost call_s, on that thread only; without call_s, enqueue_s."""
    import threading

    for call_s, want in ((3e-6, 3e-6), (None, 40e-6)):
        with _open(profile={"base": "cuda-h200", "enqueue_s": 40e-6, "call_s": call_s}) as sim:
            dev = sim.device(0)
            stream = dev.stream()
            event = dev.event()
            before = sim.host_time()
            stream.record(event)
            assert sim.host_time() - before == pytest.approx(40e-6)
            with sim.host.bare_calls():
                before = sim.host_time()
                stream.record(event)
                assert sim.host_time() - before == pytest.approx(want)
                other: list[float] = []

                def elsewhere(stream: Stream, event: Any, other: list[float]) -> None:
                    start = sim.host_time()
                    stream.record(event)
                    other.append(sim.host_time() - start)

                thread = threading.Thread(target=elsewhere, args=(stream, event, other))
                thread.start()
                thread.join()
                assert other == [pytest.approx(40e-6)]  # another thread's calls are the job's
            before = sim.host_time()
            stream.record(event)
            assert sim.host_time() - before == pytest.approx(40e-6)


def test_pageable_bytes_are_staged_when_the_copy_does_not_block() -> None:
    with _open(profile={"base": "cuda-h200", "pageable_blocks_host": False}) as sim:
        dev = sim.device(0)
        stream = dev.stream()
        array = np.ones(4096, dtype=np.uint8)
        buf = dev.alloc(4096)
        before = sim.host_time()
        stream.copy_h2d(buf, 0, dev.wrap_host(array), 0, 4096)
        assert sim.host_time() == pytest.approx(before + sim.profile.enqueue_s)  # returned at once
        array[:] = 2  # allowed: the copy already took the bytes
        stream.synchronize()
        assert buf.read().tolist() == [1] * 4096


def test_unknown_kernel_says_how_to_register_a_twin() -> None:
    with _open() as sim, pytest.raises(KernelCompileError) as info:
        sim.device(0).compile('extern "C" __global__ void k() {}', "no_such_kernel")
    assert "'no_such_kernel'" in str(info.value) and "register_kernel" in str(info.value)


def test_a_failing_twin_surfaces_when_the_host_synchronizes() -> None:
    with _open() as sim:
        dev = sim.device(0)
        stream = dev.stream()
        stream.launch(dev.compile("", BROKEN.name), 1, 1, ())
        with pytest.raises(DeviceError, match=r"device_test_broken.*index out of range"):
            stream.synchronize()


def test_the_kernels_hand_their_twins_to_compile_and_the_simulator_does_not_import_them() -> None:
    code = (
        "import sys, expertstream.backends.sim as sim\n"
        "assert 'expertstream.kernels' not in sys.modules, 'the simulator imported the kernels'\n"
        "import expertstream.kernels as k\n"
        "with sim.open() as b:\n"
        "    try:\n"
        "        b.device(0).compile('', 'moe_swiglu')\n"
        "    except Exception as exc:\n"
        "        print('by name:', type(exc).__name__)\n"
        "    print('from MoeKernels:', k.MoeKernels(b.device(0)).kernel('moe_swiglu').name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["by", "name:", "KernelCompileError", "from", "MoeKernels:", "moe_swiglu"]


def test_a_twin_given_to_compile_runs_without_registration() -> None:
    twin = KernelSpec("device_test_unregistered", run=_copy_twin, accesses=COPY.accesses, flops=COPY.flops)
    with _open() as sim:
        dev = sim.device(0)
        kernel = dev.compile("", twin.name, twin=twin)
        assert dev.compile("", twin.name, twin=twin) is kernel
        src, out = dev.upload(np.arange(8, dtype=np.uint8)), dev.alloc(8)
        stream = dev.stream()
        stream.launch(kernel, 1, 1, (src, out))
        stream.synchronize()
        assert out.read().tolist() == list(range(8))
        with pytest.raises(KernelCompileError, match="device_test_unregistered"):
            dev.compile("", twin.name)  # nothing is registered under its name
        with pytest.raises(InvalidArgument, match="the KernelSpec of 'device_test_copy'"):
            dev.compile("", twin.name, twin=COPY)
        with pytest.raises(InvalidArgument, match="got str"):
            dev.compile("", twin.name, twin="not a twin")


def test_stream_handles_are_checked() -> None:
    with _open(devices=2) as sim:
        dev0, dev1 = sim.devices
        with pytest.raises(InvalidArgument, match="12345"):
            Stream.from_handle(dev0, 12345)
        other = dev1.stream()
        with pytest.raises(InvalidArgument, match="belongs to sim:1"):
            dev0.stream_from_handle(other.handle)
        stream = dev0.stream()
        wrapped = dev0.stream_from_handle(stream.handle)
        stream.close()
        with pytest.raises(UseAfterClose, match="destroyed"):
            wrapped.memset(dev0.alloc(16), 0, 16, 0)
        with pytest.raises(InvalidArgument):
            dev0.stream_from_handle(stream.handle)


def test_host_registration_follows_the_profile(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(8192))
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    with _open(profile="rocm-r9700") as sim:
        with pytest.raises(DeviceError, match="read-only host registration is not supported"):
            sim.device(0).wrap_host(mapping).register()
        host = sim.device(0).wrap_host(np.zeros(1 << 20, dtype=np.uint8))
        before = sim.host_time()
        host.register()
        assert sim.host_time() == pytest.approx(before + (1 << 20) / sim.profile.host_register_bps)
    with (
        _open(profile={"base": "cuda-h200", "host_register": False}) as sim,
        pytest.raises(DeviceError, match="host registration is not supported"),
    ):
        sim.device(0).wrap_host(np.zeros(64, dtype=np.uint8)).register()


def test_peer_access_arguments() -> None:
    with _open(devices=2) as sim, _open() as other:
        dev0, dev1 = sim.devices
        with pytest.raises(InvalidArgument, match="own peer"):
            dev0.enable_peer_access(dev0)
        with pytest.raises(InvalidArgument, match="not a device of this backend"):
            dev0.enable_peer_access(other.device(0))
        dev0.enable_peer_access(dev1)
        dev0.enable_peer_access(dev1)  # enabling twice is harmless
        assert dev0.capabilities.peer_access == frozenset({1})


def test_describe_names_the_profile_and_modes() -> None:
    with _open(profile="rocm-r9700", data=False, check_hazards=False) as sim:
        info = sim.describe()
    assert info["vendor"] == "sim" and info["profile"]["name"] == "rocm-r9700"
    assert info["data"] is False and info["check_hazards"] is False
    assert info["devices"][0]["total_memory"] == 32 << 30
