"""The make-model subcommand writes the file and reports its size and shapes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from expertstream.model import MoeModel, commands


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_make_model_command_writes_and_describes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.gguf"
    args = _parse(["make-model", "--preset", "tiny", "--type", "bf16", "-o", str(out), "--layers", "1", "--seed", "5"])
    assert args.run(args) == 0
    text = capsys.readouterr().out
    assert f"{out}: {out.stat().st_size} bytes" in text
    assert "blk.0.ffn_down_exps.weight: BF16 ne=(192, 256, 8)" in text
    with MoeModel.open(out) as model:
        assert model.n_layer == 1


def test_make_model_command_rejects_unknown_type() -> None:
    with pytest.raises(SystemExit):
        _parse(["make-model", "--preset", "tiny", "--type", "Q7_K", "-o", "x.gguf"])
