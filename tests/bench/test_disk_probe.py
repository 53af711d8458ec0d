"""The drive probe: O_DIRECT reads at several depths, the small read's latency, and the profile fields they make."""

from __future__ import annotations

import errno
import itertools
import json
import os
from pathlib import Path

import pytest

from expertstream.backends.sim.profiles import CUDA_H200, Profile
from expertstream.bench import disk
from expertstream.bench.disk import DiskReadTiming, DiskTiming, fit_disk, measure_disk, page_cache_share
from expertstream.bench.tuner import fields_not_tuned
from expertstream.errors import InvalidArgument
from expertstream.model import MoeModel
from microbench import disk_read

MIB = 1 << 20


def _refusing_direct(path: str, flags: int) -> int:
    if flags & os.O_DIRECT:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
    return os.open(path, flags)


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(os.urandom(3 * MIB + 12_345))  # not a whole number of reads, nor of blocks
    return path


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_each_depth_reads_whole_aligned_reads_inside_the_file(data_file: Path, direct: bool) -> None:
    ticks = itertools.count()  # each clock reading one second after the last
    timing = measure_disk(
        data_file,
        depths=(1, 4, 16),
        read_bytes=MIB,
        depth_bytes=8 * MIB,
        opener=os.open if direct else _refusing_direct,
        clock=lambda: float(next(ticks)),
    )
    if direct and not timing.direct:
        pytest.skip(f"the filesystem of {data_file} refuses O_DIRECT")
    assert timing.direct is direct and (timing.fallback_reason is None) is direct
    assert timing.file_bytes == data_file.stat().st_size
    # 8 reads of 1 MiB at depths 1 and 4; at least one read per thread at depth 16.
    assert [(t.depth, t.read_bytes, t.reads) for t in timing.depths] == [(1, MIB, 8), (4, MIB, 8), (16, MIB, 16)]
    assert all(t.seconds == 1.0 for t in timing.depths)
    assert timing.latency_s == 1.0 and timing.latency_bytes % 512 == 0


def test_a_file_smaller_than_a_read_is_read_whole_blocks_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    path.write_bytes(bytes(5 * 4096 + 100))
    timing = measure_disk(path, depths=(2,), read_bytes=16 * MIB, depth_bytes=MIB)
    (row,) = timing.depths
    assert row.read_bytes == 5 * 4096 and row.reads == 52 and row.seconds > 0


def test_bad_measurements_are_refused(data_file: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="depths >= 1"):
        measure_disk(data_file, depths=(0,))
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"x" * 100)
    with pytest.raises(InvalidArgument, match="less than one aligned read"):
        measure_disk(tiny)


def test_the_fitted_fields_give_back_the_timed_reads() -> None:
    """fit_disk inverts the simulator's read time: latency + bytes * depth / rate(depth)."""
    reads = [DiskReadTiming(1, 16 * MIB, 8, 0.07), DiskReadTiming(4, 16 * MIB, 8, 0.03)]
    timing = DiskTiming("f", 1 << 30, True, None, 0.0, 4096, 100e-6, reads)
    profile = Profile.from_dict({"base": "cuda-h200", **fit_disk(timing)})
    assert profile.disk_latency_s == 100e-6
    for t in timing.depths:
        per_read = profile.disk_latency_s + t.read_bytes * t.depth / profile.disk_rate(t.depth)
        assert per_read * t.reads / t.depth == pytest.approx(t.seconds, rel=1e-9)


def test_a_written_file_is_said_to_be_in_the_page_cache(data_file: Path) -> None:
    share = page_cache_share(data_file)
    if share is None:
        pytest.skip("mincore is not available here")
    assert 0 < share <= 1  # written just now: its pages are cached
    timing = DiskTiming(str(data_file), 1, True, None, share, 4096, 1e-4)
    note = timing.cache_note()
    assert note is not None and "page cache" in note and "bypass" in note
    buffered = DiskTiming(str(data_file), 1, False, "refused", share, 4096, 1e-4).cache_note()
    assert buffered is not None and "memory's" in buffered
    assert DiskTiming(str(data_file), 1, True, None, 0.0, 4096, 1e-4).cache_note() is None


def test_the_profile_interpolates_the_drive_between_depths_and_checks_it() -> None:
    profile = Profile.from_dict({"base": "cuda-h200", "disk_read_bps": [[4, 4e9], [1, 1e9], [16, 8e9]]})
    assert profile.disk_read_bps == ((1, 1e9), (4, 4e9), (16, 8e9))
    assert profile.disk_rate(2) == pytest.approx(2.5e9)  # halfway between 1 and 4 in log(depth)
    assert profile.disk_rate(1) == 1e9 and profile.disk_rate(64) == 8e9
    for bad in ([], [[0, 1e9]], [[1, -1.0]], [[1, 1e9], [1, 2e9]], "fast"):
        with pytest.raises(InvalidArgument, match="disk_read_bps"):
            Profile.from_dict({"base": "cuda-h200", "disk_read_bps": bad})
    assert Profile.from_dict(CUDA_H200.to_dict()) == CUDA_H200


def test_a_profile_tuned_before_the_drive_was_measured_says_so() -> None:
    older = {"base": "cuda-h200", "device_name": "NVIDIA H200", "kernel_rates": []}
    missing = fields_not_tuned(older)
    assert "disk_read_bps" in missing and "disk_latency_s" in missing
    assert fields_not_tuned({"base": "cuda-h200"}) == []


def test_the_microbench_prints_a_row_per_depth(data_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--file", str(data_file), "--depths", "1", "4", "--read-mib", "1", "--gib", "0.004", "--json"]
    assert disk_read.main(argv) == 0
    out, table = capsys.readouterr()
    result = json.loads(out)
    assert [row["depth"] for row in result["rows"]] == [1, 4]
    assert all(row["gb_per_s"] > 0 for row in result["rows"])
    assert [pair[0] for pair in result["profile_fields"]["disk_read_bps"]] == [1, 4]
    assert "GB/s" in table and "byte read" in table


def test_the_baseline_leaves_the_page_cache_as_it_found_it(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = MoeModel.open(tiny_path)
    try:
        experts = model.expert_tensors
        cached_before = {experts[0].name}  # the one expert tensor the page cache held wholly before
        dropped: list[tuple[int, int, int]] = []

        def tensor_at(offset: int, nbytes: int) -> str:
            (name,) = [t.name for t in experts if (t.offset, t.nbytes) == (offset, nbytes)]
            return name

        def resident(fd: int, offset: int, nbytes: int) -> bool:
            return tensor_at(offset, nbytes) in cached_before

        def drop(fd: int, offset: int, nbytes: int, mapped: int | None = None) -> None:
            dropped.append((offset, offset + nbytes, mapped or 0))

        monkeypatch.setattr(disk, "in_page_cache", resident)
        monkeypatch.setattr(disk, "drop_from_page_cache", drop)
        with disk.page_cache_as_found(model):
            assert not dropped  # nothing before the body ends
        # Every expert tensor the body may have brought in, in runs of neighbours, each unmapped from
        # the model's own mapping first; the one cached before stays.
        assert dropped
        for start, _, mapped in dropped:
            assert mapped == model.mappings[0][start:].ctypes.data
        inside = [[start <= t.offset and t.end <= end for start, end, _ in dropped] for t in experts]
        assert [sum(runs) for runs in inside] == [0] + [1] * (len(experts) - 1)
        assert all(start >= experts[0].end or end <= experts[0].offset for start, end, _ in dropped)
    finally:
        model.close()
