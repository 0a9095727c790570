import pytest
import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.verify import filtered_probs, verify
from deepinfer.worker.sampler import SamplingBatch, sample

GREEDY = SamplingParams(temperature=0)
P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])  # target
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])  # draft: sum min(P, Q) = 0.55


def _offsets(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n + 1)
    return out


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the tokens' counts against probs (a count where probs is 0: infinite)."""
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel()).double()
    expected = counts.sum() * probs.double().flatten()
    if (counts[expected == 0] > 0).any():
        return float("inf")
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _tv(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(tokens.flatten(), minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * float((freq - probs.double().flatten()).abs().sum())


# 5 degrees of freedom: P(chi2 > 25) ~ 1.4e-4 for a right sampler; the wrong ones below land in the thousands
CHI2_5 = 25.0


# --- greedy ---------------------------------------------------------------------------------------------

def _greedy_reference(logits, lens, drafts):
    """Plain per-request loop: longest prefix equal to the argmax, then the argmax."""
    out, row, d = [], 0, 0
    for n in lens:
        am = logits[row:row + n + 1].argmax(-1).tolist()
        k = 0
        while k < n and drafts[d + k] == am[k]:
            k += 1
        out.append(drafts[d:d + k] + [am[k]])
        row, d = row + n + 1, d + n
    return out


def _greedy_case(lens, mismatch_at, seed=0, vocab=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(lens) + len(lens), vocab, generator=g)
    am, drafts, row = logits.argmax(-1).tolist(), [], 0
    for n, m in zip(lens, mismatch_at):
        drafts += [(am[row + j] + (1 if j == m else 0)) % vocab for j in range(n)]
        row += n + 1
    return logits, drafts


def test_greedy_full_accept_emits_the_bonus_token():
    logits, drafts = _greedy_case([4], [None])
    out = verify(logits, _offsets([4]), torch.tensor(drafts), [GREEDY])
    am = logits.argmax(-1).tolist()
    assert out.num_accepted.tolist() == [4]
    assert out.token_lists() == [drafts + [am[4]]] == [am]
    assert out.tokens.tolist() == am


def test_greedy_first_token_rejected_emits_the_target_argmax():
    logits, drafts = _greedy_case([3], [0])
    out = verify(logits, _offsets([3]), torch.tensor(drafts), [GREEDY])
    am = logits.argmax(-1).tolist()
    assert out.num_accepted.tolist() == [0]
    assert out.token_lists() == [[am[0]]] and drafts[0] != am[0]
    assert out.tokens.tolist() == [am[0], -1, -1, -1]


def test_greedy_mid_reject():
    logits, drafts = _greedy_case([5], [2])
    out = verify(logits, _offsets([5]), torch.tensor(drafts), [GREEDY])
    am = logits.argmax(-1).tolist()
    assert out.num_accepted.tolist() == [2]
    assert out.token_lists() == [drafts[:2] + [am[2]]]


def test_greedy_varlen_batch_of_lengths_0_to_5():
    lens = [0, 1, 2, 3, 4, 5, 5, 3, 0, 2]
    mismatch = [None, 0, None, 1, 3, None, 4, 0, None, 1]
    logits, drafts = _greedy_case(lens, mismatch, seed=3)
    out = verify(logits, _offsets(lens), torch.tensor(drafts), [GREEDY] * len(lens))
    ref = _greedy_reference(logits, lens, drafts)
    assert out.token_lists() == ref
    assert out.num_accepted.tolist() == [0, 0, 2, 1, 3, 5, 4, 0, 0, 1]
    # greedy rows inside a batch with sampled neighbours verify the same way
    mixed = [GREEDY if i % 2 else SamplingParams(temperature=0.8) for i in range(len(lens))]
    probs = torch.full((len(drafts), 11), 1 / 11)
    res = verify(logits, _offsets(lens), torch.tensor(drafts), mixed, probs,
                 generator=torch.Generator().manual_seed(0)).token_lists()
    assert [res[i] for i in range(1, len(lens), 2)] == [ref[i] for i in range(1, len(lens), 2)]


# --- sampled: the emitted tokens follow the target --------------------------------------------------------

def _sampled_run(n, draft_len, p_logits, q, params, seeded, gen_seed=0):
    """n requests of one draft length, every row with the target logits p_logits, drafts drawn from q."""
    g = torch.Generator().manual_seed(gen_seed + 1000)
    drafts = torch.multinomial(q, n * draft_len, replacement=True, generator=g)
    rows = n * (draft_len + 1)
    out = verify(p_logits.expand(rows, -1), _offsets([draft_len] * n), drafts, [params] * n,
                 q.expand(n * draft_len, -1),
                 seeds=[(gen_seed + i, 0, 0) for i in range(n)] if seeded else None,
                 generator=torch.Generator().manual_seed(gen_seed))
    return out, drafts


def test_rejection_sampling_first_token_follows_the_target_and_the_bound_catches_wrong_samplers():
    n = 40000
    out, drafts = _sampled_run(n, 1, P.log(), Q, SamplingParams(seq_seed=1), seeded=True)
    first = out.tokens[0::2]
    assert _chi2(first, P) < CHI2_5 and _tv(first, P) < 0.01
    acc = out.num_accepted.float().mean().item()
    assert abs(acc - float(torch.minimum(P, Q).sum())) < 0.01  # acceptance rate sum_x min(p, q)

    # negative controls, with the same trials: a wrong sampler fails the same bound
    rejected = out.num_accepted == 0
    g = torch.Generator().manual_seed(7)
    from_q = drafts  # emits the draft token always (sampling from q)
    resample_p = torch.where(rejected, torch.multinomial(P, n, True, generator=g), drafts)  # residual forgotten
    absdiff = (P - Q).abs() / (P - Q).abs().sum()
    resample_abs = torch.where(rejected, torch.multinomial(absdiff, n, True, generator=g), drafts)  # no max(0, .)
    for wrong in (from_q, resample_p, resample_abs):
        assert _chi2(wrong, P) > 10 * CHI2_5 and _tv(wrong, P) > 0.03


def test_rejection_sampling_across_steps_gives_iid_target_tokens():
    """Two verify steps of draft length 3 per request: the first two emitted tokens are i.i.d. from p (the
    accepted prefix and the token after it come out of different code paths)."""
    n, seqs = 30000, [[] for _ in range(30000)]
    for step in range(2):
        out, _ = _sampled_run(n, 3, P.log(), Q, SamplingParams(), seeded=False, gen_seed=step)
        for s, toks in zip(seqs, out.token_lists()):
            s.extend(toks)
    pairs = torch.tensor([s[0] * 6 + s[1] for s in seqs])
    joint = (P[:, None] * P[None, :]).flatten()
    assert _chi2(pairs, joint) < 80  # 35 dof: P(chi2 > 80) ~ 2e-5
    # what the same run would look like if the second token were the draft's (not the target's) choice
    drafted = (P[:, None] * Q[None, :]).flatten()
    assert _chi2(pairs, drafted) > 800


def _filtered_reference(probs, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """The sampler's filtering written out token by token."""
    w = probs.double() ** (1 / temperature)
    w = w / w.sum()
    order = sorted(range(len(w)), key=lambda i: -float(w[i]))
    kept = order[:top_k] if top_k > 0 else order
    total, mass, keep = float(sum(w[i] for i in kept)), 0.0, []
    for i in kept:
        if mass >= top_p:
            break
        keep.append(i)
        mass += float(w[i]) / total
    top = max(float(w[i]) for i in keep)
    keep = [i for i in keep if float(w[i]) >= min_p * top]
    out = torch.zeros_like(w)
    out[keep] = w[keep]
    return (out / out.sum()).float()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=3, seq_seed=5),
                                    SamplingParams(top_p=0.7, seq_seed=5),
                                    SamplingParams(temperature=1.3, top_k=5, top_p=0.8, seq_seed=5),
                                    SamplingParams(min_p=0.45, seq_seed=5)])
