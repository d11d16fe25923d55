"""benchmarks/gpu_check.sh in its dry mode (no GPU): every stage planned inside the deadline, the
test selections non-empty, the benchmark plan capped at 1e8 parameters, at most 8 files back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(os.listdir(out))
    assert len(files) <= 8, files  # the device tool returns at most 8 files
    assert {"summary.txt", "logs.tar.gz"} <= set(files)
    summary = (out / "summary.txt").read_text()
    for line in ["mode: dry run", "compute-sanitizer:", "pytest-timeout:", "tests: rc=0", "fsdp2: rc=0", '"dry_run": true',
                 "bench: rc=0", "done"]:
        assert line in summary, summary
    collected = next(l for l in summary.splitlines() if "tests collected" in l)
    assert int(collected.split("tests: ")[1].split("/")[0]) >= 100, collected
    memcheck = next(l for l in summary.splitlines() if l.startswith("memcheck selection:"))
    n_mem, n_lowp = (int(x) for x in memcheck.replace("(", " ").split() if x.isdigit())
    assert n_mem >= 10 and n_lowp >= 8, memcheck
    total = int(next(l for l in summary.splitlines() if l.startswith("total:")).split()[1].rstrip("s"))
    assert total < 450
    plan = json.loads((out / "plan-cuda.json").read_text())
    assert max(n for _, _, n, _ in plan["planned"]) <= 10**8
    assert {"step_adamw_master", "unscale_check", "accumulate"} <= {c for c, *_ in plan["planned"]}
