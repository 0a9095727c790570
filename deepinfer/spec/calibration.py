"""Sequential Temperature Scaling (STS) of the DSpark confidence head.

The head gives a logit z_j per draft position j = 1..gamma; the calibrated conditional confidence is
c_j = sigmoid(z_j / T_j) and the survival a_j = prod_{i<=j} c_i estimates the chance that drafts
1..j are all accepted. The scheduler (`schedule.py`) uses a as an absolute probability, so it must
be calibrated, not only well ranked. STS fits T_1, T_2, ... left to right: with T_1..T_{j-1} fixed,
T_j is the point of a 1-D grid minimising the ECE of a_j against the label "positions 1..j were all
accepted" on held-out blocks (drafted and fully verified with the target). Changing one block's label
moves an ECE by at most 1/N (N blocks), so ECEs within 1/N of the minimum are not told apart by the data:
among them the T nearest 1 is taken (the least change to the head; a flat tail, e.g. a position whose
logits carry little information and whose ECE creeps down as T grows, does not drive T to a search limit).
A minimum on an edge of the grid may lie beyond it: the grid is first continued past that edge, at its
outer step, up to T_LIMITS; a pick on the edge there is logged as a warning.

The result lives beside the checkpoint as `dspark_calibration.json` (CALIBRATION_FILE):

    format                 "deepinfer.dspark_calibration"
    version                1
    gamma                  draft positions calibrated (the draft block length)
    temperatures           gamma floats > 0, T_1..T_gamma
    bins                   equal-width [0, 1] bins the ECE used
    ece_before             gamma floats in [0, 1]: ECE of a_j with every T = 1
    ece_after              gamma floats in [0, 1]: ECE of a_j with the fitted temperatures
    num_blocks             held-out draft blocks fitted on
    accepted_per_position  gamma counts: blocks whose positions 1..j were all accepted (non-increasing)

Loading validates every field and names the one that is wrong.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

CALIBRATION_FILE = "dspark_calibration.json"
FORMAT = "deepinfer.dspark_calibration"
VERSION = 1
DEFAULT_BINS = 15
DEFAULT_GRID = tuple(np.geomspace(0.01, 100.0, 369).tolist())    # 2.5 % steps, symmetric about T = 1
T_LIMITS = (1e-4, 1e4)                                            # the farthest a grid is continued
logger = logging.getLogger(__name__)


def _ece_rows(pred: np.ndarray, label: np.ndarray, bins: int) -> np.ndarray:
    """ECE of each row of pred [G, N] against label [N]: sum over bins of |sum(pred - label)| / N."""
    g, n = pred.shape
    which = np.minimum((pred * bins).astype(np.int64), bins - 1) + bins * np.arange(g)[:, None]
    gap = np.bincount(which.ravel(), weights=(pred - label).ravel(), minlength=g * bins)
    return np.abs(gap.reshape(g, bins)).sum(axis=1) / n


def _check_bins(bins) -> None:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins: need an integer >= 1, got {bins!r}")


def ece(pred, label, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error over `bins` equal-width bins of [0, 1] (a prediction of 1 falls in
    the last bin): sum over bins of (bin count / N) * |mean prediction - mean label|."""
    p, y = np.asarray(pred, dtype=np.float64), np.asarray(label, dtype=np.float64)
    if p.ndim != 1 or p.shape != y.shape or p.size == 0:
        raise ValueError(f"pred, label: need two 1-D arrays of one non-zero length, got {p.shape} and {y.shape}")
    if not np.all((p >= 0) & (p <= 1)):
        raise ValueError("pred: must lie in [0, 1]")
    _check_bins(bins)
    return float(_ece_rows(p[None, :], y, bins)[0])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))     # exact in [0, 1], no overflow


def _inputs(logits, accepted_len) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] == 0 or not np.all(np.isfinite(z)):
        raise ValueError(f"logits: need finite values of shape [blocks >= 1, gamma], got {z.shape}")
    n = np.asarray(accepted_len)
    if n.shape != (z.shape[0],) or not np.issubdtype(n.dtype, np.integer):
        raise ValueError(f"accepted_len: need {z.shape[0]} integers (one per block), got {n.dtype} {n.shape}")
    if np.any(n < 0) or np.any(n > z.shape[1]):
        raise ValueError(f"accepted_len: must lie in 0..gamma={z.shape[1]}")
    return z, n


