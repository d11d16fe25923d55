"""What the framework adapters share: the framework import with a clear error, and the clipping
helpers that keep an ampfuse optimizer's gradients scaled (the fused step applies ``1/scale`` and
the clip coefficient in its own pass)."""

from __future__ import annotations

import importlib
import math
from collections import defaultdict
from types import ModuleType
from typing import Any, Iterator, Mapping

import torch

import ampfuse
from ampfuse.grad_scaler import ScalerHandOff


def require(module: str, pip_name: str, extra: str, integration: str) -> ModuleType:
    """Import ``module`` or raise an ``ImportError`` that says which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"ampfuse.integrations.{integration} needs the '{pip_name}' package, which is not installed: "
            f"pip install 'ampfuse[{extra}]' (or pip install {pip_name})."
        ) from e


def device_schedule(scheduler: Any) -> Any | None:
    """The device twin of ``scheduler`` (:func:`ampfuse.lr_scheduler.device_twin`: it advances only
    on the steps taken, with no host read), or None when it has none (an arbitrary ``LambdaLR``,
    ``ReduceLROnPlateau``...): the framework then steps it as before."""
    from ampfuse.lr_scheduler import device_twin

    try:
        return device_twin(scheduler)
    except TypeError:
        return None


def is_fused(optimizer: Any) -> bool:
    """Whether ``optimizer`` is an ampfuse fused optimizer (its step reads scaled gradients)."""
    return isinstance(optimizer, (ampfuse.optim.SGD, ampfuse.optim.Adam))


def params_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of the optimizer's params that have one, in param order."""
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def scaler_enabled(scaler: Any) -> bool:
    return scaler is not None and scaler.is_enabled()


def unscale_stage_open(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler`` has not yet unscaled (or checked) ``optimizer``'s gradients in this
    iteration, i.e. whether they are still multiplied by the scale."""
    return ScalerHandOff(scaler).unscale_open(optimizer)


def norm_and_coef(optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm and clip coefficient of the optimizer's (unscaled) gradients, read once in fp32 by the
    fused check op; nothing is written. For steps that run without a loss scaler (bf16)."""
    grads = grads_of(optimizer)
    devices = {g.device for g in grads}
    if len(devices) != 1:
        raise RuntimeError("fused clipping without a loss scaler needs the gradients on one device.")
    (device,) = devices
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    finite_max = max_norm if math.isfinite(max_norm) else None
    norm, coef = ampfuse.ops.check_norm_(grads, found_inf, torch.ones((), device=device), norm_type=float(norm_type),
                                         max_norm=finite_max)
    if finite_max is None:
        coef = torch.ones((), dtype=torch.float32, device=device)
    return norm, coef


def scaled_clip_norm_(scaler: ampfuse.GradScaler, optimizer: torch.optim.Optimizer, max_norm: float,
                      norm_type: float) -> torch.Tensor:
    """``scaler.unscale_and_clip_`` for any ``max_norm`` (``inf`` only measures the norm)."""
    mn: float | torch.Tensor = max_norm
    if not math.isfinite(max_norm):
        mn = torch.full((), math.inf, dtype=torch.float32)
    return scaler.unscale_and_clip_(optimizer, mn, norm_type)


def scaled_clip_value_(scaler: ampfuse.GradScaler, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
    """Clip-by-value for an ampfuse optimizer whose gradients are still scaled by ``scaler``:
    inf/NaN is checked first (read-only, recorded with ``scaler.record_inf_check``), then each
    gradient is clamped in place to ``±clip_value * scale``, which after the step's division by
    the scale is ``±clip_value`` exactly when the scale is a power of two (as with the default
    growth and backoff factors). fp16 gradients included; no unscaled copy is written."""
    grads = grads_of(optimizer)
    per_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        per_device[g.device].append(g)
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, gs in per_device.items():
            found[device] = f = torch.zeros((), dtype=torch.float32, device=device)
            ampfuse.ops.check_norm_(gs, f, torch.ones((), device=device), norm_type=math.inf)
        scaler.record_inf_check(optimizer, found)
        scale = scaler._get_scale_async()
        assert scale is not None  # the scaler is enabled: scale() made it
        bound = scale * float(clip_value)
        for device, gs in per_device.items():
            b = bound.to(device, non_blocking=True)
            for g in gs:
                torch.clamp_(g, min=-b, max=b)


def unscale_into_fp32_copies_(scaler: ampfuse.GradScaler, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """``scaler.unscale_(optimizer)`` that also handles fp16 gradients, which cannot be unscaled in
    place without losing range (torch's ``unscale_`` refuses them): each is copied to fp32 and
    the copy is unscaled instead (a transient 4 bytes per fp16 parameter). fp32/bf16 gradients are
    unscaled in place. Returns the copies (empty without fp16 gradients); pass them to
    ``scaler.step(optimizer, grads=...)`` so that the fused step reads them instead of ``.grad``
    and does not divide by the scale again."""
    fp32 = {p: g.float() for p in params_with_grad(optimizer) if (g := p.grad) is not None and g.dtype == torch.float16}
    scaler.unscale_(optimizer, grads=fp32 or None)
    return fp32


def main_params_with_copies(optimizer: torch.optim.Optimizer,
                            fp32: Mapping[torch.Tensor, torch.Tensor] | None) -> Iterator[torch.Tensor]:
    """The params whose gradients the step reads, for a precision plugin's ``main_params``: a param
    with an fp32 gradient copy is replaced by a stand-in tensor whose ``.grad`` is that copy, so
    that torch's ``clip_grad_norm_``/``clip_grad_value_`` measure and clip what the step reads."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = fp32.get(p) if fp32 else None
            if g is None:
                yield p
            else:
                stand_in = g.view_as(g)
                stand_in.grad = g
                yield stand_in
