"""The `expertstream` command line: info, make-model, prefill, demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__
from .backends import available_backends, backend
from .errors import ExpertStreamError

log = logging.getLogger(__name__)


def _info(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for status in available_backends():
        entry: dict[str, Any] = {"name": status.name, "usable": status.usable, "reason": status.reason, "devices": []}
        if status.usable:
            with backend(status.name) as be:
                entry["devices"] = be.describe()["devices"]
        rows.append(entry)
    if args.json:
        print(json.dumps({"version": __version__, "backends": rows}, indent=2))
        return 0
    for entry in rows:
        state = "usable" if entry["usable"] else f"not usable: {entry['reason']}"
        print(f"{entry['name']:5} {state}")
        for dev in entry["devices"]:
            caps = dev["capabilities"]
            flags = ", ".join(
                k for k in ("async_copies", "events", "host_register", "host_register_read_only") if caps[k]
            )
            peers = ",".join(map(str, caps["peer_access"])) or "none"
            print(
                f"      [{dev['index']}] {dev['name']} ({dev['arch']}), {dev['total_memory'] / 2**30:.1f} GiB, "
                f"{dev['free_memory'] / 2**30:.1f} GiB free; {flags}; peers: {peers}"
            )
    return 0


Command = Callable[[argparse.Namespace], int]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertstream", description=__doc__)
    parser.add_argument("--version", action="version", version=f"expertstream {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="backends, devices and capabilities")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=_info)
    for register in _command_modules():
        register(sub)
    return parser


def _command_modules() -> list[Callable[[Any], None]]:
    from .model import commands as model_commands
    from .moe import commands as moe_commands

    return [model_commands.register, moe_commands.register]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.run(args)
    except ExpertStreamError as exc:
        print(f"expertstream: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
