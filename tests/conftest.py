import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's oracle: eager everywhere, no compiler needed
os.environ.setdefault("DEEPINFER_CONFIGURE_LOGGING", "0")  # records reach pytest's caplog (the root logger)

import pytest
import torch

# The suite starts many processes of its own (servers, parallel ranks, CLI runs) on a 2-core CI machine:
# the pytest process computes single-threaded (as it did before TP/DP engines restored the thread count on
# close: with two threads here the suite ran slower).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
