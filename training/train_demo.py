"""Train a small DeepSeek-V4.1 (every layer role, Engram, mHC, the 3-stage DSpark draft and its
confidence head) with NeMo AutoModel's implementation, on the tokenized Python standard library.

    python -m training.train_demo --data TOK_DIR --out RUN_DIR [--preset demo41] [--total-steps N|auto]
        [--max-minutes 9] [--max-steps N] [--save-every 200] ...

TOK_DIR is what `python -m training.tokenizer --out TOK_DIR` wrote (tokenizer.json, train.bin).
RUN_DIR holds config.json + tokenizer files (the released layout's, for training.export), checkpoint.pt
(target + draft + optimizer + step + RNG + data position + the settings that fix the run) and
log.jsonl (one JSON object per step). Re-running the same command resumes from checkpoint.pt; a
setting that changes the run (preset, batch, sequence length, learning rate, ...) must not differ.

Each step: one target forward on a batch of packed windows (consecutive `seq_len` tokens of the
concatenated files, each file BOS ... EOS; windows in a seeded random order per epoch), next-token
cross-entropy; the draft reads the target's streams at its target layers and final-norm output
(detached) and adds NeMo's DSpark objective (draft CE + L1 to the target's distribution + confidence
BCE, at `--num-anchors` sampled anchors per row). One AdamW step on the sum, linear warm-up then
cosine decay to `--min-lr-ratio` x lr at --total-steps; then the routers' correction biases move
toward even expert load. bf16 autocast on CUDA, fp32 on CPU.

`--total-steps auto` (first run only) times steps 6..15 and fixes total_steps so that the whole run
takes about --budget-minutes of step time; it is stored in the checkpoint and never changes after.
The run stops (checkpoint written) at --max-steps, at the end of the schedule, or when the next step
would pass --max-minutes since start-up.
"""
from __future__ import annotations

import time

_START = time.monotonic()  # --max-minutes counts from here on the command line

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"
TEXT_PRESETS = ("tiny41", "demo41")
# Settings that define the run: a resumed run must use the same values.
FIXED = ("preset", "seq_len", "batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip",
         "seed", "num_anchors", "draft_weight", "gate_bias_update", "beta2")


# Optimisation settings (all part of FIXED): windows of seq_len tokens, batch_size rows a step, AdamW
# (beta1 0.9, beta2, weight decay on matrices only), global grad-norm clip.
HYPERPARAMETERS = {"--seq-len": 512, "--batch-size": 16, "--lr": 1e-3, "--min-lr-ratio": 0.1, "--warmup-steps": 100,
                   "--weight-decay": 0.1, "--beta2": 0.95, "--grad-clip": 1.0}


@dataclass
class DataState:
    epoch: int = 0
    cursor: int = 0


class PackedWindows:
    """Windows of seq_len consecutive tokens of the concatenated token file, in a seeded random order
    per epoch; the position (epoch, cursor) is all the state there is."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int, state: DataState | None = None):
        self.tokens, self.seq_len, self.batch, self.seed = tokens, seq_len, batch, seed
        self.n = len(tokens) // seq_len
        if self.n == 0:
            raise ValueError(f"--seq-len {seq_len}: the training tokens ({len(tokens)}) do not fill one window")
        self.state = state or DataState()
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> torch.Tensor:
        rows = []
        for _ in range(self.batch):
            if self.state.cursor >= self.n:
                self.state = DataState(self.state.epoch + 1, 0)
            w = int(self._order(self.state.epoch)[self.state.cursor])
            rows.append(np.asarray(self.tokens[w * self.seq_len:(w + 1) * self.seq_len], dtype=np.int64))
            self.state = DataState(self.state.epoch, self.state.cursor + 1)
        return torch.from_numpy(np.stack(rows))


def lr_at(step: int, args, total: int) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warm-up, cosine to min_lr_ratio x lr."""
    if args.warmup_steps and step <= args.warmup_steps:
        return args.lr * step / args.warmup_steps
    span = max(1, total - args.warmup_steps)
    t = min(1.0, (step - args.warmup_steps) / span)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def auto_total_steps(step_times: list[float], budget_minutes: float, step: int) -> int:
    """--total-steps auto: the schedule length whose steps take budget_minutes at the median time of
    steps 6..15 (the first five warm caches and allocators up); never below step + 1."""
    if len(step_times) < 15:
        raise ValueError("--total-steps auto needs the times of 15 steps")
    return max(step + 1, int(budget_minutes * 60 / float(np.median(step_times[5:15]))))


