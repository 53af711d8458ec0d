"""Write the llama.cpp logits fixtures of test_against_llamacpp.py (needs llamacpp-logits, a CPU build).

python3 -m tests.engine.llamacpp.make LLAMACPP_LOGITS [PRESET ...]

For each tiny preset of an architecture run end to end (make-model Q8_0, seed 3), glm4moe and
deepseek2 with a leading dense layer (deepseek2's with a query latent too), deepseek2 with YaRN,
deepseek2 with the full-size 576-wide latent row and the qwen3moe file in Q4_K_M: a 128-token
prompt from the project's corpus and 16 greedy steps through llama.cpp on the CPU; saved as
PRESET.npz with the tokens fed, the logits (float16), the prompt length and the made file's sha256
(the test refuses a fixture of another file). PRESET names limit the run to those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from expertstream.engine.hparams import ATTENTION
from expertstream.model import make_model
from expertstream.model.presets import PRESETS as MODEL_PRESETS
from expertstream.model.presets import ModelPreset, Yarn
from microbench.llamacpp_logits.compare import read_run
from microbench.llamacpp_logits.prompt import corpus_tokens

HERE = Path(__file__).parent
# glm4moe with a leading dense layer as GLM-4.5 has one: attention and a dense FFN before the MoE layers.
VARIANTS = {
    "tiny-glm4moe-dense": dataclasses.replace(MODEL_PRESETS["tiny-glm4moe"], n_dense_lead=1, n_layer=3, n_ff=384),
    # deepseek2 as the full-size models have it: a leading dense layer and the query through a latent
    "tiny-deepseek2-dense": dataclasses.replace(
        MODEL_PRESETS["tiny-deepseek2"], n_dense_lead=1, n_layer=3, n_ff=384, q_lora_rank=64
    ),
    # DeepSeek-V2-Lite's YaRN: factor 40 over 4096 positions, its magnitude's log multiplier (0.0707)
    "tiny-deepseek2-yarn": dataclasses.replace(MODEL_PRESETS["tiny-deepseek2"], yarn=Yarn(40.0, 4096, 0.0707)),
    # the full-size models' 576-wide latent row (512 + 64 rotated): the wide attention kernels (on a GPU with
    # mma.sync, their matrix-core prefill and split-K decode) in a whole model
    "tiny-deepseek2-wide": dataclasses.replace(MODEL_PRESETS["tiny-deepseek2"], kv_lora_rank=512, rope_dim=64),
}
# Files of another type than Q8_0: the qwen3moe file in Q4_K_M. Its Q4_K and Q6_K rows, as the Q8_0
# files' rows, decode on the int8 activations of the matrix-vector kernels (layout.GEMV_INT8_TYPES),
# as llama.cpp's CPU rows take q8_K and q8_0 activations.
TYPES = {"tiny-q4km": ("tiny", "Q4_K_M")}
# make-model's tiny preset of every architecture run end to end
WHOLE = tuple(name for name, p in MODEL_PRESETS.items() if name.startswith("tiny") and p.arch in ATTENTION)
PRESETS = (*WHOLE, *VARIANTS, *TYPES)
N_PROMPT, N_GEN, SEED = 128, 16, 3


def preset_of(name: str) -> str | ModelPreset:
    """A preset's name, or the variant of one this fixture set defines."""
    return VARIANTS.get(name, TYPES[name][0] if name in TYPES else name)


def type_of(name: str) -> str:
    """The weight type of a fixture's file."""
    return TYPES[name][1] if name in TYPES else "Q8_0"


def main(tool: str, only: list[str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        for preset in only or PRESETS:
            model = make_model(preset_of(preset), type_of(preset), Path(folder) / f"{preset}.gguf", seed=SEED)
            tokens = Path(folder) / f"{preset}.prompt"
            tokens.write_text("".join(f"{t}\n" for t in corpus_tokens(model, N_PROMPT)))
            out = Path(folder) / preset
            argv = [tool, "-m", str(model), "--tokens", str(tokens), "--n-prompt", str(N_PROMPT)]
            argv += ["--n-gen", str(N_GEN), "--ngl", "0", "-o", str(out)]
            subprocess.run(argv, check=True, capture_output=True)
            run = read_run(out)
            np.savez_compressed(
                HERE / f"{preset}.npz",
                tokens=np.asarray(run.tokens, np.int32),
                logits=run.logits.astype(np.float16),
                n_prompt=N_PROMPT,
                sha256=hashlib.sha256(model.read_bytes()).hexdigest(),
            )
            print(preset, run.logits.shape)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
