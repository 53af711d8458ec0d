"""Deprecated alias of ``expertstream.cli.plot`` (kept for one release)."""

from ._deprecated import alias_module

alias_module(__name__, "expertstream.cli.plot")
