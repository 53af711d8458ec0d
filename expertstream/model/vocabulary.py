"""The vocabulary make-model writes: the kind of tokenizer the architecture's real files carry.

mixtral ("llama") files carry a SentencePiece vocabulary; the other architectures a byte-level
BPE ("gpt2") with the pre-tokenizer llama.cpp picks its split regex by. The BPE is trained
here, deterministically, with the ``tokenizers`` library on corpus.txt (prose, code, digits, a
little Unicode), so that text tokenizes the way a trained vocabulary's would: common words are
one token, rare ones several, and every byte has a token of its own.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from ..errors import InvalidArgument

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
SENTENCEPIECE_ARCHS = frozenset({"llama"})


@dataclass(frozen=True)
class ByteLevelStyle:
    """How an architecture's real files declare a byte-level BPE: pre-tokenizer and special tokens."""

    pre: str  # tokenizer.ggml.pre
    bos: str
    eos: str
    add_bos: bool


_QWEN2 = ByteLevelStyle("qwen2", bos="<|endoftext|>", eos="<|endoftext|>", add_bos=False)
_LLAMA_BPE = ByteLevelStyle("llama-bpe", bos="<|begin_of_text|>", eos="<|end_of_text|>", add_bos=True)
BYTE_LEVEL_STYLES: dict[str, ByteLevelStyle] = {
    "qwen2moe": _QWEN2,
    "qwen3moe": _QWEN2,
    "qwen3next": _QWEN2,
    "gpt-oss": ByteLevelStyle("gpt-4o", bos="<|startoftext|>", eos="<|endoftext|>", add_bos=False),
    # Real GLM-4.5 and DeepSeek files name pre-tokenizers of their own ("glm4", "deepseek-llm",
    # "deepseek-v3"); llama-bpe is the nearest one the project's tokenizer models.
    "glm4moe": _LLAMA_BPE,
    "deepseek2": _LLAMA_BPE,
}


def add_vocabulary(writer: gguf.GGUFWriter, arch: str, n_vocab: int) -> None:
    """The ``tokenizer.ggml.*`` keys of an ``n_vocab``-token vocabulary in ``arch``'s style."""
    if arch in SENTENCEPIECE_ARCHS:
        _add_sentencepiece(writer, n_vocab)
        return
    style = BYTE_LEVEL_STYLES.get(arch)
    if style is None:
        known = sorted(SENTENCEPIECE_ARCHS | BYTE_LEVEL_STYLES.keys())
        raise InvalidArgument(f"no vocabulary style for architecture {arch!r}; known: {', '.join(known)}")
    _add_byte_level(writer, style, n_vocab)


def _add_sentencepiece(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    """<unk>, <s>, </s>, the 256 byte tokens, then word pieces."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    # As a trained vocabulary has them: the space mark and single letters first, so that every word
    # piece can be merged up from its characters.
    singles = ["\u2581", *letters]
    pieces = singles + [f"\u2581{a}" for a in letters] + [f"\u2581{a}{b}" for a in letters for b in letters]
    if n_vocab < len(tokens) + 1 or n_vocab - len(tokens) > len(pieces):
        raise InvalidArgument(f"vocabulary size {n_vocab} is outside {len(tokens) + 1}..{len(tokens) + len(pieces)}")
    words = pieces[: n_vocab - len(tokens)]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(words))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*tokens, *words])
    writer.add_token_scores(scores)
    writer.add_token_types([*types, *[gguf.TokenType.NORMAL] * len(words)])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)


def _add_byte_level(writer: gguf.GGUFWriter, style: ByteLevelStyle, n_vocab: int) -> None:
    """The trained tokens, then the special ones (as real files have them, after the merged pieces)."""
    specials = list(dict.fromkeys([style.bos, style.eos]))
    tokens, merges = trained_byte_level_bpe(n_vocab - len(specials))
    all_tokens = [*tokens, *specials]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(style.pre)
    writer.add_token_list(all_tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(specials))
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(all_tokens.index(style.bos))
    writer.add_eos_token_id(all_tokens.index(style.eos))
    writer.add_add_bos_token(style.add_bos)


@functools.cache
def trained_byte_level_bpe(n_tokens: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A byte-level BPE of ``n_tokens`` tokens trained on corpus.txt: (tokens by id, merges by rank).

    The first 256 tokens are the byte characters (GPT-2's byte-to-unicode map), the rest one per
    merge, in merge order. The same ``n_tokens`` gives the same vocabulary in every process.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if n_tokens < len(alphabet):
        raise InvalidArgument(f"a byte-level vocabulary needs at least {len(alphabet)} tokens besides BOS/EOS")
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=n_tokens, initial_alphabet=alphabet, show_progress=False)
    model.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True), trainer)
    state = json.loads(model.model.__getstate__())
    vocab: dict[str, int] = state["vocab"]
    if len(vocab) < n_tokens:
        raise InvalidArgument(
            f"byte-level vocabulary of {n_tokens} tokens asked; {CORPUS_PATH.name} trains at most {len(vocab)}"
        )
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in state["merges"])
    return tokens, merges
