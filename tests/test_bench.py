"""The benchmark harness in its quick configuration: it runs and its results are well formed."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import report  # noqa: E402
import run  # noqa: E402


def test_quick_benchmark_run(tmp_path):
    path = run.main(["--quick", "--no-progress", "--out", str(tmp_path)])
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    assert res["machine"]["device"] == "cpu" and res["machine"]["threads"] >= 1
    cases = {r["case"] for r in res["rows"]}
    assert {"step_adamw_master", "step_sgd_master", "step_adamw_fp32", "skip_adamw_master", "unscale_check",
            "unscale_check_norm", "accumulate"} <= cases
    for r in res["rows"]:
        assert r["ampfuse_ms"] > 0 and r["torch_ms"] > 0 and r["copy_gbps"] > 0 and r["inplace_gbps"] > 0
        assert abs(r["ratio"] - r["ampfuse_ms"] / r["torch_ms"]) < 1e-9 * r["ratio"]
        assert r["ampfuse_iqr_ms"][0] <= r["ampfuse_ms"] <= r["ampfuse_iqr_ms"][1]
    table = report.markdown_table(res)
    assert table.count("\n| ") == len(res["rows"]) + 1
    assert any(name.endswith("-adamw.png") for name in os.listdir(tmp_path))
