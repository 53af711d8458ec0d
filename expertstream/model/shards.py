"""Open a GGUF model that gguf-split wrote as several files, or a single file, as a list of shards.

gguf-split names the shards ``PREFIX-00001-of-00003.gguf`` .. ``PREFIX-00003-of-00003.gguf``
and writes ``split.no`` (0-based), ``split.count`` and ``split.tensors.count`` (tensors in all
shards) into each; the model's other metadata lives in the first. Every shard is mapped on its
own and a tensor belongs to exactly one of them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader, ReaderTensor

from .metadata import Metadata, read_gguf
from .schema import ModelError

log = logging.getLogger(__name__)

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"

_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_path(prefix: str, index: int, count: int) -> str:
    """The gguf-split file name of shard ``index`` (0-based) of ``count``."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


@dataclass(frozen=True)
class Shard:
    index: int
    path: Path
    reader: GGUFReader
    metadata: Metadata


@dataclass(frozen=True)
class ShardedTensor:
    shard: int
    tensor: ReaderTensor


def open_shards(path: Path) -> tuple[list[Shard], dict[str, ShardedTensor]]:
    """The shards of the model at ``path`` (its first shard, or a single file) and its tensors by name."""
    first = _open(path, 0)
    count = first.metadata.integer(SPLIT_COUNT, default=1)
    if count == 0:
        raise ModelError(f"{path}: metadata key {SPLIT_COUNT!r} is 0")
    named = _SHARD_NAME.match(path.name)
    if first.metadata.has(SPLIT_NO) and first.metadata.integer(SPLIT_NO) != 0:
        raise ModelError(
            f"{path}: this is shard {first.metadata.integer(SPLIT_NO) + 1} of {count}; "
            f"{_first_name_hint(path, named, count)}"
        )
    if named is not None and int(named["count"]) != count:
        raise ModelError(f"{path}: the name says {int(named['count'])} shards but {SPLIT_COUNT!r} is {count}")
    shards = [first]
    if count > 1:
        if named is None:
            raise ModelError(
                f"{path}: {SPLIT_COUNT!r} is {count} but the file name does not follow the split naming "
                f"PREFIX-00001-of-{count:05d}.gguf, so the other shards cannot be found"
            )
        for index in range(1, count):
            shards.append(_open(path.with_name(shard_path(named["prefix"], index, count)), index, count))
    tensors = _tensors(shards)
    expected = first.metadata.integer(SPLIT_TENSORS_COUNT, default=len(tensors))
    if expected != len(tensors):
        raise ModelError(
            f"{path}: {SPLIT_TENSORS_COUNT!r} is {expected} but the {count} shard(s) hold {len(tensors)} tensors"
        )
    if count > 1:
        log.debug("opened %d shards of %s", count, path)
    return shards, tensors


def _open(path: Path, index: int, count: int | None = None) -> Shard:
    if count is not None and not path.exists():
        raise ModelError(f"{path}: shard {index + 1} of {count} is missing")
    reader = read_gguf(path)
    shard = Shard(index, path, reader, Metadata(path, reader))
    if count is not None:
        no = shard.metadata.integer(SPLIT_NO)
        if no != index:
            raise ModelError(f"{path}: {SPLIT_NO!r} is {no}; expected {index} (shard {index + 1} of {count})")
        own_count = shard.metadata.integer(SPLIT_COUNT)
        if own_count != count:
            raise ModelError(f"{path}: {SPLIT_COUNT!r} is {own_count}; the first shard says {count}")
    return shard


def _tensors(shards: list[Shard]) -> dict[str, ShardedTensor]:
    found: dict[str, ShardedTensor] = {}
    for shard in shards:
        for tensor in shard.reader.tensors:
            previous = found.get(tensor.name)
            if previous is not None:
                raise ModelError(
                    f"{shard.path}: tensor {tensor.name} is also in {shards[previous.shard].path}; "
                    "a tensor must live in one shard"
                )
            found[tensor.name] = ShardedTensor(shard.index, tensor)
    return found


def _first_name_hint(path: Path, named: re.Match[str] | None, count: int) -> str:
    if named is None:
        return "open the shard whose split.no is 0"
    return f"open {path.with_name(shard_path(named['prefix'], 0, count))} instead"
