"""What every command shares: exit statuses, usage errors, output paths checked before a run,
the backend named by the environment, progress on stderr, and a Ctrl-C that stops promptly.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from tqdm import tqdm

from ..backends import ENV_VAR, available_backends
from ..backends import backend as _backend
from ..backends.base import Backend
from ..errors import ExpertStreamError
from ..timeline import to_chrome_trace

if TYPE_CHECKING:
    from ..backends.sim.profiles import Profile

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


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage error is one line that points to --help, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(Exit.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help; descriptions and epilogs keep their line breaks.

    An option whose help already says its default, or that has none, gets no second one.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        counted = isinstance(action, argparse._CountAction)  # -v: "(default: 0)" says nothing
        if "default" in text or counted or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
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

    Checked before a run starts by opening the file for writing as the run will (changing nothing),
    so a long run never ends in an unwritable output: a folder's permissions alone do not tell
    (/proc, a read-only mount, a full quota, or permissions root ignores).
    """
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise UsageError(f"{flag} {out}: is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag} {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UsageError(f"{flag} {out}: not writable")
    try:
        _open_for_writing(out)
    except OSError as exc:
        raise UsageError(f"{flag} {out}: not writable ({exc.strerror or exc})") from None
    return out


def _open_for_writing(out: Path) -> None:
    """Open ``out`` for writing and close it, leaving no trace: an existing file is not truncated,
    a new one is removed again; a device or pipe is left alone (opening a pipe with no reader
    would wait)."""
    if out.exists():
        if out.is_file():
            os.close(os.open(out, os.O_WRONLY))
        return
    os.close(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    os.unlink(out)


def backend_variable_problem() -> str | None:
    """Why $EXPERTSTREAM_BACKEND cannot be what `auto` opens (None when it is unset or usable)."""
    value = os.environ.get(ENV_VAR, "").strip()
    name = value.lower()
    if name in ("", "auto"):
        return None
    statuses = {status.name: status for status in available_backends()}
    status = statuses.get(name)
    if status is None:
        return f"{ENV_VAR}={value} names no backend; known: {', '.join(statuses)} (set it to one of them or unset it)"
    if not status.usable:
        usable = ", ".join(s.name for s in statuses.values() if s.usable) or "none"
        return (
            f"{ENV_VAR}={value} asks for {name}, which is not usable here: {status.reason} (usable: {usable}; "
            "set it to one of them or unset it)"
        )
    return None


def open_backend(name: str = "auto", **options: Any) -> Backend:
    """``expertstream.backend(name)``; for auto, a bad $EXPERTSTREAM_BACKEND is a usage error naming it."""
    problem = backend_variable_problem() if name == "auto" else None
    if problem is not None:
        raise UsageError(problem)
    return _backend(name, **options)


def progress_bar(total: int, desc: str, unit: str, **options: Any) -> tqdm[Any]:
    """A bar on stderr, drawn only when stderr is a terminal (logs and pipes stay clean)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not sys.stderr.isatty(), **options)


def write_out(text: str) -> None:
    """Print ``text`` on stdout now (a reader of a pipe sees it at once), clearing any bar first."""
    with tqdm.external_write_mode():
        print(text, flush=True)


def duration(seconds: float) -> str:
    """``seconds`` as a person reads a wait: 40 s, 3 min, 1 h 5 min."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


class RunProgress:
    """Progress of a run of row groups on stderr, whatever stdout is.

    On a terminal a bar (tqdm) over the steps (ubatches and decode steps enqueued); elsewhere
    plain lines: one as each group of rows but the last finishes, and one at most every
    ``every_s`` seconds within a long group. The time left is the time so far per step done.
    """

    def __init__(
        self,
        desc: str,
        steps: int,
        rows: int,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        terminal: bool | None = None,
    ) -> None:
        self.desc, self.steps, self.rows = desc, steps, rows
        self.steps_done = self.rows_done = 0
        self._every_s, self._clock = every_s, clock
        self._started = self._last_line = clock()
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar: tqdm[Any] | None = tqdm(total=steps, desc=desc, unit="ub", leave=False) if terminal else None

    def step(self, what: str) -> None:
        """One step enqueued (``what`` names it)."""
        self.steps_done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update()
        elif self._clock() - self._last_line >= self._every_s and self.steps_done < self.steps:
            self._line(f", {100 * self.steps_done // max(self.steps, 1)}% of the steps")

    def finished(self, rows: int) -> None:
        """``rows`` more rows are done."""
        self.rows_done += rows
        if self._bar is not None:
            self._bar.set_description_str(f"{self.desc} {self.rows_done}/{self.rows} rows", refresh=True)
        elif self.rows_done < self.rows:
            self._line("")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _line(self, within: str) -> None:
        now = self._clock()
        self._last_line = now
        left = ""
        if self.steps_done:
            left = f", about {duration((now - self._started) / self.steps_done * (self.steps - self.steps_done))} left"
        print(f"{self.desc}: {self.rows_done}/{self.rows} rows{within}{left}", file=sys.stderr, flush=True)


# Folders a hard stop removes: scratch files of the run in progress; and what it says first.
_scratch: list[Path] = []
_last_words: list[Callable[[], None]] = []
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


@contextmanager
def on_hard_stop(say: Callable[[], None]) -> Iterator[None]:
    """Call ``say`` if a hard stop ends the process while in this block (it writes what is done)."""
    _last_words.append(say)
    try:
        yield
    finally:
        _last_words.remove(say)


def _hard_stop() -> None:
    for say in list(_last_words):
        with contextlib.suppress(Exception):
            say()
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


_Parsed = TypeVar("_Parsed")


def add_decode_lookahead(parser: argparse.ArgumentParser) -> None:
    """``--decode-lookahead N``, as bench, prefill and generate take it (``MoeRunner.decode_lookahead``)."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a count of experts (0, 1, 2, ...)") from None
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value

    parser.add_argument(
        "--decode-lookahead",
        type=option_type(count),
        default=None,
        metavar="N",
        help="decode, experts streamed from page-locked memory: copy the N experts each layer's router ranks "
        "first on the layer before's input while that layer computes, then only those the router chose and "
        "the prediction missed (0: off; default: half the experts a token uses; the same bytes)",
    )


def option_type(parse: Callable[[str], _Parsed]) -> Callable[[str], _Parsed]:
    """``parse`` as an argparse type: the message of a ValueError it raises becomes the option's error
    (argparse would otherwise print only "invalid value")."""

    def parsed(text: str) -> _Parsed:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parsed.__name__ = parse.__name__
    return parsed


DECODE_COPIES = ("auto", "gather", "dma")


def add_decode_copies(parser: argparse.ArgumentParser, profile_option: str) -> None:
    """``--decode-copies`` and its older spelling ``--no-gather``, as bench, prefill and generate take them;
    ``profile_option`` names the option that gives auto its profile."""
    parser.add_argument(
        "--decode-copies",
        choices=DECODE_COPIES,
        default="auto",
        help="decode, experts streamed from page-locked memory: the device copies the experts each step uses "
        "itself (gather), or the host reads each layer's routing ids back and copies them with DMAs (dma, "
        "llama.cpp's way); auto: what `expertstream tune` measured faster on this device, from the profile "
        f"{profile_option} gives, else gather (faster on every device measured so far). The same bytes",
    )
    parser.add_argument("--no-gather", action="store_true", help="the same as --decode-copies dma")


def decode_copies(args: argparse.Namespace) -> str:
    """``--decode-copies`` with ``--no-gather`` (its older spelling of dma) folded in: one of DECODE_COPIES."""
    if args.no_gather and args.decode_copies == "gather":
        raise UsageError("--no-gather asks for --decode-copies dma, not gather: give one of them")
    return "dma" if args.no_gather else str(args.decode_copies)


def gathers(copies: str, profile: Profile | None) -> bool:
    """Whether decode copies with the device's gather (Scheduler.gather) for ``copies`` (one of
    DECODE_COPIES): auto takes the choice `tune` recorded in ``profile``, and the gather where none is given."""
    if copies == "auto":
        return profile is None or profile.decode_gather
    return copies == "gather"


__all__ = [
    "DECODE_COPIES",
    "EXIT_STATUS_HELP",
    "Exit",
    "HelpFormatter",
    "Parser",
    "RunProgress",
    "UsageError",
    "add_decode_copies",
    "add_decode_lookahead",
    "backend_variable_problem",
    "decode_copies",
    "duration",
    "gathers",
    "on_hard_stop",
    "open_backend",
    "option_type",
    "progress_bar",
    "prompt_interrupt",
    "scratch_folder",
    "writable_path",
    "write_out",
]


def write_trace(backend: Backend, device: str, model: dict[str, Any], command_line: str, path: Path) -> None:
    """The backend's timeline as a Chrome/Perfetto trace at ``path``, with what ran it (backend,
    ``device``, the simulator's profile, whether data moved, ``model``'s summary, the command line)
    as its otherData, for `expertstream plot`."""
    profile = backend.describe().get("profile")
    about = {
        "backend": backend.name,
        "device": device,
        "profile": profile["name"] if profile else None,
        "timing_only": not backend.host.holds_data,
        "model": model,
        "command_line": command_line,
    }
    trace = {**to_chrome_trace(backend.timeline or ()), "otherData": about}
    path.write_text(json.dumps(trace), encoding="utf-8")
