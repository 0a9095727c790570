"""Verification of drafted tokens against one target forward: the acceptance step of speculative decoding.

Layout (varlen, flattened over requests). Request r owns the target rows offsets[r] .. offsets[r+1] - 1:
row j < L_r (L_r = offsets[r+1] - offsets[r] - 1, the draft length, 0 allowed) is the target's distribution
for the position of draft token j; row L_r is the bonus row (the position after the last draft token). The
draft tokens are flattened the same way without bonus rows: request r's are
draft_tokens[offsets[r] - r : offsets[r+1] - r - 1].

Each request emits its accepted draft prefix (k tokens) and one token from the target (k + 1 in all):
* greedy requests (SamplingParams.greedy): accept while draft token == argmax of the target row; emit the
  argmax at the first mismatch, or the bonus row's argmax after a full match;
* sampled requests: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), which leaves the
  target's distribution unchanged. p is the row's distribution exactly as `sampler.sample` builds it
  (temperature, then top-k / top-p / min-p); q is the distribution the draft token was drawn from (the
  proposer builds it with `sampler.filtered_probs` on its own logits and the same rows' parameters). Draft token x
  is accepted with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from
  normalize(max(0, p - q)); after a full accept the bonus token is drawn from p. Exactness needs x ~ q with
  randomness independent of the verify step's (a seeded proposer keys its draws apart from the target's).
  q(x) = 0 (a token its own distribution excludes: impossible if x ~ q) is read as an infinite ratio: x is
  accepted when p(x) > 0 and rejected when p(x) = 0, so no token outside the target's filtered support is
  ever emitted. If max(0, p - q) has no mass (p == q up to rounding) the token is drawn from p.

Randomness. Every row draws one vector E ~ Exp(1)^V, the same noise `sampler.sample` draws: seeded rows
from a generator keyed by seed_key(seq_seed, position, sample_index) of the position the row samples, the
other rows from the shared generator. The acceptance uniform of draft token x is exp(-E[x]) and every draw
is the exponential race argmax(w / E). The race at a rejection never reads E[x] (max(0, p - q) is 0 at a
rejected x), so the uniform and the residual draw are independent; a row left unused keeps its key unread,
so re-sampling that position in a later step with the same key is still a fresh draw. Consequences: a
seeded request's tokens depend only on its own logits, drafts, seed and positions (never on its
neighbours), and with no drafts (L_r = 0) every request gets exactly `sampler.sample`'s token.

`match_seeded=True` verifies seeded sampled requests by matching instead: a draft token is accepted iff it
equals the token `sampler.sample` draws at that position with that key, and that draw is emitted at the
first mismatch. This is also exact, and the emitted tokens are the ones speculation-off decoding emits
from the same logits; the acceptance rate is P(x == draw), high only when the proposer draws its tokens
with the same noise (exponential race over q with the same key).

No device sync: offsets are host integers, the outputs stay on the logits' device. All token work is
batched over the flattened rows; the host loops only over the seeded rows, to key their generators and
draw their noise (as `sampler.sample` does).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.kernels.row_argmax import row_argmax
from deepinfer.sampling_params import SamplingParams
from deepinfer.state.forward_batch import to_device
from deepinfer.worker.sampler import SamplingBatch, filtered_probs, race, race_noise, seed_key

Seed = tuple[int, int, int]  # (seq_seed, position sampled by the request's first verify row, sample_index)


@dataclass
class VerifyOutput:
    tokens: torch.Tensor        # [T] long, rows' layout: request r's emitted tokens at offsets[r] ..
                                # offsets[r] + num_accepted[r] (accepted drafts, then the target's token); -1 after
    num_accepted: torch.Tensor  # [R] long, accepted draft tokens per request (emitted: num_accepted + 1)
    offsets: list[int]          # [R + 1] the verify rows' offsets, as given

    def token_lists(self) -> list[list[int]]:
        """Each request's emitted tokens on the host (one sync)."""
        toks, acc = self.tokens.tolist(), self.num_accepted.tolist()
        return [toks[o:o + a + 1] for o, a in zip(self.offsets, acc)]


