"""Models split by gguf-split: shards found by name and split.* keys, every mismatch named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from expertstream.model import ModelError, MoeModel

from . import files

ARCH = "qwen3moe"
WIDTHS = [(4, 96)] * 3
KEYS = files.moe_keys(ARCH, len(WIDTHS), 4, 96)


def _tensors() -> files.Tensors:
    return files.model_tensors(WIDTHS, seed=5)


def _hand_split(tmp_path: Path, groups: list[list[str]], *, count: int | None = None, total: int | None = None) -> Path:
    """Shards with the given tensor names each, metadata in the first; split.* as given or right."""
    tensors = _tensors()
    count = len(groups) if count is None else count
    total = sum(len(g) for g in groups) if total is None else total
    paths = []
    for no, names in enumerate(groups):
        path = tmp_path / f"m-{no + 1:05d}-of-{len(groups):05d}.gguf"
        keys = KEYS if no == 0 else None
        files.write_shard(path, ARCH, {n: tensors[n] for n in names}, (no, count, total), keys)
        paths.append(path)
    return paths[0]


def _names() -> list[str]:
    return list(_tensors())


def test_split_model_reads_the_same_bytes_as_one_file(tmp_path: Path) -> None:
    single = files.write_file(tmp_path / "one.gguf", ARCH, KEYS, _tensors())
    first = files.write_file(tmp_path / "split.gguf", ARCH, KEYS, _tensors(), split_max_tensors=5)
    assert first.name == "split-00001-of-00003.gguf"
    with MoeModel.open(single) as whole, MoeModel.open(first) as split:
        assert split.n_shards == 3 and whole.n_shards == 1
        assert split.paths[2].name == "split-00003-of-00003.gguf"
        assert sorted(split.tensors) == sorted(whole.tensors)
        assert {t.shard for t in split.tensors.values()} == {0, 1, 2}
        for name, info in split.tensors.items():
            raw = split.raw(info)
            assert np.shares_memory(raw, split.mappings[info.shard])
            assert np.array_equal(raw, whole.raw(name)), name
        with pytest.raises(ModelError, match="split over 3 files"):
            split.mapping  # noqa: B018


def test_missing_shard_is_named(tmp_path: Path) -> None:
    first = files.write_file(tmp_path / "m.gguf", ARCH, KEYS, _tensors(), split_max_tensors=5)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelError, match=r"m-00002-of-00003\.gguf: shard 2 of 3 is missing"):
        MoeModel.open(first)


def test_opening_a_later_shard_points_to_the_first(tmp_path: Path) -> None:
    files.write_file(tmp_path / "m.gguf", ARCH, KEYS, _tensors(), split_max_tensors=5)
    with pytest.raises(ModelError, match=r"this is shard 2 of 3; open .*m-00001-of-00003\.gguf instead"):
        MoeModel.open(tmp_path / "m-00002-of-00003.gguf")


def test_wrong_split_count_in_a_shard_is_named(tmp_path: Path) -> None:
    names = _names()
    first = _hand_split(tmp_path, [names[:6], names[6:]])
    # Rewrite the second shard claiming three shards.
    tensors = _tensors()
    files.write_shard(tmp_path / "m-00002-of-00002.gguf", ARCH, {n: tensors[n] for n in names[6:]}, (1, 3, len(names)))
    with pytest.raises(ModelError, match=r"m-00002-of-00002\.gguf: 'split\.count' is 3; the first shard says 2"):
        MoeModel.open(first)


def test_wrong_split_index_is_named(tmp_path: Path) -> None:
    names = _names()
    first = _hand_split(tmp_path, [names[:4], names[4:8], names[8:]])
    tensors = _tensors()
    files.write_shard(tmp_path / "m-00003-of-00003.gguf", ARCH, {n: tensors[n] for n in names[8:]}, (1, 3, len(names)))
    with pytest.raises(ModelError, match=r"m-00003-of-00003\.gguf: 'split\.no' is 1; expected 2"):
        MoeModel.open(first)


def test_count_in_the_name_and_in_the_keys_must_agree(tmp_path: Path) -> None:
    names = _names()
    first = _hand_split(tmp_path, [names[:6], names[6:]], count=3)
    with pytest.raises(ModelError, match=r"the name says 2 shards but 'split\.count' is 3"):
        MoeModel.open(first)


def test_duplicate_tensor_across_shards_is_named(tmp_path: Path) -> None:
    names = _names()
    first = _hand_split(tmp_path, [names[:7], names[6:]], total=len(names) + 1)
    with pytest.raises(ModelError, match=rf"tensor {names[6]} is also in .*m-00001-of-00002\.gguf"):
        MoeModel.open(first)


def test_tensor_count_mismatch_is_named(tmp_path: Path) -> None:
    names = _names()
    first = _hand_split(tmp_path, [names[:6], names[6:-1]], total=len(names))
    with pytest.raises(ModelError, match=rf"'split\.tensors\.count' is {len(names)} but the 2 shard\(s\) hold"):
        MoeModel.open(first)


def test_split_count_without_the_naming_is_refused(tmp_path: Path) -> None:
    names = _names()
    first = _hand_split(tmp_path, [names[:6], names[6:]])
    renamed = first.rename(tmp_path / "model.gguf")
    with pytest.raises(ModelError, match="does not follow the split naming"):
        MoeModel.open(renamed)
