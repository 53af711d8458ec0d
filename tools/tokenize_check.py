"""Compare expertstream's tokens with llama.cpp's llama-tokenize, text by text over a corpus.

python3 tools/tokenize_check.py MODEL.gguf CORPUS [--llama-tokenize PATH] [--no-bos] [--show N]

CORPUS is a .json file holding an array of strings (texts may then hold newlines, tabs and
carriage returns) or any other text file, whose non-empty lines are the texts. Each text is
tokenized by expertstream.engine.tokenizer and by ``llama-tokenize -m MODEL.gguf --stdin
--no-escape --ids --log-disable``: the text goes in on standard input, byte for byte, since
``-p`` would turn a backslash sequence such as ``\\n`` in code into a newline. llama-tokenize
parses special tokens in the text, as ``encode`` does. ``--no-bos`` passes --no-bos and encodes
without BOS/EOS here. Prints the texts whose ids differ (the first N in full), then one summary
line, and exits 1 if any differ.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

from expertstream.engine.tokenizer import Tokenizer


def llama_tokenize(binary: str, model: Path, text: str, no_bos: bool) -> list[int]:
    command = [binary, "-m", str(model), "--stdin", "--no-escape", "--ids", "--log-disable"]
    if no_bos:
        command.append("--no-bos")
    result = subprocess.run(command, input=text.encode(), capture_output=True, check=True)
    # The ids are the last line that reads as a list; model-loading chatter may come first.
    for line in reversed(result.stdout.decode(errors="replace").splitlines()):
        if line.startswith("[") and line.endswith("]"):
            return [int(i) for i in ast.literal_eval(line)]
    raise RuntimeError(f"no id list in llama-tokenize's output for {text!r}: {result.stdout[-500:]!r}")


def read_corpus(path: Path) -> list[str]:
    """The texts of a .json array of strings, or the non-empty lines of any other file."""
    if path.suffix == ".json":
        texts = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
            raise SystemExit(f"{path}: expected a JSON array of non-empty strings")
        return texts
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--llama-tokenize", default="llama-tokenize", help="the llama-tokenize binary")
    parser.add_argument("--no-bos", action="store_true", help="compare without BOS/EOS")
    parser.add_argument("--show", type=int, default=10, help="print this many differing texts in full")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_path(args.model)
    texts = read_corpus(args.corpus)
    differing = 0
    for number, text in enumerate(texts, 1):
        ours = tokenizer.encode(text, add_special=not args.no_bos)
        theirs = llama_tokenize(args.llama_tokenize, args.model, text, args.no_bos)
        if ours != theirs:
            differing += 1
            if differing <= args.show:
                print(f"text {number}: {text!r}\n  expertstream:   {ours}\n  llama-tokenize: {theirs}")
    pre = f", pre-tokenizer {tokenizer.pre}" if tokenizer.pre else ""
    mode = "no BOS/EOS" if args.no_bos else "BOS/EOS as the file asks"
    print(
        f"{args.model.name} ({tokenizer}{pre}; {mode}): "
        f"{len(texts)} texts compared, {len(texts) - differing} equal, {differing} differ"
    )
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
