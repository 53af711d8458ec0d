"""Deprecated alias of ``expertstream.engine.runner`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.engine.runner")
