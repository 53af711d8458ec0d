"""Deprecated alias of ``expertstream.bench.tuner`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.bench.tuner")