def test_filtered_target_distribution_is_kept(params):
    n, p0 = 30000, torch.tensor([0.32, 0.24, 0.18, 0.13, 0.08, 0.05])
    draft_logits = torch.tensor([0.1, 0.9, 0.2, 1.1, 0.4, 0.3])
    expected = _filtered_reference(p0, params.temperature, params.top_k, params.top_p, params.min_p)
    q = filtered_probs(draft_logits[None], SamplingBatch.build([params], 6, "cpu"))[0]  # the proposer's q
    out, _ = _sampled_run(n, 1, p0.log(), q, params, seeded=True)
    first = out.tokens[0::2]
    assert set(first.unique().tolist()) == set(expected.nonzero().flatten().tolist())
    assert _chi2(first, expected) < CHI2_5
    assert _chi2(first, p0) > 10 * CHI2_5  # the unfiltered target would be caught


def test_deterministic_draft_without_probs_is_a_one_hot_q():
    """draft_probs None: the draft chose its tokens deterministically; accepting with p(x) and drawing the
    rejection from p without x still emits p."""
    n = 30000
    out = verify(P.log().expand(2 * n, -1), _offsets([1] * n), torch.full((n,), 4), [SamplingParams()] * n,
                 generator=torch.Generator().manual_seed(0))
    assert _chi2(out.tokens[0::2], P) < CHI2_5
    assert abs(out.num_accepted.float().mean().item() - float(P[4])) < 0.01


