"""`expertstream tune` against the simulator recovers the simulator's own profile.

The probes run on a simulated device (timing only); the fitted profile must give back every
field it claims to measure within 2%, and every kernel rate it wrote must be the rate the source
profile runs that kernel at. Three sources: the two built-ins and one whose pageable copies
return at once but bind a later wait to the stream's tail, with a shared host memory bus, fixed
costs per pageable copy and per ring fill, and a ring filled by processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

import expertstream
from expertstream.backends.base import Backend
from expertstream.backends.sim.profiles import ROCM_R9700, Profile, resolve_profile
from expertstream.bench import tuner as tune_module
from expertstream.bench.measure import Settings
from expertstream.bench.predict import predict
from expertstream.bench.probes import Bounds
from expertstream.bench.tuner import (
    DEFAULT_PRESET,
    HOST_PATH_FIELDS,
    calibration_model,
    fit_host_paths,
    refit_host_paths,
    ring_bps,
    ring_rates,
    tune,
)
from expertstream.cli import main
from expertstream.engine.runner import Batching
from expertstream.hostmem import DEFAULT_RING_THREADS, HostMemoryMode
from expertstream.model import MoeModel
from microbench import rocm_r9700_fit

TOLERANCE = 0.02
TAIL_BINDING = {
    "base": "rocm-r9700",
    "name": "tail-binding",
    "pageable_blocks_host": False,
    "pageable_wait_binds_tail": True,
    "h2d_pageable_bps": 20e9,
    "host_memcpy_total_bps": 20e9,
    "enqueue_s": 40e-6,
    "call_s": 12e-6,  # a call alone costs less than the job's calls, its own work between them included
    "host_copy_latency_s": 150e-6,
    "h2d_pageable_latency_s": 60e-6,
    "ring_fill": "processes",
}


def _tune(tmp_path: Path, source: Any, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    spec = source
    if isinstance(source, dict):
        spec = tmp_path / "source.json"
        spec.write_text(json.dumps(source))
    out = tmp_path / "tuned.json"
    argv = ["tune", "--backend", "sim", "--sim-profile", str(spec), "--threads", "1,12", "-ub", "1,512,4096"]
    assert main([*argv, "-o", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


@pytest.mark.parametrize("source", ["cuda-h200", "rocm-r9700", TAIL_BINDING], ids=["cuda-h200", "rocm-r9700", "tail"])
def test_tuning_the_simulator_recovers_its_profile(
    source: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = resolve_profile(source) if isinstance(source, str) else Profile.from_dict(source)
    document, printed = _tune(tmp_path, source, capsys)
    tuned = Profile.from_dict(document)
    measured = set(document) - {"base", "name", "kernel_rates"}
    assert {"h2d_pinned_bps", "enqueue_s", "host_memcpy_total_bps", "host_copy_latency_s", "ring_fill"} <= measured
    assert "h2d_pageable_latency_s" in measured
    assert "pageable_wait_binds_tail" in measured
    for field in sorted(measured):
        want, got = getattr(truth, field), getattr(tuned, field)
        if field == "ring_threads" and want is None:
            want = DEFAULT_RING_THREADS  # a profile without it runs this machine's default, which tune writes down
        if field == "ring_fill" and want is None:
            want = "threads"  # a profile without it fills its ring with threads, which tune writes down
        if field == "call_s" and want is None:
            want = truth.enqueue_s  # a profile without it pays enqueue_s for every call, which tune measures
        if field == "h2d_gather_bps" and want is None:
            want = truth.gather_bps  # a profile without it gathers at its DMA rate, which tune measures
        if isinstance(want, float) and field.endswith("_s"):
            assert got == pytest.approx(want, rel=TOLERANCE, abs=1e-7), field  # a cost of zero comes back ~0
        elif isinstance(want, float) and want:
            assert got == pytest.approx(want, rel=TOLERANCE), field
        else:
            assert got == want, field
    assert document["kernel_rates"], "every source runs the mul_mat_id kernels at a measurable rate"
    for rate in tuned.kernel_rates:
        want = truth.kernel_rate(rate.kernel, rate.shape, rate.size)
        assert rate.flops_per_s == pytest.approx(want, rel=TOLERANCE), rate
    assert truth.device_name in printed and "profile written to" in printed
    assert "phases, s: open device and model" in printed and "compile kernels" in printed  # the 30 s budget, visible


def test_the_summary_says_where_the_wait_must_go(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, held = _tune(tmp_path, "cuda-h200", capsys)
    _, bound = _tune(tmp_path, TAIL_BINDING, capsys)
    assert "enqueue the wait before the next copy" in held and "holds the host" in held
    assert "enqueue the wait before the next copy" in bound and "binds the stream's tail" in bound


def test_tune_keeps_whichever_of_the_gather_and_the_dmas_decodes_faster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document, printed = _tune(tmp_path, "cuda-h200", capsys)
    assert document["decode_gather"] is True and "decode copies: the device's gather" in printed
    slow_gather = {"base": "cuda-h200", "name": "slow-gather", "h2d_gather_bps": 0.5e9}  # 1% of the DMAs' rate
    document, printed = _tune(tmp_path, slow_gather, capsys)
    assert document["decode_gather"] is False
    assert "decode copies: DMAs after reading the routing ids back" in printed


def test_a_profile_rates_kernels_by_shape_and_size() -> None:
    rates = [
        {"kernel": "k", "shape": [8, 8], "size": 1, "flops_per_s": 1e12},
        {"kernel": "k", "shape": [8, 8], "size": 100, "flops_per_s": 3e12},
        {"kernel": "k", "shape": [64, 64], "size": 1, "flops_per_s": 9e12},
    ]
    profile = Profile.from_dict({"base": "cuda-h200", "flops_per_s": 5e12, "kernel_rates": rates})
    assert profile.kernel_rate("k", (8, 8), 10) == pytest.approx(2e12)  # halfway in log(size)
    assert profile.kernel_rate("k", (8, 8), 1000) == 3e12 and profile.kernel_rate("k", (8, 8), 0.1) == 1e12
    assert profile.kernel_rate("k", (60, 70), 1) == 9e12  # the nearest measured shape
    assert profile.kernel_rate("other", (), 1) == 5e12  # no entry: the profile's default rate
    assert Profile.from_dict(profile.to_dict()) == profile
    assert math.isfinite(resolve_profile("cuda-h200").kernel_rate("moe_mul_mat_id_q4_0_m64", (768, 2048), 200))


def test_bad_tune_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--backend", "cuda", "--sim-profile", "cuda-h200", "-o", str(tmp_path / "x.json")]) == 2
    assert "--sim-profile describes a simulated device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--threads", "0"])
    with pytest.raises(Exception, match="size and flops_per_s"):
        Profile.from_dict(
            {"base": "cuda-h200", "kernel_rates": [{"kernel": "k", "shape": [], "size": 0, "flops_per_s": 1}]}
        )


def test_the_rocm_profile_is_fitted_to_the_reported_figures() -> None:
    """The built-in rocm-r9700 holds what microbench/rocm_r9700_fit.py fits (the stand-in's fit
    simulates 27k tokens: run that script to check it; here its entry must exist)."""
    fitted = rocm_r9700_fit.reported_fields(ROCM_R9700.launch_latency_s)
    for field, value in fitted.items():
        if field == "kernel_rates":
            for rate in value:
                assert ROCM_R9700.kernel_rate(rate.kernel, rate.shape, rate.size) == pytest.approx(
                    sum(r.flops_per_s for r in value) / len(value), rel=1e-3
                )
        else:
            assert getattr(ROCM_R9700, field) == value, field
    assert any(r.kernel == rocm_r9700_fit.STAND_IN for r in ROCM_R9700.kernel_rates)


def test_tune_measures_every_backend(backend: Backend, tiny_path: Path) -> None:
    """On a GPU: every probe runs, the profile is plausible and predicts the job it was tuned on."""
    small = Bounds(
        copy_bytes=(4 << 20, 16 << 20),
        fill_bytes=(16 << 20, 64 << 20),
        gate_bytes=16 << 20,
        ring_bytes=16 << 20,
        ring_copies=4,
        event_copy_bytes=(4 << 20, 16 << 20),
        mapping_bytes=64 << 20,
    )
    with MoeModel.open(tiny_path) as model:
        tuned = tune(backend, backend.device(0), model, ubatches=(1, 64), host_threads=(1, 2), bounds=small)
        profile = Profile.from_dict(tuned.document())
        rates = [profile.h2d_pinned_bps, profile.h2d_pageable_bps, profile.d2h_bps, profile.memset_bps]
        assert all(0 < rate < 1e13 for rate in rates)  # bytes/s: below 10 TB/s on any link or memory
        assert 0 < profile.enqueue_s < 1e-2 and 0 <= profile.launch_latency_s < 1e-2
        assert tuned.decode_step_s is not None and tuned.decode_step_s > 0
        rows = predict(profile, model, Settings(Batching(32, 16, 2), (0, 3), (HostMemoryMode.REGISTERED,))).rows
    assert len(rows) == 2 and all(r.ttft_s > 0 and r.decode_tokens_per_s for r in rows)


def _misjudged(truth: Profile) -> Profile:
    """What probes that misjudge the host paths would give: the ring's memcpys 40% slow, pageable
    copies 50% fast, no fixed cost per ring fill or pageable copy."""
    return dataclasses.replace(
        ring_rates(truth, 0.6),
        h2d_pageable_bps=truth.h2d_pageable_bps * 1.5,
        host_copy_latency_s=0.0,
        h2d_pageable_latency_s=0.0,
    )


@pytest.mark.parametrize("fill", ["threads", "processes"])
@pytest.mark.parametrize("source", ["cuda-h200", "rocm-r9700"])
def test_the_ring_and_the_mapping_are_fitted_to_the_jobs_prefill_and_decode(
    source: str, fill: str, tmp_path: Path
) -> None:
    """Probes that misjudge the host paths (the ring's memcpys 40% slow, pageable copies 50% fast,
    no fixed costs per copy) are corrected by the job's own prefill and decode steps: the rates
    and costs the job ran at come back within 2%, and the ring is scheduled as it was filled."""
    # A profile that names no ring threads takes this host's count; two keep the ring's copies what
    # bounds the job on any host (with 12, the rocm-r9700 ring outruns its DMAs: nothing to fit), and
    # a bus of 29 GB/s keeps cuda-h200's 12 bound by it (at its 43.6 they nearly keep up with the
    # DMAs, and a prefill tells their rate only roughly).
    truth = resolve_profile(source)
    truth = dataclasses.replace(
        truth,
        ring_threads=truth.ring_threads or 2,
        host_memcpy_total_bps=truth.host_memcpy_total_bps and 29e9,
        ring_fill=fill,
        host_copy_latency_s=80e-6,
        h2d_pageable_latency_s=60e-6,
    )
    misjudged = dataclasses.replace(_misjudged(truth), ring_fill=None)
    with expertstream.backend("sim", profile=truth, data=False) as sim:
        path = calibration_model(sim, tmp_path, DEFAULT_PRESET, "Q4_0")
        with MoeModel.open(path) as model:
            fitted, fits = fit_host_paths(sim, sim.device(0), model, misjudged)
    assert [f.mode for f in fits] == [HostMemoryMode.RING, HostMemoryMode.MMAP]
    assert fitted.ring_fill == fill
    assert fits[0].probe_bps == pytest.approx(0.6 * ring_bps(truth))
    assert fitted.host_memcpy_bps == pytest.approx(truth.host_memcpy_bps, rel=TOLERANCE)
    assert ring_bps(fitted) == pytest.approx(ring_bps(truth), rel=TOLERANCE)  # the shared limit too, where there is one
    assert (fitted.host_memcpy_total_bps is None) == (truth.host_memcpy_total_bps is None)
    assert fitted.h2d_pageable_bps == pytest.approx(truth.h2d_pageable_bps, rel=TOLERANCE)
    assert fits[1].fitted_bps == fitted.h2d_pageable_bps
    assert fitted.host_copy_latency_s == pytest.approx(truth.host_copy_latency_s, rel=TOLERANCE)
    assert fitted.h2d_pageable_latency_s == pytest.approx(truth.h2d_pageable_latency_s, rel=TOLERANCE)
    assert [f.fitted_latency_s for f in fits] == [fitted.host_copy_latency_s, fitted.h2d_pageable_latency_s]
    assert all(f.probe_latency_s == 0.0 and f.decode_step_s for f in fits)


def test_the_host_paths_are_fitted_again_from_what_a_run_measured(tmp_path: Path) -> None:
    """What one fit measured of the job (prefill and decode through each path) fits a misjudged
    profile again to the same rates and costs, with no device: a replay's refit."""
    truth = dataclasses.replace(
        resolve_profile("cuda-h200"), ring_fill="processes", host_copy_latency_s=80e-6, h2d_pageable_latency_s=60e-6
    )
    with expertstream.backend("sim", profile=truth, data=False) as sim:
        path = calibration_model(sim, tmp_path, DEFAULT_PRESET, "Q4_0")
        with MoeModel.open(path) as model:
            fitted, fits = fit_host_paths(sim, sim.device(0), model, _misjudged(truth))
            # From the probes' profile, and from the fitted one, which a replay holds: the fits start
            # from the probes' figures either way.
            for start in (_misjudged(truth), fitted):
                again, refits = refit_host_paths(start, model, fits)
                assert [f.mode for f in refits] == [f.mode for f in fits] == [HostMemoryMode.RING, HostMemoryMode.MMAP]
                for field in HOST_PATH_FIELDS:
                    want, got = getattr(fitted, field), getattr(again, field)
                    assert got == (pytest.approx(want, rel=TOLERANCE) if isinstance(want, float) else want), field
                for was, now in zip(fits, refits, strict=True):
                    assert (now.prefill_s, now.decode_step_s) == (was.prefill_s, was.decode_step_s)
                    assert now.probe_bps == pytest.approx(was.probe_bps) and now.probe_latency_s == was.probe_latency_s


