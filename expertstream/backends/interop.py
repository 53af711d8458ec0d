"""Deprecated alias of ``expertstream.backends.dlpack`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.backends.dlpack")
