"""Shared pieces of the framework integration tests: a tiny model, fixed data, and the comparison
helpers. Every run is small (a few hundred parameters, 16 micro-batches)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

import ampfuse
from conftest import HostReads

#: micro-batches per run, micro-batches per optimizer step, the clip norm (bites on most steps)
MICRO_BATCHES = 16
ACCUM = 2
MAX_NORM = 0.05
#: an initial scale that overflows fp16 on the first steps, and growth every 2 clean steps, so
#: that the scale overflows again on some later steps
SCALER_KWARGS = dict(init_scale=2.0**20, growth_interval=2)
#: ampfuse's AdamW against torch.optim.AdamW after a few clipped steps: the clip norm is summed in
#: another order (fp32), and torch's CPU sqrt is not correctly rounded
ATOL, RTOL = 2e-6, 1e-5
LR = 1e-2


def make_model(seed: int = 0, fp16_init: bool = False) -> nn.Module:
    """Linear layers and a Tanh only: under fp16 autocast, fp32 params and fp16 params see the same
    fp16 forward and backward (every op runs on fp16 inputs either way). ``fp16_init``: start from
    the initial weights rounded to fp16, as an fp16 model (``.half()``) does; only then is an fp32
    run the same computation as an fp16-params-with-masters run (from the unrounded weights the
    runs differ by the rounding, up to 2.9e-4, from the first step on)."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            w = torch.randn(p.shape, generator=g) * 0.3
            p.copy_(w.half() if fp16_init else w)
    return model


def make_data(n: int = MICRO_BATCHES, batch: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g) * 3) for _ in range(n)]


def lr_lambda(total_steps: int):
    return lambda s: max(0.0, 1.0 - s / total_steps)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def masters_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The fp32 master of each fp16/bf16 param (the param itself for fp32 params)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    out = {}
    for name, p in model.named_parameters():
        st = inner.state.get(p, {})
        m = st.get("master_param")
        if p.dtype != torch.float32:
            assert m is not None and m.dtype == torch.float32, f"{name} has no fp32 master"
            torch.testing.assert_close(p.detach(), m.to(p.dtype), atol=0, rtol=0)
            out[name] = m.detach().clone()
        else:
            out[name] = p.detach().clone()
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def torch_fp16_with_masters(data, max_norm: float | None = MAX_NORM, lr_steps: int | None = None):
    """torch's own path for fp16 params with fp32 masters, written by hand (one micro-batch per
    step): fp32 master copies, ``torch.optim.AdamW`` on the masters, ``torch.amp.GradScaler``; each
    step copies the scaled fp16 gradients to the masters as fp32, unscales and clips those fp32
    copies, steps the masters and copies them back into the fp16 params. ``lr_steps``: a
    ``lr_lambda(lr_steps)`` schedule advanced on the steps taken (as Accelerate's scheduler wrapper
    does). Returns (model, masters by name, per-step records of the scale and LR)."""
    import torch.nn.functional as F

    model = make_model().half()
    names = [n for n, _ in model.named_parameters()]
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR)
    scaler = torch.amp.GradScaler("cpu", **SCALER_KWARGS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lr_steps)) if lr_steps else None
    records = []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x.half()).float(), y)
        scaler.scale(loss).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        scaler.unscale_(opt)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if sched is not None and scaler.get_scale() >= before:  # the step was taken
            sched.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        records.append(dict(scale=scaler.get_scale(), lr=opt.param_groups[0]["lr"]))
    return model, {n: m.detach().clone() for n, m in zip(names, masters)}, records


@contextlib.contextmanager
def count_flag_reads():
    """Within: the skip flag of every ampfuse optimizer step an ``ampfuse.GradScaler`` runs is
    recorded (``.flags``), and every host read of one is counted (``.reads``)."""
    flags: list = []
    step = ampfuse.GradScaler.step

    def recording_step(self, optimizer, *args, **kwargs):
        out = step(self, optimizer, *args, **kwargs)
        flag = getattr(optimizer, "last_step_skipped", None)
        if flag is not None and not any(flag is f for f in flags):
            flags.append(flag)
        return out

    mode = HostReads(ignore=lambda t: not any(t is f for f in flags))
    mode.flags = flags
    with mock.patch.object(ampfuse.GradScaler, "step", recording_step), mode:
        yield mode
