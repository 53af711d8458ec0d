"""Mode disk's RAM tier (--host-cache): the first whole layers read once into pinned memory, the same bytes out."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from expertstream.backends.base import Backend, HostBuffer
from expertstream.backends.sim.profiles import Profile
from expertstream.bench.measure import Settings
from expertstream.bench.placeholder import write_sparse_model
from expertstream.bench.predict import predict
from expertstream.cli import main
from expertstream.cli.generate import _options
from expertstream.cli.generate import register as register_generate
from expertstream.cli.tools import Parser
from expertstream.engine.model import Model, Options
from expertstream.engine.offload import format_size, parse_size
from expertstream.engine.runner import Batching
from expertstream.errors import InvalidArgument
from expertstream.hostmem import HostMemoryMode, HostRegion, HostWeights, RingOptions, RingRegion
from expertstream.hostmem.hostcache import TieredRegion, layer_bytes
from expertstream.model import MoeModel

SMALL_DISK_RING = RingOptions(chunks=3, chunk_bytes=50_000, threads=3, part_bytes=8192)
PREFILL = ["--tokens", "32", "--ubatch", "16", "-r", "2", "--slots", "0,2", "--decode", "3", "--json"]


def _layer0_bytes(path: Path) -> int:
    with MoeModel.open(path) as model:
        return layer_bytes(model.layers[0])


def _copy_all(weights: HostWeights, backend: Backend) -> dict[str, bytes]:
    device = backend.device(0)
    buffers = {name: device.alloc(weights[name].nbytes) for name in weights}
    with device.stream() as stream:
        for name, dst in buffers.items():
            weights[name].enqueue_h2d(stream, dst, 0, 0, weights[name].nbytes)
        stream.synchronize()
    out = {name: dst.read().tobytes() for name, dst in buffers.items()}
    for dst in buffers.values():
        dst.close()
    return out


def _recording_reads(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[tuple[HostBuffer, int]]:
    """Every Host.read_into from now on: (buffer, bytes)."""
    reads: list[tuple[HostBuffer, int]] = []
    real = backend.host.read_into

    def recording(dst: HostBuffer, dst_offset: int, nbytes: int, read: Callable[[memoryview], None], **kw: int) -> None:
        reads.append((dst, nbytes))
        real(dst, dst_offset, nbytes, read, **kw)

    monkeypatch.setattr(backend.host, "read_into", recording)
    return reads


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_the_first_layer_is_read_once_into_pinned_memory_and_every_tensor_arrives_exact(
    backend: Backend, tiny_path: Path, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    advised: list[int] = []
    real_advise = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append(advice)
        real_advise(fd, offset, length, advice)

    def opener(path: str, flags: int) -> int:
        if not direct and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return os.open(path, flags)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    size = _layer0_bytes(tiny_path)
    reads = _recording_reads(backend, monkeypatch)
    device = backend.device(0)
    with HostWeights.open(
        tiny_path, device, HostMemoryMode.DISK, ring=SMALL_DISK_RING, opener=opener, host_cache=size, page_cache=False
    ) as weights:
        first, second = weights.model.layers
        cached = {t.name for t in (first.router, *first.experts)}
        (ring,) = weights.rings
        for name in weights:
            region = weights[name]
            if name in cached:
                assert type(region) is HostRegion and region.buffer.is_page_locked, name
            else:
                assert isinstance(region, RingRegion) and region.ring is ring, name
        # Read at open, through Host.read_into (the simulator's drive), into one buffer counted as pinned.
        buffers = {id(buffer) for buffer, _ in reads}
        assert len(buffers) == 1 and sum(n for _, n in reads) >= size
        (buffer,) = {region.buffer for name in cached if isinstance(region := weights[name], HostRegion)}
        assert id(buffer) in buffers
        assert weights.stats.host_cache_bytes == size and weights.stats.host_cache_layers == 1
        assert weights.stats.pinned_bytes == ring.pinned_bytes + buffer.nbytes
        assert advised == ([] if direct else [os.POSIX_FADV_DONTNEED] * len(reads))
        reads.clear()
        copied = _copy_all(weights, backend)
        file_bytes = tiny_path.read_bytes()
        for name, info in weights.model.tensors.items():
            assert copied[name] == file_bytes[info.offset : info.end], name
        # Copies of the cached layer read nothing from the files; the other layer's go through the ring.
        assert {id(b) for b, _ in reads} <= {id(chunk.buffer) for chunk in ring._chunks}
        assert ring.bytes_staged == sum(t.nbytes for t in (second.router, *second.experts))


def test_a_cache_larger_than_every_tensor_holds_all_and_needs_no_ring(backend: Backend, tiny_path: Path) -> None:
    with HostWeights.open(tiny_path, backend.device(0), HostMemoryMode.DISK, host_cache=parse_size("1G")) as weights:
        total = sum(t.nbytes for t in weights.model.tensors.values())
        assert weights.rings == () and weights.ring_stats() is None
        assert weights.stats.host_cache_bytes == total and weights.stats.host_cache_layers == 2
        assert all(type(weights[name]) is HostRegion for name in weights)
        file_bytes = tiny_path.read_bytes()
        copied = _copy_all(weights, backend)
        assert all(copied[n] == file_bytes[t.offset : t.end] for n, t in weights.model.tensors.items())


def test_a_cache_smaller_than_the_first_layer_holds_experts_for_decode(backend: Backend, tiny_path: Path) -> None:
    size = _layer0_bytes(tiny_path) - 1
    with HostWeights.open(tiny_path, backend.device(0), HostMemoryMode.DISK, host_cache=size) as weights:
        assert (weights.stats.host_cache_bytes, weights.stats.host_cache_layers) == (0, 0)
        assert weights.stats.host_cache_expert_bytes == size
        experts = {t.name for t in weights.model.expert_tensors}
        assert all(isinstance(weights[n], TieredRegion) == (n in experts) for n in weights)
        assert all(isinstance(weights[n], RingRegion) for n in weights if n not in experts)
        file_bytes = tiny_path.read_bytes()
        copied = _copy_all(weights, backend)  # whole copies come through the ring, exact
        assert all(copied[n] == file_bytes[t.offset : t.end] for n, t in weights.model.tensors.items())


def test_a_cache_smaller_than_one_expert_holds_nothing_and_says_so(
    backend: Backend, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    size = 100
    with HostWeights.open(tiny_path, backend.device(0), HostMemoryMode.DISK, host_cache=size) as weights:
        assert weights.stats.host_cache_bytes == 0 and weights.stats.host_cache_expert_bytes == 0
        assert all(isinstance(weights[n], RingRegion) for n in weights)
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING" and "host cache" in r.getMessage()]
    assert f"{size} bytes holds neither a whole layer" in warning.getMessage()
    assert "nor one expert" in warning.getMessage()


def test_decode_copies_an_expert_from_the_tier_from_its_second_use_on(
    backend: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranges of one expert tensor as decode asks for them: the first use comes through the ring, the second
    reads the expert once from the file into the tier, the third copies it from there; the bytes are the file's."""
    device = backend.device(0)
    file_bytes = tiny_path.read_bytes()
    with HostWeights.open(tiny_path, device, HostMemoryMode.DISK, host_cache=_layer0_bytes(tiny_path) - 1) as weights:
        tensor = weights.model.layers[1].gate
        size = tensor.slice_nbytes
        source = weights[tensor.name]
        assert isinstance(source, TieredRegion)
        ring = weights.ring_stats
        reads = _recording_reads(backend, monkeypatch)
        ranges = [(2 * size, 3 * size), (4 * size, 5 * size)]
        staged = []
        with device.alloc(tensor.nbytes) as dst, device.stream() as stream:
            for use in range(3):
                before = ring()
                source.enqueue_h2d_ranges(stream, dst, ranges)
                stream.synchronize()
                staged.append(ring().bytes_staged - before.bytes_staged)
                got = dst.read().tobytes()
                for start, end in ranges:
                    assert got[start:end] == file_bytes[tensor.offset + start : tensor.offset + end], use
        assert staged[0] == staged[1] == 2 * size and staged[2] == 0
        tier_reads = [nbytes for buffer, nbytes in reads if buffer.nbytes == weights.stats.host_cache_expert_bytes]
        assert len(tier_reads) == 2 and all(nbytes >= size for nbytes in tier_reads)  # each expert read once


