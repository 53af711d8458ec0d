"""The make-model subcommand writes the file and reports its size and shapes."""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path

import gguf
import pytest

from expertstream.cli import main
from expertstream.cli import make_model as commands
from expertstream.model import MoeModel, make_model


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_make_model_command_writes_and_describes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.gguf"
    args = _parse(["make-model", "--preset", "tiny", "--type", "bf16", "-o", str(out), "--layers", "1", "--seed", "5"])
    assert args.run(args, "expertstream make-model") == 0
    text = capsys.readouterr().out
    assert f"{out}: {out.stat().st_size} bytes" in text
    assert "blk.0.ffn_down_exps.weight: BF16 ne=(192, 256, 8)" in text
    with MoeModel.open(out) as model:
        assert model.n_layer == 1


def test_make_model_command_rejects_unknown_type() -> None:
    with pytest.raises(SystemExit):
        _parse(["make-model", "--preset", "tiny", "--type", "Q7_K", "-o", "x.gguf"])


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["make-model", "--preset", "tiny", "--layers", "1", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return code, err


def test_make_model_refuses_a_missing_folder_or_a_folder_as_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(capsys, "-o", str(tmp_path / "missing" / "m.gguf")) == (
        2,
        f"expertstream: error: -o {tmp_path / 'missing' / 'm.gguf'}: folder {tmp_path / 'missing'} does not exist\n",
    )
    code, err = _main(capsys, "-o", str(tmp_path))
    assert code == 2 and "is a folder" in err


@pytest.mark.parametrize("scale", ["0", "-1", "nan", "inf"])
def test_make_model_refuses_a_residual_scale_that_is_not_a_positive_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scale: str
) -> None:
    out = tmp_path / "m.gguf"
    code, err = _main(capsys, "-o", str(out), "--residual-scale", scale)
    assert code == 2 and "the residual scale must be a positive number" in err
    assert not out.exists()


def test_make_model_refuses_a_residual_scale_its_types_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.gguf"
    code, err = _main(capsys, "-o", str(out), "--type", "F16", "--residual-scale", "0.001")
    assert code == 2 and "blk.0.attn_output.weight (F16) would have values of RMS" in err
    assert "choose a residual scale nearer 1" in err and not out.exists()


def test_make_model_with_a_residual_scale_writes_another_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain, scaled = tmp_path / "plain.gguf", tmp_path / "scaled.gguf"
    assert _main_ok(capsys, "-o", str(plain)) == 0
    assert _main_ok(capsys, "-o", str(scaled), "--residual-scale", "0.25") == 0
    assert plain.stat().st_size == scaled.stat().st_size and plain.read_bytes() != scaled.read_bytes()


def _main_ok(capsys: pytest.CaptureFixture[str], *argv: str) -> int:
    code = main(["make-model", "--preset", "tiny", "--layers", "1", *argv])
    capsys.readouterr()
    return code


def test_make_model_reports_a_failed_write_in_one_line_and_removes_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: gguf.GGUFWriter, tensor: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
    out = tmp_path / "m.gguf"
    code, err = _main(capsys, "-o", str(out))
    assert code == 2 and f"cannot write {out}: No space left on device" in err
    assert not out.exists()


def test_make_model_into_a_read_only_place_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    code, err = _main(capsys, "-o", str(tmp_path / "m.gguf"))
    assert code == 2 and "not writable" in err


def test_a_made_model_is_on_disk_before_it_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard is flushed before make_model returns: a benchmark reading the file's mapping
    must not run while its pages are still dirty."""
    flushed: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    first = make_model("tiny", "Q8_0", tmp_path / "split.gguf", split_max_tensors=10)
    shards = sorted(str(p) for p in tmp_path.glob("split-*.gguf"))
    assert len(shards) > 1 and str(first) in shards
    assert sorted(flushed) == shards


def test_a_file_system_without_fsync_still_gets_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", fsync)
    path = make_model("tiny", "Q4_0", tmp_path / "tiny.gguf")
    with MoeModel.open(path) as model:
        assert model.n_layer == 2
    assert "not flushed to disk" in caplog.text and str(path) in caplog.text
