"""Compare expertstream's tokens with llama.cpp's llama-tokenize, line by line over a corpus.

python3 tools/tokenize_check.py MODEL.gguf CORPUS.txt [--llama-tokenize PATH] [--no-bos] [--show N]

Each non-empty line of CORPUS.txt is tokenized by expertstream.engine.tokenizer and by
``llama-tokenize -m MODEL.gguf -p LINE --ids --log-disable`` (which prints the ids as a list,
e.g. ``[1, 15043, 3186]``). ``--no-bos`` passes --no-bos to llama-tokenize and encodes without
BOS/EOS here. Prints the lines whose ids differ (the first N in full) and exits 1 if any do.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from expertstream.engine.tokenizer import Tokenizer


def llama_tokenize(binary: str, model: Path, text: str, no_bos: bool) -> list[int]:
    command = [binary, "-m", str(model), "-p", text, "--ids", "--log-disable"]
    if no_bos:
        command.append("--no-bos")
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    # The ids are the last line that reads as a list; model-loading chatter may come first.
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("[") and line.endswith("]"):
            return [int(i) for i in ast.literal_eval(line)]
    raise RuntimeError(f"no id list in llama-tokenize's output for {text!r}: {result.stdout[-500:]!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--llama-tokenize", default="llama-tokenize", help="the llama-tokenize binary")
    parser.add_argument("--no-bos", action="store_true", help="compare without BOS/EOS")
    parser.add_argument("--show", type=int, default=10, help="print this many differing lines in full")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_path(args.model)
    lines = [line for line in args.corpus.read_text(encoding="utf-8").splitlines() if line]
    differing = 0
    for number, line in enumerate(lines, 1):
        ours = tokenizer.encode(line, add_special=not args.no_bos)
        theirs = llama_tokenize(args.llama_tokenize, args.model, line, args.no_bos)
        if ours != theirs:
            differing += 1
            if differing <= args.show:
                print(f"line {number}: {line!r}\n  expertstream:   {ours}\n  llama-tokenize: {theirs}")
    print(f"{differing} of {len(lines)} lines differ ({tokenizer})")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
