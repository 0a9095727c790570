"""deepinfer.eval.structured: the independent validity check on hand-made texts, and the command on a tiny random-weight
checkpoint (CPU), where only the grammar makes a completion valid."""
from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")
from deepinfer.eval import structured  # noqa: E402
from deepinfer.eval.structured import CASES, evaluate, main, why_invalid  # noqa: E402

BY_NAME = {c.name: c for c in CASES}


@pytest.mark.parametrize("name, text, ok", [
    ("person", '{"name":"Ada","age":36}', True),
    ("person", '{"name":"Ada","age":360}', False),       # above the maximum
    ("person", '{"name":"Ada"}', False),                 # a required key missing
    ("person", '{"name":"Ada","age":36', False),         # not JSON
    ("tags", '["rust","go"]', True),
    ("tags", '[]', False),
    ("email", "ada@home.org", True),
    ("email", "ada@home.org!", False),                   # a match that is not the whole text
    ("call", "f(1, 22)", True),
    ("date", "2026-13-01", False),
])
def test_validity_check_of_hand_made_texts(name, text, ok):
    assert (why_invalid(BY_NAME[name], text) is None) == ok


@pytest.fixture(scope="module")
def ckpt(tiny):
    return tiny


ENGINE = ["--device", "cpu", "--kv-cache-memory", str(32 << 20)]


@pytest.fixture(scope="module")
def llm(ckpt):
    from deepinfer import LLM

    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=32 << 20)
    yield llm
    llm.close()


def test_json_completions_under_a_grammar_are_valid_and_cut_ones_are_not(llm):
    short = [BY_NAME["tags"], BY_NAME["ratio"]]  # (the CI subset: short completions)
    result = evaluate(llm, short, max_tokens=100)
    assert result["completions"] == result["cases"] == 2
    assert result["failures"] == [] and result["valid"] == 2 and result["validity_rate"] == 1.0
    assert result["validity_per_kind"] == {"json": 1.0} and result["validity_per_case"] == {"tags": 1.0, "ratio": 1.0}
    cut = evaluate(llm, [BY_NAME["tags"], BY_NAME["person"]], max_tokens=1)  # "[" or "{" ends neither
    assert cut["valid"] == 0 and cut["truncated"] == cut["completions"] == 2
    assert {f["why"] for f in cut["failures"]} == {"cut at --max-tokens"}


def test_command_prints_one_json_object(ckpt, llm, command, monkeypatch):
    monkeypatch.setattr(structured, "engine", lambda args: llm)  # the module's engine, not a second one
    monkeypatch.setattr(llm, "close", lambda: None)
    result = command(main, ["--model", str(ckpt), "--cases", "regex", "--max-tokens", "60", *ENGINE])
    regexes = [c.name for c in CASES if c.kind == "regex"]
    assert result["completions"] == len(regexes) and list(result["validity_per_kind"]) == ["regex"]
    assert result["validity_rate"] == 1.0 and list(result["validity_per_case"]) == regexes


def test_bad_cases_argument_is_refused(ckpt, capsys):
    assert main(["--model", str(ckpt), "--cases", "yaml", *ENGINE]) == 2
    assert "argument --cases" in capsys.readouterr().err
