"""A pure-decode step's plan straight from per-row arrays (one token per request): the index tensors of
build_forward_batch's ForwardBatch for the same rows, as flat numpy arrays in the order the decode graphs
pack them (worker/cuda_graph.py `_tensors`: the batch's fields, then each compressor kind's plan in sorted
order, then the history plan), without building chunks, torch tensors or the batch object.

Row b is request b: its token at `positions[b]` of slot `slots[b]`, its ratio-m entries paged by
`tables[m][b]` (its block table, zeros past `table_len[m][b]`: engine/kv_manager.py keeps the tables so).
Invariant (tests/state/test_decode_plan.py): for the same rows and a FixedShape, the arrays equal the
ForwardBatch's tensors value for value, shape for shape.
"""
from __future__ import annotations

import numpy as np

from deepinfer.state.forward_batch import FixedShape, _compress_arrays, _gather_plan, _history_plan, _keep_last


def decode_inputs(tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, tables: dict[int, np.ndarray],
                  table_len: dict[int, np.ndarray], window: int, compress_kinds: set[tuple[int, bool]],
                  block_size: int, fixed: FixedShape, device_history: int = 0,
                  ring_slack: int = 0) -> list[np.ndarray]:
    """The decode graphs' inputs for these rows (padding rows included), in packing order. Arguments as
    build_forward_batch's (`fixed` is required: decode graphs have fixed shapes)."""
    tok = np.arange(len(slots))
    end = positions + 1
    ring = window + ring_slack
    # (input_ids, positions, token_req, logits_idx): one token per request
    out = [tokens, positions, tok, tok]
    out += _gather_plan(tok, positions, positions, slots, window, ring)
    out += _keep_last(tok, positions, end, slots, ring)
    for m, ov in sorted(compress_kinds):
        out += _compress_arrays(m, ov, (tables[m], table_len[m]), tok, positions, tok, positions, end, slots, end,
                                slots, block_size, fixed, ring_slack)
    if device_history:
        out += _history_plan(device_history, tok, positions, positions, end, slots, ring_slack)
    return out
