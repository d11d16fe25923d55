"""benchmarks/gpu_check.sh in its dry mode (no GPU): every stage planned inside the deadline, the
test selections non-empty, the benchmark plan capped at 1e8 parameters, at most 8 files back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dry_run(tmp_path, **env_extra):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, **env_extra)
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=400)
    return r, out


def test_gpu_check_dry_run(tmp_path):
    """The dry run runs every pytest command line of the real run (with --collect-only added), so an
    argument the real run would reject fails here; pytest-timeout is installed as on the GPU image."""
    import pytest_timeout  # noqa: F401  (requirements-dev.txt: the dry run must parse `-p timeout`)

    r, out = _dry_run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed stages: none" in (out / "summary.txt").read_text()
    files = sorted(os.listdir(out))
    assert len(files) <= 8, files  # the device tool returns at most 8 files
    assert {"summary.txt", "logs.tar.gz"} <= set(files)
    summary = (out / "summary.txt").read_text()
    for line in ["mode: dry run", "compute-sanitizer:", "pytest-timeout: yes", "errors: rc=0", '"not_raised": {}',
                 "tests: rc=0", "fsdp2: rc=0",
                 '"dry_run": true', "memcheck: rc=0", "racecheck: rc=0", "synccheck: rc=0", "initcheck: rc=0",
                 "bench: rc=0", "done"]:
        assert line in summary, summary
    # The kernel-level suite is collected against the real CUDA table (it skips without a GPU).
    collected = next(l for l in summary.splitlines() if l.startswith("tests: ") and "collected" in l)
    assert int(collected.split("tests: ")[1].split()[0].split("/")[0]) >= 300, collected
    with tarfile.open(out / "logs.tar.gz") as tar:
        tests_log = tar.extractfile("./tests.log").read().decode()
    assert "test_cuda_kernels.py::test_adam_step_every_dtype_offset_and_option" in tests_log
    memcheck = next(l for l in summary.splitlines() if l.startswith("memcheck selection:"))
    n_mem, n_lowp = (int(x) for x in memcheck.replace("(", " ").split() if x.isdigit())
    assert n_mem >= 10 and n_lowp >= 8, memcheck
    kernels = next(l for l in summary.splitlines() if l.startswith("kernel selection"))
    assert 3 <= int(kernels.split(": ")[1].split()[0]) <= 12, kernels
    caps = next(l for l in summary.splitlines() if l.startswith("caps:"))
    cap_sum = int(caps.split("(sum ")[1].split("s")[0])
    assert cap_sum <= 540 - 15, caps  # every stage at its cap still ends inside the deadline
    total = int(next(l for l in summary.splitlines() if l.startswith("total:")).split()[1].rstrip("s"))
    assert total < 540
    # Stages in the order of what they can tell: refused calls, tests, benchmarks, then the rest.
    order = [summary.index(f"{s}: rc=") for s in ("errors", "tests", "bench", "fsdp2", "memcheck")]
    assert order == sorted(order), summary
    assert tests_log.index("test_optim_8bit_state.py") < tests_log.index("test_cuda_kernels.py")
    errors = re.search(r'"raised": (\d+), "of": (\d+)', summary)
    assert errors and errors[1] == errors[2] and int(errors[2]) >= 60, summary  # the whole bad-input table
    plan = json.loads((out / "plan-cuda.json").read_text())
    assert max(n for _, _, n, _ in plan["planned"]) <= 10**8
    assert {"step_adamw_master", "unscale_check", "accumulate"} <= {c for c, *_ in plan["planned"]}
    assert plan["planned"][0][0] == "step_adamw_8bit"  # the case never measured on a GPU, first


def test_gpu_check_dry_run_fails_on_an_argument_the_real_run_rejects(tmp_path):
    """A pytest option the real run would reject (the old `-p pytest_timeout` double registration was
    one) fails the dry run too."""
    r, out = _dry_run(tmp_path, PYTEST_ADDOPTS="-p pytest_timeout", STAGES="tests")
    summary = (out / "summary.txt").read_text()
    assert r.returncode != 0 and "tests: rc=0" not in summary, summary
    assert "failed stages: tests" in summary, summary