def model_config(preset: str, tokenizer_json: Path) -> dict:
    """The released config.json of `preset` with the tokenizer's Engram compressed vocabulary."""
    from tokenizers import Tokenizer

    from deepinfer.layers.engram_hash import compressed_token_map
    from deepinfer.tools.make_checkpoint_v41 import checkpoint_config_v41
    from deepinfer.tools.presets_v41 import PRESETS_V41

    tok = Tokenizer.from_file(str(tokenizer_json))
    top = PRESETS_V41[preset]
    vocab, want = tok.get_vocab_size(with_added_tokens=True), top["text_config"]["vocab_size"]
    if vocab != want:
        raise ValueError(f"--data: the tokenizer has {vocab} tokens, preset {preset} needs vocab_size {want} "
                         f"(train it with python -m training.tokenizer --vocab-size {want})")
    cfg = checkpoint_config_v41(top, "fp8", compressed_token_map(tok)[1])
    # NeMo-trained drafts feed the final-normed hidden to the confidence head (the release: pre-norm).
    cfg["text_config"]["dspark_confidence_input"] = "normalized"
    return cfg


def _param_groups(models, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for module in (models.target, models.draft):
        for _, p in module.named_parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _trainable(models) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{tag}.{n}", p) for tag, m in (("target", models.target), ("draft", models.draft))
            for n, p in m.named_parameters() if p.requires_grad]


def _rng_state(device: torch.device) -> dict:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(out: Path, models, opt, step: int, data: DataState, fixed: dict, total_steps: int,
                    device: torch.device) -> None:
    state = dict(target=models.target.state_dict(), draft=models.draft.state_dict(), optimizer=opt.state_dict(),
                 step=step, data=asdict(data), rng=_rng_state(device), fixed=fixed, total_steps=total_steps)
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / CHECKPOINT)


def load_checkpoint(run_dir: str | Path, map_location="cpu") -> dict:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise ValueError(f"no {CHECKPOINT} in {run_dir}: train with python -m training.train_demo --out {run_dir}")
    return torch.load(path, map_location=map_location, weights_only=False)


def load_trained(run_dir: str | Path, device: str = "cpu"):
    """(Models with the checkpoint's weights in eval mode, released config dict, step)."""
    from training.nemo_models import build_models

    run_dir = Path(run_dir)
    ck = load_checkpoint(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    models = build_models(cfg, run_dir / "tokenizer.json", device=device, num_anchors=ck["fixed"]["num_anchors"])
    models.target.load_state_dict(ck["target"], strict=True)
    models.draft.load_state_dict(ck["draft"], strict=True)
    models.target.eval()
    models.trainer.eval()
    return models, cfg, ck["step"]


def _truncate_log(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))


@torch.no_grad()
def heldout_loss(target, tokens: np.ndarray, seq_len: int, windows: int, batch: int, device: torch.device) -> float:
    """The target's mean next-token cross-entropy over `windows` evenly spaced held-out windows (eval
    mode: the routers' load counters do not see them)."""
    n = len(tokens) // seq_len
    starts = sorted({int(i) for i in np.linspace(0, n - 1, min(windows, n))})
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    total, count = 0.0, 0
    target.eval()
    try:
        for i in range(0, len(starts), batch):
            ids = torch.from_numpy(np.stack([np.asarray(tokens[w * seq_len:(w + 1) * seq_len], dtype=np.int64)
                                             for w in starts[i:i + batch]])).to(device)
            with amp:
                logits = target(ids).logits
            total += F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(),
                                     reduction="sum").item()
            count += ids[:, 1:].numel()
    finally:
        target.train()
    return total / count


