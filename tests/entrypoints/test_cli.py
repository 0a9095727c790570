"""The command line as a new user meets it: instant --help, flags checked before the model loads,
one-line errors with exit code 2."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from server_process import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", *args], env=env or ENV,
                          capture_output=True, text=True, timeout=300)


def _clis(*arg_lists: tuple[str, ...], env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """_cli of each argument list, the processes running at the same time (each is a real `deepinfer` run)."""
    with ThreadPoolExecutor(len(arg_lists)) as pool:
        return list(pool.map(lambda args: _cli(*args, env=env), arg_lists))


def test_help_does_not_import_torch():
    code = ("import sys\nfrom deepinfer.entrypoints import cli\ntry:\n    cli.main(['generate', '--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\nassert 'torch' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--max-tokens" in res.stdout


def _one_line_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepinfer: error: "), res.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def test_a_model_that_cannot_be_found_is_one_line(tmp_path):
    local, hub, served = _clis(
        ("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi", "--device", "cpu"),
        ("generate", "--model", "no-such-org/no-such-model", "--prompt", "hi", "--device", "cpu"),
        ("serve", "--model", str(tmp_path / "nowhere"), "--device", "cpu", "--port", str(free_port())))
    _one_line_error(local, "--model", "not found", "nowhere")
    _one_line_error(hub, "--model", "not found", "no-such-model")
    _one_line_error(served, "--model", "not found", "nowhere")


@pytest.fixture
def no_engine(monkeypatch):
    """In-process CLI runs whose engine process must never start (their errors come first)."""
    from deepinfer.entrypoints.openai.engine_client import EngineClient

    def start(self, timeout=None):
        raise AssertionError("the engine process was started")
    monkeypatch.setattr(EngineClient, "start", start)


def _main_error(capsys, *argv: str) -> str:
    """cli.main in this process: its exit status must be 2 and its stderr one line; that line."""
    from deepinfer.entrypoints import cli

    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("deepinfer: error: "), (e.value.code, err)
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (("serve", "--port", "x"), ("argument --port", "'x'")),
    (("serve", "--port", "70000"), ("argument --port", "70000")),
    (("serve", "--max-queue-len", "-1"), ("argument --max-queue-len",)),
    (("serve", "--log-level", "loud"), ("argument --log-level", "invalid choice")),
    (("generate", "--prompt", "hi", "--max-tokens", "many"), ("argument --max-tokens", "invalid int value")),
    (("generate", "--prompt", "hi", "--dtype", "float8"), ("argument --dtype", "invalid choice")),
    (("generate",), ("--prompt",)),
    (("generate", "--prompt", "hi", "--logit-bias", "5:1"), ("--logit-bias", "ID=BIAS")),
    (("generate", "--prompt", "hi", "--allowed-token-ids", "a,b"), ("--allowed-token-ids",)),
    (("bench", "serve", "--port", "-1"), ("argument --port",)),
    (("bench", "serve", "--request-rate", "fast"), ("argument --request-rate",)),
    (("nonsense",), ("invalid choice",)),
])
def test_argparse_errors_are_one_line(capsys, argv, words):
    line = _main_error(capsys, *argv)
    assert all(w in line for w in words), line


def _bad_engine_flags() -> list[tuple[str, tuple[str, ...]]]:
    """(command, argv) with a bad value for each engine flag of the declaration (deepinfer/config.py); `--model`
    takes any text."""
    from dataclasses import fields

    from deepinfer.config import OPTIONS, EngineConfig, _BASE_TYPES

    cases = []
    for f in fields(EngineConfig):
        if f.name not in OPTIONS or f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _BASE_TYPES[f.name]
        bad = (f"{flag}=on",) if kind is bool else (flag, "{not json" if kind is dict else "bogus")
        for command in ("generate", "serve"):
            cases.append((command, flag, bad))
    return cases


@pytest.mark.parametrize("command, flag, bad", _bad_engine_flags())
def test_a_bad_engine_flag_value_is_one_line(capsys, no_engine, command, flag, bad):
    argv = (command, "--model", "demo", *bad) + (("--prompt", "hi") if command == "generate" else ())
    line = _main_error(capsys, *argv)
    assert flag in line, line


def test_serve_checks_its_flags_and_port_before_the_engine_starts(capsys, no_engine):
    line = _main_error(capsys, "serve", "--model", "demo", "--max-num-seqs", "0")
    assert "--max-num-seqs" in line, line
    assert "--host" in _main_error(capsys, "serve", "--model", "demo", "--host", "no-such-host.invalid")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        line = _main_error(capsys, "serve", "--model", "demo", "--port", str(taken.getsockname()[1]))
    assert "--port" in line and "in use" in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_cuda_without_a_cuda_device_is_one_line(tmp_path):
    _one_line_error(_cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cuda"),
                    "device", "cuda")


def test_sampling_flags_are_checked_before_the_model_is_looked_for(tmp_path):
    # the model does not exist: the error must be the flag's, found before any loading
    cases = [("--top-p", "2"), ("--temperature", "-1"), ("--max-tokens", "0"), ("--n", "0"),
             ("--presence-penalty", "3"), ("--repetition-penalty", "0"), ("--min-tokens", "-1"),
             ("--logit-bias", "5=200")]
    runs = _clis(*[("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi", flag, value)
                   for flag, value in cases])
    for res, (flag, _) in zip(runs, cases):
        _one_line_error(res, flag)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("cli") / "ckpt", PRESETS["tiny"], seed=3, dtype="fp8")


def test_quantization_flag_reaches_the_engine(fp8_ckpt):
    """--quantization fp8 keeps the FP8/FP4 weights, none dequantises (the start-up log says which);
    on the CPU both give the same greedy tokens (the quantised layers dequantise exactly)."""
    common = ("generate", "--model", str(fp8_ckpt), "--prompt", "hello", "--device", "cpu", "--dtype", "float32",
              "--temperature", "0", "--max-tokens", "4")
    env = {**ENV, "DEEPINFER_CONFIGURE_LOGGING": "1"}  # the deepinfer logger's own stderr handler
    runs, cases = {}, (("fp8", "as the checkpoint stores them"), ("none", "dequantised to float32"))
    for res, (q, said) in zip(_clis(*[(*common, "--quantization", q) for q, _ in cases], env=env), cases):
        assert res.returncode == 0, res.stderr[-2000:]
        assert said in res.stderr and "request(s) of max_model_len=" in res.stderr, res.stderr[-2000:]
        runs[q] = json.loads(res.stdout.splitlines()[0])["token_ids"]
    assert runs["fp8"] == runs["none"] and len(runs["fp8"]) == 4


def test_logits_processing_flags_reach_the_engine(fp8_ckpt):
    res = _cli("generate", "--model", str(fp8_ckpt), "--prompt", "hello", "--device", "cpu", "--dtype", "float32",
               "--temperature", "0", "--max-tokens", "6", "--allowed-token-ids", "5,6,7", "--logit-bias", "7=-100",
               "--frequency-penalty", "1.5", "--min-tokens", "6")
    assert res.returncode == 0, res.stderr[-2000:]
    ids = json.loads(res.stdout.splitlines()[0])["token_ids"]
    assert len(ids) == 6 and set(ids) <= {5, 6}, ids


def test_quantization_and_parallel_flags_are_checked_before_any_weight_is_read(fp8_ckpt, tmp_path):
    res = _cli("generate", "--model", str(fp8_ckpt), "--prompt", "hi", "--quantization", "int4")
    assert res.returncode == 2 and "--quantization" in res.stderr and "int4" in res.stderr
    from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

    bf16 = write_checkpoint(tmp_path / "bf16", PRESETS["tiny"], seed=3, dtype="bfloat16")
    _one_line_error(_cli("generate", "--model", str(bf16), "--prompt", "hi", "--device", "cpu",
                         "--quantization", "fp8"), "--quantization", "no quantization_config")
    # the model does not exist: the parallel sizes are refused before it is looked for
    common = ("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi", "--device", "cpu")
    ep_tp, cp, eplb = _clis((*common, "-dp", "2", "-tp", "2", "--enable-expert-parallel"),
                            (*common, "--context-parallel-size", "0"), (*common, "--enable-eplb"))
    _one_line_error(ep_tp, "--enable-expert-parallel", "tensor_parallel_size=2")
    _one_line_error(cp, "--context-parallel-size")
    _one_line_error(eplb, "--enable-eplb", "enable_expert_parallel")


def test_tensor_parallel_flag_runs_two_ranks_with_the_same_greedy_tokens(fp8_ckpt):
    common = ("generate", "--model", str(fp8_ckpt), "--prompt", "hello", "--device", "cpu", "--dtype", "float32",
              "--kv-cache-dtype", "float32", "--temperature", "0", "--max-tokens", "4")
    runs = {}
    for tp, res in zip(("1", "2"), _clis((*common, "-tp", "1"), (*common, "-tp", "2"))):
        assert res.returncode == 0, res.stderr[-2000:]
        runs[tp] = json.loads(res.stdout.splitlines()[0])["token_ids"]
    assert runs["2"] == runs["1"] and len(runs["1"]) == 4


def test_eplb_config_flag_is_checked_before_the_model_is_looked_for(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    common = ("generate", "--model", nowhere, "--prompt", "hi", "--device", "cpu", "-dp", "2",
              "--enable-expert-parallel", "--enable-eplb")
    res, bogus = _clis((*common, "--eplb-config", "{not json"), (*common, "--eplb-config", '{"bogus": 1}'))
    assert res.returncode == 2 and "--eplb-config" in res.stderr and "not JSON" in res.stderr
    _one_line_error(bogus, "--eplb-config", "unknown key", "bogus")


def test_bench_serve_is_a_deepinfer_command():
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "bench", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--max-concurrency" in res.stdout and "--request-rate" in res.stdout


def test_eval_is_a_deepinfer_command(tmp_path):
    """`deepinfer eval TOOL ARGS` runs deepinfer.eval.TOOL with ARGS and exits with its status."""
    helped, missing = _clis(("eval", "perplexity", "--help"),
                            ("eval", "perplexity", "--model", "demo", "--file", str(tmp_path / "missing.txt")))
    assert helped.returncode == 0 and "--max-tokens" in helped.stdout, helped.stderr[-2000:]
    assert missing.returncode == 2, missing.stderr[-2000:]
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "--file" in lines[0] and "missing.txt" in lines[0], missing.stderr[-2000:]
    _one_line_error(_cli("eval", "nope"), "tool", "nope", "perplexity")
