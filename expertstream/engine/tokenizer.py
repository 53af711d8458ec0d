"""A tokenizer built from a GGUF file's own vocabulary (the ``tokenizer.ggml.*`` metadata).

Two vocabulary kinds are read, each modelled the way llama.cpp tokenizes it and run by the
``tokenizers`` library:

- ``llama`` (SentencePiece): spaces become U+2581 and one is added in front of the text and
  after every special token; pieces merge pairwise, the pair whose merged piece scores highest
  first; a character no piece covers falls back to its ``<0xNN>`` byte tokens. Here that is a
  BPE whose merges are every split of a piece into two pieces, ranked by the merged piece's
  score. llama.cpp breaks ties between equal scores by position, the BPE by rank, so the two
  can differ on vocabularies with tied scores.
- ``gpt2`` (byte-level BPE): the file's ranked merges over byte-level pieces, after the regex
  split that ``tokenizer.ggml.pre`` names ("qwen2", "llama-bpe", "gpt-4o").

CONTROL, UNKNOWN and USER_DEFINED tokens are matched in the text before anything else, as
llama.cpp does when it parses special tokens. decode renders USER_DEFINED tokens and leaves
CONTROL and UNKNOWN tokens (BOS, EOS, chat markers, <unk>) out.

``tools/tokenize_check.py`` compares these tokens with llama.cpp's ``llama-tokenize`` over a
corpus; docs/results/tokenizer-check.md records it on make-model's files of every kind (real
models' vocabularies not yet).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HfTokenizer

from ..model.loader import MoeModel
from ..model.metadata import Metadata, read_gguf
from ..model.schema import ModelError

SPM_SPACE = "\u2581"


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# The split regexes of llama.cpp's pre-tokenizer types, as the models' tokenizer.json define them.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_O200K_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_O200K_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K_SUFFIX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PRE_TOKENIZER_REGEXES: dict[str, str] = {
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}*{_O200K_LOWER}+{_O200K_SUFFIX}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}+{_O200K_LOWER}*{_O200K_SUFFIX}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# llama.cpp looks a whole pre-token up in the vocabulary before merging only for llama-bpe.
_IGNORE_MERGES = frozenset({"llama-bpe"})
_ADD_BOS_BY_DEFAULT = frozenset({"llama-bpe"})
VOCABULARY_KINDS = {"llama": "SentencePiece", "gpt2": "byte-level BPE"}


@dataclass(frozen=True)
class _Vocabulary:
    """The ``tokenizer.ggml.*`` keys of one file, checked."""

    where: str
    kind: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[tuple[str, str]]
    pre: str | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


class Tokenizer:
    """Text to token ids and back with a GGUF file's vocabulary; build with ``from_model``/``from_path``."""

    def __init__(self, vocab: _Vocabulary, backend: _HfTokenizer) -> None:
        self.kind = vocab.kind
        self.pre = vocab.pre  # the byte-level pre-tokenizer's name; None for SentencePiece
        self.bos_id = vocab.bos_id
        self.eos_id = vocab.eos_id
        self.vocab_size = len(vocab.tokens)
        self._add_bos = vocab.add_bos and vocab.bos_id is not None
        self._add_eos = vocab.add_eos and vocab.eos_id is not None
        self._backend = backend

    @property
    def adds_bos(self) -> bool:
        """Whether ``encode`` puts BOS first (as the file asks)."""
        return self._add_bos

    @classmethod
    def from_model(cls, model: MoeModel) -> Tokenizer:
        return cls._build(_read_vocabulary(str(model.path), model.metadata))

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """The vocabulary of any GGUF file, whether or not it holds a model MoeModel opens."""
        path = Path(path)
        meta = Metadata(path, read_gguf(path))
        return cls._build(_read_vocabulary(str(path), meta.value))

    @classmethod
    def _build(cls, vocab: _Vocabulary) -> Tokenizer:
        backend = _spm_backend(vocab) if vocab.kind == "llama" else _byte_level_backend(vocab)
        _add_special_tokens(backend, vocab)
        return cls(vocab, backend)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS where the file asks for them."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special and self._add_bos:
            ids.insert(0, self.bos_id)  # type: ignore[arg-type]
        if add_special and self._add_eos:
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; CONTROL tokens (BOS, EOS) render as nothing."""
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise ModelError(f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})")
        return str(self._backend.decode(list(ids), skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind} {VOCABULARY_KINDS[self.kind]}, {self.vocab_size} tokens)"


def _read_vocabulary(where: str, value: Callable[[str], Any]) -> _Vocabulary:
    kind = value("tokenizer.ggml.model")
    if kind is None:
        arch = value("general.architecture")
        raise ModelError(
            f"{where}: no vocabulary (architecture {arch!r}): metadata key 'tokenizer.ggml.model' is missing; "
            f"a tokenizer needs one of {_supported(VOCABULARY_KINDS)}"
        )
    if kind not in VOCABULARY_KINDS:
        raise ModelError(
            f"{where}: metadata key 'tokenizer.ggml.model' is {kind!r}; supported: {_supported(VOCABULARY_KINDS)}"
        )
    tokens = _list(where, value, "tokenizer.ggml.tokens", str)
    n = len(tokens)
    types = _list(where, value, "tokenizer.ggml.token_type", int, default=[TokenType.NORMAL] * n, length=n)
    pre = None
    merges: list[tuple[str, str]] = []
    scores: list[float] = []
    if kind == "llama":
        scores = _list(where, value, "tokenizer.ggml.scores", float, default=[0.0] * n, length=n)
    else:
        pre = value("tokenizer.ggml.pre")
        if pre not in PRE_TOKENIZER_REGEXES:
            raise ModelError(
                f"{where}: metadata key 'tokenizer.ggml.pre' is {pre!r}; supported: "
                f"{', '.join(map(repr, PRE_TOKENIZER_REGEXES))}"
            )
        merges = [_merge(where, line) for line in _list(where, value, "tokenizer.ggml.merges", str)]
    return _Vocabulary(
        where=where,
        kind=kind,
        tokens=tokens,
        types=[int(t) for t in types],
        scores=[float(s) for s in scores],
        merges=merges,
        pre=pre,
        bos_id=_token_id(where, value, "tokenizer.ggml.bos_token_id", n),
        eos_id=_token_id(where, value, "tokenizer.ggml.eos_token_id", n),
        unk_id=_token_id(where, value, "tokenizer.ggml.unknown_token_id", n),
        # llama.cpp's defaults: SentencePiece adds BOS and a leading space; byte-level BPE adds BOS
        # only for llama-bpe, and a leading space never.
        add_bos=bool(_flag(value, "tokenizer.ggml.add_bos_token", kind == "llama" or pre in _ADD_BOS_BY_DEFAULT)),
        add_eos=bool(_flag(value, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(_flag(value, "tokenizer.ggml.add_space_prefix", kind == "llama")),
    )


def _supported(kinds: dict[str, str]) -> str:
    return ", ".join(f"{name!r} ({what})" for name, what in kinds.items())


def _flag(value: Callable[[str], Any], key: str, default: bool) -> bool:
    found = value(key)
    return default if found is None else bool(found)


def _list(
    where: str,
    value: Callable[[str], Any],
    key: str,
    kind: type,
    default: list[Any] | None = None,
    length: int | None = None,
) -> list[Any]:
    found = value(key)
    if found is None:
        if default is None:
            raise ModelError(f"{where}: metadata key {key!r} is missing")
        return default
    accepted = (int, float) if kind is float else kind  # gguf may hand back whole scores as ints
    if not isinstance(found, list) or not all(isinstance(v, accepted) for v in found):
        raise ModelError(f"{where}: metadata key {key!r} is not an array of {kind.__name__}")
    if length is not None and len(found) != length:
        raise ModelError(f"{where}: metadata key {key!r} has {len(found)} entries; the vocabulary has {length} tokens")
    return found


def _token_id(where: str, value: Callable[[str], Any], key: str, n_vocab: int) -> int | None:
    found = value(key)
    if found is None:
        return None
    if not isinstance(found, int) or not 0 <= found < n_vocab:
        raise ModelError(f"{where}: metadata key {key!r} is {found!r}; expected a token id in 0..{n_vocab - 1}")
    return found


def _merge(where: str, line: str) -> tuple[str, str]:
    left, space, right = line.partition(" ")
    if not space or not left or not right:
        raise ModelError(f"{where}: metadata key 'tokenizer.ggml.merges' holds {line!r}; expected 'left right'")
    return left, right


def _spm_backend(vocab: _Vocabulary) -> _HfTokenizer:
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    backend = _HfTokenizer(
        models.BPE(
            ids,
            _spm_merges(vocab, ids),
            unk_token=None if vocab.unk_id is None else vocab.tokens[vocab.unk_id],
            byte_fallback=True,
        )
    )
    # The normalizer runs on each stretch of text between special tokens, so the space prefix
    # lands at the start and after every special token, as in llama.cpp.
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPM_SPACE)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    # U+2581 becomes a space after the byte tokens are joined, so one spelled in byte tokens
    # (a vocabulary without that piece) reads back as the space it stood for.
    decode_steps: list[decoders.Decoder] = [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace(SPM_SPACE, " ")]
    if vocab.add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _spm_merges(vocab: _Vocabulary, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best merged score first (ties: lower id first)."""
    ranked: list[tuple[float, int, str, str]] = []
    for merged, i in ids.items():
        if vocab.types[i] == TokenType.BYTE:
            continue
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _byte_level_backend(vocab: _Vocabulary) -> _HfTokenizer:
    assert vocab.pre is not None  # _read_vocabulary refuses a byte-level vocabulary without one
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    backend = _HfTokenizer(models.BPE(ids, vocab.merges, ignore_merges=vocab.pre in _IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEXES[vocab.pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_special_tokens(backend: _HfTokenizer, vocab: _Vocabulary) -> None:
    """CONTROL, UNKNOWN and USER_DEFINED tokens, matched verbatim before normalization and splitting.

    llama.cpp matches all three in the text; the first two render as nothing in decode.
    """
    control = [
        AddedToken(vocab.tokens[i], special=True, normalized=False)
        for i, kind in enumerate(vocab.types)
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN) and vocab.tokens[i]
    ]
    user = [
        AddedToken(vocab.tokens[i], special=False, normalized=False)
        for i, kind in enumerate(vocab.types)
        if kind == TokenType.USER_DEFINED and vocab.tokens[i]
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