def survival_labels(accepted_len, gamma: int) -> np.ndarray:
    """[N, gamma]: 1.0 where positions 1..j were all accepted (j <= accepted_len), else 0.0."""
    return (np.arange(1, gamma + 1)[None, :] <= np.asarray(accepted_len)[:, None]).astype(np.float64)


def survival(logits, temperatures) -> np.ndarray:
    """a [N, gamma] = cumulative product of sigmoid(z_j / T_j)."""
    return np.cumprod(_sigmoid(np.asarray(logits, dtype=np.float64) / np.asarray(temperatures)), axis=1)


def _grid_minimum(prefix: np.ndarray, z: np.ndarray, label: np.ndarray, t: np.ndarray, bins: int,
                  tol: float) -> tuple[int, np.ndarray]:
    """(index into t of the T nearest 1 among those whose ECE(prefix * sigmoid(z / T), label) lies within
    `tol` of the minimum; the candidate survivals [G, N])."""
    cand = prefix[None, :] * _sigmoid(z[None, :] / t[:, None])
    err = _ece_rows(cand, label, bins)
    best = np.flatnonzero(err <= err.min() + tol)
    return int(best[np.argmin(np.abs(np.log(t[best])))]), cand


def _continued(t: np.ndarray, pick: int) -> np.ndarray | None:
    """t (ascending) continued past the edge at `pick` by its outer step ratio for one decade, the last step
    cut at T_LIMITS; None when `pick` is not an edge or the edge is a limit."""
    if t.size < 2 or pick not in (0, t.size - 1):
        return None
    top = pick == t.size - 1
    edge, ratio = (t[-1], t[-1] / t[-2]) if top else (t[0], t[0] / t[1])
    if (edge >= T_LIMITS[1]) if top else (edge <= T_LIMITS[0]):
        return None
    steps = np.unique(np.clip(edge * ratio ** np.arange(1, math.ceil(math.log(10) / abs(math.log(ratio))) + 1),
                              *T_LIMITS))
    return np.concatenate([t, steps] if top else [steps, t])


def fit_temperatures(logits, accepted_len, bins: int = DEFAULT_BINS, grid=DEFAULT_GRID) -> list[float]:
    """STS: T_j, left to right, the grid point minimising ECE(a_j, label_j) given T_1..T_{j-1} up to the
    data's resolution 1/N, nearest 1 among those, the grid continued past an edge the pick lands on (module
    doc). So a position every T fits alike (e.g. no block survives to it) keeps T = 1."""
    z, accepted = _inputs(logits, accepted_len)
    t0 = np.asarray(grid, dtype=np.float64)
    if t0.ndim != 1 or t0.size == 0 or not np.all(np.isfinite(t0)) or np.any(t0 <= 0):
        raise ValueError("grid: need a 1-D array of finite temperatures > 0")
    t0 = np.unique(t0)  # ascending: its edges are its first and last points
    _check_bins(bins)
    labels = survival_labels(accepted, z.shape[1])
    prefix = np.ones(z.shape[0])
    out = []
    for j in range(z.shape[1]):
        t = t0
        pick, _ = _grid_minimum(prefix, z[:, j], labels[:, j], t, bins, 1e-12)
        while (wider := _continued(t, pick)) is not None:  # the minimum itself lies on an edge
            t = wider
            pick, _ = _grid_minimum(prefix, z[:, j], labels[:, j], t, bins, 1e-12)
        pick, cand = _grid_minimum(prefix, z[:, j], labels[:, j], t, bins, 1.0 / z.shape[0])
        if t.size > 1 and pick in (0, t.size - 1):
            logger.warning("DSpark calibration: position %d's temperature %.4g is the edge of the temperatures "
                           "searched (%.4g..%.4g); the ECE may fall further beyond it", j + 1, t[pick], t[0], t[-1])
        out.append(float(t[pick]))
        prefix = cand[pick]
    return out


