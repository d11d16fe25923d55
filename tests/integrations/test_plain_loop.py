"""A nanoGPT-style loop written for torch's scaler (unscale_ + clip_grad_norm_ + step + update):
swapping in ampfuse's scaler and AdamW needs no adapter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ampfuse

from integ_helpers import (
    ACCUM, ATOL, LR, MAX_NORM, MICRO_BATCHES, RTOL, SCALER_KWARGS, make_data, make_model, masters_of,
    torch_fp16_with_masters,
)


def loop(scaler, opt_cls):
    model = make_model()
    opt = opt_cls(model.parameters(), lr=LR)
    scales = []
    for i, (x, y) in enumerate(make_data()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y) / ACCUM
        scaler.scale(loss).backward()
        if (i + 1) % ACCUM == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
    return model, scales


def test_plain_loop_swaps_in():
    ma, sa = loop(ampfuse.cpu.amp.GradScaler(**SCALER_KWARGS), ampfuse.optim.AdamW)
    mt, st = loop(torch.amp.GradScaler("cpu", **SCALER_KWARGS), torch.optim.AdamW)
    assert sa == st and len(set(sa)) > 1 and len(sa) == MICRO_BATCHES // ACCUM
    for k, v in mt.state_dict().items():
        torch.testing.assert_close(ma.state_dict()[k], v, atol=ATOL, rtol=RTOL)


def test_plain_loop_fp16_params_with_masters_equal_torch_by_hand():
    """fp16 params with ampfuse's fp32 masters (``unscale_and_clip_``: fp16 gradients are only read)
    against torch's own path for the same thing, written by hand (integ_helpers). Same computation,
    so the tolerance is the fp32 one (ATOL, RTOL): the masters differ only by AdamW's arithmetic
    and the clip norm's summation order, measured 6e-8 (relative 8e-7) after 16 steps, and 0
    without clipping. The fp16 params are the masters rounded: measured equal; allowed one fp16
    ulp, for a master within 6e-8 of a rounding boundary."""
    model = make_model().half()
    opt = ampfuse.optim.AdamW(model.parameters(), lr=LR)
    scaler = ampfuse.GradScaler("cpu", **SCALER_KWARGS)
    scales = []
    for x, y in make_data():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x.half()).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_and_clip_(opt, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    ref, ref_masters, ref_records = torch_fp16_with_masters(make_data())
    assert scales == [r["scale"] for r in ref_records] and len(set(scales)) > 1
    masters = masters_of(model, opt)
    for k, m in ref_masters.items():
        torch.testing.assert_close(masters[k], m, atol=ATOL, rtol=RTOL)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=0, rtol=2.0**-10)
