"""Where a generating process's device memory goes, stage by stage
(``python -m microbench.device_memory --model F --backend cuda``).

The device's used memory (total less free, as the driver counts it: what nvidia-smi shows for the
whole device) once the backend's context exists, with the model open (its file parsed: a generation
uploads the weights its run needs), after a prompt and ``--steps`` greedy steps, and once the model
is closed; beside it what expertstream itself allocated for the run (``Model.device_memory``) and the
kernel images it loaded. What neither the weights nor expertstream's own count explain is the
driver's: the context, the kernels' code and local memory, graphs.

``--arena-max 0`` puts each of the model's tensors in an allocation of its own (as before they shared
arenas, ``engine.uploads``), to show what the driver's rounding of each to whole pages costs.
``--stack-limit BYTES|driver`` is the per-thread stack limit the CUDA backend gives the context
(``expertstream.backend(stack_limit=...)``, $EXPERTSTREAM_STACK_LIMIT; default 256 bytes): "driver"
keeps CUDA's own 1024, to show how much of the context is the local memory reserved for it.
Run on a device nothing else uses: the figures are the whole device's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from expertstream.backends._gpu import STACK_LIMIT_VAR, GpuDevice, _images
from expertstream.backends.base import Device
from expertstream.engine import uploads
from expertstream.engine.model import Model
from expertstream.engine.sampling import Sampling

from ._common import Column, emit, environment, open_backend, parser

MIB = 1 << 20


@dataclass(frozen=True)
class Stage:
    stage: str
    used_mib: float  # the device's used memory after the stage
    delta_mib: float  # since the stage before


def _used(device: Device) -> int:
    return device.total_memory - device.free_memory()


def _limits(backend: str) -> dict[str, int]:
    """The CUDA context's limits (bytes): stack a thread, malloc heap, printf buffer. Empty on other
    backends, or without cuda-python's runtime bindings."""
    if backend != "cuda":
        return {}
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return {}
    names = {
        "stack": rt.cudaLimit.cudaLimitStackSize,
        "malloc_heap": rt.cudaLimit.cudaLimitMallocHeapSize,
        "printf_fifo": rt.cudaLimit.cudaLimitPrintfFifoSize,
    }
    found = {}
    for name, limit in names.items():
        err, value = rt.cudaDeviceGetLimit(limit)
        if err == rt.cudaError_t.cudaSuccess:
            found[name] = int(value)
    return found


def main(argv: list[str] | None = None) -> int:
    p = parser("device_memory", __doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--model", type=Path, required=True, help="a GGUF MoE model")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (ids 100, 101, ... modulo the vocabulary)")
    p.add_argument("--steps", type=int, default=64, help="greedy steps after the prompt")
    p.add_argument("--host-memory", default="pinned")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument(
        "--stack-limit",
        help="bytes, or 'driver': the per-thread stack limit the CUDA backend gives the context (default 256)",
    )
    p.add_argument("--arena-max", type=int, help="bytes of the largest arena of tensors (0: a tensor an allocation)")
    args = p.parse_args(argv)
    if args.arena_max is not None:
        uploads.ARENA_MAX_BYTES = args.arena_max
    stages: list[Stage] = []
    if args.stack_limit is not None:
        os.environ[STACK_LIMIT_VAR] = args.stack_limit  # the backend reads (and checks) it as it opens
    backend = open_backend(args, data=True)
    if args.stack_limit is not None and backend.name != "cuda":
        backend.close()
        raise SystemExit(f"--stack-limit is the CUDA backend's; this run opened {backend.name}: use --backend cuda")
    with backend:
        device = backend.device(args.device)

        def note(stage: str, used: int) -> None:
            before = stages[-1].used_mib if stages else used / MIB
            stages.append(Stage(stage, used / MIB, used / MIB - before))

        note("context made (backend open)", _used(device))  # the first query makes the context
        limits = _limits(backend.name)
        with Model.open(args.model, backend=backend, host_memory=args.host_memory, slots=args.slots) as model:
            note("model open (nothing uploaded yet)", _used(device))
            n_vocab = model.transformer.n_vocab
            prompt = [(100 + i) % n_vocab for i in range(args.prompt)]
            tokens = [t.token for t in model.generate(prompt, args.steps, Sampling(temperature=0))]
            note(f"after {args.prompt} + {len(tokens)} tokens", _used(device))
            own = {k: v / MIB for k, v in model.device_memory.as_dict().items()}
        note("model closed", _used(device))
        after_limits = _limits(backend.name)
        modules = device._modules if isinstance(device, GpuDevice) else {}
        images = [len(image) for (_, arch, key), image in _images.items() if key in modules]
    result: dict[str, Any] = {
        **environment(backend, device),
        "model": str(args.model),
        "prompt": args.prompt,
        "steps": args.steps,
        "host_memory": args.host_memory,
        "slots": args.slots,
        "arena_max_bytes": uploads.ARENA_MAX_BYTES,
        "rows": [asdict(s) for s in stages],
        "expertstream_mib": own,
        "limits_bytes": limits,
        "limits_after_bytes": after_limits,
        "kernel_images": len(images),
        "kernel_image_mib": sum(images) / MIB,
    }
    columns = [
        Column("stage", "stage"),
        Column("used_mib", "used MiB", "{:.0f}"),
        Column("delta_mib", "delta", "{:+.0f}"),
    ]
    emit(args, result, columns, "The device's used memory, stage by stage")
    print(
        "expertstream's own: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in own.items()) + "; "
        f"{len(images)} kernel images, {sum(images) / MIB:.1f} MiB; limits {limits} -> {after_limits}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
