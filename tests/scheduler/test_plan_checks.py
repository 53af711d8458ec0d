"""A plan that cannot run is refused when it is built, naming the split, the input and the numbers."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, Device, HostBuffer
from expertstream.errors import InvalidArgument
from expertstream.scheduler import Input, MulMatId, Plan, Split
from expertstream.scheduler.source import HostRegion


@pytest.fixture
def two_devices() -> Iterator[Backend]:
    backend = expertstream.backend("sim", profile="cuda-h200", devices=2, check_hazards=True)
    yield backend
    backend.close()


def _host(device: Device, nbytes: int = 64) -> tuple[HostBuffer, HostRegion]:
    host = device.wrap_host(np.zeros(nbytes, dtype=np.uint8))
    return host, HostRegion(host, 0, nbytes)


def _noop(stream, bindings) -> None:  # type: ignore[no-untyped-def]
    pass


def test_input_limits(two_devices: Backend) -> None:
    device = two_devices.device(0)
    _, region = _host(device)
    assert Input("empty", 0, host=region).nbytes == 0
    assert Input("w", 64, host=region, expert_nbytes=1).expert_nbytes == 1
    with pytest.raises(InvalidArgument) as err:
        Input("w", 65, host=region)
    assert err.value.detail == "input 'w' declares 65 bytes but its data holds 64"
    with pytest.raises(InvalidArgument) as err:
        Input("w", -1, host=region)
    assert err.value.detail == "input 'w' declares -1 bytes but its data holds 64"
    with pytest.raises(InvalidArgument) as err:
        Input("w", 64)
    assert err.value.detail == "input 'w' needs exactly one of host= or device_data="
    for expert_nbytes in (0, -8, 48):
        with pytest.raises(InvalidArgument) as err:
            Input("w", 64, host=region, expert_nbytes=expert_nbytes)
        assert err.value.detail == f"input 'w': expert size {expert_nbytes} does not divide the tensor's 64 bytes"


def test_an_input_refuses_device_memory_where_host_memory_belongs(two_devices: Backend) -> None:
    device = two_devices.device(0)
    host, _ = _host(device)
    with device.alloc(64) as on_device:
        for wrong, kind in ((on_device, "a DeviceBuffer (device memory)"), (host, "a SimHostBuffer")):
            with pytest.raises(InvalidArgument) as err:
                Input("w", 64, host=wrong)  # type: ignore[arg-type]
            assert err.value.detail == f"input 'w': host= takes host memory behind a HostSource, not {kind}"
            assert err.value.call == "Input" and "HostRegion" in (err.value.hint or "")


def test_routing_limits(two_devices: Backend) -> None:
    ids = two_devices.device(0).upload(np.zeros(4, dtype=np.int32))
    assert MulMatId(ids.view(), 1, 1, ("w",)).n_expert == 1
    assert MulMatId(ids.view(), 4, 8, ("w",)).n_ids == 4  # the view holds exactly 4 ids
    for n_ids, n_expert in ((0, 8), (4, 0), (-1, 8), (4, -1)):
        with pytest.raises(InvalidArgument) as err:
            MulMatId(ids.view(), n_ids, n_expert, ("w",))
        assert err.value.detail == f"MUL_MAT_ID needs positive n_ids and n_expert, got {n_ids}, {n_expert}"
    with pytest.raises(InvalidArgument) as err:
        MulMatId(ids.view(), 5, 8, ("w",))
    assert err.value.detail == "ids view holds 16 bytes; 5 int32 ids need 20"


def test_split_checks(two_devices: Backend) -> None:
    dev0, dev1 = two_devices.device(0), two_devices.device(1)
    _, region = _host(dev0)
    weights = Input("w", 64, host=region, expert_nbytes=16)
    ids0, ids1 = dev0.upload(np.zeros(4, dtype=np.int32)), dev1.upload(np.zeros(4, dtype=np.int32))
    elsewhere = dev1.alloc(64)
    with pytest.raises(InvalidArgument) as err:
        Split("s", dev0, (weights, Input("w", 8, host=region)), _noop)
    assert err.value.detail == "split 's' has two inputs with one name"
    with pytest.raises(InvalidArgument) as err:
        Split("s", dev0, (Input("x", 64, device_data=elsewhere.view()),), _noop)
    assert err.value.detail == f"split 's' runs on {dev0.label} but its input 'x' lives on {dev1.label}"
    assert err.value.hint == "give each split inputs on its own device (copy activations between devices in a split)"
    with pytest.raises(InvalidArgument) as err:
        Split("s", dev0, (weights,), _noop, MulMatId(ids1.view(), 4, 4, ("w",)))
    assert err.value.detail == "split 's': routing ids live on another device"
    with pytest.raises(InvalidArgument) as err:
        Split("s", dev0, (weights,), _noop, MulMatId(ids0.view(), 4, 4, ("w", "v", "u")))
    assert err.value.detail == "split 's': MUL_MAT_ID weights ['u', 'v'] are not inputs"
    plain = Input("w", 64, host=region)
    with pytest.raises(InvalidArgument) as err:
        Split("s", dev0, (plain,), _noop, MulMatId(ids0.view(), 4, 4, ("w",)))
    assert err.value.detail == "split 's': expert weights 'w' need expert_nbytes"
    # Inputs that are not expert weights need no expert size.
    Split("s", dev0, (weights, Input("x", 8, host=region)), _noop, MulMatId(ids0.view(), 4, 4, ("w",)))


def test_a_split_names_apart_devices_of_two_backends_of_one_kind(two_devices: Backend) -> None:
    with expertstream.backend("sim") as other, other.device(0).alloc(64) as elsewhere:
        here = two_devices.device(0)
        assert here.label == elsewhere.device.label == "sim:0"
        with pytest.raises(InvalidArgument) as err:
            Split("s", here, (Input("x", 64, device_data=elsewhere.view()),), _noop)
        runs_on, lives_on = f"{two_devices.instance_name}:0", f"{other.instance_name}:0"
        assert runs_on != lives_on
        assert err.value.detail == f"split 's' runs on {runs_on} but its input 'x' lives on {lives_on}"


def test_splits_sharing_routing_ids_must_be_adjacent(two_devices: Backend) -> None:
    device = two_devices.device(0)
    _, region = _host(device)
    weights = Input("w", 64, host=region, expert_nbytes=16)
    shared, own = device.upload(np.zeros(8, dtype=np.int32)), device.upload(np.zeros(4, dtype=np.int32))

    def split(name: str, ids: object = None, offset: int = 0) -> Split:
        if ids is None:
            return Split(name, device, (), _noop)
        routing = MulMatId(ids.view(offset, 16), 4, 4, ("w",))  # type: ignore[attr-defined]
        return Split(name, device, (weights,), _noop, routing)

    Plan.of([split("a", shared), split("b", shared), split("c", own), split("d", shared, 16)])
    with pytest.raises(InvalidArgument) as err:
        Plan.of([split("plain"), split("a", shared), split("c", own), split("b", shared)])
    assert err.value.detail == "splits 'a' and 'b' share routing ids but are not adjacent"
    assert err.value.hint == "give each layer its own ids buffer"
    with pytest.raises(InvalidArgument, match="splits 'b' and 'c' share"):
        Plan.of([split("a", shared), split("b", shared), split("plain"), split("c", shared)])
