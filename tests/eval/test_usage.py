"""Bad arguments of every tool: main returns 2 with one line on stderr naming the flag or file, never a
traceback; --help returns 0. None of these loads a model but the --model case."""
from __future__ import annotations

import importlib

import pytest

from deepinfer.eval import TOOLS
from deepinfer.eval.__main__ import main as dispatch

MISSING = "/nonexistent/held_out.txt"
HERE = __file__  # a UTF-8 text file that exists


def refused(capsys, main, argv: list[str], *named: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in named:
        assert word in err, (word, err)


def tool(name: str):
    return importlib.import_module(f"deepinfer.eval.{name}").main


@pytest.mark.parametrize("name, argv, named", [
    ("perplexity", ["--model", "demo", "--file", MISSING], ["--file", MISSING, "no such file"]),
    ("perplexity", ["--model", "demo", "--file", HERE, "--max-tokens", "0"], ["--max-tokens", "0"]),
    ("perplexity", ["--model", "demo", "--file", HERE, "--window", "abc"], ["--window", "'abc'"]),
    ("perplexity", ["--model", "demo", "--file", HERE, "--context", "-1"], ["--context", "-1"]),
    ("perplexity", ["--model", "demo", "--file", HERE, "--reference", "hf"], ["--reference", "hf"]),
    ("perplexity", ["--file", HERE], ["--model"]),
    ("agreement", ["--model", "demo", "--file", MISSING], ["--file", MISSING]),
    ("agreement", ["--model", "demo", "--file", HERE, "--prompts", "x"], ["--prompts", "--file"]),
    ("agreement", ["--model", "demo", "--prompts", "x", "--max-tokens", "-2"], ["--max-tokens", "-2"]),
    ("dspark", ["--model", "demo", "--file", MISSING], ["--file", MISSING]),
    ("dspark", ["--model", "demo", "--prompts", "x", "--gamma", "0"], ["--gamma", "0"]),
    ("dspark", ["--model", "demo", "--prompts", "x", "--bins", "1.5"], ["--bins", "'1.5'"]),
    ("dspark", ["--model", "demo", "--prompts", "x", "--kv-cache-memory", "0"], ["--kv-cache-memory"]),
    ("replay", ["--model", "demo", "--file", MISSING], ["--file", MISSING]),
    ("replay", ["--model", "demo", "--prompts", "x", "--keep", "40", "0"], ["--keep", "0"]),
    ("replay", ["--model", "demo", "--file", HERE, "--skip-prompts", "-1"], ["--skip-prompts", "-1"]),
    ("replay", ["--model", "demo", "--file", HERE, "--prompt-len", "0"], ["--prompt-len", "0"]),
    ("structured", ["--model", "demo", "--cases", "yaml"], ["--cases", "yaml"]),
    ("structured", ["--model", "demo", "--temperature", "-1"], ["--temperature", "-1"]),
    ("structured", ["--model", "demo", "--samples", "0"], ["--samples", "0"]),
    ("structured", ["--model", "demo", "--bogus"], ["--bogus"]),
])
def test_bad_argument_is_one_line_and_status_2(capsys, name, argv, named):
    refused(capsys, tool(name), argv, *named)


def test_a_directory_or_a_file_that_is_not_text_is_refused(capsys, tmp_path):
    refused(capsys, tool("dspark"), ["--model", "demo", "--file", str(tmp_path)], "--file", str(tmp_path), "directory")
    binary = tmp_path / "held_out.bin"
    binary.write_bytes(b"def f():\n\xff\xfe\x00")
    refused(capsys, tool("perplexity"), ["--model", "demo", "--file", str(binary)], "--file", str(binary), "UTF-8")


def test_a_model_that_cannot_be_found_is_refused(capsys, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    refused(capsys, tool("perplexity"), ["--model", missing, "--file", HERE, "--device", "cpu"], "--model", missing)


@pytest.mark.parametrize("name", TOOLS)
def test_help_is_status_0(capsys, name):
    assert tool(name)(["--help"]) == 0
    assert f"python -m deepinfer.eval.{name}" in capsys.readouterr().out


def test_dispatcher(capsys):
    refused(capsys, dispatch, [], "no tool")
    refused(capsys, dispatch, ["perplexityy", "--help"], "'perplexityy'", "perplexity")
    refused(capsys, dispatch, ["dspark", "--model", "demo", "--prompts", "x", "--gamma", "0"], "--gamma")
    assert dispatch(["--help"]) == 0 and "agreement" in capsys.readouterr().out
    assert dispatch(["replay", "--help"]) == 0 and "--keep" in capsys.readouterr().out
