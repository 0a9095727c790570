"""Start-up of `deepinfer serve`: the listening address is bound first, then the engine-core process
starts (the model loads there), then the HTTP server. Exit status: 0 after a requested shutdown (SIGINT /
SIGTERM: requests in flight are drained first), 1 when the engine-core process died (every request then
got 503) or failed to start; an address that cannot be bound, or arguments / a model the engine refused,
raise ValueError (the CLI's one-line usage error, exit status 2)."""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import signal
import socket
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


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet (uvicorn listens once the engine is ready);
    ValueError naming `host` or `port` if it cannot be bound."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart beside TIME_WAIT binds
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        field = "port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "host"
        raise ValueError(f"{field}: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def model_version(model_dir: str | Path):
    """recipe's ModelVersion (and so prompt encoding) for the checkpoint's model_type."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
    return recipe.ModelVersion.DeepseekV41Flash if model_type == "deepseek_v41" else recipe.ModelVersion.DeepseekV4Pro


def thinking_default(info: dict) -> bool:
    """Whether a chat request that names no thinking mode thinks: as deepseek-recipe's V4 / V4.1 conversion and
    DeepSeek's API do (on), unless the engine's model was never trained to think (`thinks`: the demo models)."""
    return recipe.ConversionOptions().default_thinking_mode and info.get("thinks", True)


def build_state(client: EngineClient, served_name: str, max_queue_len: int,
                default_thinking: bool | None = None) -> ServerState:
    """`default_thinking`: the thinking mode of chat requests that name none (None: thinking_default)."""
    info = client.info
    tok = ServingTokenizer.load(info["model_dir"])
    version = model_version(info["model_dir"])
    if default_thinking is None:
        default_thinking = thinking_default(info)
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


def serve(llm_kwargs: dict, sock: socket.socket, served_name: str, api_key: str | None = None,
          max_queue_len: int = 1024, default_thinking: bool | None = None, shutdown_timeout: float = 30.0,
          log_level: str = "info") -> int:
    """Run the server on `sock` (bind_socket's) until it is asked to stop; returns the process exit status.
    ValueError (the engine's message) when the engine refused its arguments or found no model."""
    level = getattr(logging, log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    client = EngineClient(llm_kwargs, level)
    try:
        client.start()
    except EngineStartError as e:
        sock.close()
        if e.usage:
            raise ValueError(str(e)) from None
        logger.error("the engine failed to start: %s", e)
        return ENGINE_FAILED
    try:
        state = build_state(client, served_name, max_queue_len, default_thinking)
        app = build_app(state, api_key)
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=shutdown_timeout)
        server = uvicorn.Server(config)

        def died(_why: str) -> None:
            server.should_exit = True  # requests in flight have their 503 / error event; then exit non-zero

        client.on_dead = died

        async def main():
            client.attach(asyncio.get_running_loop())
            # uvicorn logs its address only for sockets it bound itself
            logger.info("serving on http://%s:%d (Ctrl+C to quit)", f"[{host}]" if ":" in host else host, port)
            try:
                await server.serve(sockets=[sock])
            finally:
                client.detach()  # before asyncio.run closes the loop
        # uvicorn turns SIGINT / SIGTERM into a graceful shutdown, then re-raises the signal to the handler it
        # found: a no-op one lets a requested shutdown end with status 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        asyncio.run(main())
    finally:
        client.shutdown()
        sock.close()
    if client.dead:
        logger.error("exiting: %s", client.dead)
        return ENGINE_FAILED
    return 0
