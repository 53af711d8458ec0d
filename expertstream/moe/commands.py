"""Deprecated alias of ``expertstream.cli.prefill`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.cli.prefill")
