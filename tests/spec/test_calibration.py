"""Sequential temperature scaling of the DSpark confidence head: ECE, fitting, the JSON file."""
from __future__ import annotations

import json

import numpy as np
import pytest

from deepinfer.spec.calibration import (CALIBRATION_FILE, Calibration, ece, fit, fit_temperatures, survival,
                                        survival_labels)

TRUE_T = [0.5, 1.0, 2.0, 0.7]


def synthetic(seed: int, blocks: int, temperatures):
    """Logits z ~ N(1.5, 2); position j accepted (given 1..j-1 were) with chance sigmoid(z_j / T_j)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 2.0, (blocks, len(temperatures)))
    accepted = rng.uniform(size=z.shape) < 1.0 / (1.0 + np.exp(-z / np.array(temperatures)))
    length = np.where(accepted.all(axis=1), len(temperatures), np.argmin(accepted, axis=1))
    return z, length


def test_ece_hand_cases():
    pred, label = [0.1, 0.2, 0.9, 0.95], [0, 1, 1, 1]
    assert ece(pred, label, bins=2) == pytest.approx((abs(0.3 - 1) + abs(1.85 - 2)) / 4)
    assert ece(pred, label, bins=10) == pytest.approx((0.1 + 0.8 + 0.15) / 4)
    assert ece([0.5, 0.5], [0, 1]) == 0.0
    assert ece([1.0, 1.0], [1, 0], bins=4) == pytest.approx(0.5)        # 1.0 falls in the last bin


def test_labels_mark_positions_up_to_the_accepted_length():
    assert survival_labels([0, 2, 3], 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_one_position_hand_case_finds_the_matching_temperature():
    # 400 blocks, z = 2, three in four accepted: sigmoid(2 / T) = .75 at T = 2 / ln 3 = 1.820 (ECE 0; T = 1
    # and 3 are 0.13 and 0.09 off, far beyond the data's resolution 1 / 400)
    z, accepted = np.full((400, 1), 2.0), np.array([1, 1, 1, 0] * 100)
    assert fit_temperatures(z, accepted, grid=[1.0, 1.82, 3.0]) == [1.82]


def test_a_position_without_evidence_keeps_temperature_one():
    z, accepted = synthetic(0, 2000, [0.5, 1.0])
    z[:, 1] = 0.0                              # sigmoid(0 / T) = .5 for every T: all fit alike
    assert fit_temperatures(z, accepted)[1] == 1.0


def test_fit_recovers_known_temperatures_and_lowers_ece():
    z, accepted = synthetic(1, 20000, TRUE_T)
    cal = fit(z, accepted)
    np.testing.assert_allclose(cal.temperatures, TRUE_T, rtol=0.2)
    assert all(after < before for before, after in zip(cal.ece_before, cal.ece_after))
    assert max(cal.ece_after) < 0.02 and max(cal.ece_before) > 0.05
    assert cal.num_blocks == 20000 and cal.gamma == 4
    assert cal.accepted_per_position == tuple(int((accepted >= j).sum()) for j in range(1, 5))
    # the temperatures carry over to blocks they were not fitted on
    z2, accepted2 = synthetic(2, 20000, TRUE_T)
    labels2 = survival_labels(accepted2, 4)
    for t, worse in ((cal.temperatures, False), ([1.0] * 4, True)):
        mean = np.mean([ece(a, y) for a, y in zip(survival(z2, t).T, labels2.T)])
        assert (mean > 0.03) == worse


def test_confidences_apply_the_temperatures():
    cal = Calibration((0.5, 2.0), 15, (0.1, 0.1), (0.0, 0.0), 10, (5, 2))
    np.testing.assert_allclose(cal.confidences([[1.0, 1.0]]), [[1 / (1 + np.exp(-2.0)), 1 / (1 + np.exp(-0.5))]])
    with pytest.raises(ValueError, match="logits"):
        cal.confidences([1.0, 1.0, 1.0])


def test_save_and_load_round_trip(tmp_path):
    z, accepted = synthetic(3, 500, [1.0, 1.5])
    cal = fit(z, accepted)
    path = cal.save(tmp_path)
    assert path == tmp_path / CALIBRATION_FILE == tmp_path / "dspark_calibration.json"
    doc = json.loads(path.read_text())
    assert sorted(doc) == sorted(["format", "version", "gamma", "temperatures", "bins", "ece_before", "ece_after",
                                  "num_blocks", "accepted_per_position"])
    assert doc["gamma"] == 2 and doc["num_blocks"] == 500
    assert Calibration.load(tmp_path) == cal == Calibration.load(path)
    assert Calibration.load(cal.save(tmp_path / "new" / "dir")) == cal  # `calibrate_dspark --out` a fresh directory


def _good() -> dict:
    return {"format": "deepinfer.dspark_calibration", "version": 1, "gamma": 2, "temperatures": [0.8, 1.2],
            "bins": 15, "ece_before": [0.05, 0.04], "ece_after": [0.01, 0.01], "num_blocks": 100,
            "accepted_per_position": [70, 40]}


@pytest.mark.parametrize("change, field", [
    ({"temperatures": None}, "temperatures"), ({"temperatures": [1.0]}, "temperatures"),
    ({"temperatures": [1.0, -1.0]}, "temperatures"), ({"temperatures": [1.0, float("nan")]}, "temperatures"),
    ({"temperatures": [1.0, "2"]}, "temperatures"), ({"gamma": 0}, "gamma"), ({"gamma": 3}, "temperatures"),
    ({"bins": 0}, "bins"), ({"bins": True}, "bins"), ({"ece_after": [0.1, 1.5]}, "ece_after"),
    ({"ece_before": [0.1]}, "ece_before"), ({"num_blocks": "100"}, "num_blocks"),
    ({"accepted_per_position": [40, 70]}, "accepted_per_position"),
    ({"accepted_per_position": [170, 40]}, "accepted_per_position"),
    ({"format": "other"}, "format"), ({"version": 2}, "version"), ({"temperature": [1.0, 1.0]}, "temperature"),
    ({"num_blocks": None}, "num_blocks")])
def test_load_rejects_a_bad_field_by_name(tmp_path, change, field):
    doc = _good()
    doc.update(change)
    doc = {k: v for k, v in doc.items() if v is not None}
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"field '{field}'"):
        Calibration.load(tmp_path)


def test_load_accepts_the_good_document_and_rejects_non_objects(tmp_path):
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(_good()))
    assert Calibration.load(tmp_path).temperatures == (0.8, 1.2)
    (tmp_path / CALIBRATION_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        Calibration.load(tmp_path)
    (tmp_path / CALIBRATION_FILE).write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        Calibration.load(tmp_path)


@pytest.mark.parametrize("call, field", [
    (lambda: fit_temperatures(np.zeros(4), np.zeros(4, dtype=int)), "logits"),
    (lambda: fit_temperatures(np.zeros((0, 2)), np.zeros(0, dtype=int)), "logits"),
    (lambda: fit_temperatures(np.zeros((2, 2)), np.array([0, 3])), "accepted_len"),
    (lambda: fit_temperatures(np.zeros((2, 2)), np.array([0.0, 1.0])), "accepted_len"),
    (lambda: fit_temperatures(np.zeros((2, 2)), np.array([0, 1]), grid=[0.0, 1.0]), "grid"),
    (lambda: fit_temperatures(np.zeros((2, 2)), np.array([0, 1]), bins=0), "bins"),
    (lambda: ece([0.5, 1.2], [0, 1]), "pred"),
    (lambda: ece([0.5], [0, 1]), "pred")])
def test_bad_fit_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def scaled(seed: int, blocks: int, temperatures):
    """synthetic(...) with position j's logits scaled by T_j: z_j / T_j ~ N(1.5, 2) whatever T_j is."""
    z, length = synthetic(seed, blocks, [1.0] * len(temperatures))
    return z * np.array(temperatures), length


