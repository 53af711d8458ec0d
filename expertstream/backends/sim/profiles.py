"""Simulated device profiles: plain data describing one GPU and its host link.

A profile is chosen by name (a built-in), given as a Profile object, as a dict
(``Profile.from_dict``) or as the path of a JSON file holding such a dict. The
EXPERTSTREAM_SIM_PROFILE environment variable sets the default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ...errors import InvalidArgument

PROFILE_ENV = "EXPERTSTREAM_SIM_PROFILE"
DEFAULT_PROFILE = "cuda-h200"

_GIB = 1 << 30
_VENDORS = ("nvidia", "amd")


@dataclass(frozen=True)
class Profile:
    """Rates in bytes (or flops) per second, times in seconds, sizes in bytes."""

    name: str
    vendor_like: str  # "nvidia" or "amd": whose runtime semantics the profile imitates
    device_name: str
    memory_bytes: int
    h2d_pinned_bps: float  # from pinned or registered host memory
    h2d_pageable_bps: float
    d2h_bps: float  # to pinned or registered host memory
    d2h_pageable_bps: float
    d2d_bps: float  # within one device
    peer_bps: float  # between devices with peer access
    memset_bps: float
    flops_per_s: float  # effective rate of the MoE kernels, not the datasheet peak
    matrix_cores: bool  # whether kernels take the matrix-core path (bf16 rounding in the twins)
    launch_latency_s: float  # kernels and memsets: from ready to running
    copy_latency_s: float  # DMA setup: from ready to moving bytes
    enqueue_s: float  # host time spent in one enqueue or query call
    host_memcpy_bps: float  # one host thread copying host -> host
    host_register_bps: float  # page-locking memory in place
    pageable_blocks_host: bool  # a copy from/to pageable memory returns only once it is done
    host_register: bool
    host_register_read_only: bool

    def __post_init__(self) -> None:
        if self.vendor_like not in _VENDORS:
            raise InvalidArgument(f"profile {self.name!r}: vendor_like must be one of {_VENDORS}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise InvalidArgument(f"profile {self.name!r}: memory_bytes must be a positive integer")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_bps", "_per_s")) and not (_is_number(value) and value > 0):
                raise InvalidArgument(f"profile {self.name!r}: {f.name} must be a positive number, got {value!r}")
            if f.name.endswith("_s") and not f.name.endswith("_per_s") and not (_is_number(value) and value >= 0):
                raise InvalidArgument(f"profile {self.name!r}: {f.name} must be a number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """A profile from plain data; an optional ``"base"`` names a built-in whose figures fill the rest."""
        values = dict(data)
        base_name = values.pop("base", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown profile field(s) {', '.join(unknown)}", hint=f"known fields: {', '.join(sorted(known))}"
            )
        if base_name is not None:
            values = {**dataclasses.asdict(builtin_profile(str(base_name))), **values}
        missing = sorted(known - set(values))
        if missing:
            raise InvalidArgument(
                f"profile is missing field(s) {', '.join(missing)}",
                hint=f'give them, or name a built-in to start from with "base" ({", ".join(BUILTIN_PROFILES)})',
            )
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"cannot read simulator profile {os.fspath(path)!r}: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidArgument(f"simulator profile {os.fspath(path)!r} must hold a JSON object")
        return cls.from_dict(data)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Figures marked "measured" come from an H200 (PCIe Gen5 x16); "reported" from the R9700 figures
# in llama.cpp PR #28414 and its review; "assumed" have no measurement yet.
CUDA_H200 = Profile(
    name="cuda-h200",
    vendor_like="nvidia",
    device_name="NVIDIA H200",
    memory_bytes=141 * 10**9,  # datasheet: 141 GB HBM3e
    h2d_pinned_bps=55.4e9,  # measured: pinned and registered H2D, 64 MB..1 GB
    # measured: pageable numpy and unregistered mmap gave 6.7..9.2 GB/s; the 1 GiB copy of the
    # event-order bench took ~127 ms (8.4 GB/s), docs/results/cuda-h200.md
    h2d_pageable_bps=8.4e9,
    d2h_bps=55.4e9,  # assumed: the PCIe link is symmetric
    d2h_pageable_bps=7.5e9,  # assumed: staged through a pinned bounce buffer like H2D
    d2d_bps=2.0e12,  # assumed: a copy reads and writes every byte, ~40% of the 4.8 TB/s HBM3e peak
    peer_bps=50e9,  # assumed: peers over PCIe Gen5 x16
    memset_bps=3.0e12,  # assumed: write-only traffic, ~60% of the HBM3e peak
    # measured: mul_mat_id, Q4_0, Qwen3-30B-A3B expert shapes at ubatch 512 (18.3 TFLOP/s gate/up,
    # 16.1 down; docs/results/cuda-h200-kernels.md). Larger ubatches run faster (~28 at 2048, ~33 at
    # 4096), so at those sizes this profile is pessimistic about compute.
    flops_per_s=17.5e12,
    matrix_cores=True,  # datasheet: Hopper tensor cores (mma.sync bf16)
    launch_latency_s=5e-6,  # assumed: typical kernel launch latency
    copy_latency_s=10e-6,  # assumed: DMA setup; with enqueue_s it matches the measured 1.26 ms for 64 MB
    enqueue_s=15e-6,  # measured: six enqueues of the event-order bench took 0.04..0.08 ms from Python
    host_memcpy_bps=8.1e9,  # measured: numpy.copyto mmap -> pinned, one thread
    host_register_bps=_GIB / 26e-3,  # measured: registering 1 GB took 26 ms
    pageable_blocks_host=True,  # measured: the host is blocked for the whole pageable copy
    host_register=True,
    host_register_read_only=True,  # measured: cudaHostRegisterReadOnly of a PROT_READ mmap works
)

ROCM_R9700 = Profile(
    name="rocm-r9700",
    vendor_like="amd",
    device_name="AMD Radeon AI PRO R9700",
    memory_bytes=32 * _GIB,  # datasheet: 32 GB GDDR6
    h2d_pinned_bps=53e9,  # reported: hipMemcpy 53 GB/s pinned
    h2d_pageable_bps=53e9,  # reported: hipMemcpy 53 GB/s pageable too
    d2h_bps=53e9,  # assumed: the PCIe link is symmetric
    d2h_pageable_bps=53e9,  # assumed: like H2D
    d2d_bps=0.26e12,  # assumed: a copy reads and writes every byte, ~40% of the 644 GB/s GDDR6 peak
    peer_bps=50e9,  # assumed: peers over PCIe 5.0 x16
    memset_bps=0.39e12,  # assumed: write-only traffic, ~60% of the GDDR6 peak
    # From the R9700 prefill figures on the 72 GB expert set at ub 4096: stock 1014 t/s means
    # 4.04 s per ubatch, of which 72 GB / 53 GB/s = 1.36 s is the serial copy, so ~2.7 s is
    # compute; with overlap 1600 t/s means ~2.6 s per ubatch, compute-bound. That compute holds
    # ~2.3e9 active expert weights (72 GB at ~4.8 bits each, 10 of 512 experts) x 2 flops x 4096
    # tokens = 1.9e13 flops of expert matmuls plus attention, so the MoE kernels ran at ~7.4e12
    # flop/s or more; 8e12 rounds that up.
    flops_per_s=8e12,
    matrix_cores=True,  # datasheet: RDNA4 WMMA (gfx1201)
    launch_latency_s=5e-6,  # assumed: like the CUDA profile
    copy_latency_s=10e-6,  # assumed: like the CUDA profile
    enqueue_s=30e-6,  # assumed: like the CUDA profile (the same Python binding overhead)
    host_memcpy_bps=8.1e9,  # assumed: the H200 host's one-thread figure
    host_register_bps=_GIB / 26e-3,  # assumed: like the CUDA profile
    # Documented ROCm behaviour: pageable copies are synchronous; large ranges are pinned chunk
    # by chunk and the call returns when the DMA is done.
    pageable_blocks_host=True,
    host_register=True,  # hipHostRegister exists
    host_register_read_only=False,  # HIP exposes no read-only registration flag
)

BUILTIN_PROFILES: dict[str, Profile] = {p.name: p for p in (CUDA_H200, ROCM_R9700)}

ProfileSpec = Union[str, "os.PathLike[str]", Profile, Mapping[str, Any], None]


def builtin_profile(name: str) -> Profile:
    try:
        return BUILTIN_PROFILES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown simulator profile {name!r}", hint=f"built-in profiles: {', '.join(BUILTIN_PROFILES)}"
        ) from None


def resolve_profile(spec: ProfileSpec) -> Profile:
    """A Profile from a name, a JSON file path, a dict or a Profile; None means the default."""
    if spec is None:
        spec = os.environ.get(PROFILE_ENV, "").strip() or DEFAULT_PROFILE
    if isinstance(spec, Profile):
        return spec
    if isinstance(spec, Mapping):
        return Profile.from_dict(spec)
    text = os.fspath(spec)
    if text in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[text]
    if text.endswith(".json") or Path(text).is_file():
        return Profile.from_json(text)
    raise InvalidArgument(
        f"unknown simulator profile {text!r}",
        hint=f"use one of {', '.join(BUILTIN_PROFILES)}, a Profile, a dict or a JSON file path",
    )


__all__ = ["BUILTIN_PROFILES", "PROFILE_ENV", "Profile", "ProfileSpec", "builtin_profile", "resolve_profile"]
