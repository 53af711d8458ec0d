"""`expertstream generate` and `expertstream perplexity` on a tiny made model, and their errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from expertstream.cli import main
from expertstream.engine.model import Model
from expertstream.engine.sampling import Sampling
from expertstream.model import make_model
from expertstream.model.presets import PRESETS
from tests.engine.llamacpp.make import WHOLE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", "Q8_0", tmp_path_factory.mktemp("generate") / "tiny.gguf", seed=3)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_writes_a_trace_of_its_prefill_and_decode(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    prompt = "the quick brown fox jumps over the lazy dog, again and again"  # more tokens than a decode step
    argv = ("generate", "-m", str(tiny_model), "-p", prompt, "-n", "3", "--temp", "0", "--backend", "sim")
    code, out, err = _run(capsys, *argv, "--trace", str(trace))
    assert code == 0, err
    doc = json.loads(trace.read_text())
    assert doc["otherData"]["backend"] == "sim" and doc["otherData"]["model"]["arch"] == "qwen3moe"
    names = {event.get("name", "") for event in doc["traceEvents"]}
    assert any(name.startswith("attn_prefill") for name in names), "the prompt's attention"
    assert any(name.startswith("attn_decode") for name in names), "a decode step's attention"
    code, out, err = _run(capsys, *argv, "--trace", str(tmp_path / "none" / "t.json"))
    assert code == 2 and "--trace" in err and out == ""


def test_generate_prints_the_prompt_its_continuation_and_llama_cpp_timings(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ("generate", "-m", str(tiny_model), "-p", "the quick brown fox", "-n", "6", "--temp", "0")
    code, out, err = _run(capsys, *argv, "--backend", "sim")
    assert code == 0, err
    assert out.startswith("the quick brown fox") and len(out.strip()) > len("the quick brown fox")
    assert "prompt eval time" in err and "tokens per second" in err and "       eval time" in err
    again = _run(capsys, *argv, "--backend", "sim")[1]
    assert again == out  # greedy: the same text every time
    # Decode's copies by DMA after the ids, and its steps issued call by call: the same text.
    code, plain, err = _run(capsys, *argv, "--backend", "sim", "--no-gather", "--no-graphs")
    assert code == 0 and plain == out and "calls issued per step" in err


def test_perplexity_prints_chunks_and_a_final_estimate(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "text.txt"
    text.write_text((Path(__file__).parents[2] / "expertstream" / "model" / "corpus.txt").read_text() * 2)
    code, out, err = _run(capsys, "perplexity", "-m", str(tiny_model), "-f", str(text), "-c", "64", "--chunks", "3")
    assert code == 0, err
    assert "[1]" in out and "[3]" in out and "[4]" not in out
    final = out.split("Final estimate: PPL = ")[1].split()
    assert float(final[0]) > 1 and final[1] == "+/-"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("-p", ""), "the prompt is empty"),
        (("-p", "a b c d e f g h i j k l m n o p", "-c", "8"), "do not fit the context of 8"),
        (("-p", "x", "--top-p", "0"), "top_p must be in (0, 1]"),
        (("-p", "x", "-ncmoe", "1", "--gpu-memory", "1G"), "both choose which layers stream"),
    ],
)
def test_bad_input_is_one_line_naming_the_problem(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    code, out, err = _run(capsys, "generate", "-m", str(tiny_model), *extra, "--backend", "sim")
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""  # the prompt is not echoed before its refusal


def test_a_file_whose_attention_has_no_kernel_is_refused_at_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    preset = dataclasses.replace(PRESETS["tiny"], name="tiny-96", head_dim=96)
    path = make_model(preset, "Q8_0", tmp_path / "96.gguf")
    code, _, err = _run(capsys, "generate", "-m", str(path), "-p", "hi", "--backend", "sim")
    assert code == 2 and "heads are 96 wide" in err and "--experts-only" in err


def test_a_missing_model_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "perplexity", "-m", str(tmp_path / "none.gguf"), "-f", str(tmp_path / "t.txt"))
    assert code == 2 and "none.gguf: no such file" in err


# Every architecture run end to end through both commands (the qwen3moe one is tiny_model's, above).
OTHER_WHOLE = [name for name in WHOLE if name != "tiny"]


@pytest.mark.parametrize("preset", OTHER_WHOLE)
def test_generate_and_perplexity_run_every_architecture(
    preset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = make_model(preset, "Q8_0", tmp_path / f"{preset}.gguf", seed=3)
    argv = ("generate", "-m", str(path), "-p", "the quick brown fox", "-n", "4", "--temp", "0", "--backend", "sim")
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert out.startswith("the quick brown fox") and "prompt eval time" in err
    text = tmp_path / "text.txt"
    text.write_text((Path(__file__).parents[2] / "expertstream" / "model" / "corpus.txt").read_text())
    argv = ("perplexity", "-m", str(path), "-f", str(text), "-c", "64", "--chunks", "2", "--backend", "sim")
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    estimate = float(out.split("Final estimate: PPL = ")[1].split()[0])
    assert 1 < estimate < float("inf")


def test_generate_takes_its_decode_copies_from_a_tuned_profile(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "dma.json"  # as tune writes it where the DMAs' steps were the faster
    profile.write_text(json.dumps({"base": "cuda-h200", "name": "dma-faster", "decode_gather": False}))
    argv = ("generate", "-m", str(tiny_model), "-p", "the quick brown fox", "-n", "4", "--temp", "0")
    argv = (*argv, "--backend", "sim")
    code, out, err = _run(capsys, *argv)
    assert code == 0 and "decode copies of streamed experts: the device's gather" in err
    dma = "decode copies of streamed experts: DMAs after reading the routing ids back"
    for flags, by_dma in (
        (("--profile", str(profile)), True),
        (("--decode-copies", "dma"), True),
        (("--profile", str(profile), "--decode-copies", "gather"), False),
    ):
        code, again, err = _run(capsys, *argv, *flags)
        assert code == 0 and again == out, err  # the same text whichever copies
        assert (dma in err) == by_dma, flags
    code, again, err = _run(capsys, *argv, "--profile", str(tmp_path / "none.json"))
    assert code == 2 and "none.json" in err and again == ""


def test_generate_says_what_it_held_on_the_device_by_kind(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        "generate",
        "-m",
        str(tiny_model),
        "-p",
        "the quick brown fox",
        "-n",
        "4",
        "--temp",
        "0",
        "--backend",
        "sim",
    )
    with Model.open(tiny_model, backend="sim") as model:
        list(model.generate("the quick brown fox", 4, Sampling(temperature=0)))
        memory = model.device_memory
    assert memory.total == sum(v for k, v in memory.as_dict().items() if k != "total")
    assert memory.weights > 0 and memory.kv_cache > 0 and memory.staging > 0 and memory.resident_experts == 0
    code, _, err = _run(capsys, *argv)
    line = next(line for line in err.splitlines() if line.startswith("device memory: "))
    assert code == 0 and f"device memory: {memory.total / 2**20:.0f} MiB (weights " in line
    code, _, err = _run(capsys, *argv, "-ncmoe", "0")  # every expert on the device: nothing streamed
    assert code == 0 and "resident experts 0," not in err and "staging 0;" in err
