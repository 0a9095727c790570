"""Every decode step of a parallel engine against one process, where the two cannot be bit-identical
(bf16 on the GPU: each rank's partial sums round apart from one process's GEMMs).

Greedy runs with logprobs: while the tokens agree, each step's returned logprobs must lie within
`bound` of one process's. Greedy tokens may part only where one process's top two logprobs lie within
2 * bound of each other (each side may move by `bound`, so a nearer pair may swap); after that the two
runs continue from different prefixes and are not compared further. Every comparison prints one
MEASURED line (pytest -s shows it) so that a bound is set from what the GPU gives, never guessed.
"""
from __future__ import annotations


def _prompt_gap(got_tokens, got_lps, want_tokens, want_lps) -> tuple[float, int, float | None]:
    """(largest |logprob difference| over the steps whose prefixes agree, steps compared, one process's
    top-two margin at the first step whose tokens part (None: they never part))."""
    worst, steps = 0.0, 0
    for g_tok, g_lp, w_tok, w_lp in zip(got_tokens, got_lps, want_tokens, want_lps, strict=True):
        common = g_lp.keys() & w_lp.keys()
        assert g_tok != w_tok or w_tok in common, (w_tok, g_lp, w_lp)
        worst = max([worst] + [abs(g_lp[k] - w_lp[k]) for k in common])
        steps += 1
        if g_tok != w_tok:
            top = sorted(w_lp.values(), reverse=True)
            return worst, steps, top[0] - top[1]
    return worst, steps, None


def assert_steps_close(got, want, bound: float, label: str) -> float:
    """got / want: per prompt, its greedy completions (CompletionOutput lists, logprobs >= 2 asked).
    Returns the largest difference (printed on a MEASURED line)."""
    worst, steps, parted = 0.0, 0, []
    for g_outs, w_outs in zip(got, want, strict=True):
        for g, w in zip(g_outs, w_outs, strict=True):
            gap, n, margin = _prompt_gap(g.token_ids, g.logprobs, w.token_ids, w.logprobs)
            worst, steps = max(worst, gap), steps + n
            if margin is not None:
                parted.append(margin)
    print(f"MEASURED {label}: largest |logprob - one process's| {worst:.4g} over {steps} steps; "
          f"tokens parted at top-two margins {parted}")
    assert steps > len(got), "only the first tokens were compared"
    assert worst <= bound, (label, worst, bound)
    assert all(m <= 2 * bound for m in parted), (label, "tokens parted away from a near tie", parted, bound)
    return worst


def assert_chosen_close(got_tokens: list[int], got_lps: list[float], want_tokens: list[int], want_lps: list[float],
                        bound: float, label: str) -> float:
    """Greedy runs that give only the chosen token's logprob per step (no margin to judge a flip by):
    every token equal, every logprob within `bound`."""
    worst = max(abs(a - b) for a, b in zip(got_lps, want_lps, strict=True))
    print(f"MEASURED {label}: largest |logprob - one process's| {worst:.4g} over {len(got_lps)} steps")
    assert got_tokens == want_tokens, (label, got_tokens, want_tokens)
    assert worst <= bound, (label, worst, bound)
    return worst
