"""The rocm-r9700 profile fitted, the way `expertstream tune` fits one, to the PR #28414 report only.

No AMD GPU has run this project. The report on a Radeon AI PRO R9700 (gfx1201, PCIe 5.0 x16,
Qwen3.8-Flash-Next, ubatch 4096) gives a few figures; each goes through the fit function tune
uses for the same measurement (expertstream/bench/tuner.py), and the simulator fits the one field
no probe measures (what the rest of a layer costs: attention, which the runner does not run):

| figure (the report's words)                                          | fits                             |
|----------------------------------------------------------------------|----------------------------------|
| hipMemcpy microbench: 53 GB/s H2D from pageable memory and pinned    | h2d_pinned_bps, h2d_pageable_bps |
| B released after copy1 (1.3 ms) with its wait before copy2, after    | pageable_wait_binds_tail         |
| copy2 (22 ms) with it after; "the runtime pins on the fly"           | (pageable_blocks_host False)     |
| timeline at ub 4096: gate_L 3289.00-3291.49 ms, up_L 3300.82-3303.95 | mul_mat_id kernel rates          |
| stock copy path, mmap, 27k tokens: 1014 t/s                          | the attention stand-in's rate    |

Everything else the report gives is predicted, not fitted (docs/results/rocm-sim.md): the other
prompt lengths, every slot count, pinned against mmap, the down copy of the timeline, decode.
Fields without a figure (latencies, host copies, registration) are assumptions in profiles.py.
``tune`` on an AMD GPU replaces all of it with measurements.

    python -m microbench.rocm_r9700_fit      # prints the fitted fields (about a minute: it simulates 27k tokens)
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from expertstream.backends.sim.profiles import ROCM_R9700, KernelRate, Profile
from expertstream.bench.measure import Settings
from expertstream.bench.placeholder import write_sparse_model
from expertstream.bench.predict import predict
from expertstream.bench.probes import EventOrderTiming, KernelTiming
from expertstream.bench.tuner import fit_event_order, fit_kernel
from expertstream.engine.runner import Batching
from expertstream.hostmem import HostMemoryMode
from expertstream.kernels.layout import weight_format
from expertstream.model import PRESETS, MoeModel

PRESET = PRESETS["qwen3.8-flash-next"]
QTYPE = GGMLQuantizationType.Q4_0  # the simulated model's expert type (the reported file mixes K-quants)
UBATCH = 4096

HIPMEMCPY_BPS = 53e9
EVENT_ORDER_S = {"before": 1.3e-3, "after": 22e-3}  # pageable; pinned released at 1.3 ms either way
GATE_UP_S = (2.49e-3, 3.13e-3)  # gate_L and up_L in the reported timeline
STOCK_TOKENS, STOCK_TOKENS_PER_S = 27000, 1014.0
STAND_IN = "moe_rms_norm"  # the runner's stand-in for attention and normalization (engine/standin.py)


def reported_fields(launch_latency_s: float) -> dict[str, Any]:
    """The fields the report's copy, event-order and kernel figures fit (the stand-in aside)."""
    fields: dict[str, Any] = {"h2d_pinned_bps": HIPMEMCPY_BPS, "h2d_pageable_bps": HIPMEMCPY_BPS}
    # The report gives no copy sizes; copy2 is what the late release means at 53 GB/s.
    copy2 = (EVENT_ORDER_S["after"] - EVENT_ORDER_S["before"]) * HIPMEMCPY_BPS
    rows = [EventOrderTiming("pageable", wait, s, 0.0, int(copy2)) for wait, s in EVENT_ORDER_S.items()]
    # The report's reading: the runtime pins pageable memory on the fly, the copy returns at once,
    # and a wait enqueued after it resolves against the copy stream's tail.
    fields["pageable_blocks_host"] = False
    fields["pageable_wait_binds_tail"] = fit_event_order(rows, HIPMEMCPY_BPS, blocks_host=False)
    pairs = UBATCH * PRESET.top_k
    fmt = weight_format(QTYPE)
    kernel = fmt.kernel_name(fmt.tile_for(pairs, PRESET.n_expert))
    flops = 2.0 * pairs * PRESET.n_ff_exp * PRESET.n_embd
    shape = (PRESET.n_ff_exp, PRESET.n_embd)  # gate and up: n_out x n_in
    timings = [KernelTiming(kernel, shape, pairs / PRESET.n_expert, flops, s) for s in GATE_UP_S]
    rates = [fit_kernel(t, launch_latency_s, other_rate=1.0) for t in timings]
    fields["kernel_rates"] = [r for r in rates if r is not None]
    return fields


def fit_stand_in(profile: Profile, model: MoeModel) -> KernelRate:
    """The stand-in's rate for which the stock path runs STOCK_TOKENS at the reported rate.

    On the stock path every copy and kernel runs in series, so the prefill time is linear in the
    stand-in's time: one run with a free stand-in fixes what the rest costs.
    """
    flops = 3.0 * UBATCH * PRESET.n_embd  # the stand-in's work on one ubatch (twins.py)
    settings = Settings(Batching(STOCK_TOKENS, UBATCH), (0,), (HostMemoryMode.MMAP,))

    def wall_s(rate: float) -> float:
        rates = (*profile.kernel_rates, KernelRate(STAND_IN, (), flops, rate))
        return predict(dataclasses.replace(profile, kernel_rates=rates), model, settings).rows[0].ttft_s

    without = wall_s(1e18)
    stand_in_s = STOCK_TOKENS / STOCK_TOKENS_PER_S - without
    total_flops = 3.0 * STOCK_TOKENS * PRESET.n_embd * PRESET.n_layer
    return KernelRate(STAND_IN, (), flops, total_flops / stand_in_s)


def derive() -> dict[str, Any]:
    fields = reported_fields(ROCM_R9700.launch_latency_s)
    without_stand_in = dataclasses.replace(
        ROCM_R9700,
        **{k: v for k, v in fields.items() if k != "kernel_rates"},
        kernel_rates=tuple(KernelRate.from_value(r) for r in fields["kernel_rates"]),
    )
    with tempfile.TemporaryDirectory(prefix="rocm-r9700-fit-") as folder:
        path = write_sparse_model(PRESET, QTYPE, Path(folder) / "model.gguf")
        with MoeModel.open(path) as model:
            stand_in = fit_stand_in(without_stand_in, model)
    fields["kernel_rates"] = [*fields["kernel_rates"], stand_in]
    return fields


def main() -> int:
    fields = derive()
    fields["kernel_rates"] = [dataclasses.asdict(r) for r in fields["kernel_rates"]]
    print(json.dumps(fields, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
