"""The byte-level BPE make-model trains: the same in every process, sized as asked, errors named."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from expertstream.errors import InvalidArgument
from expertstream.model.vocabulary import add_vocabulary, trained_byte_level_bpe

ROOT = Path(__file__).resolve().parents[2]
_DIGEST = (
    "import hashlib, sys; from expertstream.model.vocabulary import trained_byte_level_bpe as t; "
    "tokens, merges = t(int(sys.argv[1])); "
    "print(hashlib.sha256(repr((tokens, merges)).encode()).hexdigest())"
)


def digest(n_tokens: int) -> str:
    tokens, merges = trained_byte_level_bpe(n_tokens)
    return hashlib.sha256(repr((tokens, merges)).encode()).hexdigest()


def test_training_gives_the_same_vocabulary_in_another_process() -> None:
    other = subprocess.run(
        [sys.executable, "-c", _DIGEST, "510"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    assert other == digest(510)


@pytest.mark.parametrize("n_tokens", [256, 257, 510, 1000])
def test_vocabulary_has_the_bytes_then_one_token_per_merge(n_tokens: int) -> None:
    tokens, merges = trained_byte_level_bpe(n_tokens)
    assert len(tokens) == n_tokens and len(set(tokens)) == n_tokens
    assert set(tokens[:256]) == set(pre_tokenizers.ByteLevel.alphabet())
    assert len(merges) == n_tokens - 256
    # Each merge's pieces are tokens that come before the token it makes.
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ")
        made = tokens.index(left + right)
        assert made == 256 + rank and tokens.index(left) < made and tokens.index(right) < made


@pytest.mark.parametrize("n_tokens", [255, 100_000])
def test_vocabulary_size_out_of_reach_is_refused(n_tokens: int) -> None:
    with pytest.raises(InvalidArgument, match=f"{n_tokens}|at least 256"):
        trained_byte_level_bpe(n_tokens)


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "x.gguf", "olmoe")
    with pytest.raises(InvalidArgument, match=r"no vocabulary style for architecture 'olmoe'; known: .*qwen3moe"):
        add_vocabulary(writer, "olmoe", 512)
