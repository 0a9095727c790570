"""`deepinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an engine-core process.

Modules: protocol (request models, OpenAI error bodies), tokenizer (the chat encoding's tokenizer),
engine_proc (the engine-core process loop), engine_client (the API process's side of it), metrics
(Prometheus), serving_completions (/v1/completions), serving_recipe (/v1/chat/completions,
/v1/messages, /v1/responses through deepseek-recipe), app (routes, auth, limits) and server (start-up).
"""
