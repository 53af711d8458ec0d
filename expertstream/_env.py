"""On/off switches read from the environment."""

from __future__ import annotations

import os

from .errors import InvalidArgument


def switch(var: str, call: str, hint: str, default: bool = False) -> bool:
    """$var as a switch: 1 is on, 0 off, unset ``default``; any other value is refused, naming the variable."""
    value = os.environ.get(var, "").strip()
    if value not in ("", "0", "1"):
        raise InvalidArgument(f"{var}={value!r} is neither 0 nor 1", call=call, hint=hint)
    return default if value == "" else value == "1"
