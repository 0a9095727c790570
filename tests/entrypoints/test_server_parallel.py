"""`deepinfer serve -tp 2` of a DeepSeek-V4 (not V4.1) checkpoint with its MTP layer drafting: the engine-core
process is itself the driver of a tensor-parallel group (it spawns the other rank), on the CPU (gloo); chat uses
V4's encoding; a JSON schema and prompt_logprobs are served as in one process (tests/distributed/test_layouts.py
compares their values with one process)."""
from __future__ import annotations

import json
import re
import urllib.request

import openai
from server_process import ServerProcess

from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["tag", "ok"], "additionalProperties": False}


def test_serve_with_two_tensor_parallel_ranks_and_every_feature(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", PRESETS["tiny"], seed=11, dtype="fp8")
    srv = ServerProcess(ckpt, tmp_path / "server.log", "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                        "--max-model-len", "1024", "--kv-cache-memory", str(32 << 20),
                        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}')
    try:
        client = openai.OpenAI(api_key="none", base_url=f"{srv.url}/v1", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, seed=1,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.prompt_tokens > 5  # V4's encoding
        shaped = client.completions.create(model="tiny", prompt="JSON:", max_tokens=64, temperature=0, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
            "prompt_logprobs": 2})
        assert shaped.choices[0].finish_reason == "stop", shaped
        assert set(json.loads(shaped.choices[0].text)) == {"tag", "ok"}
        prompt_lps = shaped.choices[0].model_extra["prompt_logprobs"]
        assert prompt_lps[0] is None and len(prompt_lps) == shaped.usage.prompt_tokens
        assert all(2 <= len(entry) <= 3 for entry in prompt_lps[1:])  # the top 2 and the prompt's own token
        metrics = urllib.request.urlopen(f"{srv.url}/metrics", timeout=30).read().decode()
        drafts = re.search(r'^deepinfer:spec_decode_num_drafts\{[^}]*\} (\S+)$', metrics, re.M)
        assert drafts and float(drafts.group(1)) > 0, metrics[:2000]  # the MTP layer drafted on both ranks
    finally:
        srv.stop_cleanly()