def _from_files(row: dict) -> int:
    """The bytes a mode disk row read from the model's files: from the drive, or out of the page cache
    where the kernel held them (a file this test just wrote, on a real backend)."""
    return int(row["disk_bytes_read"]) + int(row["page_cache_bytes"])


def _prefill_rows(capsys: pytest.CaptureFixture[str], path: Path, backend: Backend, *extra: str) -> list[dict]:
    code = main(["prefill", str(path), "--backend", backend.name, *PREFILL, *extra])
    out, _ = capsys.readouterr()
    assert code == 0
    rows: list[dict] = json.loads(out)["rows"]
    return rows


def test_prefill_and_decode_give_the_same_bytes_and_the_hit_rate_is_the_cached_share(
    backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with MoeModel.open(tiny_path) as model:
        experts = [sum(t.nbytes for t in layer.experts) for layer in model.layers]
    layer0 = _layer0_bytes(tiny_path)
    plain = _prefill_rows(capsys, tiny_path, backend, "--host-memory", "disk")
    half = _prefill_rows(capsys, tiny_path, backend, "--host-memory", "disk", "--host-cache", str(layer0))
    whole = _prefill_rows(capsys, tiny_path, backend, "--host-memory", "disk", "--host-cache", "1G")
    pinned = _prefill_rows(capsys, tiny_path, backend, "--host-memory", "pinned")
    rows = plain + half + whole + pinned
    for key in ("prefill_sha256", "decode_sha256", "output_sha256"):
        assert len({r[key] for r in rows}) == 1, key
    assert all(r["decode_steps"] == 3 and r["nonfinite"] == 0 for r in rows)
    for row in plain:
        assert (row["host_cache_bytes"], row["host_cache_hit_pct"]) == (0, 0.0)
        assert _from_files(row) >= row["h2d_bytes"] and "host_cache" not in row
    for row in half:
        assert row["host_cache_hit_pct"] == pytest.approx(100.0 * experts[0] / sum(experts), abs=1e-9)
        # two ubatches layer-major (mode disk's default): layer 0's experts copied once for the prompt
        assert row["prefill_order"] == "layer" and row["host_cache_bytes"] == experts[0]
        assert experts[1] <= _from_files(row) < _from_files(plain[0])
        assert row["host_cache"] == format_size(layer0)
        assert row["decode_path"] == "calls"  # the ring's layer cannot be captured
    for row in whole:
        assert (row["host_cache_hit_pct"], _from_files(row)) == (100.0, 0)
        assert row["host_cache_bytes"] == row["h2d_bytes"]
        assert row["decode_path"] == "graph"  # every copy from pinned memory: one captured step replayed
    assert all(r["host_cache_bytes"] is None and r["host_cache_hit_pct"] is None for r in pinned)
    # Decode: the used experts' bytes served from RAM, per repetition of the steps.
    assert [r["decode_host_cache_hit_pct"] for r in plain + whole] == [0.0] * len(plain) + [100.0] * len(whole)
    assert all(0.0 < r["decode_host_cache_hit_pct"] < 100.0 for r in half)
    assert all(r["decode_host_cache_hit_pct"] is None for r in pinned)


def test_the_summary_says_what_the_host_cache_served(
    backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size = format_size(_layer0_bytes(tiny_path))
    argv = ["prefill", str(tiny_path), "--backend", backend.name, "-p", "32", "-ub", "16", "-r", "1", "--slots", "0"]
    code = main([*argv, "--host-memory", "disk", "--host-cache", size])
    out, _ = capsys.readouterr()
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("reads from the drive")]
    assert f"the host cache ({size}) served 50% of the expert bytes" in line


def test_the_engine_gives_the_same_logits_with_a_host_cache(backend: Backend, tiny_path: Path) -> None:
    tokens = [1, 5, 9, 2, 7, 3, 1, 5, 9, 2, 7, 3]
    logits = []
    layer0 = _layer0_bytes(tiny_path)
    for cache, layers in ((None, 0), (layer0, 1), (layer0 - 1, 0)):  # none, a whole layer, single experts
        options = Options(ubatch=4, host_memory="disk", host_cache=cache)
        with Model.open(tiny_path, backend=backend, options=options) as model:
            assert model.weights.stats.host_cache_layers == layers
            logits.append(model.logits(tokens, prompt=4))  # two ubatches, then eight decode steps
    assert np.array_equal(logits[0], logits[1]) and np.array_equal(logits[0], logits[2])


def test_decode_finds_experts_it_uses_again_in_the_tier(
    backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host cache smaller than a layer: prefill reads every expert from the drive, decode gets the
    experts it uses again from RAM; the same bytes as without a host cache."""
    decode = ["--decode", "12"]
    plain = _prefill_rows(capsys, tiny_path, backend, "--host-memory", "disk", *decode)
    tier = _prefill_rows(
        capsys, tiny_path, backend, "--host-memory", "disk", "--host-cache", str(_layer0_bytes(tiny_path) - 1), *decode
    )
    for key in ("prefill_sha256", "decode_sha256", "output_sha256"):
        assert len({r[key] for r in plain + tier}) == 1, key
    assert all(r["decode_host_cache_hit_pct"] == 0.0 for r in plain)
    assert all(0.0 < r["decode_host_cache_hit_pct"] < 100.0 for r in tier)
    assert all(r["host_cache_hit_pct"] == 0.0 for r in tier)  # prefill's whole copies all from the drive
    size = str(_layer0_bytes(tiny_path) - 1)  # in bytes: a rounded size could hold the layer
    argv = ["prefill", str(tiny_path), "--backend", backend.name, "-p", "32", "-ub", "16", "-r", "1", "--slots", "0"]
    assert main([*argv, "--host-memory", "disk", "--host-cache", size, *decode]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("reads from the drive")]
    assert "% of its experts' bytes in RAM" in line and "served" not in line


@pytest.fixture(scope="module")
def qwen3_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Four and two layers of Qwen3-30B-A3B shapes, sparse: timing-only runs read no bytes."""
    folder = tmp_path_factory.mktemp("q")
    return (
        write_sparse_model("qwen3-30b-a3b", "Q4_0", folder / "four.gguf", layers=4),
        write_sparse_model("qwen3-30b-a3b", "Q4_0", folder / "two.gguf", layers=2),
    )


def test_the_simulator_predicts_a_disk_bound_prefill_shorter_by_the_layers_cached(
    qwen3_layers: tuple[Path, Path],
) -> None:
    """With a drive far slower than the link, caching k of 4 equal layers leaves the drive-bound time of
    the other 4 - k: the prediction is that of a model of only those layers read from the drive (within
    2%), and half the layers cached about halves the prefill."""
    profile = Profile.from_dict({"base": "cuda-h200", "disk_latency_s": 0.0, "disk_read_bps": [[1, 1e9]]})

    def ttft(path: Path, layers: int) -> float:
        with MoeModel.open(path) as model:
            size = sum(layer_bytes(layer) for layer in model.layers[:layers])
            settings = Settings(Batching(512, 512), (3,), (HostMemoryMode.DISK,), host_cache=size, compute_only=False)
            (row,) = predict(profile, model, settings).rows
            assert row.host_cache_hit_pct == pytest.approx(25.0 * layers if len(model.layers) == 4 else 0.0)
            return row.ttft_s

    four, two = qwen3_layers
    times = [ttft(four, k) for k in range(5)]
    assert times == sorted(times, reverse=True) and len(set(times)) == 5
    assert times[2] == pytest.approx(ttft(two, 0), rel=0.02)
    assert times[2] / times[0] == pytest.approx(0.5, abs=0.06)
    assert times[4] < 0.05 * times[0]  # every layer from RAM: no drive left


@pytest.mark.parametrize("mode", ["ring", "pinned", "preferred", "mmap"])
def test_a_host_cache_outside_mode_disk_is_refused_naming_the_option(
    backend: Backend, tiny_path: Path, mode: str
) -> None:
    with pytest.raises(InvalidArgument, match="host_cache is a RAM tier of host memory mode disk") as raised:
        HostWeights.open(tiny_path, backend.device(0), mode, host_cache=1 << 20)
    assert "--host-memory disk" in str(raised.value) and mode in str(raised.value)
    with pytest.raises(InvalidArgument, match="host_cache is a RAM tier"):
        Model.open(tiny_path, backend=backend, host_memory=mode, host_cache=1 << 20)


def test_a_negative_host_cache_is_refused(backend: Backend, tiny_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="host_cache must be >= 0 bytes, got -1"):
        HostWeights.open(tiny_path, backend.device(0), HostMemoryMode.DISK, host_cache=-1)


@pytest.mark.parametrize(
    "modes", [[], ["--host-memory", "ring"], ["--host-memory", "disk,ring"], ["--host-memory", "auto"], ["-lm", "mmap"]]
)
def test_prefill_refuses_a_host_cache_without_host_memory_disk_in_one_line(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], modes: list[str]
) -> None:
    code = main(["prefill", str(tiny_path), "--backend", "sim", "-p", "16", "-ub", "16", "--host-cache", "1G", *modes])
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert code == 2 and out == ""
    assert "--host-cache is a RAM tier of --host-memory disk" in line and "give --host-memory disk" in line


def test_generate_refuses_a_host_cache_without_host_memory_disk(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", "-m", str(tiny_path), "--backend", "sim", "-p", "hi", "-n", "1", "--host-cache", "1G"])
    _, err = capsys.readouterr()
    assert code != 0 and "host_cache is a RAM tier of host memory mode disk, not of preferred" in err


@pytest.mark.parametrize(
    "text, nbytes", [("24G", 24 << 30), ("512M", 512 << 20), ("1.5G", 3 << 29), ("640K", 640 << 10)]
)
def test_the_size_round_trips(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes and format_size(nbytes) == text and parse_size(format_size(nbytes)) == nbytes


def test_generate_and_perplexity_take_host_cache_into_options() -> None:
    parser = Parser(prog="expertstream")
    register_generate(parser.add_subparsers())
    for argv in (["generate", "-p", "x"], ["perplexity", "-f", "x.txt"]):
        args = parser.parse_args([*argv, "-m", "m.gguf", "--host-memory", "disk", "--host-cache", "512M"])
        options = _options(args)
        assert (options.host_memory, options.host_cache) == (HostMemoryMode.DISK, 512 << 20)


def test_a_full_tier_trades_its_least_used_expert_for_one_used_more(
    backend: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier with room for one expert: expert 2 enters at its second use; expert 5 takes its slot only once
    it has more uses (its fourth against 2's three), after the copies from the slot are done; every copy
    gets the file's bytes, from the tier or the ring."""
    device = backend.device(0)
    file_bytes = tiny_path.read_bytes()
    with HostWeights.open(tiny_path, device, HostMemoryMode.DISK, host_cache=40_000) as weights:
        tensor = weights.model.layers[1].gate
        size = tensor.slice_nbytes
        source = weights[tensor.name]
        assert isinstance(source, TieredRegion) and source.tier.nbytes == 40_000
        ring = weights.ring_stats
        served = []
        with device.alloc(tensor.nbytes) as dst, device.stream() as stream:
            for expert in (2, 2, 2, 5, 5, 5, 5, 5, 2):
                before = ring()
                source.enqueue_h2d_ranges(stream, dst, [(expert * size, (expert + 1) * size)])
                stream.synchronize()
                served.append("ring" if ring().bytes_staged > before.bytes_staged else "tier")
                start, end = tensor.offset + expert * size, tensor.offset + (expert + 1) * size
                assert dst.read().tobytes()[expert * size : (expert + 1) * size] == file_bytes[start:end]
        assert served == ["ring", "ring", "tier", "ring", "ring", "ring", "ring", "tier", "ring"]
        assert source.tier.experts == 1 and source.tier.evictions == 1
        # Back to back, no synchronize between: the eviction must wait for the slot's copies itself (the
        # simulator's hazard checker fails a refill that a pending DMA still reads).
        # Expert 5 (6 uses after the first call, copied from the tier there) gives way to expert 7 at its
        # seventh use.
        with device.alloc(tensor.nbytes) as dst, device.stream() as stream:
            source.enqueue_h2d_ranges(stream, dst, [(5 * size, 6 * size), (7 * size, 8 * size)])
            for _ in range(6):
                source.enqueue_h2d_ranges(stream, dst, [(7 * size, 8 * size)])
            stream.synchronize()
            got = dst.read().tobytes()
        assert source.tier.evictions == 2
        for expert in (5, 7):
            start, end = expert * size, (expert + 1) * size
            assert got[start:end] == file_bytes[tensor.offset + start : tensor.offset + end]
