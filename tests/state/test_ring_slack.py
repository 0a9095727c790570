"""ring_slack: per-slot rings with spare rows, so a verify chunk's rejected positions can be taken back
(speculative decoding, issue 17).

A verify step computes [t, d1..dk] at positions p..p+k and keeps p..p+a; the next step restarts at
p+a+1. With ring_slack = 0 the rejected positions' ring writes land in rows that the next steps still
read (window keys, compressor carries, Engram token history); with ring_slack >= k - 1 they do not.

1. The planner alone (no model): every ring row a step reads is simulated with position labels, over
   rounds of verify / rollback, and checked against the position it should hold.
2. The tiny V4 and V4.1 models, fp32, in batch-invariant mode: after a verify chunk with wrong drafts
   and a rollback, the logits equal bit for bit those of a run that never computed the rejected tokens.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.layers import invariant
from deepinfer.layers.engram_hash import history_windows
from deepinfer.loader.model_loader import load_model
from deepinfer.models.config import DeepseekV4Config
from deepinfer.models.config_v41 import DeepseekV41Config
from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.worker.kv_cache import allocate_v4_cache, cache_spec

K = 3  # drafts per verify chunk


def _true(pos: int) -> int:
    return pos + 1  # the committed token at `pos` (a label: the position it belongs to)


def _wrong(pos: int) -> int:
    return 1_000_000 + pos  # a rejected draft at `pos`


class _Shadow:
    """The cache's rings and entry pool holding labels instead of values, written and read exactly as
    a model step does with a plan: reads first, then the kept-last writes (entries: written, then read)."""

    def __init__(self, slots: int, window: int, kinds, history: int, slack: int, blocks: int, bs: int):
        self.window, self.kinds, self.history, self.slack, self.bs = window, kinds, history, slack, bs
        self.ring = torch.full((slots * (window + slack),), -7, dtype=torch.long)
        self.carry = {(m, ov): torch.full((slots * ((2 * m if ov else m) + slack),), -7, dtype=torch.long)
                      for m, ov in kinds}
        self.entries = {m: torch.full((blocks * bs,), -7, dtype=torch.long) for m, _ in kinds}
        self.tokens = torch.full((slots, history + slack), -1, dtype=torch.long)
        self.wrong = dict.fromkeys(["window", "carry", "history", "entries"], 0)

    def step(self, chunks: list[SeqChunk]) -> None:
        b = build_forward_batch(chunks, self.window, set(self.kinds), self.bs, "cpu", device_history=self.history,
                                ring_slack=self.slack)
        ids, pos = b.input_ids, b.positions.tolist()
        start = [c.start for c in chunks for _ in c.token_ids]
        req = b.token_req.tolist()

        def want(t: int, q: int) -> int:  # label position q holds for token t: this step's own, or committed
            return -1 if q < 0 else int(ids[t - (pos[t] - q)]) if q >= start[t] else _true(q)

        def check(kind: str, t: int, first: int, new, old, store) -> None:
            for j in range(new.shape[-1]):
                q = first + j
                got = int(ids[new[j]]) if new[j] >= 0 else int(store[old[j]]) if old[j] >= 0 else -1
                self.wrong[kind] += got != want(t, q)

        for t in range(len(pos)):
            check("window", t, pos[t] - self.window + 1, b.win_new[t], b.win_ring[t], self.ring)
        for (m, ov), plan in b.plans.items():
            span = 2 * m if ov else m
            closing = [t for t in range(len(pos)) if (pos[t] + 1) % m == 0]
            for n, t in enumerate(closing):
                check("carry", t, pos[t] - span + 1, plan.src_new[n], plan.src_carry[n], self.carry[(m, ov)])
            self.carry[(m, ov)][plan.carry_dst] = ids[plan.carry_src]
            # entry w is labelled by its closing token; every visible entry's address holds the right label
            self.entries[m][plan.dst] = ids[torch.tensor(closing, dtype=torch.long)]
            for t in range(len(pos)):
                for w in range(int(plan.visible[t])):
                    got = int(self.entries[m][plan.addr[req[t], w]])
                    self.wrong["entries"] += got != want(t, (w + 1) * m - 1)
        if self.history:
            windows = history_windows(ids, None, self.tokens, b.history)
            for t in range(len(pos)):
                for c in range(self.history):
                    self.wrong["history"] += int(windows[t, c]) != want(t, pos[t] - c)
        self.ring[b.ring_dst] = ids[b.ring_src]


def _speculate(shadow: _Shadow, slot: int, tables, prompt: int, rounds: list[tuple[int, int]], neighbour=None):
    """Prefill `prompt` tokens, then per round (k, a): verify [t, d1..dk] at p, keep p..p+a (d1..da right,
    the others wrong); the next round starts at p+a+1. `neighbour` = (slot, tables): a request decoding
    one committed token per step beside it."""
    n_pos = [0]

    def with_neighbour(chunks):
        if neighbour is not None:
            q = n_pos[0]
            chunks.append(SeqChunk(neighbour[0], q, [_true(q)], neighbour[1]))
            n_pos[0] += 1
        return chunks

    shadow.step(with_neighbour([SeqChunk(slot, 0, [_true(q) for q in range(prompt)], tables)]))
    p = prompt
    for k, a in rounds:
        toks = [_true(p)] + [_true(p + j) if j <= a else _wrong(p + j) for j in range(1, k + 1)]
        shadow.step(with_neighbour([SeqChunk(slot, p, toks, tables)]))
        p += a + 1


# an overlapped kind (V4 CSA: 2m carry rows) and two that are not (V4 HCA, V4.1's Full layers: m rows)
KINDS = {(2, True), (3, False), (4, False)}
ROUNDS = [(K, 0), (K, 1), (1, 0), (K, K), (2, 0), (K, 0), (K, 2), (K, 0), (K, 0), (2, 1), (K, 1), (K, 0)]


def _shadow_run(slack: int, window: int = 5, history: int = 3, rounds=ROUNDS) -> dict[str, int]:
    bs, per = 4, 16
    shadow = _Shadow(3, window, KINDS, history, slack, 3 * per, bs)
    tables = lambda s: {m: list(range(s * per, (s + 1) * per)) for m, _ in KINDS}  # noqa: E731
    _speculate(shadow, 1, tables(1), 9, rounds, neighbour=(2, tables(2)))
    return shadow.wrong


@pytest.mark.parametrize("window", [4, 5, 8])
def test_rings_with_slack_k_minus_1_hold_every_position_a_later_step_reads(window):
    assert _shadow_run(K - 1, window) == dict.fromkeys(["window", "carry", "history", "entries"], 0)
    assert _shadow_run(K + 2, window) == dict.fromkeys(["window", "carry", "history", "entries"], 0)


@pytest.mark.parametrize("slack", [0, K - 2])
def test_rings_with_less_slack_are_clobbered_by_rejected_drafts(slack):
    wrong = _shadow_run(slack)
    # every ring kind is read at a rejected draft's label; the paged entries never are (rewritten first)
    assert wrong["window"] and wrong["carry"] and wrong["history"], wrong
    assert wrong["entries"] == 0, wrong


def test_window_tables_with_slack_are_the_same_on_the_host_and_on_the_device_path():
    """_gather_plan expands in numpy (CPU steps) or in torch (where a GPU reads it), ring size != span."""
    from deepinfer.state.forward_batch import _gather_plan

    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 300, (40,), generator=g)
    start, tok, slot = pos - torch.randint(0, 20, (40,), generator=g), torch.arange(40), torch.randint(0, 8, (40,))
    for span, slack in ((16, 3), (4, 1), (128, 5)):
        host = _gather_plan(tok.numpy(), pos.numpy(), start.numpy(), slot.numpy(), span, span + slack)
        dev = _gather_plan(tok, pos, start, slot, span, span + slack)
        assert all(torch.equal(torch.from_numpy(h), d) for h, d in zip(host, dev))
        q = pos[:, None] - span + 1 + torch.arange(span)
        ring = host[1]
        old = (q >= 0) & (q < start[:, None])
        assert torch.equal(torch.from_numpy(ring)[old], (slot[:, None] * (span + slack) + q % (span + slack))[old])


def test_slack_zero_plans_todays_layout_bit_for_bit():
    chunks = [SeqChunk(1, 7, [5, 6, 7, 8], {4: [0, 1, 2], 2: [3, 4, 5]}, replay_from=9),
              SeqChunk(0, 0, [1, 2, 3], {4: [6], 2: [7]})]
    base = build_forward_batch(chunks, 5, {(4, True), (2, False)}, 4, "cpu", device_history=3)
    zero = build_forward_batch(chunks, 5, {(4, True), (2, False)}, 4, "cpu", device_history=3, ring_slack=0)
    from deepinfer.worker.cuda_graph import _tensors
    assert [n for n, _ in _tensors(base)] == [n for n, _ in _tensors(zero)]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(_tensors(base), _tensors(zero)))
    # with slack the window ring of the replay plan's upper layers is the bigger ring too
    two = build_forward_batch(chunks, 5, {(4, True), (2, False)}, 4, "cpu", device_history=3, ring_slack=2)
    kept_pos = two.replay.upper.positions[two.replay.upper.ring_src]
    slot = two.replay.upper.token_req[two.replay.upper.ring_src].neg().add(1)  # request 0 -> slot 1, 1 -> 0
    assert torch.equal(two.replay.upper.ring_dst, slot * 7 + kept_pos % 7)
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="ring_slack"):
            build_forward_batch(chunks, 5, set(), 4, "cpu", ring_slack=bad)


@pytest.mark.parametrize("preset, config", [("tiny", DeepseekV4Config), ("tiny41", DeepseekV41Config)])
def test_cache_rings_grow_by_the_slack(preset, config):
    cfg = config.from_dict(PRESETS[preset])
    base, slack = cache_spec(cfg, "float32", 16), cache_spec(cfg, "float32", 16, ring_slack=K)
    assert slack.block_bytes == base.block_bytes and slack.slot_bytes > base.slot_bytes
    c0 = allocate_v4_cache(cfg, 2, dict.fromkeys(base.ratios, 1), "float32", "meta", 16, scratch=True)
    c3 = allocate_v4_cache(cfg, 2, dict.fromkeys(base.ratios, 1), "float32", "meta", 16, scratch=True, ring_slack=K)
    assert (c0.ring_slack, c3.ring_slack) == (0, K)
    for a, b in zip(c0.layers + c0.mtp, c3.layers + c3.mtp):
        for x, y in zip(a.per_slot(), b.per_slot()):  # every per-slot ring: K more rows per slot (3 slots)
            assert y.shape[0] == x.shape[0] + 3 * K and y.shape[1:] == x.shape[1:]
        assert [t.shape for t in a.paged()] == [t.shape for t in b.paged()]
    if c0.token_history is not None:
        assert c3.token_history.shape == (3, c0.token_history.shape[1] + K)
    with pytest.raises(ValueError, match="ring_slack"):
        allocate_v4_cache(cfg, 2, dict.fromkeys(base.ratios, 1), "float32", "meta", 16, ring_slack=-1)


def test_decode_graph_plans_address_the_cache_rings_with_its_slack():
    """DecodeGraphs.plan (host only) plans with cache.ring_slack: window, carry and history rows of the
    bigger rings, padding rows in the scratch slot's bigger rings too."""
    from types import SimpleNamespace

    from deepinfer.worker.cuda_graph import DecodeGraphs

    cfg = DeepseekV41Config.from_dict(PRESETS["tiny41"])
    ratios = cache_spec(cfg, "float32", 16).ratios
    cache = allocate_v4_cache(cfg, 3, dict.fromkeys(ratios, 4), "float32", "meta", 16, scratch=True, ring_slack=K)
    model = SimpleNamespace(config=cfg, token_history=cfg.engram_max_ngram_size)
    graphs = DecodeGraphs(model, cache, cache.scratch_slot, cache.scratch_addr, device="cpu")
    tables = {m: [0, 1, 2] for m in ratios}
    _, b = graphs.plan([SeqChunk(2, 40, [5], tables), SeqChunk(0, 17, [6], tables), SeqChunk(1, 3, [7], tables)])
    W, H = cfg.sliding_window + K, cfg.engram_max_ngram_size + K
    slots, pos = torch.tensor([2, 0, 1, 3]), torch.tensor([40, 17, 3, 0])  # a padding row in scratch slot 3
    assert torch.equal(b.ring_dst, slots * W + pos % W) and b.ring_src.tolist() == [0, 1, 2, 3]
    assert torch.equal(b.history.hist_dst, slots * H + pos % H)
    plan = b.plans[(2, False)]
    assert torch.equal(plan.carry_dst, slots * (2 + K) + pos % (2 + K))


