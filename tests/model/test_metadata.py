"""Metadata read as llama.cpp reads it, and no file whatever its bytes gets past without a ModelError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from expertstream.model import ModelError, MoeModel

from . import files


def _open(tmp_path: Path, arch: str, keys: dict, widths: list[tuple[int, int]]) -> MoeModel:
    return MoeModel.open(files.write_file(tmp_path / "m.gguf", arch, keys, files.model_tensors(widths)))


def test_per_layer_expert_count_array_skips_dense_layers(tmp_path: Path) -> None:
    widths = [(0, 0), (4, 96), (6, 64)]
    keys = files.moe_keys("qwen3moe", 3, [0, 4, 6], [0, 96, 64])
    with _open(tmp_path, "qwen3moe", keys, widths) as model:
        assert [layer.index for layer in model.layers] == [1, 2]
        assert [(layer.n_expert, layer.n_ff) for layer in model.layers] == [(4, 96), (6, 64)]
        assert (model.n_layer, model.n_expert, model.n_ff) == (3, 6, 96)
        assert model.summary()["moe_layers"] == 2


def test_leading_dense_blocks_are_skipped(tmp_path: Path) -> None:
    keys = files.moe_keys("deepseek2", 3, 4, 96, leading_dense_block_count=1)
    with _open(tmp_path, "deepseek2", keys, [(0, 0), (4, 96), (4, 96)]) as model:
        assert [layer.index for layer in model.layers] == [1, 2]


def test_layers_without_expert_tensors_are_dense(tmp_path: Path) -> None:
    keys = files.moe_keys("qwen3moe", 3, 4, 96)
    with _open(tmp_path, "qwen3moe", keys, [(4, 96), (0, 0), (4, 96)]) as model:
        assert [layer.index for layer in model.layers] == [0, 2]


@pytest.mark.parametrize(
    ("arch", "n_ff", "width"),
    [("qwen3moe", 96 * files.TOP_K, 96), ("qwen2moe", 96 * files.TOP_K, 96), ("olmoe", 96, 96), ("llama", 96, 96)],
)
def test_expert_width_falls_back_as_llama_cpp_does(tmp_path: Path, arch: str, n_ff: int, width: int) -> None:
    keys = files.moe_keys(arch, 2, 4, feed_forward_length=n_ff)
    with _open(tmp_path, arch, keys, [(4, width)] * 2) as model:
        assert model.n_ff == width


def test_feed_forward_length_may_be_a_per_layer_array(tmp_path: Path) -> None:
    keys = files.moe_keys("qwen3moe", 2, 4, feed_forward_length=[96 * files.TOP_K, 64 * files.TOP_K])
    with _open(tmp_path, "qwen3moe", keys, [(4, 96), (4, 64)]) as model:
        assert [layer.n_ff for layer in model.layers] == [96, 64]


def test_architecture_that_requires_the_expert_width_names_the_key(tmp_path: Path) -> None:
    keys = files.moe_keys("gpt-oss", 2, 4, feed_forward_length=96)
    with pytest.raises(ModelError, match=r"m\.gguf: metadata key 'gpt-oss\.expert_feed_forward_length' is missing"):
        _open(tmp_path, "gpt-oss", keys, [(4, 96)] * 2)


def test_no_width_key_at_all_names_both(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"'qwen3moe.expert_feed_forward_length' and 'qwen3moe.feed_forward_length'"):
        _open(tmp_path, "qwen3moe", files.moe_keys("qwen3moe", 2, 4), [(4, 96)] * 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"qwen3moe.block_count": "two"}, r"'qwen3moe\.block_count' holds STRING; expected an integer"),
        ({"qwen3moe.expert_count": [4, 4, 4]}, r"'qwen3moe\.expert_count' has 3 entries; expected one per layer \(2\)"),
        ({"qwen3moe.expert_count": "four"}, r"'qwen3moe\.expert_count' holds STRING; expected an integer or an array"),
        ({"qwen3moe.expert_used_count": 9}, r"'qwen3moe\.expert_used_count' is 9; expected 1\.\.4"),
        ({"qwen3moe.expert_count": 0}, "this is not an MoE model"),
        ({"qwen3moe.leading_dense_block_count": 5}, r"'qwen3moe\.leading_dense_block_count' is 5, more than"),
        ({"qwen3moe.embedding_length": 0}, r"'qwen3moe\.embedding_length' is 0; expected at least 1"),
    ],
)
def test_malformed_keys_are_named_with_the_file(tmp_path: Path, change: dict, message: str) -> None:
    keys = {**files.moe_keys("qwen3moe", 2, 4, 96), **change}
    with pytest.raises(ModelError, match=message) as err:
        _open(tmp_path, "qwen3moe", keys, [(4, 96)] * 2)
    assert str(tmp_path / "m.gguf") in str(err.value)


def _valid_bytes(tmp_path: Path) -> bytes:
    keys = files.moe_keys("qwen3moe", 2, 4, 96)
    return files.write_file(tmp_path / "valid.gguf", "qwen3moe", keys, files.model_tensors([(4, 96)] * 2)).read_bytes()


def _attempt(tmp_path: Path, data: bytes) -> ModelError | None:
    """Open ``data`` as a model: None if it opens, the ModelError (naming the file) if not.

    Any other exception escapes and fails the test.
    """
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(data)
    try:
        MoeModel.open(path).close()
    except ModelError as exc:
        assert str(path) in str(exc)
        return exc
    return None


def test_truncated_headers_give_model_errors(tmp_path: Path) -> None:
    data = _valid_bytes(tmp_path)
    header_end = data.index(b"blk.1.ffn_down_exps.weight") + 64
    for cut in [0, 3, 4, 8, 15, 23, 24, 40, *range(41, header_end, 37), len(data) - 1]:
        assert _attempt(tmp_path, data[:cut]) is not None, f"a file cut at {cut} bytes opened"


@pytest.mark.parametrize("field_at", [8, 16], ids=["tensor_count", "kv_count"])
@pytest.mark.parametrize("count", [2**63 - 1, 2**40, 10**6])
def test_absurd_counts_give_model_errors(tmp_path: Path, field_at: int, count: int) -> None:
    data = bytearray(_valid_bytes(tmp_path))
    data[field_at : field_at + 8] = count.to_bytes(8, "little")
    assert _attempt(tmp_path, bytes(data)) is not None


def test_random_header_corruption_never_escapes_as_another_error(tmp_path: Path) -> None:
    data = _valid_bytes(tmp_path)
    header_end = data.index(b"blk.1.ffn_down_exps.weight") + 64
    rng = np.random.default_rng(0)
    for _ in range(40):
        corrupt = bytearray(data)
        for at in rng.integers(0, header_end, int(rng.integers(1, 4))):
            corrupt[int(at)] = int(rng.integers(0, 256))
        _attempt(tmp_path, bytes(corrupt))
