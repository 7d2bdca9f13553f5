"""bench/cluster.py on one of the paper's workloads: its tables, its comparison with the
paper's figures and its last line, in seconds (the whole run is the bench's, not CI's)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.benches.support import REPO


def test_it_compares_the_policies_on_a_workload_and_ends_with_its_json():
    done = subprocess.run(
        [sys.executable, "-m", "bench.cluster", "--workloads", "workload-3", "--policies",
         "fixed,fairshare,goodput,goodput_batch", "--scale", "300x30", "--skip-real",
         "--workers", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout
    assert "paper pollux" in printed and "workload-3" in printed
    last = json.loads(printed.strip().splitlines()[-1])
    for policy in ("fixed", "fairshare", "goodput"):
        assert last[f"jct_mean_{policy}_s"] > 0
    assert 0 < last["goodput_vs_fairshare"] < 1.5
    assert 0 < last["goodput_vs_fixed"] < 1.5
    # The what-if of jobs that also adapt their batch, beside the policies.
    assert last["jct_mean_goodput_batch_s"] > 0 and 0 < last["goodput_batch_vs_fairshare"] < 1.5
    assert last["decision_ms_10000x1000"] > 0
    assert last["sim_vs_real_max_err"] is None  # --skip-real


def test_another_job_load_reads_its_own_workloads_and_the_papers_figures_for_it(tmp_path):
    data = REPO / "bench" / "data" / "pollux-osdi21"
    argv = [sys.executable, "-m", "bench.cluster", "--workloads", "workload-3", "--policies",
            "fairshare", "--scale", "0", "--skip-real", "--workers", "1", "--load", "2.0"]
    # The bundled subset holds job load 1.0 only: the bench says what is missing and where.
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:]
    assert "workloads-2.0/workload-3.csv" in done.stderr, done.stderr
    assert "--data ../shared/traces/pollux-osdi21" in done.stderr, done.stderr
    # A data folder laid out as the full artifact is: its workloads-2.0 and results at 2.0.
    (tmp_path / "traces").symlink_to(data / "traces")
    (tmp_path / "workloads-2.0").mkdir()
    fewer = (data / "workloads" / "workload-3.csv").read_text().splitlines()[:21]
    (tmp_path / "workloads-2.0" / "workload-3.csv").write_text("\n".join(fewer) + "\n")
    for name in ("pollux", "tiresias", "optimus"):
        (tmp_path / "results-jobload" / f"{name}-2.0").mkdir(parents=True)
        (tmp_path / "results-jobload" / f"{name}-2.0" / "summary.json").write_text(
            json.dumps({"avgs": {"workload-3": 1234.0}}))
    done = subprocess.run([*argv, "--data", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "job load 2.0" in done.stdout and "1,234" in done.stdout, done.stdout
    assert json.loads(done.stdout.strip().splitlines()[-1])["jct_mean_fairshare_s"] > 0
