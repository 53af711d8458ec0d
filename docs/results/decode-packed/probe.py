"""Where a generate process's device memory goes, stage by stage: the driver's count of used memory
(nvidia-smi) after the backend opens, after the model opens, after generating 64 tokens after a
16-token prompt (kernels compiled and loaded, every expert streamed from pinned host memory), beside
what expertstream itself allocated for that run (Model.device_memory).

usage: python3 docs/results/decode-packed/probe.py MODEL.gguf
"""

from __future__ import annotations

import subprocess
import sys

import expertstream
from expertstream.engine.model import Model
from expertstream.engine.sampling import Sampling


def used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return int(out.stdout.split()[0])


def main(path: str) -> None:
    print(f"before the process opens a backend: {used_mib()} MiB")
    with expertstream.backend("cuda") as backend:
        backend.device(0).free_memory()  # the context is made
        print(f"backend open (the device's context): {used_mib()} MiB")
        with Model.open(path, backend=backend, host_memory="pinned") as model:
            print(f"model open: {used_mib()} MiB")
            tokens = [t.token for t in model.generate(list(range(100, 116)), 64, Sampling(temperature=0))]
            print(f"after 16 + 64 tokens: {used_mib()} MiB ({len(tokens)} generated)")
            memory = model.device_memory.as_dict()
            print("expertstream's own: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in memory.items()))
        print(f"model closed: {used_mib()} MiB")


if __name__ == "__main__":
    main(sys.argv[1])