# --- the models ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny", "tiny41"])
def model(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", PRESETS[request.param], seed=1,
                            dtype="float32")
    return load_model(str(path), dtype=torch.float32)[0]


def _run(model, ids: list[int], nb: list[int], prompt: int, a: int, steps: int, slack: int, drafts: bool,
         kv: str = "float32"):
    """Request A (slot 1): prefill ids[:prompt]; at p = prompt a verify chunk [t, d1..dK] whose drafts
    after the a-th are wrong (`drafts`), rolled back to p+a, or (not `drafts`) the run that never computes
    the rejected drafts: ids[p..p+a] in that step; then `steps` one-token decode steps. Request B (slot 0)
    decodes `nb` beside it, one token per step. -> {(request, position): logits} of committed positions."""
    cfg, device = model.config, model.embed.weight.device
    kinds = set(model.compressed_kinds(cfg))
    bs, per = 16, 4
    cache = allocate_v4_cache(cfg, 2, {m: 2 * per for m, _ in kinds}, kv, device, bs, ring_slack=slack)
    tables = lambda s: {m: list(range(s * per, (s + 1) * per)) for m, _ in kinds}  # noqa: E731
    wrong = [(ids[prompt + j] + 7) % cfg.vocab_size for j in range(a + 1, K + 1)] if drafts else []
    a_steps = [(0, ids[:prompt]), (prompt, ids[prompt:prompt + a + 1] + wrong)]
    a_steps += [(p, [ids[p]]) for p in range(prompt + a + 1, prompt + a + 1 + steps)]
    out = {}
    for q, (start, toks) in enumerate(a_steps):
        chunks = [SeqChunk(1, start, toks, tables(1)), SeqChunk(0, q, [nb[q]], tables(0))]
        b = build_forward_batch(chunks, cfg.sliding_window, cache.compress_kinds, bs, device,
                                device_history=model.token_history, ring_slack=cache.ring_slack)
        with torch.inference_mode(), invariant.mode(True):
            logits = model.compute_logits(model(b, cache.layers, token_history=cache.token_history)).cpu()
        for i in range(len(toks) - len(wrong) if start == prompt else len(toks)):
            out[("A", start + i)] = logits[i]
        out[("B", q)] = logits[len(toks)]
    return out