def test_a_ring_that_nearly_keeps_up_with_its_dmas_is_fitted_where_the_probes_say_it_matters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fill processes close to the link's rate leave little of a prefill above its DMAs, but probes
    that rate them slow predict a ring that bounds the job: the fit takes the job's rate."""
    truth = dataclasses.replace(resolve_profile("cuda-h200"), ring_fill="processes", host_memcpy_total_bps=48e9)
    truth = dataclasses.replace(truth, host_memcpy_bps=6e9)  # 12 processes reach the shared limit
    misjudged = dataclasses.replace(_misjudged(truth), h2d_pageable_bps=truth.h2d_pageable_bps)
    shares: list[float] = []
    real = tune_module.solve

    def solve(simulated: Any, measured: float, x0: float, x1: float) -> float:
        shares.append((measured - simulated(0.0)) / measured)
        return real(simulated, measured, x0, x1)

    monkeypatch.setattr(tune_module, "solve", solve)
    with expertstream.backend("sim", profile=truth, data=False) as sim:
        path = calibration_model(sim, tmp_path, DEFAULT_PRESET, "Q4_0")
        with MoeModel.open(path) as model:
            fitted, fits = fit_host_paths(sim, sim.device(0), model, misjudged)
    assert fits[0].mode is HostMemoryMode.RING and shares[0] < tune_module.MIN_COPY_SHARE  # measured: a sliver
    assert ring_bps(fitted) == pytest.approx(ring_bps(truth), rel=TOLERANCE)


