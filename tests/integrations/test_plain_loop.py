"""A nanoGPT-style loop written for torch's scaler (unscale_ + clip_grad_norm_ + step + update):
swapping in ampfuse's scaler and AdamW needs no adapter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ampfuse

from integ_helpers import ACCUM, ATOL, LR, MAX_NORM, MICRO_BATCHES, RTOL, SCALER_KWARGS, make_data, make_model


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
