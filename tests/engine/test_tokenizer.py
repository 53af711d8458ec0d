"""The tokenizer built from a GGUF file's own vocabulary: SentencePiece and byte-level BPE."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from expertstream.engine.tokenizer import Tokenizer, TokenType
from expertstream.model import ModelError, MoeModel, make_model

ROUND_TRIPS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading, trailing and   inner runs of spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "digits 0123456789 and 3.14159 and 1,000,000",
    "Unicode: héllo wörld, naïve café, 日本語, Ελληνικά, emoji 🙂🚀",
    "def f(x):\n    return {'a': [x, x ** 2]}  # code\n",
    "",
]

SPM_SPACE = "\u2581"


def write_vocabulary(path: Path, fill: Callable[[gguf.GGUFWriter], None], arch: str = "llama") -> Path:
    """A GGUF file holding metadata only: the architecture and what ``fill`` adds."""
    writer = gguf.GGUFWriter(path, arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()  # no tensors: pads the file to the data alignment
    writer.close()
    return path


# --- SentencePiece ("llama"): the vocabulary make-model writes for mixtral -----------------------


@pytest.fixture(scope="module")
def mixtral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny-mixtral", "Q4_0", tmp_path_factory.mktemp("mixtral") / "mixtral.gguf")


@pytest.fixture(scope="module")
def tiny_tokenizer(mixtral_path: Path) -> Tokenizer:
    with MoeModel.open(mixtral_path) as model:
        return Tokenizer.from_model(model)


def test_tiny_preset_vocabulary_is_read(tiny_tokenizer: Tokenizer) -> None:
    assert (tiny_tokenizer.kind, tiny_tokenizer.pre, tiny_tokenizer.vocab_size) == ("llama", None, 512)
    assert (tiny_tokenizer.bos_id, tiny_tokenizer.eos_id) == (1, 2)


def test_from_path_reads_the_same_vocabulary(mixtral_path: Path, tiny_tokenizer: Tokenizer) -> None:
    assert Tokenizer.from_path(mixtral_path).encode(ROUND_TRIPS[1]) == tiny_tokenizer.encode(ROUND_TRIPS[1])


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_tiny_preset_round_trips(tiny_tokenizer: Tokenizer, text: str) -> None:
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text, add_special=False)) == text


def test_bos_is_added_once_when_asked(tiny_tokenizer: Tokenizer) -> None:
    with_bos = tiny_tokenizer.encode("ab")
    without = tiny_tokenizer.encode("ab", add_special=False)
    assert with_bos == [1, *without]
    assert tiny_tokenizer.encode("") == [1]
    assert tiny_tokenizer.encode("", add_special=False) == []
    assert tiny_tokenizer.decode([1, *without, 2]) == "ab"


def test_byte_fallback_spells_uncovered_characters_in_byte_tokens(tiny_tokenizer: Tokenizer) -> None:
    # The space prefix is a piece of its own (the first after the 256 byte tokens); e-acute is not,
    # so it is spelled in its UTF-8 bytes, byte b being token 3 + b after <unk>, <s>, </s>.
    space = 3 + 256
    assert tiny_tokenizer.encode("\u00e9", add_special=False) == [space, 3 + 0xC3, 3 + 0xA9]


def test_control_tokens_in_text_are_matched_and_not_rendered(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("<s>x</s>", add_special=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tiny_tokenizer.decode(ids) == "x"


def test_unknown_token_in_text_is_matched_and_not_rendered(tiny_tokenizer: Tokenizer) -> None:
    # llama.cpp parses UNKNOWN tokens in the text as it does CONTROL ones.
    ids = tiny_tokenizer.encode("a<unk>b", add_special=False)
    assert 0 in ids
    assert "<unk>" not in tiny_tokenizer.decode(ids)


def test_out_of_range_id_is_refused(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ModelError, match="token id 512 is outside the vocabulary"):
        tiny_tokenizer.decode([512])


def spm_vocabulary(pieces: dict[str, float], user: tuple[str, ...] = ()) -> Callable[[gguf.GGUFWriter], None]:
    """<unk>, <s>, </s>, 256 byte tokens, then ``pieces`` with their scores and USER_DEFINED ``user``."""

    def fill(writer: gguf.GGUFWriter) -> None:
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *user]
        types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
        types += [TokenType.NORMAL] * len(pieces) + [TokenType.USER_DEFINED] * len(user)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * 259 + list(pieces.values()) + [0.0] * len(user))
        writer.add_token_types([int(t) for t in types])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    return fill


def pieces_of(tokenizer: Tokenizer, text: str) -> list[str]:
    return [tokenizer._backend.id_to_token(i) for i in tokenizer.encode(text, add_special=False)]


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ({"ab": -1.0, "bc": -2.0}, [SPM_SPACE, "ab", "c"]),
        ({"ab": -2.0, "bc": -1.0}, [SPM_SPACE, "a", "bc"]),
    ],
)
def test_spm_merges_the_best_scoring_pair_first(tmp_path: Path, scores: dict[str, float], expected: list[str]) -> None:
    pieces = {SPM_SPACE: -5.0, "a": -6.0, "b": -6.0, "c": -6.0, **scores}
    tokenizer = Tokenizer.from_path(write_vocabulary(tmp_path / "spm.gguf", spm_vocabulary(pieces)))
    assert pieces_of(tokenizer, "abc") == expected


def test_spm_space_prefix_and_whole_pieces(tmp_path: Path) -> None:
    letters = {c: -10.0 for c in "helowrd"}
    pieces = {SPM_SPACE: -9.0, **letters, f"{SPM_SPACE}hello": -1.0, f"{SPM_SPACE}world": -1.5}
    pieces |= {f"{SPM_SPACE}h": -3.0, "el": -3.0, "lo": -3.0, f"{SPM_SPACE}hel": -2.0, f"{SPM_SPACE}w": -3.0}
    pieces |= {"or": -3.0, "ld": -3.0, f"{SPM_SPACE}wor": -2.0}
    tokenizer = Tokenizer.from_path(write_vocabulary(tmp_path / "spm.gguf", spm_vocabulary(pieces)))
    assert pieces_of(tokenizer, "hello world") == [f"{SPM_SPACE}hello", f"{SPM_SPACE}world"]
    for text in ROUND_TRIPS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_spm_user_defined_tokens_are_matched_and_rendered(tmp_path: Path) -> None:
    pieces = {SPM_SPACE: -1.0, "a": -2.0}
    path = write_vocabulary(tmp_path / "spm.gguf", spm_vocabulary(pieces, user=("<tool>",)))
    tokenizer = Tokenizer.from_path(path)
    tool = tokenizer.vocab_size - 1
    ids = tokenizer.encode("a<tool>a", add_special=False)
    assert tool in ids
    # After a special token the space prefix comes back, as in llama.cpp.
    assert pieces_of(tokenizer, "a<tool>a") == [SPM_SPACE, "a", "<tool>", SPM_SPACE, "a"]
    assert "<tool>" in tokenizer.decode(ids)


# --- byte-level BPE ("gpt2"): the vocabulary make-model writes for the other architectures ------

# preset -> (tokenizer.ggml.pre, BOS text, EOS text, whether BOS is added)
MADE_BYTE_LEVEL = {
    "tiny": ("qwen2", "<|endoftext|>", "<|endoftext|>", False),
    "tiny-gpt-oss": ("gpt-4o", "<|startoftext|>", "<|endoftext|>", False),
    "tiny-glm4moe": ("llama-bpe", "<|begin_of_text|>", "<|end_of_text|>", True),
}


@pytest.fixture(scope="module", params=sorted(MADE_BYTE_LEVEL))
def made_bpe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Tokenizer]:
    path = make_model(request.param, "Q4_0", tmp_path_factory.mktemp("made") / "m.gguf")
    with MoeModel.open(path) as model:
        return request.param, Tokenizer.from_model(model)


def test_made_byte_level_vocabulary_is_read(made_bpe: tuple[str, Tokenizer]) -> None:
    preset, tokenizer = made_bpe
    pre, bos, eos, add_bos = MADE_BYTE_LEVEL[preset]
    assert (tokenizer.kind, tokenizer.pre, tokenizer.vocab_size) == ("gpt2", pre, 512)
    # The special tokens close the vocabulary, as in real files.
    specials = list(dict.fromkeys([bos, eos]))
    assert tokenizer.decode([tokenizer.vocab_size - len(specials)]) == ""  # CONTROL: not rendered
    assert tokenizer.encode(bos + eos, add_special=False) == [tokenizer.bos_id, tokenizer.eos_id]
    assert (tokenizer.encode("x")[0] == tokenizer.bos_id) is add_bos


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_made_byte_level_round_trips(made_bpe: tuple[str, Tokenizer], text: str) -> None:
    _, tokenizer = made_bpe
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_made_byte_level_vocabulary_merges_common_words(made_bpe: tuple[str, Tokenizer]) -> None:
    _, tokenizer = made_bpe
    text = "The experts of the model sit in host memory and travel to the device."
    assert len(tokenizer.encode(text, add_special=False)) < len(text) // 2


# --- byte-level BPE ("gpt2") ----------------------------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "HelloWorld and helloWorld: camelCase words in code, 123 456 789 123456 numbers.",
    "def main():\n    print('hello, world')  # it's done\n",
    "We're here; they'll come, you've seen it, I'd say. I'm sure.",
    "Unicode text: café, naïve, 日本語, emoji 🙂.",
]
SPECIALS = {
    "<|endoftext|>": TokenType.CONTROL,
    "<|im_start|>": TokenType.CONTROL,
    "<tool_call>": TokenType.USER_DEFINED,
}


@pytest.fixture(scope="module")
def trained_bpe() -> tuple[list[str], list[str]]:
    """A small byte-level BPE trained on CORPUS: its tokens by id and its merges by rank."""
    trainer_model = HfTokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer_model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainer_model.train_from_iterator(CORPUS * 4, trainer)
    state: dict[str, Any] = json.loads(trainer_model.model.__getstate__())
    vocab: dict[str, int] = state["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return tokens, merges


def bpe_vocabulary(
    tokens: list[str], merges: list[str], pre: str | None, add_bos: bool = False
) -> Callable[[gguf.GGUFWriter], None]:
    def fill(writer: gguf.GGUFWriter) -> None:
        all_tokens = [*tokens, *SPECIALS]
        writer.add_tokenizer_model("gpt2")
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(all_tokens)
        writer.add_token_types([int(TokenType.NORMAL)] * len(tokens) + [int(t) for t in SPECIALS.values()])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(len(tokens))
        writer.add_eos_token_id(len(tokens))
        writer.add_add_bos_token(add_bos)

    return fill


@pytest.fixture(scope="module", params=["qwen2", "llama-bpe", "gpt-4o"])
def bpe_tokenizer(
    request: pytest.FixtureRequest, trained_bpe: tuple[list[str], list[str]], tmp_path_factory: pytest.TempPathFactory
) -> Tokenizer:
    path = tmp_path_factory.mktemp("bpe") / "bpe.gguf"
    return Tokenizer.from_path(write_vocabulary(path, bpe_vocabulary(*trained_bpe, pre=request.param), "qwen2moe"))


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_byte_level_round_trips(bpe_tokenizer: Tokenizer, text: str) -> None:
    assert bpe_tokenizer.decode(bpe_tokenizer.encode(text)) == text


def test_byte_level_merges_are_used(bpe_tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    assert len(bpe_tokenizer.encode(text)) < len(text.encode()) // 2


def test_byte_level_special_tokens_are_matched_first(bpe_tokenizer: Tokenizer) -> None:
    first_special = bpe_tokenizer.vocab_size - len(SPECIALS)
    ids = bpe_tokenizer.encode("<|im_start|>hello<tool_call>x<|endoftext|>")
    assert ids[0] == first_special + 1
    assert first_special + 2 in ids
    assert ids[-1] == first_special
    # CONTROL tokens render as nothing, USER_DEFINED ones as their text.
    assert bpe_tokenizer.decode(ids) == "hello<tool_call>x"


def test_byte_level_bos_follows_the_file(
    trained_bpe: tuple[list[str], list[str]], bpe_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    assert bpe_tokenizer.encode("hello") == bpe_tokenizer.encode("hello", add_special=False)
    path = write_vocabulary(tmp_path / "bos.gguf", bpe_vocabulary(*trained_bpe, pre="qwen2", add_bos=True))
    with_bos = Tokenizer.from_path(path)
    assert with_bos.encode("hello") == [with_bos.bos_id, *with_bos.encode("hello", add_special=False)]


def pre_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """The pieces the pre-tokenizer's regex cuts ``text`` into, before any merge."""
    pre_tokenizer = tokenizer._backend.pre_tokenizer
    assert pre_tokenizer is not None
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("pre", "text", "expected"),
    [
        ("qwen2", "123456", ["1", "2", "3", "4", "5", "6"]),
        ("llama-bpe", "123456", ["123", "456"]),
        ("gpt-4o", "123456", ["123", "456"]),
        ("qwen2", "HelloWorld it's", ["HelloWorld", "Ġit", "'s"]),
        ("llama-bpe", "HelloWorld it's", ["HelloWorld", "Ġit", "'s"]),
        # o200k cuts where a capital follows lower case and keeps a contraction on its word.
        ("gpt-4o", "HelloWorld it's", ["Hello", "World", "Ġit's"]),
        ("qwen2", "a\n\n  b", ["a", "ĊĊ", "Ġ", "Ġb"]),
    ],
)
def test_pre_tokenizer_regexes(
    trained_bpe: tuple[list[str], list[str]], tmp_path: Path, pre: str, text: str, expected: list[str]
) -> None:
    tokenizer = Tokenizer.from_path(write_vocabulary(tmp_path / "pre.gguf", bpe_vocabulary(*trained_bpe, pre=pre)))
    assert pre_tokens(tokenizer, text) == expected


