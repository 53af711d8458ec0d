"""What every command shares: exit statuses, usage errors, output paths checked before a run,
progress bars, and a Ctrl-C that stops promptly.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from tqdm import tqdm

from ..errors import ExpertStreamError

log = logging.getLogger(__name__)


class Exit(enum.IntEnum):
    OK = 0
    OUTPUTS_DIFFER = 1
    USAGE = 2  # a bad argument, an unreadable input or an unwritable output
    INTERRUPTED = 130  # 128 + SIGINT, as shells report it
    BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (`| head`)


EXIT_STATUS_HELP = (
    "exit status: 0 ok; 1 outputs differ between rows (or are not finite); 2 usage or input error "
    "(bad argument, unreadable model, unwritable output); 130 interrupted (Ctrl-C); 141 stdout closed early"
)


class UsageError(ExpertStreamError):
    """A command line that cannot mean what it says; reported in one line with exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help; descriptions and epilogs keep their line breaks.

    An option whose help already says its default, or that has none, gets no second one.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def int_list(minimum: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: a comma list of integers, each >= ``minimum``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
        low = [v for v in values if v < minimum]
        if low:
            raise argparse.ArgumentTypeError(f"values must be >= {minimum}, got {low[0]}")
        return values

    return parse


def writable_path(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` if a file can be created or replaced there; UsageError naming ``flag`` otherwise.

    Checked before a run starts, so a long run never ends in an unwritable output.
    """
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise UsageError(f"{flag} {out}: is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag} {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UsageError(f"{flag} {out}: not writable")
    return out


def progress_bar(total: int, desc: str, unit: str, **options: Any) -> tqdm[Any]:
    """A bar on stderr, drawn only when stderr is a terminal (logs and pipes stay clean)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not sys.stderr.isatty(), **options)


# Folders a hard stop removes: scratch files of the run in progress.
_scratch: list[Path] = []
HARD_STOP_GRACE_S = 1.0


@contextmanager
def scratch_folder(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """Mark ``folder`` as removed by a hard stop on Ctrl-C (the caller still removes it normally)."""
    path = Path(folder)
    _scratch.append(path)
    try:
        yield path
    finally:
        _scratch.remove(path)


def _hard_stop() -> None:
    for folder in list(_scratch):
        shutil.rmtree(folder, ignore_errors=True)
    sys.stderr.write("expertstream: interrupted\n")
    sys.stderr.flush()
    os._exit(Exit.INTERRUPTED)


@contextmanager
def prompt_interrupt(grace_s: float = HARD_STOP_GRACE_S) -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt at once; if unwinding has not ended ``grace_s`` later, exit.

    Unwinding waits for the work already enqueued on the devices (freeing memory a kernel may
    still read is not allowed), and on the simulator that work is numpy run on this host: it
    can take far longer than the user is willing to wait. The hard stop removes the scratch
    folders and leaves the rest to process exit, which releases device memory too.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    timers: list[threading.Timer] = []

    def interrupted(signum: int, frame: FrameType | None) -> None:
        timer = threading.Timer(grace_s, _hard_stop)
        timer.daemon = True
        timer.start()
        timers.append(timer)
        raise KeyboardInterrupt

    previous: Callable[[int, FrameType | None], Any] | int | None = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        for timer in timers:
            timer.cancel()  # unwound in time
        signal.signal(signal.SIGINT, previous)


__all__ = [
    "EXIT_STATUS_HELP",
    "Exit",
    "HelpFormatter",
    "UsageError",
    "progress_bar",
    "prompt_interrupt",
    "scratch_folder",
    "writable_path",
]
