"""KL of expertstream's decode rows against llama.cpp's CPU logits on the Q4_K_M tiny qwen3moe file.

    PYTHONPATH=. python3 docs/results/decode-round7/cpu/kl_tiny_q4km.py

The fixture tests/engine/llamacpp/tiny-q4km.npz (llama.cpp's logits over a 128-token prompt and 16
greedy steps; `python3 -m tests.engine.llamacpp.make LLAMACPP_LOGITS tiny-q4km`) against this tree on
the simulator, the decode steps on the matrix-vector kernels (gemv) and on the tile kernels.
"""

import tempfile
from pathlib import Path

import numpy as np

from expertstream.engine.model import Model
from expertstream.model import make_model
from microbench.llamacpp_logits.compare import compare_logits
from tests.engine.llamacpp.make import SEED, preset_of, type_of

fixture = np.load("tests/engine/llamacpp/tiny-q4km.npz")
n_prompt = int(fixture["n_prompt"])
reference = fixture["logits"].astype(np.float32)
with tempfile.TemporaryDirectory() as folder:
    path = make_model(preset_of("tiny-q4km"), type_of("tiny-q4km"), Path(folder) / "tiny-q4km.gguf", seed=SEED)
    for gemv in (True, False):
        with Model.open(path, backend="sim", ubatch=64, gemv=gemv) as model:
            ours = model.logits(fixture["tokens"].tolist(), prompt=n_prompt)
        steps = compare_logits(reference[n_prompt:], ours[n_prompt:])
        print(
            f"gemv={gemv}: decode rows KL median {np.median(steps.kl):.3g} mean {steps.mean_kl:.3g} "
            f"max {steps.max_kl:.3g} argmax {steps.argmax_agreement:.3f}"
        )