# --- errors --------------------------------------------------------------------------------------


def test_file_without_vocabulary_names_the_architecture(tmp_path: Path) -> None:
    path = write_vocabulary(tmp_path / "none.gguf", lambda writer: None, arch="qwen3moe")
    with pytest.raises(ModelError, match=r"no vocabulary \(architecture 'qwen3moe'\).*'tokenizer.ggml.model'.*'llama'"):
        Tokenizer.from_path(path)


def test_unknown_vocabulary_kind_is_named(tmp_path: Path) -> None:
    path = write_vocabulary(tmp_path / "bert.gguf", lambda writer: writer.add_tokenizer_model("bert"))
    with pytest.raises(ModelError, match=r"'tokenizer.ggml.model' is 'bert'; supported: 'llama' .*'gpt2'"):
        Tokenizer.from_path(path)


@pytest.mark.parametrize("pre", ["falcon", None])
def test_unknown_pre_tokenizer_is_named(
    trained_bpe: tuple[list[str], list[str]], tmp_path: Path, pre: str | None
) -> None:
    path = write_vocabulary(tmp_path / "pre.gguf", bpe_vocabulary(*trained_bpe, pre=pre))
    expected = rf"'tokenizer.ggml.pre' is {pre!r}; supported: 'qwen2', 'llama-bpe', 'gpt-4o'"
    with pytest.raises(ModelError, match=expected):
        Tokenizer.from_path(path)
