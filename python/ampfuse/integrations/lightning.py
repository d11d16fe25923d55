"""ampfuse in the Lightning ``Trainer``: the precision plugin :class:`MixedPrecision`.

A subclass of Lightning's ``MixedPrecision`` plugin with its constructor, whose scaler defaults to
:class:`ampfuse.GradScaler`. With an ampfuse optimizer, ``gradient_clip_val`` works through the
fused read-only check + norm pass (Lightning's own plugin refuses it), ``on_before_optimizer_step``
sees unscaled gradients when something overrides it, ``interval="step"`` schedules become their
device twins (:func:`ampfuse.lr_scheduler.device_twin`: they advance only on the steps taken, with
no host read), and checkpoints resume bit for bit; any other optimizer takes Lightning's path
unchanged. The whole contract and the cost of each path: the
manual's Integrations page (``docs/integrations.md``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Literal

import torch

import ampfuse
from ampfuse.integrations._common import (
    device_schedule,
    is_fused,
    main_params_with_copies,
    norm_and_coef,
    require,
    scaled_clip_norm_,
    scaled_clip_value_,
    scaler_enabled,
    unscale_into_fp32_copies_,
    unscale_stage_open,
)
from ampfuse.grad_scaler import ScalerHandOff
from ampfuse.optim import StepScaling

require("lightning.pytorch", "lightning", "lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import Precision as _LightningPrecision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

__all__ = ["MixedPrecision"]


def _hook_overridden(trainer: Any, model: Any) -> bool:
    """Whether anyone listens to ``on_before_optimizer_step`` (and so must see unscaled grads)."""
    if type(model).on_before_optimizer_step is not pl.LightningModule.on_before_optimizer_step:
        return True
    return any(type(cb).on_before_optimizer_step is not pl.Callback.on_before_optimizer_step
               for cb in getattr(trainer, "callbacks", []))


def _raw(optimizer: Any) -> Any:
    """The optimizer Lightning steps, for a ``LightningOptimizer`` (what ``self.optimizers()``
    returns in manual optimization): the scaler keeps its per-optimizer stage by identity, and
    the step it clips for is called with the raw optimizer."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's AMP precision plugin, with ampfuse's scaler and support for ampfuse optimizers.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast, loss scaling) or ``"bf16-mixed"``.
        device: the device type of ``torch.autocast`` (``"cuda"``, ``"cpu"``).
        scaler: the loss scaler for ``"16-mixed"``; default ``ampfuse.GradScaler(device)``.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if scaler is None and precision == "16-mixed":
            scaler = ampfuse.GradScaler(device)
        super().__init__(precision, device, scaler)
        self._clip_coefs: dict[int, torch.Tensor] = {}
        # per optimizer: the unscaled fp32 copies of its fp16 gradients, for this step
        self._fp32_grads: dict[int, dict[torch.Tensor, torch.Tensor]] = {}

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        """Lightning's hook at setup: each ``interval="step"`` schedule of an ampfuse optimizer is
        replaced by its device twin (a schedule without one is left as it is)."""
        for config in lr_schedulers:
            sched = getattr(config, "scheduler", None)
            if getattr(config, "interval", None) == "step" and is_fused(getattr(sched, "optimizer", None)):
                config.scheduler = device_schedule(sched) or sched
        return super().connect(model, optimizers, lr_schedulers)

    def optimizer_step(
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Lightning's AMP step; for an ampfuse optimizer the scaled gradients go to the fused step."""
        optimizer = _raw(optimizer)
        if not is_fused(optimizer):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._fp32_grads.pop(id(optimizer), None)
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        scaler = self.scaler if scaler_enabled(self.scaler) else None
        if scaler is not None and not skip and _hook_overridden(model.trainer, model):
            if unscale_stage_open(scaler, optimizer):
                self._unscale_for_hook(scaler, optimizer)
            elif ScalerHandOff(scaler).grads_still_scaled(optimizer):
                raise RuntimeError(
                    "ampfuse.integrations.lightning: clip_gradients() was called before optimizer.step() and "
                    "on_before_optimizer_step is overridden, but the fused clip keeps the gradients scaled, so the "
                    "hook would see scaled gradients. Call self.clip_gradients(optimizer, ...) inside "
                    "on_before_optimizer_step instead (the gradients are unscaled there)."
                )
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clip_gradients
        fp32 = self._fp32_grads.pop(id(optimizer), None)
        coef = self._clip_coefs.pop(id(optimizer), None)
        if skip:
            return closure_result
        if scaler is not None:
            out = scaler.step(optimizer, grads=fp32, **kwargs) if fp32 else scaler.step(optimizer, **kwargs)
            scaler.update()
            return out
        if coef is not None:
            optimizer.step(scaling=StepScaling(clip_coef=coef), **kwargs)
        else:
            optimizer.step(**kwargs)
        return closure_result

    def _unscale_for_hook(self, scaler: ampfuse.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """Unscale so that ``on_before_optimizer_step`` sees unscaled gradients (see the module
        doc): fp32/bf16 in place; fp16 into fp32 copies (what clipping and the step use), whose
        values are written back, rounded, into the fp16 ``.grad`` for the hook."""
        fp32 = unscale_into_fp32_copies_(scaler, optimizer)
        if fp32:
            with torch.no_grad():
                for p, g in fp32.items():
                    grad = p.grad
                    assert grad is not None  # fp32 holds params with a gradient
                    grad.copy_(g)
            self._fp32_grads[id(optimizer)] = fp32

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The params Lightning's clipping works on: for fp16 params unscaled into fp32 copies
        (for the hook), stand-ins whose ``.grad`` is the copy the step will read."""
        optimizer = _raw(optimizer)
        return main_params_with_copies(optimizer, self._fp32_grads.get(id(optimizer)))

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip by norm or value; for an ampfuse optimizer without writing scaled gradients back.
        In manual optimization (``self.clip_gradients(opt, ...)`` before ``opt.step()``) too: the
        step that follows applies the clip, as ``unscale_``, ``clip_grad_norm_``, ``step`` would."""
        optimizer = _raw(optimizer)
        if clip_val <= 0 or not is_fused(optimizer):
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        by_norm = gradient_clip_algorithm == GradClipAlgorithmType.NORM
        if scaler_enabled(self.scaler):
            if not unscale_stage_open(self.scaler, optimizer):  # unscaled for the hook
                return _LightningPrecision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
            if by_norm:
                scaled_clip_norm_(self.scaler, optimizer, float(clip_val), 2.0)
            else:
                scaled_clip_value_(self.scaler, optimizer, float(clip_val))
            return None
        if by_norm:
            self._clip_coefs[id(optimizer)] = norm_and_coef(optimizer, float(clip_val), 2.0)[1]
            return None
        return _LightningPrecision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
