"""A tiny synthetic model on disk, shared by the prefill tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from expertstream.model import make_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2 layers, 8 experts, top-2; the down tensors' rows (192) need the quantized-row padding.
    return make_model("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", seed=3)
