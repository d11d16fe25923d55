"""The demo in a tiny configuration: it runs, writes its outputs, and both recipes agree."""

from __future__ import annotations

import json
import os

from ampfuse import demo


def test_demo_tiny(tmp_path, capsys, monkeypatch):
    # a CPU without native bf16 matmuls is named in the output (forced here, to see the note)
    monkeypatch.setattr(demo, "native_low_precision_matmul", lambda device, dtype: False)
    out = str(tmp_path / "demo")
    summary = demo.main([
        "--steps", "8", "--accum", "2", "--batch", "4", "--context", "32", "--d-model", "32",
        "--layers", "1", "--corpus-bytes", "200000", "--eval-batches", "2", "--no-progress", "--out", out,
    ])
    assert os.path.getsize(os.path.join(out, "demo.png")) > 10_000
    with open(os.path.join(out, "demo.json"), encoding="utf-8") as f:
        saved = json.load(f)
    a, t = saved["ampfuse"], saved["torch"]
    assert len(a["train_loss"]) == len(t["train_loss"]) == 8
    # Same initial weights and batches: bf16 weights with fp32 masters track fp32 + autocast.
    assert abs(a["val_loss"] - t["val_loss"]) < 0.05 * t["val_loss"]
    assert abs(a["train_loss"][0] - t["train_loss"][0]) < 0.02 * t["train_loss"][0]
    assert a["train_loss"][-1] < a["train_loss"][0]  # it learns
    assert summary["median_step_ms"]["ampfuse"] > 0
    assert "no native torch.bfloat16 matrix multiply on this CPU" in capsys.readouterr().out


def test_native_low_precision_matmul_probe():
    import torch

    assert demo.native_low_precision_matmul("cuda", torch.float16)
    assert demo.native_low_precision_matmul("cpu", torch.float32)
    assert demo.native_low_precision_matmul("cpu", torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_demo_step_heavy_and_precision_options(tmp_path):
    """The step-heavy configuration (a big embedding table, the optimizer a large share of the
    step) with remainder masters and bf16 moments: it runs, reports the split, and learns."""
    out = str(tmp_path / "heavy")
    summary = demo.main([
        "--config", "step-heavy", "--steps", "6", "--embed-rows", "4096", "--d-model", "64", "--layers", "1",
        "--corpus-bytes", "200000", "--eval-batches", "2", "--val-every", "3", "--no-progress", "--out", out,
        "--master-weights", "remainder", "--state-dtype", "bf16",
    ])
    cfg = summary["config"]
    assert cfg["embed_rows"] == 4096 and cfg["batch"] == 4 and cfg["accum"] == 1
    a = summary["ampfuse"]
    assert len(a["val_curve"]) == 2 and len(a["fwd_bwd_seconds"]) == 6
    assert 0 < summary["median_rest_ms"]["ampfuse"] < summary["median_step_ms"]["ampfuse"]
    assert a["train_loss"][-1] < a["train_loss"][0]


def test_demo_without_accumulation_steps_on_grad(tmp_path, monkeypatch):
    """--accum 1: the ampfuse run uses the scaler and the optimizer on .grad (no accumulator, no
    fp32 gradient buffers), and still tracks the torch run."""
    import ampfuse

    def refuse(*a, **k):
        raise AssertionError("GradAccumulator used with --accum 1")

    monkeypatch.setattr(ampfuse, "GradAccumulator", refuse)
    summary = demo.main(["--steps", "6", "--accum", "1", "--batch", "4", "--context", "32", "--d-model", "32",
                         "--layers", "1", "--corpus-bytes", "200000", "--eval-batches", "2", "--no-progress",
                         "--out", str(tmp_path / "direct")])
    a, t = summary["ampfuse"], summary["torch"]
    assert len(a["train_loss"]) == 6 and a["skipped"] == [False] * 6 == t["skipped"]
    assert abs(a["val_loss"] - t["val_loss"]) < 0.05 * t["val_loss"]
    assert a["train_loss"][-1] < a["train_loss"][0]


def test_config_auto_picks_small_without_native_low_precision_matmul(monkeypatch):
    monkeypatch.setattr(demo, "native_low_precision_matmul", lambda device, dtype: False)
    cfg, native = demo.parse_config([])
    assert not native and cfg.preset == "small" and (cfg.d_model, cfg.layers, cfg.context, cfg.accum) == (64, 2, 64, 1)
    cfg, _ = demo.parse_config(["--d-model=96"])  # sizes given: the default preset with them
    assert cfg.preset == "default" and (cfg.d_model, cfg.layers, cfg.accum) == (96, 4, 4)
    cfg, _ = demo.parse_config(["--config", "step-heavy", "--batch", "2"])
    assert cfg.embed_rows == 65536 and cfg.batch == 2 and cfg.accum == 1
    monkeypatch.setattr(demo, "native_low_precision_matmul", lambda device, dtype: True)
    cfg, native = demo.parse_config([])
    assert native and cfg.preset == "default" and (cfg.d_model, cfg.layers, cfg.context, cfg.accum) == (128, 4, 128, 4)
