"""Deprecated alias of ``expertstream.bench.measure`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.bench.measure")
