"""A model's MoE layers split over devices, and the hidden state's crossing between them.

``LayerSplit`` gives each device a contiguous run of layers, the first ones to the first
device (llama.cpp's ``--split-mode layer``). Where one device's layers end, the hidden rows
of a ubatch (or decode step) cross to the next device: the sending device's last split
records an event after its residual add, the receiving device's first split waits on it
and copies the rows, peer to peer where the devices allow it, else through a page-locked
host buffer that the sender fills on its own stream before it records.

Every ubatch has its own rows in the hidden state and in the host buffer, so nothing is
overwritten while the other side may still read it, and one event per crossing is enough:
each wait is enqueued before the next record of the same event (plan order).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .._closing import Closing
from ..backends.base import BufferView, Device, Event, HostBuffer, Stream
from ..errors import BackendError, InvalidArgument
from ..model import MoeModel

log = logging.getLogger(__name__)


class LayerSplit:
    """Which device runs each MoE layer: contiguous, as even as the layer count allows."""

    def __init__(self, model: MoeModel, devices: Sequence[Device]) -> None:
        devices = tuple(devices)
        if not devices:
            raise InvalidArgument("a layer split needs at least one device", call="LayerSplit")
        if len({id(d) for d in devices}) != len(devices):
            raise InvalidArgument(
                f"devices repeat in {[d.label for d in devices]}", call="LayerSplit", hint="name each device once"
            )
        backends = {id(d.backend) for d in devices}
        if len(backends) > 1:
            raise InvalidArgument("the devices of a layer split belong to different backends", call="LayerSplit")
        layers = model.layers
        if len(devices) > len(layers):
            raise InvalidArgument(
                f"{len(devices)} devices for {len(layers)} MoE layers: each device needs at least one layer",
                call="LayerSplit",
                hint="use fewer devices",
            )
        self.devices = devices
        base, extra = divmod(len(layers), len(devices))
        self.layers: dict[Device, tuple[int, ...]] = {}
        start = 0
        for i, device in enumerate(devices):
            count = base + (1 if i < extra else 0)
            self.layers[device] = tuple(layer.index for layer in layers[start : start + count])
            start += count
        self._device_of = {index: device for device, indexes in self.layers.items() for index in indexes}
        # Where each expert tensor is copied to: what a staging ring per device needs (HostWeights.open).
        self.expert_devices = {t.name: self.device_of(layer.index) for layer in layers for t in layer.experts}

    def device_of(self, layer_index: int) -> Device:
        return self._device_of[layer_index]

    def __repr__(self) -> str:
        parts = ", ".join(f"{d.label}: layers {ix[0]}..{ix[-1]}" for d, ix in self.layers.items())
        return f"LayerSplit({parts})"


@dataclass(frozen=True)
class Crossing:
    """One ubatch's (or decode step's) hidden rows moving from one device to the next."""

    link: Link
    src: BufferView  # the rows on the sending device
    dst: BufferView  # the same rows on the receiving device
    bounce: HostBuffer | None  # host rows of the same offsets, where peers cannot copy directly

    def send(self, stream: Stream) -> None:
        """On the sender's compute stream, after its last kernel for these rows."""
        if self.bounce is not None:
            stream.copy_d2h(self.bounce, self.src.offset, self.src.buffer, self.src.offset, self.src.nbytes)
        stream.record(self.link.sent)

    def receive(self, stream: Stream) -> None:
        """On the receiver's compute stream, before its first kernel for these rows."""
        stream.wait(self.link.sent)
        if self.bounce is not None:
            stream.copy_h2d(self.dst.buffer, self.dst.offset, self.bounce, self.src.offset, self.dst.nbytes)
        else:
            stream.copy_d2d(self.dst.buffer, self.dst.offset, self.src.buffer, self.src.offset, self.dst.nbytes)


class Link(Closing):
    """The crossing from ``sender`` to ``receiver``: an event, and host buffers when not peers.

    Peer access is asked for once; a refusal is logged once and the link goes through host
    memory (``via`` says which).
    """

    def __init__(self, sender: Device, receiver: Device, bounce_bytes: Sequence[int]) -> None:
        self.sender, self.receiver = sender, receiver
        self.sent: Event = sender.event()
        self.bounce: list[HostBuffer] = []
        try:
            receiver.enable_peer_access(sender)
            self.via = "peer"
        except BackendError as exc:  # InvalidArgument and DeviceError among them
            log.warning(
                "%s cannot read %s's memory (%s): the hidden state crosses through page-locked host memory",
                receiver.label,
                sender.label,
                exc,
            )
            self.via = "host"
            try:
                self.bounce = [sender.alloc_pinned(max(n, 4)) for n in bounce_bytes]
            except BaseException:
                self.close()
                raise

    def crossing(self, src: BufferView, dst: BufferView, region: int) -> Crossing:
        """Rows ``src`` (sender) to ``dst`` (receiver), through host buffer ``region`` if not peers."""
        return Crossing(self, src, dst, self.bounce[region] if self.bounce else None)

    def close(self) -> None:
        for buf in self.bounce:
            buf.close()
        self.bounce.clear()
        self.sent.close()
