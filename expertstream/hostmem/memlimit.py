"""How much host memory this process may fill: what decides whether a model's tensors are read from disk.

The smaller of the kernel's MemAvailable (/proc/meminfo: free memory and the page cache it can
drop) and, under cgroup v2, what the limits of the process's cgroup and of every cgroup above it
leave (memory.max less memory.current). A model whose tensors, with some headroom for the rest of
the process, do not fit that would have its pages read from the drive again and again through the
page cache (a mapping, a ring) or fail to lock them (registration): mode disk reads each once per use,
with no page cache, into the ring's few chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model.loader import MoeModel

# Room left beside the tensors for everything else the process holds in host memory (the
# interpreter, the ring's pinned chunks, outputs and host copies of activations).
HEADROOM_BYTES = 2 << 30

_GIB = 1 << 30


@dataclass(frozen=True)
class HostMemoryLimit:
    """What the process may fill: MemAvailable, and what the tightest cgroup limit leaves (None: no limit)."""

    available_bytes: int
    cgroup_free_bytes: int | None = None
    cgroup: str | None = None  # the cgroup whose limit leaves least, as /proc/self/cgroup names it

    @property
    def usable_bytes(self) -> int:
        if self.cgroup_free_bytes is None:
            return self.available_bytes
        return min(self.available_bytes, self.cgroup_free_bytes)

    def describe(self) -> str:
        """What was read, in GiB: "MemAvailable 12.0 GiB, cgroup /x: 4.0 GiB left below its memory.max"."""
        text = f"MemAvailable {self.available_bytes / _GIB:.1f} GiB"
        if self.cgroup_free_bytes is not None:
            text += f", cgroup {self.cgroup}: {self.cgroup_free_bytes / _GIB:.1f} GiB left below its memory.max"
        return text


MemoryReader = Callable[[], "HostMemoryLimit | None"]


def read_memory_limit(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemoryLimit | None:
    """What this process may fill, read from ``proc`` and ``cgroup_root``; None where MemAvailable
    cannot be read (not Linux)."""
    try:
        meminfo = (proc / "meminfo").read_text(encoding="ascii")
    except OSError:
        return None
    available = _meminfo_bytes(meminfo, "MemAvailable")
    if available is None:
        return None
    tightest: tuple[int, str] | None = None
    for path, name in _own_cgroups(proc, cgroup_root):
        left = _cgroup_left(path)
        if left is not None and (tightest is None or left < tightest[0]):
            tightest = (left, name)
    if tightest is None:
        return HostMemoryLimit(available)
    return HostMemoryLimit(available, tightest[0], tightest[1])


def too_big_for_memory(nbytes: int, limit: HostMemoryLimit | None) -> str | None:
    """Why ``nbytes`` of tensors should be read from disk: they and HEADROOM_BYTES do not fit what the
    process may fill; None where they fit or the limit is not known."""
    if limit is None or nbytes + HEADROOM_BYTES <= limit.usable_bytes:
        return None
    return (
        f"the model's {nbytes / _GIB:.1f} GiB of tensors and {HEADROOM_BYTES / _GIB:.0f} GiB of headroom do not fit "
        f"the {limit.usable_bytes / _GIB:.1f} GiB of host memory this process may fill ({limit.describe()})"
    )


def model_too_big(model: MoeModel, memory: MemoryReader | None = None) -> str | None:
    """``too_big_for_memory`` of the model's tensors, against what ``memory`` reads (None:
    ``read_memory_limit``)."""
    limit = (memory or read_memory_limit)()
    return too_big_for_memory(sum(t.nbytes for t in model.tensors.values()), limit)


def _meminfo_bytes(text: str, key: str) -> int | None:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            parts = value.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return None


def _own_cgroups(proc: Path, cgroup_root: Path) -> list[tuple[Path, str]]:
    """The process's cgroup v2 folder and every one above it, each with its name. The root is included:
    inside a container's cgroup namespace the process's own cgroup is "/", its limit in the root's
    memory.max (the host's root cgroup has no such file)."""
    try:
        lines = (proc / "self" / "cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    # cgroup v2 is the line "0::/path"; v1 controllers have other numbers and no limit read here.
    name = next((line[3:] for line in lines if line.startswith("0::")), None)
    if name is None:
        return []
    found = []
    parts = [p for p in name.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        found.append((cgroup_root.joinpath(*parts[:depth]), "/" + "/".join(parts[:depth])))
    return found


def _cgroup_left(folder: Path) -> int | None:
    """memory.max less memory.current of one cgroup; None without a limit (or the files)."""
    try:
        limit = (folder / "memory.max").read_text(encoding="ascii").strip()
        current = int((folder / "memory.current").read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None
    if not limit.isdigit():
        return None  # "max": no limit
    return max(0, int(limit) - current)
