"""Perplexity as llama.cpp's llama-perplexity computes it.

The text's tokens (BOS first where the vocabulary adds it) are cut into chunks of ``n_ctx``;
each chunk runs alone from an empty cache, its first token replaced by BOS where the vocabulary
adds one, and only its second half is scored: the negative log-likelihood of token j + 1 under
the logits after token j, for j from n_ctx / 2 to n_ctx - 2. The estimate is exp of the mean
over every scored token, with llama.cpp's error bar (its standard error through the exp).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument


@dataclass(frozen=True)
class Perplexity:
    """The estimate after every chunk, the final one and its error."""

    running: tuple[float, ...]
    value: float
    error: float
    scored: int


def chunk_nll(logits: np.ndarray, tokens: Sequence[int], first: int) -> np.ndarray:
    """Negative log-likelihoods of tokens[j + 1] under logits[j] for j in first..len(tokens) - 2 (float64)."""
    rows = np.asarray(logits[first : len(tokens) - 1], dtype=np.float64)
    top = rows.max(axis=1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    targets = np.asarray(tokens[first + 1 :], dtype=np.int64)
    return log_norm - rows[np.arange(len(targets)), targets]


def perplexity(
    logits_of: Callable[[Sequence[int]], np.ndarray],
    tokens: Sequence[int],
    n_ctx: int,
    bos: int | None,
    on_chunk: Callable[[int, float], None] = lambda i, ppl: None,
    max_chunks: int | None = None,
) -> Perplexity:
    """Perplexity of ``tokens`` with ``logits_of`` (every position's logits of a chunk), over at most
    ``max_chunks`` chunks (llama-perplexity's --chunks)."""
    if n_ctx < 4:
        raise InvalidArgument(f"the context must be at least 4 tokens, got {n_ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise InvalidArgument(f"max_chunks must be at least 1 (None: every chunk), got {max_chunks}")
    n_chunks = len(tokens) // n_ctx if max_chunks is None else min(max_chunks, len(tokens) // n_ctx)
    if len(tokens) < 2 * n_ctx:
        raise InvalidArgument(
            f"the text has {len(tokens)} tokens; perplexity with a context of {n_ctx} needs at least {2 * n_ctx}",
            hint="give a longer text (-f) or a smaller context (-c)",
        )
    first = n_ctx // 2
    total = total_sq = 0.0
    count = 0
    running = []
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        nll = chunk_nll(logits_of(chunk), chunk, first)
        total += float(nll.sum())
        total_sq += float((nll * nll).sum())
        count += nll.size
        running.append(math.exp(total / count))
        on_chunk(i, running[-1])
    mean = total / count
    var = total_sq / count - mean * mean
    value = math.exp(mean)
    error = value * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return Perplexity(tuple(running), value, error, count)
