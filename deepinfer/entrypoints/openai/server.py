"""Start-up of `deepinfer serve`: the engine-core process first (the model loads there), then the HTTP
server. Exit status: 0 after a requested shutdown (SIGINT / SIGTERM: requests in flight are drained
first), 1 when the engine-core process died (every request then got 503) or failed to start, 2 (the CLI's
usage error) when it refused its arguments or found no model (one line on stderr)."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

import deepseek_recipe as recipe
import uvicorn

from deepinfer.entrypoints.openai.app import build_app
from deepinfer.entrypoints.openai.engine_client import EngineClient, EngineStartError
from deepinfer.entrypoints.openai.metrics import ServerMetrics
from deepinfer.entrypoints.openai.serving import ServerState
from deepinfer.entrypoints.openai.tokenizer import ServingTokenizer

logger = logging.getLogger(__name__)
ENGINE_FAILED = 1
USAGE_ERROR = 2


def model_version(model_dir: str | Path):
    """recipe's ModelVersion (and so prompt encoding) for the checkpoint's model_type."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
    return recipe.ModelVersion.DeepseekV41Flash if model_type == "deepseek_v41" else recipe.ModelVersion.DeepseekV4Pro


def build_state(client: EngineClient, served_name: str, max_queue_len: int, default_thinking: bool) -> ServerState:
    info = client.info
    tok = ServingTokenizer.load(info["model_dir"])
    version = model_version(info["model_dir"])
    options = recipe.ConversionOptions(default_thinking_mode=default_thinking)
    # every accepted name (the served one and recipe's DeepSeek names) renders and parses as the model served
    options = options.with_model_versions_by_name({n: version for n in [served_name, *options.model_versions_by_name]})
    encodings = {recipe.ModelVersion.DeepseekV4Pro: recipe.DeepseekV4Encoding().with_tokenizer(tok.recipe),
                 recipe.ModelVersion.DeepseekV41Flash: recipe.DeepseekV41Encoding().with_tokenizer(tok.recipe)}
    metrics = ServerMetrics(served_name)
    metrics.update_engine(client.stats)
    client.on_stats = metrics.update_engine
    return ServerState(client, metrics, tok, served_name, info["max_model_len"], max_queue_len, info["max_num_seqs"],
                       info["vocab_size"], info["bos_token_id"], info["eos_token_id"], options, encodings,
                       aliases={served_name, *options.model_versions_by_name}, model_dir=info["model_dir"])


def serve(llm_kwargs: dict, host: str, port: int, served_name: str, api_key: str | None = None,
          max_queue_len: int = 1024, default_thinking: bool = True, shutdown_timeout: float = 30.0,
          log_level: str = "info") -> int:
    """Run the server until it is asked to stop; returns the process exit status."""
    level = getattr(logging, log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    client = EngineClient(llm_kwargs, level)
    try:
        client.start()
    except EngineStartError as e:
        if e.usage:
            print(f"deepinfer: error: {e}", file=sys.stderr)
            return USAGE_ERROR
        logger.error("the engine failed to start: %s", e)
        return ENGINE_FAILED
    try:
        state = build_state(client, served_name, max_queue_len, default_thinking)
        app = build_app(state, api_key)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=shutdown_timeout)
        server = uvicorn.Server(config)

        def died(_why: str) -> None:
            server.should_exit = True  # requests in flight have their 503 / error event; then exit non-zero

        client.on_dead = died

        async def main():
            client.attach(asyncio.get_running_loop())
            try:
                await server.serve()
            finally:
                client.detach()  # before asyncio.run closes the loop
        # uvicorn turns SIGINT / SIGTERM into a graceful shutdown, then re-raises the signal to the handler it
        # found: a no-op one lets a requested shutdown end with status 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        asyncio.run(main())
    finally:
        client.shutdown()
    if client.dead:
        logger.error("exiting: %s", client.dead)
        return ENGINE_FAILED
    return 0
