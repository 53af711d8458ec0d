"""Host-to-host copies with non-temporal stores, for filling page-locked staging buffers.

A plain memcpy writes through the cache: each destination line is first read from memory (a
read for ownership), so copying a byte moves three across the memory bus. Non-temporal stores
write whole lines without reading them, two bytes per byte copied. glibc's memcpy uses them only
above a size tied to the last-level cache (the tunable ``glibc.cpu.x86_non_temporal_threshold``);
on a host with a large L3 a staging ring's 8 MiB parts stay below it. On the H200 host (300 MiB
of L3), 12 threads copying from a file mapping into pinned memory moved 46.1 GB/s with memcpy and
68.3 GB/s with non-temporal stores (docs/results/hostmem-h200.md).

Python has no way to ask for those stores, so on x86-64 Linux this module maps the few bytes of
machine code below into an executable page and calls them through ctypes, which lets go of the
interpreter lock for the call. SSE2, which every x86-64 processor has, is all it uses. Elsewhere,
where the system refuses an executable mapping, where the routine fails its check when loaded, or
with EXPERTSTREAM_HOST_COPY=memcpy in the environment, copies use numpy's memcpy; ``STATUS`` says
which and why, and the first large copy that falls back logs it, once.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

log = logging.getLogger(__name__)

# void stream_copy(void* dst, const void* src, size_t nbytes), System V calling convention:
# dst 16-byte aligned, nbytes a non-zero multiple of 64. Unaligned 16-byte loads, aligned
# non-temporal stores, then a store fence so the stores are visible before the call returns.
#
#   1: movdqu  xmm0, [rsi]          f3 0f 6f 06
#      movdqu  xmm1, [rsi+16]       f3 0f 6f 4e 10
#      movdqu  xmm2, [rsi+32]       f3 0f 6f 56 20
#      movdqu  xmm3, [rsi+48]       f3 0f 6f 5e 30
#      movntdq [rdi], xmm0          66 0f e7 07
#      movntdq [rdi+16], xmm1       66 0f e7 4f 10
#      movntdq [rdi+32], xmm2       66 0f e7 57 20
#      movntdq [rdi+48], xmm3       66 0f e7 5f 30
#      add     rsi, 64              48 83 c6 40
#      add     rdi, 64              48 83 c7 40
#      sub     rdx, 64              48 83 ea 40
#      jnz     1b                   75 cc
#      sfence                       0f ae f8
#      ret                          c3
_X86_64_CODE = bytes.fromhex(
    "f30f6f06 f30f6f4e10 f30f6f5620 f30f6f5e30"
    "660fe707 660fe74f10 660fe75720 660fe75f30"
    "4883c640 4883c740 4883ea40 75cc 0faef8 c3"
)
_LINE = 64

# Below this a copy goes through memcpy: the call's fixed cost would outweigh what the stores
# save, and a small copy's destination is likely read again soon, from the cache.
MIN_STREAM_BYTES = 256 << 10

_Routine = Callable[[int, int, int], None]


def _load() -> tuple[_Routine | None, str, int]:
    """The routine, what copies use (for STATUS), and the level at which to log a fallback."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() == "memcpy":
        return None, f"memcpy ({ENV_SWITCH}=memcpy)", logging.INFO
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        where = f"{sys.platform} on {platform.machine()}"
        return None, f"memcpy (non-temporal copies need x86-64 Linux, not {where})", logging.INFO
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        page.write(_X86_64_CODE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            why = os.strerror(ctypes.get_errno())
            return None, f"memcpy (the system refused an executable page for the copy routine: {why})", logging.WARNING
    except (OSError, AttributeError, ValueError) as e:
        return None, f"memcpy (could not map the copy routine: {e})", logging.WARNING
    routine = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(address)
    _pages.append(page)  # the code lives as long as the process
    check = np.arange(4 * _LINE, dtype=np.uint8)
    out = np.zeros(5 * _LINE, dtype=np.uint8)
    start = -out.ctypes.data % _LINE
    routine(out.ctypes.data + start, check.ctypes.data, check.nbytes)
    if not np.array_equal(out[start : start + check.nbytes], check):
        return None, "memcpy (the non-temporal copy routine failed its check)", logging.WARNING
    return routine, "non-temporal stores", logging.INFO


ENV_SWITCH = "EXPERTSTREAM_HOST_COPY"  # "memcpy": never use the routine
_pages: list[mmap.mmap] = []
_routine, STATUS, _fallback_level = _load()
_enabled = True
_fallback_logged = False
_log_lock = threading.Lock()


def streaming() -> bool:
    """Whether large copies use non-temporal stores now (``STATUS`` says why not, if the host has none)."""
    return _routine is not None and _enabled


def stores() -> str:
    """What large host copies write with now: "non-temporal" or "memcpy"."""
    return "non-temporal" if streaming() else "memcpy"


@contextmanager
def using(non_temporal: bool) -> Iterator[None]:
    """Within the block, large copies use non-temporal stores only if ``non_temporal`` (and the host
    has them); for comparing the two in one process. Affects every thread."""
    global _enabled
    before, _enabled = _enabled, non_temporal
    try:
        yield
    finally:
        _enabled = before


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy the bytes of ``src`` into ``dst`` (contiguous uint8 arrays of one size), with
    non-temporal stores where ``streaming()`` and the copy is large enough to gain from them."""
    n = dst.nbytes
    if n < MIN_STREAM_BYTES or not streaming():
        if _routine is None and n >= MIN_STREAM_BYTES:
            _log_fallback()
        np.copyto(dst, src)
        return
    to = dst.ctypes.data
    head = -to % _LINE
    body = (n - head) // _LINE * _LINE
    if head:
        np.copyto(dst[:head], src[:head])
    assert _routine is not None
    _routine(to + head, src.ctypes.data + head, body)
    if head + body < n:
        np.copyto(dst[head + body :], src[head + body :])


def _log_fallback() -> None:
    global _fallback_logged
    with _log_lock:
        if not _fallback_logged:
            _fallback_logged = True
            log.log(_fallback_level, "large host copies use %s", STATUS)
