"""The prompt every logits check feeds both tools: the project's corpus in a file's own vocabulary.

python3 -m microbench.llamacpp_logits.prompt MODEL COUNT    -> COUNT token ids, one a line

The corpus (expertstream/model/corpus.txt) is repeated until it gives COUNT tokens; BOS first where
the vocabulary adds one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from expertstream.engine.tokenizer import Tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "expertstream" / "model" / "corpus.txt"


def corpus_tokens(model: str | Path, count: int) -> list[int]:
    """The first ``count`` tokens of the corpus, repeated as often as it takes."""
    tokenizer = Tokenizer.from_path(model)
    text = CORPUS.read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    while len(ids) < count:
        ids += tokenizer.encode(text, add_special=False)
    return ids[:count]


def main(argv: list[str]) -> int:
    model, count = argv
    print(*corpus_tokens(model, int(count)), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
