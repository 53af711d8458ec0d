"""Compiled kernel images on disk, so that a new process loads what an earlier one compiled.

Compiling the kernels' source with NVRTC or hipRTC takes tens of seconds; loading an image takes
milliseconds. An entry's name is the sha256 of everything that decides the image: the source,
the architecture, the compile options, the compiler's version, the driver's version and the
bindings' (which carry the runtime). An entry is written to a temporary file in the same folder
and renamed into place, so a reader sees a whole entry or none; each holds the sha256 of its
image, and one that cannot be read or does not match is ignored (and compiled again).

The folder is ``$EXPERTSTREAM_KERNEL_CACHE`` when set (``0`` turns the cache off), else
``$XDG_CACHE_HOME/expertstream/kernels`` (``~/.cache/expertstream/kernels``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "EXPERTSTREAM_KERNEL_CACHE"
_MAGIC = b"expertstream kernel image 1\n"
_DIGEST_BYTES = 32


def cache_folder(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where images are kept, or None when the cache is off."""
    value = environ.get(CACHE_ENV, "").strip()
    if value == "0":
        return None
    if value:
        return Path(value).expanduser()
    base = environ.get("XDG_CACHE_HOME", "").strip() or "~/.cache"
    return Path(base).expanduser() / "expertstream" / "kernels"


def image_key(*parts: str) -> str:
    """The entry name for an image that ``parts`` (source, arch, options, versions) decide."""
    digest = hashlib.sha256()
    for part in parts:
        encoded = part.encode()
        digest.update(len(encoded).to_bytes(8, "little"))  # no two lists of parts hash alike
        digest.update(encoded)
    return digest.hexdigest()


class ImageCache:
    """One folder of images by key; every failure to read or write is a miss, logged at DEBUG."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.bin"

    def load(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.debug("kernel cache: cannot read %s (%s): compiling", path, exc)
            return None
        head = len(_MAGIC) + _DIGEST_BYTES
        image = data[head:]
        if (
            not data.startswith(_MAGIC)
            or len(data) <= head
            or hashlib.sha256(image).digest() != data[len(_MAGIC) : head]
        ):
            log.debug("kernel cache: %s is damaged: compiling", path)
            return None
        return image

    def store(self, key: str, image: bytes) -> None:
        path = self._path(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_MAGIC + hashlib.sha256(image).digest() + image)
                os.replace(temporary, path)  # atomic: readers see the old entry, or none, or this one
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as exc:
            log.debug("kernel cache: cannot write %s (%s): the next process compiles again", path, exc)


def open_cache(environ: Mapping[str, str] = os.environ) -> ImageCache | None:
    folder = cache_folder(environ)
    return None if folder is None else ImageCache(folder)


__all__ = ["CACHE_ENV", "ImageCache", "cache_folder", "image_key", "open_cache"]
