"""The preferred rule and --host-memory auto read from disk where the tensors do not fit the host
memory the process may fill: MemAvailable, or less where a cgroup v2 limit leaves less."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from expertstream.backends.base import Backend
from expertstream.cli import main
from expertstream.hostmem import HostMemoryLimit, HostMemoryMode, HostWeights, memlimit, read_memory_limit
from expertstream.hostmem.memlimit import HEADROOM_BYTES, too_big_for_memory

GIB = 1 << 30
SMALL = ["--tokens", "32", "--ubatch", "16", "-r", "1", "--slots", "0"]


def _fake_system(tmp_path: Path, cgroup_line: str, limits: dict[str, tuple[str, int]]) -> tuple[Path, Path]:
    """A /proc with MemAvailable 8 GiB and the given /proc/self/cgroup; a cgroup tree with
    (memory.max, memory.current) per folder."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       33554432 kB\nMemAvailable:    {8 * GIB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for name, (limit, current) in limits.items():
        folder = root / name.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.max").write_text(limit + "\n")
        (folder / "memory.current").write_text(f"{current}\n")
    return proc, root


def test_the_tightest_cgroup_limit_above_the_process_counts(tmp_path: Path) -> None:
    proc, root = _fake_system(
        tmp_path,
        "0::/jobs/run",
        {"/": ("max", 0), "/jobs": (str(6 * GIB), 3 * GIB), "/jobs/run": (str(16 * GIB), 1 * GIB)},
    )
    limit = read_memory_limit(proc, root)
    assert limit == HostMemoryLimit(8 * GIB, 3 * GIB, "/jobs")  # /jobs leaves 3 GiB, its child 15
    assert limit.usable_bytes == 3 * GIB and "cgroup /jobs: 3.0 GiB left" in limit.describe()


def test_no_cgroup_limit_leaves_mem_available(tmp_path: Path) -> None:
    proc, root = _fake_system(tmp_path, "0::/", {"/": ("max", 5 * GIB)})
    assert read_memory_limit(proc, root) == HostMemoryLimit(8 * GIB)
    # cgroup v1 only: no line 0::, no limit read.
    proc, root = _fake_system(tmp_path / "v1", "4:memory:/x", {})
    assert read_memory_limit(proc, root) == HostMemoryLimit(8 * GIB)
    assert read_memory_limit(tmp_path / "nowhere", root) is None


def test_a_container_limit_at_the_namespace_root_counts(tmp_path: Path) -> None:
    proc, root = _fake_system(tmp_path, "0::/", {"/": (str(4 * GIB), GIB)})
    assert read_memory_limit(proc, root) == HostMemoryLimit(8 * GIB, 3 * GIB, "/")


def test_tensors_fit_with_headroom_or_say_why_not() -> None:
    limit = HostMemoryLimit(8 * GIB, 3 * GIB, "/jobs")
    assert too_big_for_memory(GIB - 1, HostMemoryLimit(GIB + HEADROOM_BYTES)) is None
    why = too_big_for_memory(2 * GIB, limit)
    assert why is not None and "2.0 GiB of tensors" in why and "3.0 GiB of host memory" in why and "/jobs" in why
    assert too_big_for_memory(100 * GIB, None) is None  # not known: the rule stays as it was


def test_preferred_reads_from_disk_where_the_tensors_do_not_fit(
    backend: Backend, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    device = backend.device(0)
    with HostWeights.open(tiny_path, device, memory=lambda: HostMemoryLimit(64 * GIB)) as roomy:
        assert roomy.mode is not HostMemoryMode.DISK and not any(
            f.used is HostMemoryMode.DISK for f in roomy.stats.fallbacks
        )
    tight = HostMemoryLimit(64 * GIB, HEADROOM_BYTES, "/small")  # the headroom alone: no room for tensors
    with (
        caplog.at_level(logging.WARNING, logger="expertstream.hostmem"),
        HostWeights.open(tiny_path, device, memory=lambda: tight) as weights,
    ):
        assert weights.mode is HostMemoryMode.DISK
        chosen = weights.stats.fallbacks[0]
        assert (chosen.requested, chosen.used) == (HostMemoryMode.PREFERRED, HostMemoryMode.DISK)
        assert "/small" in chosen.reason
        # A mode asked for by name is placed as asked, whatever the memory.
        with HostWeights.open(weights.model, device, HostMemoryMode.RING, memory=lambda: tight) as ring:
            assert ring.mode is HostMemoryMode.RING
    said = [r.getMessage() for r in caplog.records if "host memory mode disk" in r.getMessage()]
    assert len(said) == 1 and "do not fit" in said[0]


def test_the_command_line_reads_from_disk_where_memory_is_short(
    backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memlimit, "read_memory_limit", lambda: HostMemoryLimit(HEADROOM_BYTES))
    assert main(["prefill", str(tiny_path), "--backend", backend.name, *SMALL, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["host_memory"] == "disk"
    code = main(["prefill", str(tiny_path), "--backend", backend.name, *SMALL, "--host-memory", "auto", "--json"])
    out, err = capsys.readouterr()
    document = json.loads(out)
    assert code == 0 and [r["host_memory"] for r in document["rows"]] == ["disk"]
    assert "host memory disk alone" in document["auto"]["why"] and "do not fit" in err
