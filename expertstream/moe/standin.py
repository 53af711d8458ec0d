"""Deprecated alias of ``expertstream.engine.standin`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.engine.standin")