def test_a_fixed_cost_the_probes_put_far_off_is_fitted_before_the_rate(tmp_path: Path) -> None:
    """Probes that put a ring fill's fixed cost far above the job's leave no rate at which the
    prefill of a thread-filled ring (every fill pays the cost) comes out as measured: the cost is
    fitted to the decode steps first, then the rate to the prefill."""
    truth = dataclasses.replace(resolve_profile("cuda-h200"), ring_fill="threads", host_copy_latency_s=150e-6)
    misjudged = dataclasses.replace(_misjudged(truth), host_copy_latency_s=20e-3)
    with expertstream.backend("sim", profile=truth, data=False) as sim:
        path = calibration_model(sim, tmp_path, DEFAULT_PRESET, "Q4_0")
        with MoeModel.open(path) as model:
            fitted, fits = fit_host_paths(sim, sim.device(0), model, misjudged)
    assert fits[0].mode is HostMemoryMode.RING and fits[0].probe_latency_s == 20e-3
    assert fitted.host_copy_latency_s == pytest.approx(truth.host_copy_latency_s, rel=TOLERANCE)
    assert ring_bps(fitted) == pytest.approx(ring_bps(truth), rel=TOLERANCE)


def test_a_host_path_too_small_to_tell_keeps_the_probes_rates(tiny_path: Path) -> None:
    """The tiny model's expert copies are a sliver of its prefill: fitting a rate to it would credit
    the copies with the kernels' time, so the probes' rates stay and no path is listed."""
    truth = resolve_profile("cuda-h200")
    misjudged = _misjudged(truth)
    with expertstream.backend("sim", profile=truth, data=False) as sim, MoeModel.open(tiny_path) as model:
        fitted, fits = fit_host_paths(sim, sim.device(0), model, misjudged)
    assert fits == [] and fitted == dataclasses.replace(misjudged, ring_fill=truth.ring_fill)  # who filled it, still


