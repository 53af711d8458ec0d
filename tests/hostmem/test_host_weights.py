"""Every host memory mode delivers every tensor byte-exact into device buffers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, Device, HostBuffer
from expertstream.backends.sim import BUILTIN_PROFILES
from expertstream.errors import InvalidArgument, UseAfterClose
from expertstream.hostmem import (
    DEFAULT_RING_THREADS,
    HostMemoryMode,
    HostRegion,
    HostSource,
    HostWeights,
    RingOptions,
    RingRegion,
    default_ring_threads,
)
from expertstream.model import MoeModel

# Ring settings for tests: chunks smaller than a tensor (221184 bytes) and not dividing it.
SMALL_RING = RingOptions(chunk_bytes=50_000, chunks=3, threads=2)
MODES = list(HostMemoryMode)


def _copy_out(device: Device, source: HostSource, offset: int, nbytes: int, dst_offset: int = 0) -> np.ndarray:
    dst = device.alloc(dst_offset + nbytes)
    try:
        with device.stream() as stream:
            source.enqueue_h2d(stream, dst, dst_offset, offset, nbytes)
            stream.synchronize()
        return dst.read(dst_offset, nbytes)
    finally:
        dst.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_every_tensor_round_trips(backend: Backend, tiny_path: Path, mode: HostMemoryMode) -> None:
    device = backend.device(0)
    with MoeModel.open(tiny_path) as model, HostWeights.open(model, device, mode, ring=SMALL_RING) as weights:
        assert sorted(weights) == sorted(model.tensors)
        for name, info in model.tensors.items():
            source = weights[name]
            assert isinstance(source, HostSource)
            assert source.nbytes == info.nbytes
            assert np.array_equal(_copy_out(device, source, 0, info.nbytes), model.raw(info)), name


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_range_starting_mid_tensor_into_mid_buffer(backend: Backend, tiny_path: Path, mode: HostMemoryMode) -> None:
    device = backend.device(0)
    with MoeModel.open(tiny_path) as model, HostWeights.open(model, device, mode, ring=SMALL_RING) as weights:
        info = model.layers[1].down
        offset, nbytes = 12_345, info.nbytes - 12_345 - 777
        got = _copy_out(device, weights[info.name], offset, nbytes, dst_offset=100)
        assert np.array_equal(got, model.raw(info)[offset : offset + nbytes])


def test_sources_say_whether_they_block_the_host(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    name = "blk.0.ffn_up_exps.weight"
    with HostWeights.open(tiny_path, device, "mmap") as weights:
        assert isinstance(weights[name], HostRegion)
        assert weights[name].blocks_host
    with HostWeights.open(tiny_path, device, "pinned") as weights:
        assert not weights[name].blocks_host
    with HostWeights.open(tiny_path, device, "ring", ring=SMALL_RING) as weights:
        assert isinstance(weights[name], RingRegion)
        assert weights[name].blocks_host


def test_pinned_mode_holds_one_copy_of_the_tensors(
    backend: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = backend.device(0)
    sizes: list[int] = []
    real = device.alloc_pinned

    def counting_alloc(n: int) -> HostBuffer:
        sizes.append(n)
        return real(n)

    monkeypatch.setattr(device, "alloc_pinned", counting_alloc)
    with HostWeights.open(tiny_path, device, HostMemoryMode.PINNED) as weights:
        total = sum(t.nbytes for t in weights.model.tensors.values())
        assert len(sizes) == 1
        assert total <= sizes[0] == weights.stats.pinned_bytes < total + 4096 * len(weights)
        assert weights.mode is HostMemoryMode.PINNED and not weights.stats.fallbacks


def test_region_ranges_are_checked(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    for mode in (HostMemoryMode.MMAP, HostMemoryMode.RING):
        with HostWeights.open(tiny_path, device, mode, ring=SMALL_RING) as weights:
            source = weights["blk.0.ffn_gate_inp.weight"]
            dst = device.alloc(2 * source.nbytes)
            with device.stream() as stream, pytest.raises(InvalidArgument, match="outside"):
                source.enqueue_h2d(stream, dst, 0, 8, source.nbytes)
            dst.close()


def test_closed_weights_refuse_copies_and_close_an_owned_model(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    for mode in (HostMemoryMode.MMAP, HostMemoryMode.RING, HostMemoryMode.PINNED):
        weights = HostWeights.open(tiny_path, device, mode, ring=SMALL_RING)
        source = weights["blk.0.ffn_up_exps.weight"]
        weights.close()
        weights.close()  # idempotent
        dst = device.alloc(source.nbytes)
        with device.stream() as stream, pytest.raises(UseAfterClose):
            source.enqueue_h2d(stream, dst, 0, 0, source.nbytes)
        dst.close()
        with pytest.raises(Exception, match="closed"):
            weights.model.mapping  # noqa: B018


def test_a_model_passed_in_stays_open(backend: Backend, tiny_path: Path) -> None:
    with MoeModel.open(tiny_path) as model:
        HostWeights.open(model, backend.device(0), "mmap").close()
        assert model.raw("blk.0.ffn_up_exps.weight").nbytes > 0


def test_unknown_mode_is_refused(backend: Backend, tiny_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="unknown host memory mode 'fast'"):
        HostWeights.open(tiny_path, backend.device(0), "fast")


@pytest.mark.parametrize("named", [7, None])
def test_a_simulated_machine_runs_the_ring_threads_its_profile_names(tiny_path: Path, named: int | None) -> None:
    """A prediction of another machine's ring takes that machine's thread count, not this host's."""
    profile = dataclasses.replace(BUILTIN_PROFILES["cuda-h200"], ring_threads=named)
    with expertstream.backend("sim", profile=profile) as sim:
        device = sim.device(0)
        assert default_ring_threads(device) == (named or DEFAULT_RING_THREADS)
        with HostWeights.open(tiny_path, device, HostMemoryMode.RING) as weights:
            regions = [weights[name] for name in weights]
            assert regions and all(isinstance(r, RingRegion) for r in regions)
            assert {r.ring.threads for r in regions if isinstance(r, RingRegion)} == {named or DEFAULT_RING_THREADS}
