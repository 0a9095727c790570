import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's oracle: eager everywhere, no compiler needed
os.environ.setdefault("DEEPINFER_CONFIGURE_LOGGING", "0")  # records reach pytest's caplog (the root logger)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
