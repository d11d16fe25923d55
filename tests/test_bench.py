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
        if r["case"] == "step_adamw_8bit":  # each 8-bit candidate against the bf16 moments it replaces
            assert {"ampfuse", "ampfuse-fp8", "ampfuse-bf16"} <= set(r["candidates"])
            assert set(r["time_vs_bf16_moments"]) == {"ampfuse", "ampfuse-fp8"}
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


def test_8bit_targets_read_each_candidates_ratio():
    def summ(v):
        return {"median": v, "min": v, "max": v}

    goal = {t["id"]: t["value"] for t in report.load_targets()}
    peer, bf16 = goal["adamw-8bit-vs-best-peer"], goal["adamw-8bit-vs-bf16-moments"]
    sb = {"ampfuse": 8}
    row = {"case": "step_adamw_8bit", "layout": "40x", "params": 10**7, "dtype": "bfloat16", "state_bytes_per_param": sb,
           "best_peer": "torchao-fp8",
           "speedup_vs_best_peer": {"ampfuse": summ(0.9 * peer), "ampfuse-fp8": summ(1.1 * peer)},
           "time_vs_bf16_moments": {"ampfuse": summ(1.1 * bf16),
                                    "ampfuse-fp8": summ(0.9 * goal["adamw-fp8-vs-bf16-moments"])}}
    status = {t["id"]: t["status"] for t in report.evaluate_targets({"machine": {"device": "cpu"}, "rows": [row]})}
    assert status["adamw-8bit-vs-best-peer"] == "FAIL" and status["adamw-fp8-vs-best-peer"] == "PASS"
    assert status["adamw-8bit-vs-bf16-moments"] == "FAIL" and status["adamw-fp8-vs-bf16-moments"] == "PASS"
    # a result without the peers or the bf16 candidate leaves those targets unmeasured
    bare = {"case": "step_adamw_8bit", "layout": "40x", "params": 10**7, "dtype": "bfloat16", "state_bytes_per_param": sb}
    status = {t["id"]: t["status"] for t in report.evaluate_targets({"machine": {"device": "cpu"}, "rows": [bare]})}
    assert status["adamw-fp8-vs-best-peer"] == "not measured" and status["adamw-8bit-vs-bf16-moments"] == "not measured"
    # a claim names its layout: the 40-tensor row says nothing of the 400-tensor one
    assert status["adamw-8bit-vs-best-peer-many-small"] == "not measured"


def test_precision_quality_runs_every_choice_against_the_reference(tmp_path):
    """benchmarks/precision_quality.py: the choices trained from the same start on the same
    batches, each one's gap to the reference at the same steps, the state per parameter; the
    result written as JSON and a plot, and rendered by the report."""
    import pytest

    import precision_quality
    import report

    only = "fp32/remainder,uint8/remainder,fp8/none"
    res = precision_quality.main(["--models", "demo", "--tiny", "--only", only, "--out", str(tmp_path)])
    runs = res["models"]["demo"]["runs"]
    assert list(runs) == ["fp32/fp32", "fp32/remainder", "uint8/remainder", "fp8/none"]
    assert [s for s, _ in runs["fp32/fp32"]["val_curve"]] == [2, 4]
    assert runs["fp32/fp32"]["gap_final"] == 0.0 and runs["fp32/fp32"]["gap_max_matched"] == 0.0
    assert abs(runs["fp32/remainder"]["gap_final"]) < 0.05
    assert runs["uint8/remainder"]["state_bytes_per_param"] < runs["fp32/remainder"]["state_bytes_per_param"]
    assert runs["uint8/remainder"]["gap_final"] == runs["uint8/remainder"]["final_val_loss"] - runs["fp32/fp32"]["final_val_loss"]
    saved = [f for f in os.listdir(tmp_path) if f.startswith("precision-quality-")]
    assert sorted(os.path.splitext(f)[1] for f in saved) == [".json", ".png"]
    text = report.precision_quality_text(res, "today")
    assert "| uint8/remainder |" in text and "fp32/fp32" in text
    # other seeds added to the result: the chosen choices and the reference, gaps per seed
    path = os.path.join(tmp_path, [f for f in saved if f.endswith(".json")][0])
    again = precision_quality.main(["--into", path, "--seeds", "1", "--only", "uint8/remainder"])
    repeat = again["models"]["demo"]["repeats"]["1"]
    assert sorted(repeat) == ["fp32/fp32", "uint8/remainder"] and repeat["fp32/fp32"]["gap_final"] == 0.0
    assert "| uint8/remainder | " in report.precision_quality_text(again, "today").split("mean [min")[1]
    # choices added to the result's own runs: the reference reproduces, the new run is dated
    added = precision_quality.main(["--into", path, "--only", "bf16/stochastic"])
    runs = added["models"]["demo"]["runs"]
    assert list(runs)[-1] == "bf16/stochastic" and "date" in runs["bf16/stochastic"] and "date" not in runs["fp32/fp32"]
    assert runs["bf16/stochastic"]["gap_final"] == runs["bf16/stochastic"]["final_val_loss"] - runs["fp32/fp32"]["final_val_loss"]
    assert "| bf16/stochastic (added " in report.precision_quality_text(added, "today")
    with pytest.raises(SystemExit, match="unknown choices: nope"):
        precision_quality.main(["--tiny", "--only", "nope", "--out", str(tmp_path)])
    # runs without a common validation step cannot be compared
    with pytest.raises(ValueError, match="no validation step in common"):
        precision_quality.gaps({"a": {"val_curve": [[1, 1.0]], "final_val_loss": 1.0},
                                "b": {"val_curve": [[2, 1.0]], "final_val_loss": 1.0}}, "a")


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
