"""Mistakes on the command line end in one line that says what is wrong, before any work, exit status 2."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import expertstream.cli.prefill as prefill_command
import expertstream.cli.tune as tune_command
from expertstream.cli.tools import writable_path

from . import run_main as _run

SMALL = ["-p", "16", "-ub", "16", "--slots", "0", "-r", "1"]
UNWRITABLE = "/proc/expertstream-test.json"  # a folder that passes a permission check, where no file can be made


def _never(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started before the output path was checked")

    monkeypatch.setattr(module, name, fail)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    ("argv", "module", "work"),
    [
        (["prefill", *SMALL, "--trace", UNWRITABLE], prefill_command, "measure"),
        (["tune", "--backend", "sim", "-o", UNWRITABLE], tune_command, "tune"),
        (["plot", "results.json", "-o", UNWRITABLE], None, None),
    ],
    ids=["prefill --trace", "tune -o", "plot -o"],
)
def test_an_output_that_cannot_be_created_is_refused_first(
    argv: list[str],
    module: object,
    work: str | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if work is not None:
        _never(monkeypatch, module, work)
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"expertstream: error: {argv[-2]} {UNWRITABLE}: not writable (No such file or directory)"
    ]


def test_checking_an_output_leaves_it_as_it_was(tmp_path: Path) -> None:
    existing = tmp_path / "kept.json"
    existing.write_text("before")
    assert writable_path(existing, "-o") == existing and existing.read_text() == "before"
    new = tmp_path / "new.json"
    assert writable_path(new, "-o") == new and not new.exists()


@pytest.mark.parametrize("command", ["prefill", "bench"])
def test_a_bad_value_is_one_line_naming_the_command_as_typed(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, command, "--slots", "-1")
    assert code == 2
    assert err.strip().splitlines() == [
        f"expertstream {command}: error: argument --slots: slots must be 0 (off) or 2..8, got -1 "
        f"(see expertstream {command} --help)"
    ]


def test_verbose_is_taken_after_the_command_too(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    levels: list[int] = []
    monkeypatch.setattr(logging, "basicConfig", lambda level, **kwargs: levels.append(level))
    code, _, _ = _run(capsys, "-v", "prefill", str(tiny_path), *SMALL, "-v")
    assert code == 0 and levels == [logging.DEBUG]
    code, _, _ = _run(capsys, "prefill", str(tiny_path), *SMALL, "--verbose")
    assert code == 0 and levels[-1] == logging.INFO


@pytest.mark.parametrize(
    "argv",
    [["demo"], ["prefill", *SMALL], ["tune", "-o", "never-written.json"]],
    ids=["demo", "prefill", "tune"],
)
def test_an_unknown_backend_in_the_environment_is_named(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "bogus")
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.startswith("expertstream: error: EXPERTSTREAM_BACKEND=bogus names no backend")
    assert not (tmp_path / "never-written.json").exists()


def test_info_lists_what_it_can_then_exits_as_the_commands_do(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", "bogus")
    code, out, err = _run(capsys, "info")
    assert code == 2 and "sim   usable" in out
    assert err.strip() == (
        "expertstream info: error: EXPERTSTREAM_BACKEND=bogus names no backend; known: cuda, hip, sim "
        "(set it to one of them or unset it)"
    )
    code, out, _ = _run(capsys, "info", "--json")
    assert code == 2 and json.loads(out)["auto"] is None


def test_info_help_says_when_it_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "info", "--help")
    assert code == 0 and "Exit status 2, after the list, when $EXPERTSTREAM_BACKEND names" in " ".join(out.split())


def test_a_model_that_is_no_file_says_what_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "prefill", "-m", str(tmp_path), *SMALL)
    assert code == 2 and err.strip() == f"expertstream: error: {tmp_path}: is a directory"
    code, _, err = _run(capsys, "prefill", "-m", "/dev/null", *SMALL)
    assert code == 2 and err.strip() == "expertstream: error: /dev/null: is not a regular file"
    code, _, err = _run(capsys, "prefill", "-m", str(tmp_path / "none.gguf"), *SMALL)
    assert code == 2 and err.strip() == f"expertstream: error: {tmp_path / 'none.gguf'}: no such file"


def test_help_says_where_the_ring_microbenchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "prefill", "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "`python -m microbench.ring_limits`, run from the root of a clone of the repository" in text


def test_two_output_formats_asked_at_once_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "prefill", "--backend", "sim", "--timing-only", "--json", "-o", "csv")
    assert code == 2 and out == "" and "--json and -o csv ask for two formats" in err
    code, out, _ = _run(capsys, "prefill", "--backend", "sim", "--timing-only", "--json", "-o", "json")
    assert code == 0 and out.lstrip().startswith("{")