def test_the_host_paths_are_fitted_on_a_bounded_part_of_a_large_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for one layer's experts, the fit's prefills stream one layer of the two: tune's
    time does not grow with the model, and the fitted rates are those of the whole model."""
    truth = dataclasses.replace(resolve_profile("cuda-h200"), host_memcpy_total_bps=29e9)  # a ring that bounds
    with expertstream.backend("sim", profile=truth, data=False) as sim:
        path = calibration_model(sim, tmp_path, DEFAULT_PRESET, "Q4_0")
        with MoeModel.open(path) as model:
            whole, whole_fits = fit_host_paths(sim, sim.device(0), model, truth)
            layer_bytes = sum(t.nbytes for t in model.layers[0].experts)
            monkeypatch.setattr(tune_module, "HOST_PATH_BYTES", layer_bytes + 1)
            bounded, bounded_fits = fit_host_paths(sim, sim.device(0), model, truth)
    assert [f.mode for f in bounded_fits] == [f.mode for f in whole_fits] == [HostMemoryMode.RING, HostMemoryMode.MMAP]
    for one_layer, two_layers in zip(bounded_fits, whole_fits, strict=True):
        assert one_layer.prefill_s < 0.7 * two_layers.prefill_s  # one layer of two, and the ring's start
    assert bounded.h2d_pageable_bps == pytest.approx(whole.h2d_pageable_bps, rel=TOLERANCE)
    assert bounded.host_memcpy_total_bps == pytest.approx(whole.host_memcpy_total_bps, rel=TOLERANCE)


def test_the_decode_calibration_runs_on_the_same_bounded_part_and_fits_the_whole_models_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tune times decode steps on the layers the host paths sample, not the whole model: what it fits
    per call and per operation is the same, and a large model's tune stays short."""
    truth = Profile.from_dict({"base": "cuda-h200", "enqueue_s": 40e-6, "call_s": 12e-6, "launch_latency_s": 6e-6})
    with expertstream.backend("sim", profile=truth, data=False) as sim:
        path = calibration_model(sim, tmp_path, DEFAULT_PRESET, "Q4_0")
        with MoeModel.open(path) as model:
            whole = tune(sim, sim.device(0), model, ubatches=(1, 512), host_threads=(1, 12))
            layer_bytes = sum(t.nbytes for t in model.layers[0].experts)
            monkeypatch.setattr(tune_module, "HOST_PATH_BYTES", layer_bytes + 1)
            bounded = tune(sim, sim.device(0), model, ubatches=(1, 512), host_threads=(1, 12))
    assert (whole.decode_layers, bounded.decode_layers) == (2, 1)
    assert whole.decode_step_s is not None and bounded.decode_step_s is not None
    assert bounded.decode_step_s < 0.7 * whole.decode_step_s  # one layer's steps of two
    for field in ("enqueue_s", "launch_latency_s"):
        assert bounded.fields[field] == pytest.approx(getattr(truth, field), rel=TOLERANCE), field
        assert whole.fields[field] == pytest.approx(getattr(truth, field), rel=TOLERANCE), field
