"""What the scheduler runs: splits, their inputs, and the routing of MUL_MAT_ID splits."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import BufferView, Device, Stream, Usage
from ..errors import InvalidArgument
from ..ggml import RowType, padded_size
from .source import HostSource, argument_kind

Bindings = Mapping[str, BufferView]
"""Input name -> device bytes to read (for host inputs: ``padded_size`` bytes, tail zeroed)."""

ComputeFn = Callable[[Stream, Bindings], None]
"""Enqueues a split's kernels on the given stream; must not block the host."""


@dataclass(frozen=True)
class Input:
    """One tensor a split reads: device-resident (``device_data``) or host-resident (``host``)."""

    name: str
    nbytes: int
    host: HostSource | None = None
    device_data: BufferView | None = None
    usage: Usage = Usage.WEIGHTS
    row_type: RowType | None = None
    ne0: int | None = None
    expert_nbytes: int | None = None  # bytes of one expert's matrix, for MUL_MAT_ID weights

    def __post_init__(self) -> None:
        where = f"input {self.name!r}"
        if (self.host is None) == (self.device_data is None):
            raise InvalidArgument(f"{where} needs exactly one of host= or device_data=")
        if self.host is not None and not isinstance(self.host, HostSource):
            # Refused here: the scheduler would only fail mid-run, on the first attribute it reads.
            raise InvalidArgument(
                f"{where}: host= takes host memory behind a HostSource, not {argument_kind(self.host)}",
                call="Input",
                hint="wrap host memory in HostRegion(buffer, start, length) or pass a staging ring's source; "
                "device-resident data enters a plan as Input(device_data=buffer.view())",
            )
        available = self.host.nbytes if self.host is not None else self.device_data.nbytes  # type: ignore[union-attr]
        if not 0 <= self.nbytes <= available:
            raise InvalidArgument(f"{where} declares {self.nbytes} bytes but its data holds {available}")
        if self.expert_nbytes is not None and (self.expert_nbytes <= 0 or self.nbytes % self.expert_nbytes):
            raise InvalidArgument(
                f"{where}: expert size {self.expert_nbytes} does not divide the tensor's {self.nbytes} bytes"
            )

    @property
    def is_host(self) -> bool:
        return self.host is not None

    @property
    def padded_nbytes(self) -> int:
        return padded_size(self.nbytes, self.row_type, self.ne0)


@dataclass(frozen=True)
class Prediction:
    """The experts a decode step's router is expected to choose, known before it runs.

    ``ids``: ``n_ids`` int32 expert ids on the split's device that split ``after`` (earlier in
    the plan) writes; for example the next layer's router applied to this layer's FFN input. A
    prediction only moves copies earlier (``Scheduler``'s decode lookahead): the experts the
    router then chooses are the ones computed, whatever was predicted.
    """

    ids: BufferView
    n_ids: int
    after: str

    def __post_init__(self) -> None:
        if self.n_ids <= 0 or self.ids.nbytes < 4 * self.n_ids or self.ids.offset % 4:
            raise InvalidArgument(f"a prediction needs {self.n_ids} > 0 whole int32 ids in its view")


@dataclass(frozen=True)
class MulMatId:
    """Routing of a MUL_MAT_ID split: which experts each token uses.

    ``stand_in_ids``: the expert ids a backend that holds no data (the simulator's timing-only
    mode) copies by at decode scale; the ids it reads back mean nothing there. ``predicted``:
    the experts expected before the router runs (decode scale only; see ``Prediction``).

    ``packed``: the split's kernels index its expert weights by the ids each binds under
    ``expert_ids(name)``, so that at decode scale the scheduler may copy the experts a step uses
    one after another into scratch of a few experts (``Stream.gather_h2d``'s packed rows) instead
    of at their own offsets in scratch of the whole tensor. A weight then binds fewer experts
    than ``n_expert`` (``bound_experts``), its padding tail after them, and its ids name those;
    elsewhere (prefill scale, weights on the device, prefetched) it binds the whole tensor and
    its ids are ``ids``.
    """

    ids: BufferView  # int32 [n_tokens, top_k] on the split's device
    n_ids: int  # n_tokens * top_k
    n_expert: int
    weights: tuple[str, ...]  # names of the inputs holding the expert matrices
    stand_in_ids: np.ndarray | None = field(default=None, compare=False)
    predicted: Prediction | None = field(default=None, compare=False)
    packed: bool = False

    def __post_init__(self) -> None:
        if self.n_ids <= 0 or self.n_expert <= 0:
            raise InvalidArgument(f"MUL_MAT_ID needs positive n_ids and n_expert, got {self.n_ids}, {self.n_expert}")
        if self.ids.nbytes < 4 * self.n_ids:
            raise InvalidArgument(
                f"ids view holds {self.ids.nbytes} bytes; {self.n_ids} int32 ids need {4 * self.n_ids}"
            )
        stand_in = self.stand_in_ids
        if stand_in is not None and (
            stand_in.size != self.n_ids or (stand_in.size and not 0 <= stand_in.min() <= stand_in.max() < self.n_expert)
        ):
            raise InvalidArgument(f"stand-in ids must be {self.n_ids} expert ids in 0..{self.n_expert - 1}")


