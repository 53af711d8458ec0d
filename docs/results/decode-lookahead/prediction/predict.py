"""How well the next layer's router, applied to this layer's FFN input, predicts the experts it chooses.

Reads what dump_hidden (llama.cpp's CPU forward pass, decode steps of one token) wrote: per step and
layer the F32 tensor ffn_inp-L (the hidden state after attention, before the FFN norm) and the I32
ffn_moe_topk-L (the experts chosen). For each layer L+1 it ranks the experts by layer L+1's router on
ffn_inp-L normed with layer L+1's ffn_norm, and counts how many of the first m are among the chosen.

usage: python predict.py MODEL.gguf DUMP.bin
"""

from __future__ import annotations

import sys
from collections import defaultdict

import gguf
import numpy as np


def read_dump(path: str) -> dict[int, dict[str, np.ndarray]]:
    steps: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    step = -1
    with open(path, "rb") as f:
        while len(head := f.read(72)) == 72:
            name = head[:64].split(b"\0")[0].decode()
            is_int, n = np.frombuffer(head[64:], np.int32)
            values = np.frombuffer(f.read(4 * int(n)), np.int32 if is_int else np.float32)
            if name == "attn_norm-0":  # the first tensor of a step
                step += 1
            steps[step][name] = values.copy()
    return steps


def main(model_path: str, dump_path: str) -> None:
    reader = gguf.GGUFReader(model_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    top_k = int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0])
    eps = float(reader.fields[f"{arch}.attention.layer_norm_rms_epsilon"].parts[-1][0])
    tensors = {t.name: t for t in reader.tensors}

    def floats(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64)

    steps = read_dump(dump_path)
    n_layer = 1 + max(int(k.split("-")[1]) for k in steps[0] if k.startswith("ffn_moe_topk-"))
    routers = {i: floats(f"blk.{i}.ffn_gate_inp.weight") for i in range(n_layer)}
    norms = {i: floats(f"blk.{i}.ffn_norm.weight").reshape(-1) for i in range(n_layer)}

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x) + eps) * weight

    ranks = range(1, 2 * top_k + 1)
    hits: dict[int, list[int]] = {m: [] for m in ranks}
    for tensors_of_step in steps.values():
        for i in range(n_layer):
            x = tensors_of_step[f"ffn_inp-{i}"].astype(np.float64)
            chosen = set(tensors_of_step[f"ffn_moe_topk-{i}"].tolist())
            own = np.argsort(-(routers[i] @ rms_norm(x, norms[i])))[:top_k]
            assert set(own.tolist()) == chosen, f"layer {i}: the router read here disagrees with llama.cpp's"
            if i + 1 == n_layer:
                continue
            following = set(tensors_of_step[f"ffn_moe_topk-{i + 1}"].tolist())
            order = np.argsort(-(routers[i + 1] @ rms_norm(x, norms[i + 1])))
            for m in ranks:
                hits[m].append(len(following & set(order[:m].tolist())))
    print(f"{model_path}: {arch}, {n_layer} layers, top-{top_k}, {len(steps)} decode steps, {len(hits[1])} layer pairs")
    print("m  chosen among the first m  precision  recall  copied per layer (m + missed)")
    for m in ranks:
        mean = float(np.mean(hits[m]))
        print(f"{m:<2} {mean:24.2f}  {mean / m:9.3f}  {mean / top_k:6.3f}  {m + top_k - mean:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