@pytest.mark.parametrize("true_t", [[40.0, 1.0], [0.02, 1.0]])
def test_a_temperature_beyond_the_old_grid_is_found(true_t):
    # the old grid (0.05..20) would give its edge, 20 or 0.05
    z, accepted = scaled(3, 5000, true_t)
    np.testing.assert_allclose(fit_temperatures(z, accepted), true_t, rtol=0.2)


@pytest.mark.parametrize("true_t", [[300.0, 1.0], [0.003, 1.0]])
def test_a_minimum_on_the_grid_edge_continues_the_grid(true_t, caplog):
    z, accepted = scaled(4, 5000, true_t)                                         # beyond DEFAULT_GRID (0.01..100)
    np.testing.assert_allclose(fit_temperatures(z, accepted), true_t, rtol=0.2)
    assert not caplog.records


def test_a_minimum_at_the_search_limit_is_a_warning(caplog):
    with caplog.at_level("WARNING", logger="deepinfer.spec.calibration"):
        # z = 2000 everywhere, half of 2000 blocks accepted: ECE = sigmoid(2000 / T) - 0.5 still falls by
        # ~0.0012 a grid step at T = 1e4, more than the data's resolution 1 / N = 0.0005
        z, accepted = np.full((2000, 1), 2000.0), np.arange(2000) % 2
        assert fit_temperatures(z, accepted) == [pytest.approx(1e4)]
    assert "position 1's temperature 1e+04 is the edge" in caplog.text


def test_an_ece_that_creeps_down_for_ever_stops_within_the_datas_resolution(caplog):
    # z = 5 everywhere, half of 100 blocks accepted: ECE = sigmoid(5 / T) - 0.5 falls with T for ever, but
    # below 1 / N = 0.01 above T ~ 125 (the shipped demo's first position: 20 -> 1e4 changed its ECE by 1e-5)
    z, accepted = np.full((100, 1), 5.0), np.arange(100) % 2
    with caplog.at_level("WARNING", logger="deepinfer.spec.calibration"):
        (t,) = fit_temperatures(z, accepted)
    assert 100 < t < 150 and not caplog.records
    assert ece(survival(z, [t])[:, 0], accepted) <= ece(survival(z, [1e4])[:, 0], accepted) + 1 / 100
