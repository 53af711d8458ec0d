"""The `expertstream` command line: every command, its argument parsing and output formats."""

from .main import main

__all__ = ["main"]
