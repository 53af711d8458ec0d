"""Compare two runs of llamacpp-logits (or any logits in its format): KL divergence and argmax agreement.

python3 -m microbench.llamacpp_logits.compare REF_PREFIX OTHER_PREFIX [--by N]

A run is PREFIX.logits (float32, [rows, n_vocab]), PREFIX.tokens (the ids fed, one a line) and
PREFIX.json (its ``shape``). Row i is the next-token distribution after position i, so it depends
on the tokens fed at positions 0..i: rows are compared only while both runs fed the same tokens
(greedy continuations may part). Per row: KL(P_ref || P_other) in nats, from float64 log-softmax,
and whether the two argmaxes agree. With --by N, also the mean and median KL of each run of N
positions (where in the context the two part).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from expertstream.errors import InvalidArgument


@dataclass(frozen=True)
class LogitsRun:
    """One run's files: logits [rows, n_vocab], the token fed at each row's position, its JSON."""

    logits: np.ndarray
    tokens: list[int]
    meta: dict[str, Any]


@dataclass(frozen=True)
class Comparison:
    """Per compared position: KL(P_ref || P_other) in nats and whether the argmaxes agree."""

    kl: np.ndarray
    argmax_agrees: np.ndarray

    @property
    def positions(self) -> int:
        return len(self.kl)

    @property
    def mean_kl(self) -> float:
        return float(self.kl.mean()) if self.positions else 0.0

    @property
    def max_kl(self) -> float:
        return float(self.kl.max()) if self.positions else 0.0

    @property
    def argmax_agreement(self) -> float:
        """The fraction of positions whose argmaxes agree (1.0 where none are compared)."""
        return float(self.argmax_agrees.mean()) if self.positions else 1.0


def read_run(prefix: str | Path) -> LogitsRun:
    """PREFIX.logits, PREFIX.tokens and PREFIX.json, checked against each other."""
    prefix = Path(prefix)
    meta_path, logits_path, tokens_path = (prefix.with_name(prefix.name + s) for s in (".json", ".logits", ".tokens"))
    for path in (meta_path, logits_path, tokens_path):
        if not path.is_file():
            raise InvalidArgument(f"{path} is missing: a run is PREFIX.json, PREFIX.logits and PREFIX.tokens")
    meta = json.loads(meta_path.read_text())
    rows, n_vocab = (int(n) for n in meta["shape"])
    logits = np.fromfile(logits_path, dtype=np.float32)
    if logits.size != rows * n_vocab:
        raise InvalidArgument(
            f"{logits_path} holds {logits.size} floats; {meta_path.name} says shape [{rows}, {n_vocab}]"
        )
    tokens = [int(line) for line in tokens_path.read_text().split()]
    if len(tokens) != rows:
        raise InvalidArgument(f"{tokens_path} holds {len(tokens)} token ids; the logits have {rows} rows")
    return LogitsRun(logits.reshape(rows, n_vocab), tokens, meta)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, shifted by each row's maximum so that nothing overflows."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_divergence(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(P_ref || P_other) per row, in nats, of two [rows, n_vocab] logits arrays."""
    _check_pair(reference, other)
    log_p = log_softmax(reference)
    log_q = log_softmax(other)
    return np.asarray((np.exp(log_p) * (log_p - log_q)).sum(axis=-1))


def compare_logits(reference: np.ndarray, other: np.ndarray) -> Comparison:
    """KL divergence and argmax agreement of two [rows, n_vocab] logits arrays, row by row."""
    kl = kl_divergence(reference, other)
    agrees = np.argmax(reference, axis=-1) == np.argmax(other, axis=-1)
    return Comparison(kl=kl, argmax_agrees=agrees)


def comparable_rows(reference_tokens: list[int], other_tokens: list[int]) -> int:
    """How many leading rows saw the same tokens in both runs (row i needs tokens 0..i equal)."""
    for i, (a, b) in enumerate(zip(reference_tokens, other_tokens, strict=False)):
        if a != b:
            return i
    return min(len(reference_tokens), len(other_tokens))


def compare_runs(reference: LogitsRun, other: LogitsRun) -> Comparison:
    """The rows both runs computed on the same tokens, compared."""
    n = comparable_rows(reference.tokens, other.tokens)
    return compare_logits(reference.logits[:n], other.logits[:n])


def _check_pair(reference: np.ndarray, other: np.ndarray) -> None:
    if reference.ndim != 2 or reference.shape != other.shape:
        raise InvalidArgument(
            f"logits of shapes {reference.shape} and {other.shape}: expected two equal [rows, n_vocab] arrays"
        )
    for name, array in (("reference", reference), ("other", other)):
        bad = np.flatnonzero(~np.isfinite(array).all(axis=-1))
        if bad.size:
            raise InvalidArgument(f"{name} logits are not finite in rows {bad[:8].tolist()} ({bad.size} rows)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path, help="the reference run's prefix")
    parser.add_argument("other", type=Path, help="the other run's prefix")
    parser.add_argument("--by", type=int, metavar="N", help="also the mean and median KL of each run of N positions")
    args = parser.parse_args(argv)
    if args.by is not None and args.by < 1:
        parser.error(f"--by takes a positive number of positions, not {args.by}")
    reference, other = read_run(args.reference), read_run(args.other)
    result = compare_runs(reference, other)
    rows = min(len(reference.tokens), len(other.tokens))
    print(f"positions compared: {result.positions} of {rows} (the fed tokens agree through that many)")
    if result.positions:
        worst = int(np.argmax(result.kl))
        print(f"KL(ref || other): mean {result.mean_kl:.6g} nats, max {result.max_kl:.6g} at position {worst}")
        agree = int(result.argmax_agrees.sum())
        print(f"argmax agreement: {agree} of {result.positions} ({result.argmax_agreement:.2%})")
        if args.by:
            for start in range(0, result.positions, args.by):
                part = result.kl[start : start + args.by]
                stats = f"KL mean {part.mean():.6g}, median {np.median(part):.6g}"
                print(f"positions {start}-{start + len(part) - 1}: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
