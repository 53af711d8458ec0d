"""The sampler's chain (top-k, then top-p over what is left, then temperature), seeded draws only."""

from __future__ import annotations

import numpy as np
import pytest

from expertstream.engine.sampling import Sampler, Sampling
from expertstream.errors import InvalidArgument

# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
LOGITS = np.log(np.array([0.15, 0.5, 0.05, 0.3]))


def _draws(sampling: Sampling, n: int = 400) -> list[int]:
    sampler = Sampler(sampling)
    return [sampler(LOGITS) for _ in range(n)]


def test_greedy_takes_the_largest_logit() -> None:
    assert set(_draws(Sampling(temperature=0), 10)) == {1}


@pytest.mark.parametrize(("top_k", "kept"), [(1, {1}), (2, {1, 3}), (3, {0, 1, 3}), (0, {0, 1, 2, 3})])
def test_top_k_keeps_the_k_most_likely(top_k: int, kept: set[int]) -> None:
    assert set(_draws(Sampling(temperature=1, top_k=top_k, top_p=1, seed=7))) == kept


@pytest.mark.parametrize(("top_p", "kept"), [(0.45, {1}), (0.6, {1, 3}), (0.9, {0, 1, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_token_that_reaches_p(top_p: float, kept: set[int]) -> None:
    assert set(_draws(Sampling(temperature=1, top_k=0, top_p=top_p, seed=7))) == kept


def test_top_p_applies_to_what_top_k_left() -> None:
    # top-k 2 leaves 0.5 and 0.3, renormalised to 0.625 and 0.375: p 0.6 keeps the first alone.
    assert set(_draws(Sampling(temperature=1, top_k=2, top_p=0.6, seed=7))) == {1}


def test_temperature_sharpens_and_flattens() -> None:
    cold = _draws(Sampling(temperature=0.05, top_k=0, top_p=1, seed=3))
    hot = _draws(Sampling(temperature=100, top_k=0, top_p=1, seed=3), 2000)
    assert cold.count(1) == len(cold)  # 0.5 against 0.3 at 1/20 of the temperature: e^-10 for the next
    shares = np.bincount(hot, minlength=4) / len(hot)
    assert np.all(np.abs(shares - 0.25) < 0.05)  # nearly uniform


def test_a_seed_gives_the_same_draws_and_none_picks_one() -> None:
    assert _draws(Sampling(temperature=1, seed=11)) == _draws(Sampling(temperature=1, seed=11))
    sampler = Sampler(Sampling(temperature=1, seed=None))
    assert 0 <= sampler.seed < 2**32


def test_non_finite_logits_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="NaN or infinite"):
        Sampler(Sampling(temperature=1, seed=0))(np.array([0.0, np.nan]))
