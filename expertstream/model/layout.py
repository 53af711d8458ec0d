"""Deprecated alias of ``expertstream.model.schema`` (kept for one release)."""

from .._deprecated import alias_module

alias_module(__name__, "expertstream.model.schema")
