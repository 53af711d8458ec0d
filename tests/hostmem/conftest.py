"""A tiny synthetic model on disk, shared by the host-memory tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from expertstream.model import make_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Q4_0 tensors of 221184 bytes; F32 routers of 8192.
    return make_model("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", seed=3)
