"""The demo in tiny configurations: it runs, writes its outputs, both recipes agree, ampfuse's default
holds params + optimizer state in two thirds of torch's, and fp16 runs skip the same steps as torch."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ampfuse import demo

TINY = ["--batch", "4", "--context", "32", "--d-model", "32", "--layers", "1", "--corpus-bytes", "200000",
        "--eval-batches", "2", "--no-progress"]


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
    # Same initial weights and batches: bf16 weights with remainder masters and bf16 moments
    # (the default) track fp32 + autocast.
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


def _exact_bytes(run: dict, per_param: int) -> int:
    """Params + optimizer state of a run: ``per_param`` bytes per element plus AdamW's 4-byte
    step counter per tensor (TinyGPT's tensors: 2 embeddings, 12 per block, final LayerNorm 2, head 2)."""
    return per_param * run["n_params"] + 4 * (2 + 12 * 1 + 2 + 2)


def test_default_configuration_holds_two_thirds_of_torchs_memory_at_the_same_loss(tmp_path, capsys):
    cfg, _ = demo.parse_config([])
    assert (cfg.master_weights, cfg.state_dtype, cfg.masters()) == ("remainder", "bf16", "remainder")
    summary = demo.main(["--steps", "8", "--accum", "2", *TINY, "--out", str(tmp_path / "default")])
    a, t = summary["ampfuse"], summary["torch"]
    mem = summary["memory_bytes"]
    # bf16 param 2 + int16 remainder 2 + bf16 exp_avg 2 + exp_avg_sq 2, against fp32 param 4 + moments 8
    assert a["param_bytes"] + a["state_bytes"] == mem["ampfuse"] == _exact_bytes(a, 8)
    assert t["param_bytes"] + t["state_bytes"] == mem["torch"] == _exact_bytes(t, 12)
    assert mem["ratio"] <= 0.8
    assert abs(summary["val_loss_rel_diff"]) < 0.01
    out = capsys.readouterr().out
    assert "(0.67x torch)" in out and "16-bit master remainders, bf16 moments" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("In short: ampfuse reached the same validation loss as torch")
    assert "--config step-heavy" in last and 'make demo ARGS="--device cuda --steps 300 --dtype fp16 --accum 8"' in last


def test_fp32_masters_and_fp32_moments_give_the_previous_configuration(tmp_path, capsys):
    summary = demo.main(["--master-weights", "true", "--state-dtype", "fp32", "--steps", "4", "--accum", "2", *TINY,
                         "--out", str(tmp_path / "fp32")])
    assert summary["recipes"]["ampfuse"] == "ampfuse (bfloat16 weights + fp32 masters, fp32 moments)"
    a, t = summary["ampfuse"], summary["torch"]
    # bf16 param 2 + fp32 master 4 + fp32 moments 8: more than torch's 12
    assert summary["memory_bytes"]["ampfuse"] == _exact_bytes(a, 14)
    assert summary["memory_bytes"]["torch"] == _exact_bytes(t, 12)
    assert abs(a["val_loss"] - t["val_loss"]) < 0.05 * t["val_loss"]


@pytest.mark.parametrize("accum", [2, 1])
def test_fp16_run_skips_and_backs_off_on_the_same_steps_as_torch(tmp_path, capsys, accum):
    """fp16 weights on the CPU, the scale growing every 2 steps from torch's default init scale until
    gradients overflow: ampfuse's skipped steps and backoffs are torch's, and the plot marks them."""
    assert demo.INIT_SCALE == torch.amp.GradScaler("cpu").get_scale()  # torch's default, not chosen to overflow
    out = str(tmp_path / "fp16")
    summary = demo.main(["--dtype", "fp16", "--growth-interval", "2", "--steps", "12", "--accum", str(accum),
                         *TINY, "--out", out])
    a, t = summary["ampfuse"], summary["torch"]
    assert summary["skipped_steps"]["ampfuse"] == summary["skipped_steps"]["torch"] != []
    assert summary["backoff_steps"]["ampfuse"] == summary["backoff_steps"]["torch"] == summary["skipped_steps"]["torch"]
    assert a["scale"] == t["scale"] and summary["skips_identical"]
    # fp16 weights keep fp32 masters under the default "remainder": 2 + 4 + bf16 moments 4
    assert summary["recipes"]["ampfuse"] == "ampfuse (float16 weights + fp32 masters, bf16 moments)"
    assert summary["memory_bytes"]["ampfuse"] == _exact_bytes(a, 10)
    assert summary["memory_bytes"]["ratio"] <= 0.85
    assert os.path.getsize(os.path.join(out, "demo.png")) > 10_000
    marks = {"skipped": summary["skipped_steps"]["torch"], "backoff": summary["backoff_steps"]["torch"]}
    assert summary["plot_marks"] == {"ampfuse": marks, "torch": marks}
    text = capsys.readouterr().out
    assert "(the same steps as torch)" in text
    assert f"skipping the same {len(summary['skipped_steps']['torch'])} fp16-overflow steps as torch" in text
