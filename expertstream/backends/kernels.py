"""Deprecated alias: the MoE kernels moved to ``expertstream.kernels``; this name goes away in 0.3."""

from __future__ import annotations

import sys
import warnings

from .. import kernels as _kernels
from .._deprecated import REMOVED_IN
from ..kernels import layout, reference, twins

warnings.warn(
    f"expertstream.backends.kernels moved to expertstream.kernels; the old name goes away in {REMOVED_IN}",
    DeprecationWarning,
    stacklevel=2,
)
for _name, _module in (("layout", layout), ("reference", reference), ("twins", twins)):
    sys.modules[f"{__name__}.{_name}"] = _module
sys.modules[__name__] = _kernels