def test_zero_draft_probability_accepts_only_tokens_the_target_allows():
    n = 2000
    logits = torch.tensor([0.0, 0.0, float("-inf"), 0.0])  # p = 1/3 on 0, 1, 3; p(2) = 0
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    drafts = torch.tensor([3, 2] * n)  # both outside q's support
    out = verify(logits.expand(4 * n, -1), _offsets([1] * 2 * n), drafts, [SamplingParams()] * 2 * n,
                 q.expand(2 * n, -1), generator=torch.Generator().manual_seed(0))
    acc = out.num_accepted.view(n, 2)
    assert (acc[:, 0] == 1).all()   # q(3) = 0 < p(3): always accepted
    assert (acc[:, 1] == 0).all()   # p(2) = 0: always rejected
    assert 2 not in out.tokens.tolist()


# --- seeds --------------------------------------------------------------------------------------------------

def _mixed_batch(seed=0, vocab=9):
    g = torch.Generator().manual_seed(seed)
    reqs = [  # (draft length, params, seed tuple)
        (3, SamplingParams(seq_seed=11), (11, 40, 0)),
        (0, SamplingParams(temperature=0.6, top_p=0.9, seq_seed=12), (12, 7, 0)),
        (5, SamplingParams(), None),
        (2, GREEDY, None),
        (4, SamplingParams(top_k=4, seq_seed=13), (13, 100, 1)),
        (1, SamplingParams(min_p=0.2), None),
        (5, SamplingParams(temperature=1.5, seq_seed=14), (14, 3, 0)),
    ]
    lens = [r[0] for r in reqs]
    logits = torch.randn(sum(lens) + len(lens), vocab, generator=g) * 0.7
    q = torch.randn(sum(lens), vocab, generator=g).softmax(-1)
    drafts = torch.multinomial(q, 1, generator=g).flatten()
    # the greedy request's first draft is the target's argmax: it accepts one token, then rejects or not
    g_req = next(i for i, r in enumerate(reqs) if r[1].greedy)
    drafts[sum(lens[:g_req])] = logits[_offsets(lens)[g_req]].argmax()
    return reqs, logits, q, drafts


def _select(reqs, logits, q, drafts, idx):
    """The sub-batch of requests idx, in that order."""
    offs, doff, rows, drows = _offsets([r[0] for r in reqs]), [0], [], []
    for r in reqs:
        doff.append(doff[-1] + r[0])
    for i in idx:
        rows += range(offs[i], offs[i + 1])
        drows += range(doff[i], doff[i + 1])
    sub = [reqs[i] for i in idx]
    return (logits[rows], _offsets([r[0] for r in sub]), drafts[drows], [r[1] for r in sub], q[drows],
            [r[2] for r in sub])


def test_seeded_requests_do_not_depend_on_their_batch():
    for seed in range(4):
        reqs, logits, q, drafts = _mixed_batch(seed)
        together = verify(*_select(reqs, logits, q, drafts, range(len(reqs))),
                          generator=torch.Generator().manual_seed(seed)).token_lists()
        shuffled_idx = [6, 3, 0, 5, 1, 2, 4]
        shuffled = verify(*_select(reqs, logits, q, drafts, shuffled_idx),
                          generator=torch.Generator().manual_seed(99)).token_lists()
        for i, r in enumerate(reqs):
            if r[2] is None:
                continue
            alone = verify(*_select(reqs, logits, q, drafts, [i]),
                           generator=torch.Generator().manual_seed(1234)).token_lists()[0]
            assert together[i] == alone == shuffled[shuffled_idx.index(i)], (seed, i)
    # the seed matters: another seq_seed for the same request gives other tokens somewhere
    reqs, logits, q, drafts = _mixed_batch(0)
    a = verify(*_select(reqs, logits, q, drafts, [6])).token_lists()
    outs = set()
    for s in range(20):
        batch = list(_select(reqs, logits, q, drafts, [6]))
        batch[5] = [(s, 3, 0)]
        outs.add(tuple(verify(*batch).token_lists()[0]))
    assert len(outs) > 1 and tuple(a[0]) in outs


def test_draft_length_zero_is_plain_sampling():
    vocab, g = 7, torch.Generator().manual_seed(5)
    params = [SamplingParams(), SamplingParams(seq_seed=3), GREEDY, SamplingParams(top_k=3, seq_seed=4),
              SamplingParams(temperature=0.5, top_p=0.8), SamplingParams(min_p=0.3, seq_seed=9)] * 5
    seeds = [None if p.seq_seed is None else (p.seq_seed, 17 + i, 0) for i, p in enumerate(params)]
    logits = torch.randn(len(params), vocab, generator=g)
    plain = sample(logits, SamplingBatch.build(params, vocab, "cpu", seeds), torch.Generator().manual_seed(8))
    out = verify(logits, _offsets([0] * len(params)), torch.zeros(0, dtype=torch.long), params,
                 torch.zeros(0, vocab), seeds, torch.Generator().manual_seed(8))
    assert out.tokens.tolist() == plain.tolist()
    assert out.num_accepted.tolist() == [0] * len(params)
    # and without draft_probs
    again = verify(logits, _offsets([0] * len(params)), torch.zeros(0, dtype=torch.long), params, None, seeds,
                   torch.Generator().manual_seed(8))
    assert again.tokens.tolist() == plain.tolist()


