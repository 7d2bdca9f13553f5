"""bench/move_e2e.py's figures and table from a run's samples (the run itself needs the real
cluster and a minute a move: the bench's, not CI's)."""

from __future__ import annotations

from bench.move_e2e import figures, table


def test_its_figures_and_table_name_the_move_and_its_parts():
    samples = {"move": [0.6, 0.7, 0.8], "  reclaim -> released": [0.3, 0.2, 0.4],
               "  decision -> granted": [0.0, 0.0, 0.0],
               "  granted -> training": [0.6, 0.7, 0.8]}
    f = figures({"samples": samples, "iteration_s": 0.0345}, "PyTorch")
    assert f["move_p50_s"] == 0.7 and f["move_p95_s"] == 0.79
    assert f["moves"] == 3 and f["framework"] == "PyTorch" and f["iteration_s"] == 0.035
    assert f["reclaim_to_released_p50_s"] == 0.3
    assert f["granted_to_training_p50_s"] == 0.7
    printed = table(f)
    assert "decision -> training (p50 / p95)" in printed and "0.7 / 0.79 s" in printed


def test_a_run_without_a_move_has_no_figure():
    f = figures({"samples": {}, "iteration_s": float("nan")}, "TensorFlow")
    assert f["move_p50_s"] is None and f["moves"] == 0
