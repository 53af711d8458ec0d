"""Deprecated alias of ``expertstream.cli.tune`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.cli.tune")