def test_match_seeded_emits_the_speculation_off_tokens():
    """match_seeded: a seeded request emits what plain decoding samples from the same logits, position by
    position (each position keyed as a plain decode step would key it)."""
    vocab, g = 8, torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.9, top_p=0.95, seq_seed=21)
    for first_bad in range(5):
        logits = torch.randn(5, vocab, generator=g)
        plain = [sample(logits[j:j + 1], SamplingBatch.build([params], vocab, "cpu", [(21, 30 + j, 0)]))[0].item()
                 for j in range(5)]
        drafts = [t if j != first_bad else (t + 1) % vocab for j, t in enumerate(plain[:4])]
        out = verify(logits, [0, 5], torch.tensor(drafts), [params], torch.full((4, vocab), 1 / vocab),
                     [(21, 30, 0)], match_seeded=True)
        k = min(first_bad, 4)
        assert out.num_accepted.tolist() == [k]
        assert out.token_lists() == [plain[:k + 1]]


def test_bf16_inputs_verify_as_their_fp32_values():
    reqs, logits, q, drafts = _mixed_batch(2)
    batch = list(_select(reqs, logits, q, drafts, range(len(reqs))))
    batch[0], batch[4] = batch[0].bfloat16(), batch[4].bfloat16()
    low = verify(*batch, generator=torch.Generator().manual_seed(1)).token_lists()
    batch[0], batch[4] = batch[0].float(), batch[4].float()
    assert low == verify(*batch, generator=torch.Generator().manual_seed(1)).token_lists()


def test_bad_inputs_name_the_field():
    logits, drafts = torch.zeros(5, 4), torch.zeros(3, dtype=torch.long)
    good = dict(target_logits=logits, offsets=[0, 4, 5], draft_tokens=drafts, params=[GREEDY, GREEDY])
    for change, field in [(dict(offsets=[0, 4, 6]), "offsets"), (dict(offsets=[1, 4, 5]), "offsets"),
                          (dict(offsets=[0, 5, 5]), "offsets"),
                          (dict(draft_tokens=torch.zeros(2, dtype=torch.long)), "draft_tokens"),
                          (dict(draft_tokens=torch.zeros(3)), "draft_tokens"),
                          (dict(params=[GREEDY]), "params"),
                          (dict(draft_probs=torch.zeros(3, 5)), "draft_probs"),
                          (dict(seeds=[None]), "seeds"), (dict(seeds=[None, (1, 2)]), "seeds"),
                          (dict(target_logits=torch.zeros(5)), "target_logits")]:
        with pytest.raises(ValueError, match=field):
            verify(**{**good, **change})


@pytest.mark.gpu
def test_on_the_gpu_without_a_host_sync():
    """CUDA: greedy tokens equal the CPU's, draft length 0 equals sampler.sample on the device, seeded
    requests are independent of their batch, and the call never waits for the device."""
    reqs, logits, q, drafts = _mixed_batch(1)
    cpu = verify(*_select(reqs, logits, q, drafts, range(len(reqs)))).token_lists()
    dev = [t.cuda() if isinstance(t, torch.Tensor) else t for t in _select(reqs, logits, q, drafts, range(len(reqs)))]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = verify(*dev, generator=torch.Generator("cuda").manual_seed(0))
        one_hot = verify(*dev[:4], None, dev[5], generator=torch.Generator("cuda").manual_seed(0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    together, _ = out.token_lists(), one_hot.token_lists()
    assert together[3] == cpu[3]  # the greedy request
    for i, r in enumerate(reqs):
        if r[2] is not None:
            alone = [t.cuda() if isinstance(t, torch.Tensor) else t for t in _select(reqs, logits, q, drafts, [i])]
            assert verify(*alone, generator=torch.Generator("cuda").manual_seed(5)).token_lists()[0] == together[i]
    params = [r[1] for r in reqs]
    seeds = [None if p.seq_seed is None else (p.seq_seed, 9, 0) for p in params]
    rows = torch.randn(len(params), 9, device="cuda")
    plain = sample(rows, SamplingBatch.build(params, 9, "cuda", seeds), torch.Generator("cuda").manual_seed(3))
    zero = verify(rows, _offsets([0] * len(params)), torch.zeros(0, dtype=torch.long, device="cuda"), params,
                  None, seeds, torch.Generator("cuda").manual_seed(3))
    assert zero.tokens.tolist() == plain.tolist()
