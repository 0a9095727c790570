"""The `deepinfer` logger: one stderr handler unless DEEPINFER_CONFIGURE_LOGGING=0."""
from __future__ import annotations

import logging

from deepinfer.config import LoggingConfig

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging(cfg: LoggingConfig) -> None:
    root = logging.getLogger("deepinfer")
    if not cfg.configure or getattr(root, "_deepinfer_handler", None) is not None:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(cfg.level)
    root.propagate = False  # the application's own root handlers would print every line twice
    root._deepinfer_handler = handler