def _check_inputs(logits, offsets, draft_tokens, params, draft_probs, seeds) -> None:
    def need(ok: bool, name: str, msg: str) -> None:
        if not ok:
            raise ValueError(f"verify: {name} {msg}")

    need(logits.dim() == 2 and logits.is_floating_point(), "target_logits",
         f"must be a 2-D float tensor [rows, vocab], got {tuple(logits.shape)} {logits.dtype}")
    need(len(offsets) >= 1 and offsets[0] == 0, "offsets", f"must start at 0, got {list(offsets)[:4]}")
    need(all(b - a >= 1 for a, b in zip(offsets, offsets[1:])), "offsets",
         "must grow by at least 1 per request (draft length + 1 rows)")
    need(offsets[-1] == logits.shape[0], "offsets", f"end at {offsets[-1]} but target_logits has {logits.shape[0]} rows")
    num_req = len(offsets) - 1
    num_draft = logits.shape[0] - num_req
    need(draft_tokens.dim() == 1 and not draft_tokens.is_floating_point(), "draft_tokens",
         f"must be a 1-D integer tensor, got {tuple(draft_tokens.shape)} {draft_tokens.dtype}")
    need(draft_tokens.shape[0] == num_draft, "draft_tokens",
         f"has {draft_tokens.shape[0]} tokens, the offsets give {num_draft} draft rows")
    need(len(params) == num_req, "params", f"has {len(params)} entries for {num_req} requests")
    need(all(isinstance(p, SamplingParams) for p in params), "params", "must be SamplingParams")
    need(draft_probs is None or tuple(draft_probs.shape) == (num_draft, logits.shape[1]), "draft_probs",
         f"must be None or [{num_draft}, {logits.shape[1]}], got "
         f"{None if draft_probs is None else tuple(draft_probs.shape)}")
    need(seeds is None or len(seeds) == num_req, "seeds", f"has {len(seeds or ())} entries for {num_req} requests")
    need(all(s is None or (len(s) == 3 and all(isinstance(v, int) for v in s)) for s in seeds or ()), "seeds",
         "entries must be None or (seq_seed, position, sample_index) integers")


