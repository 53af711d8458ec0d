"""Host copies with non-temporal stores (backends.streamcopy): exact bytes whatever the alignment,
the routine given every whole line of a large copy, and memcpy, said once, where it cannot run."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from expertstream.backends import streamcopy

BIG = streamcopy.MIN_STREAM_BYTES


@pytest.mark.parametrize("dst_at", [0, 1, 15, 16, 33, 63])
@pytest.mark.parametrize("src_at", [0, 7, 64])
@pytest.mark.parametrize("nbytes", [BIG - 1, BIG, BIG + 1, BIG + 63, 3 * BIG + 100])
def test_copies_are_exact_and_touch_nothing_else(dst_at: int, src_at: int, nbytes: int) -> None:
    rng = np.random.default_rng(nbytes + dst_at)
    src = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst = np.full(nbytes + 256, 0xA5, dtype=np.uint8)
    # 64-byte aligned base, so dst_at is the destination's offset from a cache line
    base = -dst.ctypes.data % 64
    to = dst[base + dst_at : base + dst_at + nbytes]
    streamcopy.copy(to, src[src_at : src_at + nbytes])
    assert np.array_equal(to, src[src_at : src_at + nbytes])
    assert (dst[: base + dst_at] == 0xA5).all() and (dst[base + dst_at + nbytes :] == 0xA5).all()


def test_the_routine_gets_every_whole_line_and_memcpy_the_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []

    def routine(to: int, source: int, nbytes: int) -> None:
        calls.append((to, source, nbytes))
        ctypes.memmove(to, source, nbytes)

    monkeypatch.setattr(streamcopy, "_routine", routine)
    src = np.arange(BIG + 200, dtype=np.uint64).view(np.uint8)[: BIG + 200]
    dst = np.zeros(BIG + 400, dtype=np.uint8)
    at = (-dst.ctypes.data % 64) + 5  # 59 bytes before the next line
    streamcopy.copy(dst[at : at + BIG + 200], src)
    assert np.array_equal(dst[at : at + BIG + 200], src)
    [(to, source, nbytes)] = calls
    assert to % 64 == 0 and to - dst.ctypes.data == at + 59 and source == src.ctypes.data + 59
    assert nbytes % 64 == 0 and BIG + 200 - 59 - nbytes < 64
    calls.clear()
    streamcopy.copy(dst[at : at + BIG - 1], src[: BIG - 1])  # below the size that pays: memcpy
    with streamcopy.using(False):
        streamcopy.copy(dst[at : at + BIG], src[:BIG])
        assert streamcopy.stores() == "memcpy"
    assert calls == [] and streamcopy.stores() == "non-temporal"


def test_a_host_without_the_routine_copies_with_memcpy_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(streamcopy, "_routine", None)
    monkeypatch.setattr(streamcopy, "_fallback_logged", False)
    monkeypatch.setattr(streamcopy, "STATUS", "memcpy (a reason)")
    src = np.arange(2 * BIG, dtype=np.uint8)
    dst = np.zeros_like(src)
    with caplog.at_level(logging.INFO, logger=streamcopy.__name__):
        streamcopy.copy(dst, src)
        streamcopy.copy(dst, src)
    assert np.array_equal(dst, src) and not streamcopy.streaming() and streamcopy.stores() == "memcpy"
    assert [r.getMessage() for r in caplog.records] == ["large host copies use memcpy (a reason)"]


def _status_in_fresh_process(env: dict[str, str]) -> str:
    code = "from expertstream.backends import streamcopy; print(streamcopy.STATUS)"
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_environment_switch_turns_the_routine_off() -> None:
    assert _status_in_fresh_process({streamcopy.ENV_SWITCH: "memcpy"}) == "memcpy (EXPERTSTREAM_HOST_COPY=memcpy)"


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 Linux only"
)
def test_the_routine_loads_on_x86_64_linux_or_says_why_not() -> None:
    status = _status_in_fresh_process({streamcopy.ENV_SWITCH: ""})
    assert status == "non-temporal stores" or status.startswith("memcpy (the system refused"), status
