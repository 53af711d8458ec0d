"""Per-device counters of what the scheduler did."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


class Fallback(str, enum.Enum):
    """Why a prefetch-eligible input took the stock copy path instead (stats keys)."""

    ALLOC_FAILED = "alloc_failed"  # prefetch slots, stream or events could not be allocated: prefetch turned off
    DISABLED = "disabled"  # prefetch is off on this device since an earlier failure
    TOO_MANY_INPUTS = "too_many_inputs"  # a split reads more prefetchable inputs than the prefetch slots leave room for
    GATHER_FAILED = "gather_failed"  # the device could not copy decode's experts itself: ids read back since
    LOOKAHEAD_FAILED = "lookahead_failed"  # a decode step with the lookahead's second stream could not be captured


@dataclass
class DeviceStats:
    device: str
    fires: int = 0  # lookahead copies enqueued into prefetch slots
    consumed: int = 0  # splits that read a prefetch slot
    bytes_prefetched: int = 0
    bytes_stock: int = 0  # bytes the stock path copied right before their split
    stock_copies: int = 0
    ids_readbacks: int = 0  # decode-scale host syncs to read routing ids
    gathers: int = 0  # decode-scale expert copies the device made itself from the routing ids
    bytes_gathered_at_most: int = 0  # their bytes if every id names its own expert (one token's top-k do)
    lookahead_gathers: int = 0  # decode copies of predicted experts, made before their router ran
    bytes_lookahead_at_most: int = 0
    ready_wait_ms: float = 0.0  # time the compute stream waited on prefetch-slot ready events
    untimed_waits: int = 0  # ready waits left out of ready_wait_ms (no timing event could be made)
    fallbacks: Counter[Fallback] = field(default_factory=Counter)

    def add(self, other: DeviceStats) -> None:
        """Count what ``other`` (of the same device) counted too."""
        for name, value in vars(other).items():
            if name == "fallbacks":
                self.fallbacks.update(value)
            elif name != "device":
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fallbacks"] = {reason.value: n for reason, n in self.fallbacks.items()}
        return out


@dataclass
class RunStats:
    """What one Scheduler.run did, by device label."""

    devices: dict[str, DeviceStats] = field(default_factory=dict)

    def device(self, label: str) -> DeviceStats:
        if label not in self.devices:
            self.devices[label] = DeviceStats(label)
        return self.devices[label]

    def add(self, other: RunStats) -> RunStats:
        """Count what ``other`` counted too (runs one after another); returns self."""
        for label, stats in other.devices.items():
            self.device(label).add(stats)
        return self

    def total(self, name: str) -> float:
        return sum(getattr(d, name) for d in self.devices.values())

    def bytes_moved(self) -> int:
        """Host bytes copied to the devices, every way (a gather's at most)."""
        moved = ("bytes_prefetched", "bytes_stock", "bytes_gathered_at_most", "bytes_lookahead_at_most")
        return int(sum(self.total(name) for name in moved))

    def as_dict(self) -> dict[str, Any]:
        return {label: d.as_dict() for label, d in self.devices.items()}
