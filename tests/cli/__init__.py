"""Tests of the command line; ``run_main`` runs one command as a user would."""

from __future__ import annotations

import pytest

from expertstream.cli import main


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The exit status, stdout and stderr of ``expertstream ARGV`` (never a traceback)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err