def train_step(models, capture, ids: torch.Tensor, opt, lr: float, args, device: torch.device) -> dict:
    """One optimizer step on ids [B, S]; returns the step's log fields (losses, grad checks)."""
    from training.nemo_models import sync_draft_embeddings, update_router_biases

    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    sync_draft_embeddings(models)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    with amp:
        logits = models.target(ids).logits
        feats, last = capture.take()
        ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        m = models.trainer(input_ids=ids, target_hidden_states=feats, loss_mask=torch.ones_like(ids),
                           target_last_hidden_states=last)
        loss = ce + args.draft_weight * m.loss
    loss.backward()
    params = _trainable(models)
    missing = [n for n, p in params if p.grad is None]
    nonfinite = [n for n, p in params if p.grad is not None and not torch.isfinite(p.grad).all()]
    norm = torch.nn.utils.clip_grad_norm_([p for _, p in params if p.grad is not None], args.grad_clip)
    opt.step()
    update_router_biases(models.target)
    acc_den = m.accept_rate_per_pos_den.float().clamp_min(1)
    return dict(loss=ce.item(), draft_loss=m.loss.item(), draft_ce=m.ce_loss.item(), draft_l1=m.l1_loss.item(),
                confidence_loss=m.confidence_loss.item(),
                accept_rate=[round(x, 4) for x in (m.accept_rate_per_pos_num / acc_den).tolist()],
                tau=(m.tau_num / m.tau_den.clamp_min(1)).item(),
                grad_norm=float(norm), missing_grads=missing, nonfinite_grads=nonfinite)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="directory written by python -m training.tokenizer")
    p.add_argument("--out", required=True, help="run directory (checkpoint, log, config); re-run to resume")
    p.add_argument("--preset", default="demo41", choices=TEXT_PRESETS, help="deepinfer/tools/presets_v41.py widths")
    for flag, default in HYPERPARAMETERS.items():  # the type is the default's
        p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--total-steps", default="auto",
                   help="schedule length; 'auto' (first run) sizes it to --budget-minutes of step time")
    p.add_argument("--budget-minutes", type=float, default=52.0, help="step time of the whole schedule (auto)")
    p.add_argument("--max-steps", type=int, default=None, help="stop this run after this step")
    p.add_argument("--max-minutes", type=float, default=9.0, help="stop (and checkpoint) before this wall time")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=200, help="held-out loss every N steps (0: never)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of --seq-len per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-anchors", type=int, default=8, help="DSpark draft blocks per row per step")
    p.add_argument("--draft-weight", type=float, default=1.0, help="weight of the DSpark objective")
    p.add_argument("--gate-bias-update", type=float, default=1e-3, help="router correction-bias step (0: off)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--attn", default="eager", choices=("eager", "sdpa"), help="NeMo attention backend")
    p.add_argument("--experts", default="torch", choices=("torch", "torch_mm"), help="NeMo expert GEMM backend")
    args = p.parse_args(argv)
    if args.total_steps != "auto":
        try:
            args.total_steps = int(args.total_steps)
        except ValueError:
            p.error(f"--total-steps: {args.total_steps!r} is neither an integer nor 'auto'")
        if args.total_steps < 1:
            p.error("--total-steps must be >= 1")
    if args.seq_len < 8 or args.seq_len % 8:
        p.error(f"--seq-len {args.seq_len}: must be a multiple of 8 (compression groups, draft blocks)")
    return args


