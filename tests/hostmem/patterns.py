"""Host bytes for the ring's copies: no two chunks or parts alike, so a misplaced piece shows."""

from __future__ import annotations

import numpy as np


def pattern(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
