"""`deepinfer serve -tp 2` of a DeepSeek-V4 (not V4.1) checkpoint: the engine-core process is itself the
driver of a tensor-parallel group (it spawns the other rank), on the CPU (gloo); chat uses V4's encoding."""
from __future__ import annotations

import openai
from server_process import ServerProcess

from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint


def test_serve_with_two_tensor_parallel_ranks(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", PRESETS["tiny"], seed=11, dtype="fp8")
    srv = ServerProcess(ckpt, tmp_path / "server.log", "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                        "--max-model-len", "1024", "--kv-cache-memory", str(32 << 20))
    try:
        client = openai.OpenAI(api_key="none", base_url=f"{srv.url}/v1", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, seed=1,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.prompt_tokens > 5  # V4's encoding
    finally:
        srv.stop_cleanly()