@dataclass(frozen=True)
class Calibration:
    """Fitted per-position temperatures and how well they fit (the JSON file's content)."""
    temperatures: tuple[float, ...]
    bins: int
    ece_before: tuple[float, ...]
    ece_after: tuple[float, ...]
    num_blocks: int
    accepted_per_position: tuple[int, ...]

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def confidences(self, logits) -> np.ndarray:
        """Calibrated conditional confidences c [..., gamma] = sigmoid(z / T)."""
        z = np.asarray(logits, dtype=np.float64)
        if z.shape[-1:] != (self.gamma,):
            raise ValueError(f"logits: last dimension must be gamma={self.gamma}, got shape {z.shape}")
        return _sigmoid(z / np.asarray(self.temperatures))

    def to_json(self) -> dict:
        d = asdict(self)
        return {"format": FORMAT, "version": VERSION, "gamma": self.gamma,
                **{k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}}

    def save(self, checkpoint_dir) -> Path:
        """Writes CALIBRATION_FILE into `checkpoint_dir` (created if missing)."""
        path = Path(checkpoint_dir) / CALIBRATION_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "Calibration":
        """From a checkpoint directory (its CALIBRATION_FILE) or the file itself."""
        path = Path(path)
        if path.is_dir():
            path = path / CALIBRATION_FILE
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return from_json(doc, str(path))


def fit(logits, accepted_len, bins: int = DEFAULT_BINS, grid=DEFAULT_GRID) -> Calibration:
    """Fit the temperatures and record the ECE per position before (all T = 1) and after."""
    z, accepted = _inputs(logits, accepted_len)
    temps = fit_temperatures(z, accepted, bins, grid)
    labels = survival_labels(accepted, z.shape[1])

    def per_position(t):
        a = survival(z, t)
        return tuple(ece(a[:, j], labels[:, j], bins) for j in range(z.shape[1]))

    return Calibration(tuple(temps), bins, per_position(np.ones(z.shape[1])), per_position(temps),
                       int(z.shape[0]), tuple(int(x) for x in labels.sum(axis=0)))


def _field(doc: dict, name: str, where: str, ok, what: str):
    if name not in doc:
        raise ValueError(f"{where}: field '{name}' is missing")
    value = doc[name]
    if not ok(value):
        raise ValueError(f"{where}: field '{name}' must be {what}, got {value!r}")
    return value


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _floats(n: int, ok) -> Callable[[object], bool]:
    def check(v) -> bool:
        return (isinstance(v, list) and len(v) == n and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and math.isfinite(x) and ok(x) for x in v))
    return check


def from_json(doc, where: str = CALIBRATION_FILE) -> Calibration:
    """Validate a parsed calibration file; every error names the file and the field."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(doc).__name__}")
    known = {"format", "version", "gamma", *Calibration.__dataclass_fields__}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field '{unknown[0]}' (known: {sorted(known)})")
    _field(doc, "format", where, lambda v: v == FORMAT, repr(FORMAT))
    _field(doc, "version", where, lambda v: _is_int(v) and v == VERSION, str(VERSION))
    gamma = _field(doc, "gamma", where, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    temps = _field(doc, "temperatures", where, _floats(gamma, lambda x: x > 0), f"{gamma} finite numbers > 0")
    bins = _field(doc, "bins", where, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    unit = _floats(gamma, lambda x: 0 <= x <= 1)
    before = _field(doc, "ece_before", where, unit, f"{gamma} numbers in [0, 1]")
    after = _field(doc, "ece_after", where, unit, f"{gamma} numbers in [0, 1]")
    blocks = _field(doc, "num_blocks", where, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    counts = _field(doc, "accepted_per_position", where,
                    lambda v: isinstance(v, list) and len(v) == gamma and all(_is_int(x) for x in v)
                    and all(blocks >= x >= y >= 0 for x, y in zip(v, v[1:] + [0])),
                    f"{gamma} non-increasing integers in 0..num_blocks={blocks}")
    return Calibration(tuple(float(t) for t in temps), bins, tuple(map(float, before)), tuple(map(float, after)),
                       blocks, tuple(counts))
