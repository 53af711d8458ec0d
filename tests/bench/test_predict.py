"""Predictions are the job run in virtual time; `auto` picks the fastest predicted setting that fits."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import expertstream
from expertstream.backends.sim.profiles import Profile, resolve_profile
from expertstream.bench.measure import Settings
from expertstream.bench.placeholder import write_sparse_model
from expertstream.bench.predict import SLOT_CHOICES, TIE, Candidate, choose, pick, predict, seconds
from expertstream.cli import main
from expertstream.engine.runner import Batching, MoeRunner
from expertstream.ggml import padded_size
from expertstream.hostmem import HostMemoryMode
from expertstream.model import MoeModel

REGISTERED, RING, MMAP = HostMemoryMode.REGISTERED, HostMemoryMode.RING, HostMemoryMode.MMAP


@pytest.fixture(scope="module")
def qwen3_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer of Qwen3-30B-A3B shapes, sparse: timing-only runs read no bytes."""
    return write_sparse_model("qwen3-30b-a3b", "Q4_0", tmp_path_factory.mktemp("m") / "q.gguf", layers=1)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_prediction_with_the_simulators_own_profile_is_what_it_measures(
    qwen3_layer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["prefill", str(qwen3_layer), "--backend", "sim", "--timing-only", "-p", "1024", "-ub", "512"]
    code, out, _ = _run(
        capsys, *argv, "-n", "2", "--slots", "0,3", "--host-memory", "registered,mmap", "-r", "1", "--json"
    )
    rows = json.loads(out)["rows"]
    assert code == 0 and len(rows) == 4
    assert all(r["predicted_ttft_s"] is None for r in rows)
    code, out, _ = _run(
        capsys, *argv, "-n", "2", "--slots", "0,3", "--host-memory", "registered,mmap", "-r", "1", "--json", "--predict"
    )
    predicted = json.loads(out)["rows"]
    assert code == 0
    for row in predicted:
        assert row["predicted_ttft_s"] == pytest.approx(row["ttft_s"], rel=1e-9)
        assert row["predicted_decode_tokens_per_s"] == pytest.approx(row["decode_tokens_per_s"], rel=1e-9)
    code, out, _ = _run(capsys, *argv, "--slots", "3", "--predict", "rocm-r9700")
    assert code == 0 and "pred s" in out and "err" in out  # another profile: a different prediction, shown


def test_a_profile_tuned_before_a_field_was_measured_is_named_with_the_field(
    qwen3_layer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from expertstream.bench.tuner import FITTED_FIELDS

    whole = resolve_profile("cuda-h200").to_dict()
    tuned = {"base": "cuda-h200", "name": "tuned", "device_name": "NVIDIA H200", "kernel_rates": []}
    tuned |= {f: whole[f] for f in FITTED_FIELDS if f != "kernel_rates"}  # what tune writes
    argv = ["prefill", str(qwen3_layer), "--backend", "sim", "--timing-only", "-p", "512", "--slots", "3"]
    for name, document, said in (
        ("current.json", tuned, False),
        ("older.json", {k: v for k, v in tuned.items() if k != "call_s"}, True),
        ("by-hand.json", {"base": "cuda-h200", "enqueue_s": 40e-6}, False),  # the rest from its base, meant so
    ):
        path = tmp_path / name
        path.write_text(json.dumps(document))
        code, out, err = _run(capsys, *argv, "--predict", str(path))
        assert code == 0 and "pred s" in out
        notice = f"{path} was tuned before tune measured call_s"
        assert (notice in err) is said and ("'cuda-h200'" in err) is said, err


@pytest.mark.parametrize(("profile", "resolved"), [("cuda-h200", "registered"), ("rocm-r9700", "ring")])
def test_auto_slots_and_ubatch_work_with_the_default_host_memory(
    qwen3_layer: Path, capsys: pytest.CaptureFixture[str], profile: str, resolved: str
) -> None:
    """No --host-memory: the preferred mode, which each platform resolves (registered where it can)."""
    argv = ["prefill", str(qwen3_layer), "--backend", "sim", "--sim-profile", profile, "--timing-only", "-p", "2048"]
    code, out, err = _run(capsys, *argv, "-r", "1", "--json", "--slots", "auto", "--ubatch", "auto")
    assert code == 0, err
    document = json.loads(out)
    (row,) = document["rows"]
    assert row["host_memory"] == document["auto"]["host_memory"] == resolved
    assert (row["slots"], row["ubatch"]) == (document["auto"]["slots"], document["auto"]["ubatch"])


def test_auto_picks_the_fastest_prediction_and_says_why(qwen3_layer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["prefill", str(qwen3_layer), "--backend", "sim", "--timing-only", "-p", "2048", "-r", "1", "--json"]
    code, out, err = _run(capsys, *argv, "-ub", "auto", "--slots", "auto", "--host-memory", "auto")
    document = json.loads(out)
    picked = document["auto"]
    assert code == 0 and err.count("\n") == 1 and "auto picked" in err and picked["why"] in err
    (row,) = document["rows"]
    assert (row["slots"], row["host_memory"], row["ubatch"]) == (
        picked["slots"],
        picked["host_memory"],
        picked["ubatch"],
    )
    # Nothing predicted faster among the same candidates: check it against every one predicted here.
    profile = resolve_profile("cuda-h200")
    with MoeModel.open(qwen3_layer) as model:
        for ubatch in (512, 1024, 2048):
            settings = Settings(Batching(2048, ubatch), (0, 2, 3, 4), (REGISTERED, RING, MMAP), whole=True)
            for other in predict(profile, model, settings).rows:
                assert picked["predicted_s"] <= seconds(other) * 1.002, other.label


def test_auto_leaves_out_slots_that_do_not_fit(qwen3_layer: Path) -> None:
    profile = resolve_profile("cuda-h200")
    batching = Batching(1024, 512)
    with MoeModel.open(qwen3_layer) as model:
        slot_bytes = max(padded_size(t.nbytes, t.qtype, t.ne0) for t in model.expert_tensors)
        with expertstream.backend("sim", data=False) as sim, MoeRunner(sim.device(0), model, batching) as runner:
            activations = runner.device_bytes
        base = Settings(batching, (0,), (REGISTERED,))
        roomy = choose(profile, model, base, slots=(0, 2, 4), modes=(REGISTERED,), ubatches=(512,), free_bytes=1 << 40)
        tight = choose(
            profile,
            model,
            base,
            slots=(0, 2, 4),
            modes=(REGISTERED,),
            ubatches=(512,),
            free_bytes=activations + int(3.5 * slot_bytes),  # room for 2 slots, or the stock scratch, not 4
        )
    assert roomy.slots > 0 and all(c.seconds is not None for c in roomy.candidates)
    fits = {c.slots: c.seconds is not None for c in tight.candidates}
    assert fits == {0: True, 2: True, 4: False}
    assert tight.slots == 2 and "do not fit" in tight.explain() and "slots 4" in tight.explain()


def test_auto_never_picks_more_slots_than_a_prediction_as_fast() -> None:
    """Slots can be predicted slower than the stock path (several devices whose launching thread the
    lookahead's calls bound): auto predicts 0 among the rest and takes no count a smaller one beats."""
    assert 0 in SLOT_CHOICES
    rng = np.random.default_rng(3)
    for _ in range(300):
        candidates = [
            Candidate(slots, mode, 512, None if rng.random() < 0.1 else float(rng.uniform(1.0, 1.01)))
            for slots in SLOT_CHOICES
            for mode in (REGISTERED, MMAP)
        ]
        fitting = [(c.slots, c.seconds) for c in candidates if c.seconds is not None]
        if not fitting:
            continue
        best = pick(candidates, free_bytes=1 << 40).best
        assert best.seconds is not None
        for slots, predicted in fitting:
            assert best.seconds <= predicted * (1 + TIE)
            assert slots >= best.slots or predicted > best.seconds, (best, slots, predicted)


def test_auto_refuses_lists_it_cannot_pick_one_setting_for(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "prefill", "--backend", "sim", "--timing-only", "-p", "64,128", "--slots", "auto")
    assert code == 2 and "one prompt" in err
    code, _, err = _run(capsys, "prefill", "--backend", "sim", "--timing-only", "-ncmoe", "all,1", "--slots", "auto")
    assert code == 2 and "one -ncmoe" in err
    code, _, err = _run(capsys, "prefill", "--backend", "sim", "--timing-only", "--predict", "no-such.json")
    assert code == 2 and "no-such.json" in err


def test_a_replay_predicts_the_rows_of_a_run_again(tmp_path: Path) -> None:
    """``microbench.predict --replay``: the measured rows and the profile of an earlier run, predicted
    again by this simulator; with the simulator unchanged, the predictions are the run's own."""
    from microbench import predict as bench

    first, again = tmp_path / "run", tmp_path / "replay"
    argv = ["--backend", "sim", "--preset", "tiny", "--tokens", "32", "--ubatch", "16", "--decode-steps", "2"]
    run = bench.main([*argv, "--out", str(first)])
    assert run == 0 and bench.main(["--replay", str(first), "--out", str(again)]) == 0
    original, replayed = (json.loads((d / "predict.json").read_text()) for d in (first, again))
    assert replayed["replay"]["command"] == original["command"] and replayed["replay"]["fields_from_base"] == []
    assert replayed["replay"]["measured_at"] == original["date"]
    assert len(replayed["rows"]) == len(original["rows"]) == 12
    for was, now in zip(original["rows"], replayed["rows"], strict=True):
        assert now["ttft_s"] == was["ttft_s"] and now["decode_tokens_per_s"] == was["decode_tokens_per_s"]
        assert now["predicted_ttft_s"] == pytest.approx(was["predicted_ttft_s"], rel=1e-9)
        assert now["predicted_decode_tokens_per_s"] == pytest.approx(was["predicted_decode_tokens_per_s"], rel=1e-9)
    assert [a["picked"] for a in replayed["auto"]] == [a["picked"] for a in original["auto"]]
    assert (again / "predict.md").read_text().startswith("REPLAY: the rows measured on")
    profile = json.loads((first / "profile.json").read_text())
    del profile["host_copy_latency_s"]  # a profile from before tune measured it
    (first / "profile.json").write_text(json.dumps(profile))
    assert bench.main(["--replay", str(first), "--out", str(again)]) == 0
    assert "host_copy_latency_s" in (again / "predict.md").read_text().split("\n\n")[0]


def test_rounds_are_combined_by_their_median_setting_by_setting() -> None:
    from expertstream.errors import InvalidArgument
    from microbench.predict import Measured

    def row(slots: int, ttft: float, decode: float, host: str = "ring") -> SimpleNamespace:
        # decode: the rate of the median step, which rounds are held to
        return SimpleNamespace(
            ubatch=512, slots=slots, host_memory=host, ttft_s=ttft, decode_steps=4, decode_step_s=1 / decode
        )

    rounds = [
        [row(0, 3.0, 10.0), row(2, 1.0, 30.0)],
        [row(0, 1.0, 20.0), row(2, 4.0, 10.0)],
        [row(0, 2.0, 40.0), row(2, 2.0, 20.0)],
    ]
    stock, lookahead = Measured.over_rounds(rounds)  # type: ignore[arg-type]
    assert (stock.slots, stock.ttft_s, stock.decode_tokens_per_s) == (0, 2.0, 20.0)
    assert (lookahead.slots, lookahead.ttft_s, lookahead.decode_tokens_per_s) == (2, 2.0, 20.0)
    assert stock.ttft_runs == (3.0, 1.0, 2.0) and stock.ttft_spread == pytest.approx(2.0)
    assert Measured.over_rounds(rounds[:1])[0].ttft_spread is None  # type: ignore[arg-type]
    fell_back = [rounds[0], [row(0, 1.0, 20.0, host="registered"), row(2, 4.0, 10.0)]]
    with pytest.raises(InvalidArgument, match="different settings"):
        Measured.over_rounds(fell_back)  # type: ignore[arg-type]


def test_a_row_is_near_a_round_when_each_prediction_is_within_the_band_of_some_round() -> None:
    from microbench.predict import near_a_round

    def row(ttft_runs: list[float], decode_runs: list[float]) -> dict[str, object]:
        predicted = {"predicted_ttft_s": 1.0, "predicted_decode_tokens_per_s": 10.0}
        return {"ttft_runs": ttft_runs, "decode_runs": decode_runs, **predicted}

    assert near_a_round(row([1.25, 1.08, 1.3], [13.0, 10.9, 7.0])) is True  # 1.08 and 10.9 are within 10%
    assert near_a_round(row([1.25, 1.12, 1.3], [10.0, 10.0, 10.0])) is False  # no round of the ttft is
    assert near_a_round(row([1.0, 1.0], [12.0, 8.5])) is False  # nor of the decode rate
    assert near_a_round(row([1.0, 1.0], [])) is True  # no decode steps: the ttft decides
    assert near_a_round(row([1.5], [10.0])) is None  # measured once: the median is the only figure


def test_rounds_are_kept_in_the_results_and_their_replay(tmp_path: Path) -> None:
    from microbench import predict as bench

    first, again = tmp_path / "run", tmp_path / "replay"
    argv = ["--backend", "sim", "--preset", "tiny", "--tokens", "32", "--ubatch", "16", "--decode-steps", "2"]
    assert bench.main([*argv, "--rounds", "3", "--out", str(first)]) == 0
    doc = json.loads((first / "predict.json").read_text())
    assert doc["rounds"] == 3 and len(doc["rows"]) == 12
    for row in doc["rows"]:
        assert len(row["ttft_runs"]) == len(row["decode_runs"]) == 3
    summary = (first / "predict.md").read_text()
    assert "| spread |" in summary and "within 10% of at least one of their rounds: " in summary
    assert bench.main(["--replay", str(first), "--out", str(again)]) == 0
    replayed = json.loads((again / "predict.json").read_text())
    assert [r["ttft_runs"] for r in replayed["rows"]] == [r["ttft_runs"] for r in doc["rows"]]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--rounds", "0"])


def test_a_run_measures_and_chooses_among_the_host_memory_it_is_given(tmp_path: Path) -> None:
    from microbench import predict as bench

    first, again = tmp_path / "run", tmp_path / "replay"
    argv = ["--backend", "sim", "--preset", "tiny", "--tokens", "32", "--ubatch", "16", "--decode-steps", "2"]
    assert bench.main([*argv, "--host-memory", "ring,registered", "--out", str(first)]) == 0
    doc = json.loads((first / "predict.json").read_text())
    assert [(r["host_memory"], r["slots"]) for r in doc["rows"]] == [
        (mode, slots) for mode in ("ring", "registered") for slots in (0, 2, 3, 4)
    ]
    assert doc["auto"] and all("mmap" not in a["choice"] + a["picked"] + a["best"] for a in doc["auto"])
    assert bench.main(["--replay", str(first), "--out", str(again)]) == 0
    replayed = json.loads((again / "predict.json").read_text())
    assert [r["host_memory"] for r in replayed["rows"]] == [r["host_memory"] for r in doc["rows"]]
    for wrong in ("pinned", "ring,,mmap"):
        with pytest.raises(SystemExit):
            bench.main([*argv, "--host-memory", wrong])


def test_a_run_on_a_model_file_is_replayed_on_a_preset_of_its_shape(tmp_path: Path, tiny_path: Path) -> None:
    from expertstream.errors import InvalidArgument
    from microbench import predict as bench

    first, again = tmp_path / "run", tmp_path / "replay"
    argv = ["--backend", "sim", "--model", str(tiny_path), "--tokens", "32", "--ubatch", "16", "--decode-steps", "2"]
    assert bench.main([*argv, "--out", str(first)]) == 0
    with pytest.raises(InvalidArgument, match="--preset, --type and --layers"):
        bench.replay(first, None)
    with pytest.raises(InvalidArgument, match="its model was"):
        bench.main(["--replay", str(first), "--preset", "qwen3-30b-a3b", "--layers", "1", "--out", str(again)])
    assert bench.main(["--replay", str(first), "--preset", "tiny", "--refit", "--out", str(again)]) == 0
    original, replayed = (json.loads((d / "predict.json").read_text()) for d in (first, again))
    assert replayed["replay"]["refit"] is True
    for was, now in zip(original["rows"], replayed["rows"], strict=True):
        assert now["predicted_ttft_s"] == pytest.approx(was["predicted_ttft_s"], rel=1e-9)
    assert "fitted again to what that run's tune measured" in (again / "predict.md").read_text()
    with pytest.raises(SystemExit):
        bench.main([*argv, "--refit"])  # a refit goes with a replay


def test_a_replay_of_a_folder_without_a_run_is_refused(tmp_path: Path) -> None:
    from expertstream.errors import InvalidArgument
    from microbench import predict as bench

    with pytest.raises(InvalidArgument, match="cannot replay"):
        bench.replay(tmp_path, None)


def _disk_prefill(model: MoeModel, **drive: object) -> tuple[float, int]:
    """(predicted prefill seconds, expert bytes copied) of one 512-token ubatch through mode disk."""
    profile = Profile.from_dict({"base": "cuda-h200", "disk_latency_s": 0.0, **drive})
    settings = Settings(Batching(512, 512, 0), (0,), (HostMemoryMode.DISK,), compute_only=False)
    (row,) = predict(profile, model, settings).rows
    assert row.host_memory == "disk"
    return row.ttft_s, row.h2d_bytes


def test_a_slower_drive_predicts_a_proportionally_longer_disk_bound_prefill(qwen3_layer: Path) -> None:
    """Mode disk's chunks are read at the profile's drive rate: where the drive bounds the prefill, half
    the rate takes twice the time (within 1%: the compute and the DMA of the last chunk come after the
    reads), never less than the bytes at that rate."""
    rate = 1e9  # well below the memcpy and link rates: the drive bounds the prefill
    with MoeModel.open(qwen3_layer) as model:
        for threads in (1, 4, 12):
            fast, nbytes = _disk_prefill(model, disk_read_bps=[[1, rate]], ring_threads=threads)
            slow, _ = _disk_prefill(model, disk_read_bps=[[1, rate / 2]], ring_threads=threads)
            assert slow == pytest.approx(2 * fast, rel=0.01), threads
            assert fast > nbytes / rate, threads


def test_the_drive_is_read_at_the_depth_the_rings_threads_keep_in_flight(qwen3_layer: Path) -> None:
    """One thread reads at the drive's rate at depth 1; four threads at its (four times) rate at depth 4."""
    drive = {"disk_read_bps": [[1, 0.5e9], [4, 2e9]]}
    with MoeModel.open(qwen3_layer) as model:
        one, nbytes = _disk_prefill(model, ring_threads=1, **drive)
        four, _ = _disk_prefill(model, ring_threads=4, **drive)
    assert one == pytest.approx(nbytes / 0.5e9, rel=0.03)
    assert one - four == pytest.approx(nbytes / 0.5e9 - nbytes / 2e9, rel=0.03)


def test_bench_predicts_mode_disk(qwen3_layer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["prefill", str(qwen3_layer), "--backend", "sim", "--timing-only", "-p", "512", "-ub", "512"]
    code, out, _ = _run(capsys, *argv, "--slots", "0", "--host-memory", "ring,disk", "-r", "1", "--json", "--predict")
    ring, disk = json.loads(out)["rows"]
    assert code == 0 and (ring["host_memory"], disk["host_memory"]) == ("ring", "disk")
    assert disk["predicted_ttft_s"] == pytest.approx(disk["ttft_s"], rel=1e-9)
    drive = resolve_profile("cuda-h200").disk_rate(12)  # the profile's 12 ring threads, each a read in flight
    assert disk["ttft_s"] > disk["h2d_bytes"] / drive > ring["ttft_s"]
