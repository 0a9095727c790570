"""Model-quality evaluations of the engine, each one command (`python -m eval.<name>`), results as JSON.
See eval/README.md."""
