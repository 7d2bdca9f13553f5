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
