"""microbench.llamacpp_logits.compare on synthetic logits: KL against float64 sums, argmax, files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from expertstream.errors import InvalidArgument
from microbench.llamacpp_logits.compare import (
    comparable_rows,
    compare_logits,
    compare_runs,
    kl_divergence,
    log_softmax,
    main,
    read_run,
)


def kl_by_hand(p_logits: list[float], q_logits: list[float]) -> float:
    """KL(P || Q) of one row, each softmax and sum written out in exact-as-possible float64."""
    p_max, q_max = max(p_logits), max(q_logits)
    p_norm = math.fsum(math.exp(x - p_max) for x in p_logits)
    q_norm = math.fsum(math.exp(x - q_max) for x in q_logits)
    terms = []
    for x, y in zip(p_logits, q_logits, strict=True):
        log_p = x - p_max - math.log(p_norm)
        log_q = y - q_max - math.log(q_norm)
        terms.append(math.exp(log_p) * (log_p - log_q))
    return math.fsum(terms)


def test_kl_of_a_known_pair() -> None:
    # P = (1/2, 1/2), Q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
    kl = kl_divergence(np.array([[0.0, 0.0]]), np.array([[math.log(3.0), 0.0]]))
    assert kl[0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-14)


def test_kl_matches_float64_sums_on_random_float32_logits() -> None:
    rng = np.random.default_rng(7)
    reference = rng.normal(0, 3, (6, 300)).astype(np.float32)
    other = (reference + rng.normal(0, 0.05, reference.shape)).astype(np.float32)
    pairs = zip(reference.astype(float).tolist(), other.astype(float).tolist(), strict=True)
    expected = [kl_by_hand(r, o) for r, o in pairs]
    np.testing.assert_allclose(kl_divergence(reference, other), expected, rtol=1e-9, atol=1e-15)


def test_kl_is_zero_for_equal_or_shifted_rows_and_positive_otherwise() -> None:
    rng = np.random.default_rng(1)
    reference = rng.normal(0, 2, (4, 50)).astype(np.float32)
    shifted = reference.astype(np.float64) + np.array([[0.0], [5.0], [-3.0], [100.0]])
    np.testing.assert_allclose(kl_divergence(reference, reference), 0.0, atol=1e-15)
    np.testing.assert_allclose(kl_divergence(reference, shifted), 0.0, atol=1e-12)
    assert (kl_divergence(reference, reference[:, ::-1]) > 0.1).all()


def test_large_logits_do_not_overflow() -> None:
    reference = np.array([[1000.0, 0.0, -1000.0]], dtype=np.float32)
    other = np.array([[0.0, 1000.0, -1000.0]], dtype=np.float32)
    assert np.isfinite(log_softmax(reference)).all()
    assert kl_divergence(reference, other)[0] == pytest.approx(1000.0, rel=1e-9)


def test_argmax_agreement_and_summary() -> None:
    reference = np.eye(5, dtype=np.float32)  # row i's argmax is i
    other = reference.copy()
    other[1] = np.roll(other[1], 1)
    other[3] = np.roll(other[3], 2)
    result = compare_logits(reference, other)
    assert result.argmax_agrees.tolist() == [True, False, True, False, True]
    assert result.argmax_agreement == pytest.approx(0.6)
    assert result.positions == 5
    assert result.max_kl == pytest.approx(float(result.kl.max()))
    assert result.mean_kl == pytest.approx(float(result.kl.mean()))
    assert result.kl[0] == 0.0 and result.kl[1] > 0.0


@pytest.mark.parametrize(
    ("reference", "other", "expected"),
    [([1, 2, 3, 4], [1, 2, 3, 4], 4), ([1, 2, 3, 4], [1, 2, 9, 4], 2), ([5], [6], 0), ([1, 2, 3], [1, 2], 2)],
)
def test_comparable_rows_stop_where_the_fed_tokens_part(reference: list[int], other: list[int], expected: int) -> None:
    assert comparable_rows(reference, other) == expected


def test_mismatched_or_non_finite_logits_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"shapes \(2, 3\) and \(2, 4\)"):
        kl_divergence(np.zeros((2, 3)), np.zeros((2, 4)))
    bad = np.zeros((3, 4))
    bad[2, 1] = np.nan
    with pytest.raises(InvalidArgument, match=r"other logits are not finite in rows \[2\]"):
        kl_divergence(np.zeros((3, 4)), bad)


def write_run(prefix: Path, logits: np.ndarray, tokens: list[int]) -> Path:
    """The three files llamacpp-logits writes."""
    prefix.with_name(prefix.name + ".logits").write_bytes(logits.astype(np.float32).tobytes())
    prefix.with_name(prefix.name + ".tokens").write_text("".join(f"{t}\n" for t in tokens))
    meta = {"shape": list(logits.shape), "n_vocab": logits.shape[1], "dtype": "float32"}
    prefix.with_name(prefix.name + ".json").write_text(json.dumps(meta))
    return prefix


def test_runs_are_read_and_compared_up_to_the_first_differing_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (6, 20)).astype(np.float32)
    ref = write_run(tmp_path / "ref", logits, [1, 2, 3, 4, 5, 6])
    other_logits = logits.copy()
    other_logits[4:] = rng.normal(0, 1, (2, 20))  # after the parting token: not compared
    other = write_run(tmp_path / "other", other_logits, [1, 2, 3, 4, 9, 9])
    run = read_run(ref)
    assert run.logits.shape == (6, 20) and run.tokens == [1, 2, 3, 4, 5, 6]
    np.testing.assert_array_equal(run.logits, logits)
    result = compare_runs(run, read_run(other))
    assert result.positions == 4 and result.max_kl == 0.0 and result.argmax_agreement == 1.0
    assert main([str(ref), str(other)]) == 0
    assert "positions compared: 4 of 6" in capsys.readouterr().out


def test_run_files_that_disagree_are_refused(tmp_path: Path) -> None:
    prefix = write_run(tmp_path / "run", np.zeros((3, 4)), [1, 2, 3])
    prefix.with_name("run.tokens").write_text("1\n2\n")
    with pytest.raises(InvalidArgument, match="holds 2 token ids; the logits have 3 rows"):
        read_run(prefix)
    prefix.with_name("run.logits").write_bytes(np.zeros(11, np.float32).tobytes())
    with pytest.raises(InvalidArgument, match=r"holds 11 floats; run.json says shape \[3, 4\]"):
        read_run(prefix)
    with pytest.raises(InvalidArgument, match=r"missing\.json is missing"):
        read_run(tmp_path / "missing")


def test_by_prints_the_mean_kl_of_each_run_of_positions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, (5, 20)).astype(np.float32)
    other_logits = logits.copy()
    other_logits[4] = rng.normal(0, 1, 20)  # only the last position differs: the second run of two
    ref = write_run(tmp_path / "ref", logits, [1, 2, 3, 4, 5])
    other = write_run(tmp_path / "other", other_logits, [1, 2, 3, 4, 5])
    last = float(kl_divergence(logits[4:], other_logits[4:])[0])
    assert main([str(ref), str(other), "--by", "2"]) == 0
    out = capsys.readouterr().out
    assert "positions 0-1: KL mean 0, median 0" in out and "positions 2-3: KL mean 0, median 0" in out
    assert f"positions 4-4: KL mean {last:.6g}, median {last:.6g}" in out
    with pytest.raises(SystemExit):
        main([str(ref), str(other), "--by", "0"])