@pytest.mark.parametrize("a", [0, 1])
def test_rollback_after_rejected_drafts_gives_the_logits_of_a_run_without_them(model, a):
    """Exact (torch.equal): batch-invariant mode makes a row's logits independent of the step's other
    rows, so the verify chunk's extra rows change nothing but, without slack, the rings."""
    _check_rollback(model, a)


@pytest.mark.gpu
@pytest.mark.parametrize("preset, dtype, kv", [("tiny", torch.bfloat16, "bfloat16"), ("tiny", torch.float32, "float32"),
                                               ("tiny41", torch.bfloat16, "auto")])
def test_rollback_on_cuda(tmp_path, preset, dtype, kv):
    """The same on the GPU path (torch-side window tables, compress_pool / copy_rows / sparse attention
    kernels over the bigger rings), in the batch-invariant CUDA mode, in the cache formats as served."""
    path = write_checkpoint(tmp_path / "ckpt", PRESETS[preset], seed=1, dtype="fp8")
    gpu = load_model(str(path), dtype=dtype, device="cuda")[0]
    for a in (0, 1):
        _check_rollback(gpu, a, kv)


def _check_rollback(model, a: int, kv: str = "float32"):
    W = model.config.sliding_window
    prompt, steps = W + 4, W + 6  # decode past a window length and across compressor boundaries
    g = torch.Generator().manual_seed(10 + a)
    ids = torch.randint(3, 1000, (prompt + K + steps + 1,), generator=g).tolist()
    nb = torch.randint(3, 1000, (steps + 2,), generator=g).tolist()
    want = _run(model, ids, nb, prompt, a, steps, 0, drafts=False, kv=kv)
    for slack in (K - 1, K):
        got = _run(model, ids, nb, prompt, a, steps, slack, drafts=True, kv=kv)
        assert got.keys() == want.keys()
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], f"ring_slack {slack}"
    # without slack the rejected drafts clobber rows the continuation reads: request A's logits after the
    # rollback differ (its neighbour's do not)
    got = _run(model, ids, nb, prompt, a, steps, 0, drafts=True, kv=kv)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert bad and {r for r, _ in bad} == {"A"} and min(p for _, p in bad) == prompt + a + 1, bad
