import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.sampler import SamplingBatch, filtered_probs, race, race_noise, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(params: SamplingParams, n: int = 20000, logits=None) -> torch.Tensor:
    logits = (PROBS.log() if logits is None else logits).expand(n, -1).clone()
    sb = SamplingBatch.build([params] * n, logits.shape[-1], "cpu")
    return sample(logits, sb, torch.Generator().manual_seed(0))


def test_temperature_one_draws_from_the_softmax():
    freq = torch.bincount(_draw(SamplingParams(temperature=1.0)), minlength=4).float() / 20000
    assert (freq - PROBS).abs().max() < 0.015


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(_draw(SamplingParams(top_k=2)).tolist()) == {0, 1}
    assert set(_draw(SamplingParams(top_p=0.7)).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert set(_draw(SamplingParams(top_p=0.01)).tolist()) == {0}
    assert set(_draw(SamplingParams(min_p=0.5)).tolist()) == {0, 1}  # p >= 0.25
    freq = torch.bincount(_draw(SamplingParams(top_k=2)), minlength=4).float() / 20000
    assert abs(freq[0] - 0.625) < 0.015  # renormalised over the kept tokens


def test_greedy_rows_and_mixed_batches():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=1), SamplingParams(top_p=0.5)]
    sb = SamplingBatch.build(params, 3, "cpu")
    assert sample(logits, sb).tolist() == [1, 0, 2]


def test_sample_is_the_race_over_filtered_probs_and_race_noise():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=0.8, top_k=7), SamplingParams(top_p=0.7), SamplingParams(min_p=0.2)] * 2
    sb = SamplingBatch.build(params, 40, "cpu", seeds=[None, (1, 5, 0), None, (2, 9, 0), None, None])
    probs = filtered_probs(logits, sb)
    noise = race_noise(probs, sb, torch.Generator().manual_seed(4))
    assert sample(logits, sb, torch.Generator().manual_seed(4)).tolist() == race(probs, noise).tolist()
    alone = SamplingBatch.build(params[1:2], 40, "cpu", seeds=[(1, 5, 0)])  # a seeded row's noise is its own
    assert torch.equal(race_noise(probs[1:2], alone, torch.Generator().manual_seed(99))[0], noise[1])
    assert race(torch.tensor([[0.0, 2.0, 0.0]]), torch.rand(1, 3) + 0.1).tolist() == [1]  # unnormalised weights


def test_all_greedy_batches_are_one_argmax_and_draw_no_noise():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 5, 30, "cpu")
    mixed = SamplingBatch.build([SamplingParams(temperature=0)] * 4 + [SamplingParams(temperature=1.0)], 30, "cpu")
    assert greedy.all_greedy and not mixed.all_greedy
    g = torch.Generator().manual_seed(7)
    before = g.get_state()
    assert torch.equal(sample(logits, greedy, g), logits.argmax(-1))
    assert torch.equal(g.get_state(), before)  # no noise drawn
    assert torch.equal(sample(logits, mixed, g)[:4], logits[:4].argmax(-1))
    assert not torch.equal(g.get_state(), before)  # a sampled row draws
