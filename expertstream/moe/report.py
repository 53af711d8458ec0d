"""Deprecated alias of ``expertstream.bench.report`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.bench.report")
