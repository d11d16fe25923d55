"""Shared pieces of the framework integration tests: a tiny model, fixed data, and the comparison
helpers. Every run is small (a few hundred parameters, 16 micro-batches)."""

from __future__ import annotations

import torch
from torch import nn

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


def make_model(seed: int = 0) -> nn.Module:
    """Linear layers only, so that under fp16 autocast fp32 params and fp16 params see the same
    fp16 forward (the masters of an fp16 model then follow the fp32 model's params exactly)."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
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
