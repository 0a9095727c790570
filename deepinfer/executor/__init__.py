"""The engine's executors and its one builder: a Worker per rank (worker.py), run in this process
(uniproc.py) or over processes on one or several nodes (multiproc.py), under one Engine (engine.py)."""
