"""Choosing the next token from a step's logits: greedy, or temperature with top-k and top-p.

The order is llama.cpp's common sampler chain for these three: top-k, then top-p (the smallest
set of the most likely tokens whose probability reaches p), then temperature, then a draw.
A temperature of 0 is greedy (the lowest id among equal maxima). Draws come from one seeded
generator, so a seed gives the same text for the same logits.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgument


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; ``temperature`` 0 is greedy."""

    temperature: float = 0.8
    top_k: int = 40  # 0: every token
    top_p: float = 0.95  # 1.0: no cut
    seed: int | None = None  # None: a fresh seed per Sampler

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise InvalidArgument(f"seed must be non-negative, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Sampler:
    """Draws tokens by ``sampling``; one per generation."""

    sampling: Sampling
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        seed = self.sampling.seed
        self.seed = seed if seed is not None else secrets.randbelow(2**32)
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> int:
        values = np.asarray(logits, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(values)):
            raise InvalidArgument("the logits hold NaN or infinite values: the forward pass went wrong")
        if self.sampling.greedy:
            return int(np.argmax(values))
        order = np.argsort(-values, kind="stable")
        if self.sampling.top_k:
            order = order[: self.sampling.top_k]
        kept = values[order]
        probs = np.exp(kept - kept[0])
        probs /= probs.sum()
        if self.sampling.top_p < 1:
            reach = int(np.searchsorted(np.cumsum(probs), self.sampling.top_p)) + 1
            order, kept = order[:reach], kept[:reach]
        scaled = np.exp((kept - kept[0]) / self.sampling.temperature)
        return int(order[self._rng.choice(len(order), p=scaled / scaled.sum())])
