"""llama-perplexity's definition on hand-made logits: which chunks, which tokens are scored, BOS in place."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from expertstream.engine.perplexity import perplexity
from expertstream.errors import InvalidArgument

VOCAB = 5
BOS = 4


def _uniform_but(chunk: Sequence[int], sure: float) -> np.ndarray:
    """Logits under which, after each position j, token chunk[j + 1] has probability ``sure`` and the
    others share what is left."""
    rows = np.full((len(chunk), VOCAB), math.log((1 - sure) / (VOCAB - 1)))
    for j in range(len(chunk) - 1):
        rows[j, chunk[j + 1]] = math.log(sure)
    return rows


def test_only_the_second_half_of_each_chunk_is_scored_after_bos_replaces_its_first_token() -> None:
    tokens = list(range(4)) * 5  # 20 tokens: two whole chunks of 8, four left over
    seen: list[list[int]] = []

    def logits_of(chunk: Sequence[int]) -> np.ndarray:
        seen.append(list(chunk))
        rows = _uniform_but(chunk, 0.5)
        rows[: len(chunk) // 2] = np.nan  # the first half is never read
        return rows

    result = perplexity(logits_of, tokens, n_ctx=8, bos=BOS)
    assert seen == [[BOS, 1, 2, 3, 0, 1, 2, 3], [BOS, 1, 2, 3, 0, 1, 2, 3]]
    # Tokens 5, 6 and 7 of each chunk, each at probability 0.5: perplexity 2 exactly, no spread.
    assert result.scored == 6 and result.value == pytest.approx(2.0, rel=1e-12) and result.error == 0
    assert result.running == pytest.approx((2.0, 2.0), rel=1e-12)


def test_the_estimate_is_exp_of_the_mean_with_its_standard_error_through_the_exp() -> None:
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    chunks = iter([0.5, 0.25])  # every scored token of the first chunk at 0.5, of the second at 0.25

    def logits_of(chunk: Sequence[int]) -> np.ndarray:
        return _uniform_but(chunk, next(chunks))

    result = perplexity(logits_of, tokens, n_ctx=4, bos=None)
    nll = np.array([math.log(2), math.log(4)])  # one scored token a chunk (j = 2 of 4)
    assert result.scored == 2
    assert result.running == pytest.approx((2.0, math.exp(nll.mean())), rel=1e-12)
    spread = math.sqrt((np.mean(nll**2) - nll.mean() ** 2) / (len(nll) - 1))
    assert result.error == pytest.approx(result.value * spread, rel=1e-12)


def test_max_chunks_and_short_texts() -> None:
    tokens = [1, 2, 3] * 8
    result = perplexity(lambda chunk: _uniform_but(chunk, 0.5), tokens, n_ctx=8, bos=None, max_chunks=2)
    assert len(result.running) == 2 and result.scored == 6
    with pytest.raises(InvalidArgument, match="needs at least 16"):
        perplexity(lambda chunk: _uniform_but(chunk, 0.5), tokens[:15], n_ctx=8, bos=None)