def expert_ids(name: str) -> str:
    """The binding of a packed MUL_MAT_ID split (``MulMatId.packed``) that holds the int32 ids its
    kernels index the experts of input ``name`` by."""
    return f"{name}:ids"


def bound_experts(view: BufferView, expert_nbytes: int, tail_nbytes: int) -> int:
    """The experts a binding of expert weights holds: the bytes before its padding tail
    (``Input.padded_nbytes - Input.nbytes``) over one expert's."""
    return (view.nbytes - tail_nbytes) // expert_nbytes


@dataclass(frozen=True)
class Split:
    """A run of kernels on one device and the inputs they read."""

    name: str
    device: Device
    inputs: tuple[Input, ...]
    compute: ComputeFn
    mul_mat_id: MulMatId | None = None

    def __post_init__(self) -> None:
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"split {self.name!r} has two inputs with one name")
        for inp in self.inputs:
            if inp.device_data is not None and inp.device_data.buffer.device is not self.device:
                runs_on, lives_on = _labels_apart(self.device, inp.device_data.buffer.device)
                raise InvalidArgument(
                    f"split {self.name!r} runs on {runs_on} but its input {inp.name!r} lives on {lives_on}",
                    hint="give each split inputs on its own device (copy activations between devices in a split)",
                )
        mmid = self.mul_mat_id
        if mmid is not None:
            if mmid.ids.buffer.device is not self.device:
                raise InvalidArgument(f"split {self.name!r}: routing ids live on another device")
            unknown = set(mmid.weights) - set(names)
            if unknown:
                raise InvalidArgument(f"split {self.name!r}: MUL_MAT_ID weights {sorted(unknown)} are not inputs")
            for inp in self.inputs:
                if inp.name not in mmid.weights:
                    continue
                if inp.expert_nbytes is None:
                    raise InvalidArgument(f"split {self.name!r}: expert weights {inp.name!r} need expert_nbytes")
                if inp.expert_nbytes * mmid.n_expert != inp.nbytes:
                    raise InvalidArgument(
                        f"split {self.name!r}: input {inp.name!r} holds {inp.nbytes} bytes, but {mmid.n_expert} "
                        f"experts of {inp.expert_nbytes} bytes make {inp.expert_nbytes * mmid.n_expert}",
                        hint="expert_nbytes is the bytes of one expert's matrix: the tensor's bytes / n_expert",
                    )


def _labels_apart(first: Device, second: Device) -> tuple[str, str]:
    """Two devices' labels for one message, with their backends' numbers ("sim#2:0") where the labels
    alone are alike: device 0 of two backends of one kind."""
    if first.label != second.label:
        return first.label, second.label
    return f"{first.backend.instance_name}:{first.index}", f"{second.backend.instance_name}:{second.index}"


@dataclass(frozen=True)
class Plan:
    """Splits in launch order."""

    splits: tuple[Split, ...]
    devices: tuple[Device, ...] = field(init=False)

    def __post_init__(self) -> None:
        devices: list[Device] = []
        for split in self.splits:
            if split.device not in devices:
                devices.append(split.device)
        object.__setattr__(self, "devices", tuple(devices))
        self._check_ids_reuse()
        self._check_predictions()

    @classmethod
    def of(cls, splits: Sequence[Split]) -> Plan:
        return cls(tuple(splits))

    def _check_predictions(self) -> None:
        """A prediction's ids come from an earlier split on the same device."""
        earlier: dict[str, Split] = {}
        for split in self.splits:
            predicted = split.mul_mat_id.predicted if split.mul_mat_id is not None else None
            if predicted is not None:
                writer = earlier.get(predicted.after)
                if writer is None:
                    raise InvalidArgument(
                        f"split {split.name!r}: its predicted experts come from {predicted.after!r}, "
                        "which is not an earlier split of the plan",
                        hint="name the split that writes the predicted ids, placed before this one",
                    )
                if writer.device is not split.device or predicted.ids.buffer.device is not split.device:
                    raise InvalidArgument(f"split {split.name!r}: its predicted experts live on another device")
            earlier[split.name] = split

    def _check_ids_reuse(self) -> None:
        # The stock decode path reads each ids buffer back once and reuses it for the splits that
        # follow; that is only right while no other split can rewrite it in between.
        last_seen: dict[tuple[int, int], int] = {}
        for index, split in enumerate(self.splits):
            if split.mul_mat_id is None:
                continue
            key = (id(split.mul_mat_id.ids.buffer), split.mul_mat_id.ids.offset)
            previous = last_seen.get(key)
            if previous is not None and previous != index - 1:
                raise InvalidArgument(
                    f"splits {self.splits[previous].name!r} and {split.name!r} share routing ids but are not adjacent",
                    hint="give each layer its own ids buffer",
                )
            last_seen[key] = index
