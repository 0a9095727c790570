"""Draw the loss curve of a training run (training/train_demo.py's log.jsonl).

    python -m training.plot_loss --run RUN_DIR [--out loss.png] [--smooth 20]

Left: the target's next-token cross-entropy and the draft's cross-entropy per step (thin) and their
moving averages over --smooth steps, and the held-out cross-entropy where it was measured. Right: the
draft's expected accepted length tau (NeMo's estimate from the L1 distance to the target). Needs
matplotlib; without it, says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_log(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        raise ValueError(f"--run: no log.jsonl in {run_dir}")
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def moving_average(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot(records: list[dict], out: str | Path, smooth: int = 20) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, color in (("loss", "target CE", "C0"), ("draft_ce", "DSpark draft CE", "C1")):
        ys = [r[key] for r in records]
        ax.plot(steps, ys, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, moving_average(ys, smooth), color=color, label=label)
    held = [(r["step"], r["heldout_loss"]) for r in records if "heldout_loss" in r]
    if held:
        ax.plot(*zip(*held), "o-", color="C3", markersize=3, label="target CE, held-out files")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(steps, moving_average([r["tau"] for r in records], smooth), color="C2")
    ax2.set_xlabel("step")
    ax2.set_ylabel("expected accepted length (tokens / block)")
    ax2.set_title("DSpark tau (training estimate)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(out), dpi=120)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run directory with log.jsonl")
    p.add_argument("--out", default=None, help="image file (default: RUN_DIR/loss.png)")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window in steps")
    args = p.parse_args(argv)
    records = read_log(args.run)
    if not records:
        print(f"{args.run}/log.jsonl has no steps yet", file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_loss: matplotlib is not installed (pip install matplotlib); the losses are in "
              f"{Path(args.run) / 'log.jsonl'}", file=sys.stderr)
        return 2
    out = plot(records, args.out or Path(args.run) / "loss.png", max(1, args.smooth))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
