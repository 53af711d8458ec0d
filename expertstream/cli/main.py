"""The `expertstream` command line: info, make-model, prefill (bench), demo, tune, plot."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .. import __version__
from ..backends import ENV_VAR, available_backends, backend, resolve_name
from ..errors import ExpertStreamError
from .tools import EXIT_STATUS_HELP, Exit, HelpFormatter, Parser, backend_variable_problem, prompt_interrupt

log = logging.getLogger(__name__)


def _auto() -> tuple[str | None, str]:
    """What backend("auto") opens here, and why (or None and why nothing can be opened)."""
    problem = backend_variable_problem()
    if problem is not None:
        return None, problem
    if os.environ.get(ENV_VAR, "").strip().lower() not in ("", "auto"):
        return resolve_name(), f"from {ENV_VAR}"
    return resolve_name(), "the first usable of cuda, hip, sim"


def _info(args: argparse.Namespace, command_line: str) -> int:
    rows: list[dict[str, Any]] = []
    for status in available_backends():
        entry: dict[str, Any] = {"name": status.name, "usable": status.usable, "reason": status.reason, "devices": []}
        if status.usable:
            with backend(status.name) as be:
                entry["devices"] = be.describe()["devices"]
        rows.append(entry)
    auto, why = _auto()
    if args.json:
        doc = {"version": __version__, "auto": auto, "auto_reason": why, "backends": rows}
        print(json.dumps(doc, indent=2))
        return _auto_status(auto, why)
    print(f"auto: {auto or 'none'} ({why})")
    for entry in rows:
        state = "usable" if entry["usable"] else f"not usable: {entry['reason']}"
        print(f"{entry['name']:5} {state}")
        for dev in entry["devices"]:
            caps = dev["capabilities"]
            flags = ", ".join(
                k
                for k in (
                    "async_copies",
                    "events",
                    "host_register",
                    "host_register_read_only",
                    "matrix_cores",
                    "int8_matrix_cores",
                    "mma_fragments",
                )
                if caps[k]
            )
            peers = ",".join(map(str, caps["peer_access"])) or "none"
            print(
                f"      [{dev['index']}] {dev['name']} ({dev['arch']}), {dev['total_memory'] / 2**30:.1f} GiB, "
                f"{dev['free_memory'] / 2**30:.1f} GiB free; {flags}; "
                f"{caps['max_shared_bytes'] // 1024} KB shared memory a block; peers: {peers}"
            )
    return _auto_status(auto, why)


def _auto_status(auto: str | None, why: str) -> int:
    """0 when `auto` can open a backend; else, as every other command would stop, say why and 2."""
    if auto is not None:
        return Exit.OK
    sys.stdout.flush()
    print(f"expertstream info: error: {why}", file=sys.stderr)
    return Exit.USAGE


VERBOSE_HELP = "more log output (-vv for debug)"


def _parser(typed: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``typed``: the command as typed, which its messages name (bench, not prefill)."""
    parser = Parser(prog="expertstream", description=__doc__, epilog=EXIT_STATUS_HELP, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"expertstream {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser(
        "info",
        help="backends, devices and capabilities, and what auto picks",
        description=f"List every backend, whether it can run here, its devices, and the one `auto` opens "
        f"(${ENV_VAR} if set, else the first usable of cuda, hip, sim). Exit status 2, after the list, "
        f"when ${ENV_VAR} names a backend that is unknown or not usable here, as every command that opens "
        "a backend stops then.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=HelpFormatter,
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=_info)
    for register in _command_modules():
        register(sub)
    commands = {id(command): command for command in sub.choices.values()}  # an alias shares its parser
    for command in commands.values():
        # -v after the command too; its own count, added to the one before the command.
        command.add_argument("-v", "--verbose", dest="command_verbose", action="count", default=0, help=VERBOSE_HELP)
    if typed in sub.choices:
        sub.choices[typed].prog = f"expertstream {typed}"
    return parser


def _typed_command(argv: Sequence[str]) -> str | None:
    """The command word of ``argv`` (options before it take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _command_modules() -> list[Callable[[Any], None]]:
    from . import generate, make_model, plot, prefill, tune

    return [make_model.register, prefill.register, generate.register, tune.register, plot.register]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(_typed_command(argv)).parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose + args.command_verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        with prompt_interrupt():
            # Every command's run takes its parsed arguments (never rewritten) and the command line as typed.
            code: int = args.run(args, shlex.join(["expertstream", *argv]))
        sys.stdout.flush()
    except ExpertStreamError as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):  # cleaning up after Ctrl-C failed: still a stop
            print(f"expertstream: interrupted ({exc})", file=sys.stderr)
            return Exit.INTERRUPTED
        print(f"expertstream: error: {exc}", file=sys.stderr)
        return Exit.USAGE
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and let nothing write to the closed pipe at exit.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.BROKEN_PIPE
    except OSError as exc:  # a file that cannot be read or written: one line, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"expertstream: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return Exit.USAGE
    except KeyboardInterrupt:
        print("expertstream: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    return code
