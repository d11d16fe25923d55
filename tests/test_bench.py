"""The benchmark harness in its quick configuration: it runs, its results are well formed, every
target of benchmarks/targets.json is evaluated, and the tables come from the JSON."""

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
    assert {"small_model", "step_adamw_master", "step_adamw_precision", "step_sgd_master", "step_adamw_fp32",
            "skip_adamw_master", "unscale_check", "unscale_check_norm", "accumulate"} <= cases
    for r in res["rows"]:
        assert r["rounds"] >= 3
        for name, c in r["candidates"].items():
            assert 0 < c["min_ms"] <= c["ms"] <= c["max_ms"], (r["case"], name)
        assert {"inplace", "copy", "triad"} <= set(r["roofs"])
        if r["case"] == "small_model":
            assert {"ampfuse-1000", "ampfuse-10", "torch-A*-1000", "torch-A*-10"} <= set(r["candidates"])
            assert r["per_tensor_us"]["min"] <= r["per_tensor_us"]["median"] <= r["per_tensor_us"]["max"]
            continue
        assert r["best_torch"].startswith("torch")
        s = r["speedup_vs_best_torch"]
        assert s["min"] <= s["median"] <= s["max"]
        if r["case"].startswith(("step_adamw_master", "step_sgd", "skip")):
            assert {"torch-A", "torch-A*"} <= set(r["candidates"])
        if r["case"] == "step_adamw_fp32":
            assert {"torch-B", "torch-B*"} <= set(r["candidates"])
    # every CPU target is evaluated (measured rows in a quick run: only the size-independent ones pass or fail)
    ids = {t["id"] for t in res["targets"]}
    assert ids == {t["id"] for t in report.load_targets() if t["device"] in ("any", "cpu")}
    assert all(t["status"] in ("PASS", "FAIL", "not measured") for t in res["targets"])
    assert {t["id"]: t["status"] for t in res["targets"]}["precision-bytes"] == "PASS"
    table = report.markdown_table(res)
    assert table.count("\n| ") == len(res["rows"]) - 1 + 1  # the small-model row is a sentence
    assert "per extra tensor" in table
    assert report.targets_table(res).count("\n| ") == len(res["targets"])  # rows after the header line
    assert any(name.endswith("-adamw.png") for name in os.listdir(tmp_path))


def test_targets_evaluate_pass_and_fail():
    row = {"case": "small_model", "params": 10**6, "dtype": "bfloat16", "per_tensor_us": {"median": 0.8, "min": 0.5, "max": 1.2}}
    res = {"machine": {"device": "cpu"}, "rows": [row]}
    status = {t["id"]: t["status"] for t in report.evaluate_targets(res)}
    assert status["small-model-per-tensor"] == "PASS"
    row["per_tensor_us"]["median"] = 1.5
    status = {t["id"]: t["status"] for t in report.evaluate_targets(res)}
    assert status["small-model-per-tensor"] == "FAIL"
    assert status["adamw-masters-vs-best-torch"] == "not measured"


def test_precision_quality_comparison(tmp_path):
    """benchmarks/precision_quality.py: both precision variants trained from the same start, their
    validation curves compared at the same steps, the result written as JSON and a plot."""
    import pytest

    import precision_quality

    tiny = ["--steps", "4", "--accum", "1", "--batch", "4", "--context", "32", "--d-model", "32", "--layers", "1",
            "--corpus-bytes", "200000", "--eval-batches", "2", "--val-every", "2"]
    res = precision_quality.main(["--out", str(tmp_path), "--", *tiny])
    assert [s for s, _ in res["val_curve"]["fp32-state"]] == [2, 4]
    assert res["state_bytes"]["remainder+bf16-state"] < res["state_bytes"]["fp32-state"]
    assert res["max_abs_rel_diff"] == max(abs(r) for _, r in res["rel_diff_per_eval"]) < 0.05
    saved = [f for f in os.listdir(tmp_path) if f.startswith("precision-quality-")]
    assert sorted(os.path.splitext(f)[1] for f in saved) == [".json", ".png"]
    # runs without a common validation step cannot be compared
    bad = {"a": {"ampfuse": {"val_curve": [[1, 1.0]]}}, "b": {"ampfuse": {"val_curve": [[2, 1.0]]}}}
    with pytest.raises(ValueError, match="no validation step in common"):
        precision_quality.compare(bad)


def test_quick_host_overhead_run(tmp_path):
    """benchmarks/host_overhead.py: the CUDA kernels' host code with stubbed launches, the three
    candidates at each count, and the table from the JSON."""
    import host_overhead

    path = host_overhead.main(["--quick", "--out", str(tmp_path)])
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    assert "launches stubbed" in res["machine"]["mode"]
    assert [r["tensors"] for r in res["rows"]] == [10, 100]
    for r in res["rows"]:
        assert set(r["candidates"]) == {"ampfuse", "ampfuse-no-plan", "torch-A*"}
        for c in r["candidates"].values():
            assert 0 < c["min_us"] <= c["us"] <= c["max_us"]
    assert set(res["per_extra_tensor_us"]) == {"ampfuse", "ampfuse-no-plan", "torch-A*"}
    lines = host_overhead.table(res).splitlines()
    assert sum(line.startswith("| ") for line in lines) == 1 + len(res["rows"])  # header + one per count
    assert lines[-1].startswith("Per extra tensor")
