"""The fp16 FSDP2 recipe (examples/fsdp2_fp16.py) on 2 CPU processes (gloo, under a deadline):
ampfuse (fp16 params, fp32 masters in ampfuse.optim.AdamW, ampfuse.GradScaler) against torch
(fp32 params computing in fp16 through MixedPrecisionPolicy(param_dtype=fp16), torch.optim.AdamW,
ShardedGradScaler, clip_grad_norm_), same data, same initial weights, one run of both.

Where the two differ, and so the tolerances: both forwards and backwards are the same fp16 ops on
the same fp16 weights, and both reduce the gradients in fp32; ampfuse's sharded gradient is then
stored in its param's dtype (fp16, one rounding: 2**-11 relative), torch's stays fp32. Adam's
update is invariant to the scale of the gradient, so each taken step's update differs by about two
such roundings of lr (the update and the clip coefficient); over the taken steps the fp32 weights
agree to 2 * 2**-11 * lr * steps_taken (3.3e-5 for 34 steps of lr 1e-3; measured 1.2e-5). The fp16
weights each side computes with are those fp32 weights rounded, so they differ by at most one fp16
ulp in the few elements whose fp32 values straddle a rounding boundary, and the losses agree to
about one fp16 rounding of the outputs (rtol 2**-11; measured 3.8e-5 relative). Before the first
update the weights are identical, so those losses are equal bit for bit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dist_utils import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import fsdp2_fp16  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

FP16_ROUNDING = 2.0**-11  # fp16's relative rounding error (half an ulp of its 11-bit significand)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Both trainings, run once for every test here: each rank's result."""
    return run_ranks(fsdp2_fp16.run, 2, "cpu", fsdp2_fp16.STEPS, timeout=120.0)


def test_ranks_return_the_same_gathered_results(runs):
    for side in ("ampfuse", "torch"):
        r0, r1 = runs[0][side], runs[1][side]
        assert r0["losses"] == r1["losses"] and r0["skipped"] == r1["skipped"] and r0["scales"] == r1["scales"]
        for x, y in zip(r0["masters"] + r0["params"], r1["masters"] + r1["params"]):
            assert torch.equal(x, y)


def test_same_steps_taken_and_skipped_in_the_same_pattern(runs):
    a, t = runs[0]["ampfuse"], runs[0]["torch"]
    assert a["steps"] == t["steps"] == fsdp2_fp16.STEPS
    assert a["skipped"] == t["skipped"]
    assert a["steps_taken"] == t["steps_taken"]
    assert a["skipped_count"] == t["skipped_count"] == sum(a["skipped"])
    assert a["steps_taken"] + a["skipped_count"] == a["steps"]  # the optimizers' step counters agree with the scalers
    # init_scale overflows fp16: the first steps are skipped, the scale backs off until they are not
    first_taken = a["skipped"].index(False)
    assert first_taken >= 2 and not any(a["skipped"][first_taken:])
    assert a["scales"] == t["scales"]
    assert a["scales"][-1] == fsdp2_fp16.INIT_SCALE * 0.5**first_taken


def test_losses_equal_until_the_first_update_then_within_one_fp16_rounding(runs):
    a, t = runs[0]["ampfuse"], runs[0]["torch"]
    first_taken = a["skipped"].index(False)
    # the skipped steps and the first taken one compute with the initial weights on both sides
    assert a["losses"][:first_taken + 1] == t["losses"][:first_taken + 1]
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(t["losses"]), rtol=FP16_ROUNDING, atol=0)
    assert a["final_loss"] == pytest.approx(t["final_loss"], rel=FP16_ROUNDING)
    assert a["final_loss"] < 0.6 * a["losses"][0]  # and it trained


def test_ampfuse_masters_close_to_torch_fp32_params(runs):
    a, t = runs[0]["ampfuse"], runs[0]["torch"]
    atol = 2 * FP16_ROUNDING * fsdp2_fp16.LR * a["steps_taken"]
    moved = 0.0
    for master, param, p0 in zip(a["masters"], t["masters"], fsdp2_fp16.make_model().parameters()):
        torch.testing.assert_close(master, param, rtol=0, atol=atol)
        moved = max(moved, float((param - p0.detach()).abs().max()))
    assert moved > 20 * atol  # the weights moved far more than the two runs differ


def test_ampfuse_fp16_params_are_its_masters_rounded(runs):
    a = runs[0]["ampfuse"]
    for param, master in zip(a["params"], a["masters"]):
        assert torch.equal(param, master.half().float())


def test_bytes_per_param_follow_the_byte_model(runs):
    """Per parameter element over both ranks: ampfuse holds an fp16 param (2 B), an fp32 master
    (4) and two fp32 moments (8), 14 B; torch an fp32 param (4) and two moments (8), 12 B. So
    ampfuse's params take half the memory but params + optimizer state take 2 B more; with the
    sharded gradients (fp16 2 B against fp32 4 B) both come to 16 B. Plus one 4-byte step counter
    per param tensor on every rank."""
    a, t = runs[0]["ampfuse"]["bytes_per_param"], runs[0]["torch"]["bytes_per_param"]
    numel = sum(p.numel() for p in fsdp2_fp16.make_model().parameters())
    tensors = len(list(fsdp2_fp16.make_model().parameters()))
    counters = 4 * tensors * 2 / numel
    assert a["numel"] == t["numel"] == numel
    assert (a["param"], a["master"], a["moments"], a["grad"]) == (2, 4, 8, 2)
    assert (t["param"], t["master"], t["moments"], t["grad"]) == (4, 0, 8, 4)
    assert a["step_counters"] == pytest.approx(counters) and t["step_counters"] == pytest.approx(counters)
    assert a["params_and_state"] == pytest.approx(14 + counters)
    assert t["params_and_state"] == pytest.approx(12 + counters)
    assert a["params_and_state"] + a["grad"] == pytest.approx(t["params_and_state"] + t["grad"])