def _prepare_run_dir(out: Path, data: Path, preset: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (data / name).is_file():
            raise ValueError(f"--data: {data / name} is missing (python -m training.tokenizer --out {data})")
    if (out / "config.json").is_file():
        return json.loads((out / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data / name, out / name)
    cfg = model_config(preset, out / "tokenizer.json")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def main(argv: list[str] | None = None, start: float | None = None) -> dict:
    """Runs (or resumes) training; returns {"step", "total_steps", "finished", "reason"}. --max-minutes
    counts from `start` (time.monotonic(); default: now; the command line: interpreter start-up)."""
    from training.nemo_models import FeatureCapture, build_models
    from training.tokenizer import read_tokens

    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out, data = Path(args.out), Path(args.data)
    cfg = _prepare_run_dir(out, data, args.preset)
    fixed = {k: getattr(args, k) for k in FIXED}
    ck = load_checkpoint(out) if (out / CHECKPOINT).is_file() else None
    if ck is not None:
        for k, v in fixed.items():
            if ck["fixed"].get(k) != v:
                raise ValueError(f"--{k.replace('_', '-')}: {v!r} differs from this run's {ck['fixed'].get(k)!r} "
                                 f"(checkpoint in {out}); use the original value or a new --out")
        if args.total_steps not in ("auto", ck["total_steps"]):
            raise ValueError(f"--total-steps {args.total_steps} differs from this run's {ck['total_steps']}")
    models = build_models(cfg, out / "tokenizer.json", device=device, num_anchors=args.num_anchors,
                          gate_bias_update=args.gate_bias_update, attn=args.attn, experts=args.experts,
                          seed=args.seed)
    opt = torch.optim.AdamW(_param_groups(models, args.weight_decay), lr=args.lr, betas=(0.9, args.beta2),
                            eps=1e-8)
    step, total, state = 0, args.total_steps, DataState()
    if ck is not None:
        models.target.load_state_dict(ck["target"], strict=True)
        models.draft.load_state_dict(ck["draft"], strict=True)
        opt.load_state_dict(ck["optimizer"])
        step, total, state = ck["step"], ck["total_steps"], DataState(**ck["data"])
        _set_rng_state(ck["rng"], device)
        del ck
        print(f"resuming {out} at step {step} of {total}", file=sys.stderr)
    else:
        torch.manual_seed(args.seed + 1)
    _truncate_log(out / LOG, step)
    windows = PackedWindows(read_tokens(data / "train.bin"), args.seq_len, args.batch_size, args.seed, state)
    held = read_tokens(data / "heldout.bin") if (data / "heldout.bin").is_file() else np.zeros(0, np.int32)
    if len(held) < args.seq_len:
        args.eval_every = 0
    capture = FeatureCapture(models.target)
    start = time.monotonic() if start is None else start
    deadline = start + args.max_minutes * 60
    timed: list[float] = []
    reason, last_saved = "", step
    tokens_per_step = args.batch_size * args.seq_len
    with (out / LOG).open("a") as log:
        while True:
            if total != "auto" and step >= total:
                reason = "schedule finished"
                break
            if args.max_steps is not None and step >= args.max_steps:
                reason = f"--max-steps {args.max_steps}"
                break
            typical = float(np.median(timed[-20:])) if timed else 0.0
            if time.monotonic() + 1.5 * typical + 20 > deadline:
                reason = f"--max-minutes {args.max_minutes}"
                break
            t0 = time.monotonic()
            ids = windows.next_batch().to(device, non_blocking=True)
            lr = lr_at(step + 1, args, total if total != "auto" else 10 ** 9)
            rec = train_step(models, capture, ids, opt, lr, args, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.monotonic() - t0
            step += 1
            timed.append(dt)
            if total == "auto" and len(timed) == 15:
                total = auto_total_steps(timed, args.budget_minutes, step)
                print(f"--total-steps auto: {args.budget_minutes} min of steps -> total_steps {total}", file=sys.stderr)
            rec = dict(step=step, lr=lr, tokens=step * tokens_per_step, step_s=round(dt, 4),
                       tokens_per_s=round(tokens_per_step / dt, 1), elapsed_s=round(time.monotonic() - start, 1),
                       **rec)
            if args.eval_every and step % args.eval_every == 0:
                rec["heldout_loss"] = heldout_loss(models.target, held, args.seq_len, args.eval_windows,
                                                   args.batch_size, device)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if rec["nonfinite_grads"]:
                raise FloatingPointError(f"step {step}: non-finite gradients in {rec['nonfinite_grads'][:5]}")
            if step % args.save_every == 0 and total != "auto":
                save_checkpoint(out, models, opt, step, windows.state, fixed, total, device)
                last_saved = step
    if total == "auto":
        raise RuntimeError("--total-steps auto needs at least 15 steps in the first run")
    if last_saved != step or not (out / CHECKPOINT).is_file():
        save_checkpoint(out, models, opt, step, windows.state, fixed, total, device)
    capture.remove()
    finished = step >= total
    summary = dict(step=step, total_steps=total, finished=finished, reason=reason)
    print(json.dumps(summary))
    if not finished:
        print("re-run the same command to resume", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main(start=_START)
