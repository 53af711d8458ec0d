"""The scheduler: splits, the stock copy path and lookahead prefetch into prefetch slots (device buffers)."""

from .plan import Bindings, ComputeFn, Input, MulMatId, Plan, Prediction, Split, bound_experts, expert_ids
from .prefetch import prefetch_footprint, slot_sizes
from .scheduler import (
    DEFAULT_PREFILL_FACTOR,
    MAX_SLOTS,
    Replay,
    Scheduler,
    check_slots,
    device_footprint,
    is_prefill_scale,
)
from .source import HostRegion, HostSource
from .stats import DeviceStats, Fallback, RunStats

__all__ = [
    "DEFAULT_PREFILL_FACTOR",
    "MAX_SLOTS",
    "Bindings",
    "ComputeFn",
    "DeviceStats",
    "Fallback",
    "HostRegion",
    "HostSource",
    "Input",
    "MulMatId",
    "Plan",
    "Prediction",
    "Replay",
    "RunStats",
    "Scheduler",
    "Split",
    "bound_experts",
    "check_slots",
    "device_footprint",
    "expert_ids",
    "is_prefill_scale",
    "prefetch_footprint",
    "slot_sizes",
]
