"""training/plot_loss.py: the loss curve of a run's log.jsonl (matplotlib optional for the tool; a test
dependency, requirements/test.txt, so the curve is always drawn here)."""
from __future__ import annotations

import json
import sys

from training.plot_loss import main, moving_average


def _run(tmp_path):
    recs = [dict(step=i, loss=8 - i * 0.1, draft_ce=8.5 - i * 0.1, tau=1 + i * 0.05) for i in range(1, 31)]
    recs[19]["heldout_loss"] = 6.5
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return tmp_path


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_without_matplotlib_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["--run", str(_run(tmp_path))]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "loss.png").exists()


def test_draws_the_curve(tmp_path):
    assert main(["--run", str(_run(tmp_path)), "--smooth", "5"]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
