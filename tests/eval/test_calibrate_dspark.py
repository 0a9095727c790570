"""eval/calibrate_dspark.py on the tiny V4.1 checkpoint (CPU): logs the engine's own verify steps, fits the
temperatures, writes dspark_calibration.json, and LLM with enable_mtp_varlen picks the file up."""
import json

import pytest

from deepinfer import LLM
from deepinfer.spec.calibration import CALIBRATION_FILE, Calibration
from deepinfer.eval import calibrate_dspark
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

TEXT = " ".join(f"def f{i}(x): return x + {i}" for i in range(200))


@pytest.fixture(scope="module")
def ckpt41(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny41") / "ckpt", PRESETS["tiny41"], seed=5, dtype="fp8")


def test_calibrate_from_held_out_text(ckpt41, tmp_path, capsys):
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT)
    summary = calibrate_dspark.main(["--model", str(ckpt41), "--file", str(text), "--gamma", "3", "--prompt-len",
                                     "24", "--max-tokens", "8", "--max-prompts", "3", "--device", "cpu",
                                     "--dtype", "float32", "--out", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    cal = Calibration.load(tmp_path / CALIBRATION_FILE)
    assert cal.gamma == 3 and cal.num_blocks == summary["num_blocks"] > 0
    assert list(cal.temperatures) == summary["temperatures"]
    assert cal.ece_after[0] <= cal.ece_before[0]  # position 1's temperature minimises its ECE, T = 1 included
    # LLM reads the file from the checkpoint directory when confidence scheduling is on
    (ckpt41 / CALIBRATION_FILE).write_text((tmp_path / CALIBRATION_FILE).read_text())
    try:
        llm = LLM(str(ckpt41), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20,
                  max_num_seqs=4, num_speculative_tokens=3, enable_mtp_varlen=True)
        assert llm.scheduler.varlen.temperatures == cal.temperatures
    finally:
        (ckpt41 / CALIBRATION_FILE).unlink()


def test_too_little_text_is_named(ckpt41, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("def f(): pass")
    with pytest.raises(ValueError, match="--file"):
        calibrate_dspark.main(["--model", str(ckpt41), "--file", str(text), "--prompt-len", "500",
                               "--device", "cpu", "--dtype", "float32"])
