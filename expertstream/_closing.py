"""One way to be a context manager: ``with obj:`` calls ``obj.close()`` on the way out."""

from __future__ import annotations

from typing import TypeVar

_C = TypeVar("_C", bound="Closing")


class Closing:
    """Base of every object that holds resources until ``close()``; close is idempotent."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