def verify(target_logits: torch.Tensor, offsets: Sequence[int], draft_tokens: torch.Tensor,
           params: Sequence[SamplingParams], draft_probs: torch.Tensor | None = None,
           seeds: Sequence[Seed | None] | None = None, generator: torch.Generator | None = None,
           match_seeded: bool = False) -> VerifyOutput:
    """Accepts each request's longest admissible draft prefix and draws its next token (module docstring).

    target_logits [T, V]: the verify rows; offsets [R + 1] host ints; draft_tokens [T - R]; params [R];
    draft_probs [T - R, V]: the distribution each draft token was drawn from, or None when the draft chose its
    tokens deterministically (q one-hot at the token); seeds [R]: per request None or (seq_seed, position of
    the token its first row samples, sample_index), row j then keyed at position + j as a plain decode step
    sampling that position would be; generator: the unseeded rows' randomness."""
    offsets = [int(o) for o in offsets]
    _check_inputs(target_logits, offsets, draft_tokens, params, draft_probs, seeds)
    logits = target_logits.float()
    device, (num_rows, vocab) = logits.device, logits.shape
    num_req = len(offsets) - 1
    lens = [b - a - 1 for a, b in zip(offsets, offsets[1:])]
    if num_req == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return VerifyOutput(empty, empty.clone(), offsets)

    # host-built row maps, one copy to the device
    counts = torch.tensor(lens) + 1
    row_req = torch.repeat_interleave(torch.arange(num_req), counts)
    row_j = torch.arange(num_rows) - torch.tensor(offsets[:-1]).repeat_interleave(counts)
    draft_rows = torch.nonzero(row_j < torch.tensor(lens)[row_req]).flatten()
    packed = to_device(torch.cat([row_req, row_j, draft_rows, torch.tensor(offsets[:-1]), torch.tensor(lens)]),
                       device)
    row_req, row_j, draft_rows, starts, lens_t = packed.split([num_rows, num_rows, len(draft_rows), num_req, num_req])

    x_rows = torch.zeros(num_rows, dtype=torch.long, device=device)  # each row's draft token (0 on bonus rows)
    x_rows[draft_rows] = draft_tokens.to(device=device, dtype=torch.long)
    x = x_rows[draft_rows]
    greedy_choice = row_argmax(logits)

    if all(p.greedy for p in params):
        choice, use_choice = greedy_choice, None
        accepted = x == choice[draft_rows]
    else:
        per_req = SamplingBatch.build(list(params), vocab, device)
        keys = [None] * num_rows
        for r, s in enumerate(seeds or ()):
            if s is not None:  # row j samples position s[1] + j
                keys[offsets[r]:offsets[r + 1]] = [seed_key(s[0], s[1] + j, s[2]) for j in range(lens[r] + 1)]
        sb = SamplingBatch(temperature=per_req.temperature[row_req], top_k=per_req.top_k[row_req],
                           top_p=per_req.top_p[row_req], min_p=per_req.min_p[row_req],
                           needs_sort=per_req.needs_sort, max_logprobs=per_req.max_logprobs, seed_keys=keys)
        p = filtered_probs(logits, sb)
        noise = race_noise(p, sb, generator)
        plain_draw = race(p, noise)  # sampler.sample's token for each row
        greedy_rows = sb.temperature == 0
        choice = torch.where(greedy_rows, greedy_choice, plain_draw)
        use_choice = greedy_rows
        if match_seeded:
            seeded = to_device(torch.tensor([k is not None for k in sb.seed_keys]), device)
            use_choice = greedy_rows | seeded
        # rejection test u < p(x) / q(x) with u = exp(-E[x]), written u * q(x) < p(x) (q(x) = 0: accept iff p(x) > 0)
        qx = (torch.ones_like(x, dtype=torch.float32) if draft_probs is None
              else draft_probs.to(device).gather(-1, x[:, None]).squeeze(-1).float())
        u = torch.exp(-noise[draft_rows, x])
        accepted = torch.where(use_choice[draft_rows], x == choice[draft_rows], u * qx < p[draft_rows, x])

    # k = the first row that stops: a rejected draft row, or the bonus row (which always stops)
    stops = torch.ones(num_rows, dtype=torch.bool, device=device)
    stops[draft_rows] = ~accepted
    k = torch.full((num_req,), num_rows, dtype=torch.long, device=device).scatter_reduce(
        0, row_req, torch.where(stops, row_j, num_rows), reduce="amin")
    final_row = starts + k

    if use_choice is None:
        final = choice[final_row]
    else:
        pf = p[final_row]
        rejected = (k < lens_t)[:, None]
        if draft_probs is None:
            qf = torch.zeros_like(pf).scatter_(-1, x_rows[final_row][:, None], 1.0)  # (F.one_hot syncs)
        elif draft_probs.shape[0] > 0:
            req = torch.arange(num_req, device=device)
            qf = draft_probs.to(device)[(final_row - req).clamp(max=draft_probs.shape[0] - 1)].float()
        else:  # no draft rows: every request stops at its bonus row
            qf = torch.zeros_like(pf)
        w = torch.where(rejected, (pf - qf).clamp(min=0), pf)
        w = torch.where(w.sum(-1, keepdim=True) > 0, w, pf)
        drawn = race(w, noise[final_row])
        final = torch.where(use_choice[final_row], choice[final_row], drawn)

    tokens = torch.where(row_j < k[row_req], x_rows, torch.full_like(x_rows, -1))
    tokens[final_row] = final
    return VerifyOutput(tokens, k, offsets)
