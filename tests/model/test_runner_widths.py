"""The runner takes one expert shape per model and says so when a file has several."""

from __future__ import annotations

from pathlib import Path

import pytest

from expertstream.backends.base import Backend
from expertstream.engine.runner import Batching, MoeRunner
from expertstream.model import ModelError, MoeModel

from . import files


def test_layers_of_different_expert_widths_are_refused_by_name(backend: Backend, tmp_path: Path) -> None:
    widths = [(4, 96), (4, 64)]
    keys = files.moe_keys("qwen3moe", len(widths), [w[0] for w in widths], [w[1] for w in widths])
    path = files.write_file(tmp_path / "mixed.gguf", "qwen3moe", keys, files.model_tensors(widths))
    with (
        MoeModel.open(path) as model,
        pytest.raises(ModelError, match=r"differ in expert count or width \(4 experts x 64, 4 experts x 96\)"),
    ):
        MoeRunner(backend.device(0), model, Batching(16, 16, 0))
