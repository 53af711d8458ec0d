"""The MoE kernels: expert matmul by routing ids, SwiGLU, the weighted sum of the top-k outputs, router top-k.

``launcher.MoeKernels`` compiles and launches them; ``program`` builds the CUDA-C source from
the .cu files of this package; ``routing`` and ``dense`` launch the per-architecture routing
pieces and the dense pieces of a forward pass (embedding rows, RMS norm, biases, rotary
embedding, the KV cache write); ``twins``, ``routing_twins`` and ``dense_twins`` are what the
simulator runs in their place, handed over with each compile; ``reference`` and
``reference_dense`` compute the same in float64.
"""

from __future__ import annotations

from .launcher import MoeKernels, check_path, default_path, scratch_bytes
from .layout import MatrixPath
from .program import kernel_source, module_types, type_kernels

__all__ = [
    "MatrixPath",
    "MoeKernels",
    "check_path",
    "default_path",
    "kernel_source",
    "module_types",
    "scratch_bytes",
    "type_kernels",
]
