"""ampfuse in the Lightning ``Trainer``: the precision plugin :class:`MixedPrecision`.

::

    from ampfuse.integrations.lightning import MixedPrecision
    trainer = L.Trainer(plugins=[MixedPrecision("16-mixed", "cuda")], gradient_clip_val=1.0,
                        accumulate_grad_batches=4)
    # LightningModule.configure_optimizers returns ampfuse.optim.AdamW(self.parameters(), ...)

A subclass of ``lightning.pytorch.plugins.precision.MixedPrecision`` with its constructor; the
scaler defaults to an :class:`ampfuse.GradScaler`. With an ampfuse optimizer (any other optimizer
takes Lightning's own path unchanged):

* ``gradient_clip_val`` works (Lightning refuses clipping for optimizers that unscale in their
  step): by norm through the fused check + norm pass (:meth:`ampfuse.GradScaler.unscale_and_clip_`:
  the gradients are read once, in fp32, never written; the step applies ``1/scale`` and the clip
  coefficient), by value as a clamp of the scaled gradients to ``±clip_val * scale`` after a
  read-only inf check. fp32, bf16 and fp16 params alike (fp16: the norm of the unscaled gradients
  is taken in fp32 and no fp16 gradient is written back). With ``"bf16-mixed"`` (no scaler) the
  norm is taken by the same read-only pass and the coefficient handed to the step.
* ``on_before_optimizer_step`` sees unscaled gradients, as Lightning promises, when the
  LightningModule or a callback overrides it (when nothing overrides it the gradients stay scaled
  and the step is the fused one; nothing below is paid). The plugin then unscales first, with
  :meth:`ampfuse.GradScaler.unscale_` (the public hand-off: the fused step then reads unscaled
  gradients and does not divide by the scale again), and clipping uses torch's
  ``clip_grad_norm_``/``clip_grad_value_`` on the unscaled gradients, as Lightning's own plugin.
  fp32 and bf16 gradients are unscaled in place: a read-write pass where the fused path only
  reads, and clipping by norm then adds torch's read pass and read-write pass where the fused path
  folds the coefficient into the step. fp16 gradients cannot be unscaled in place without losing range (torch
  refuses it), so they are copied to fp32 and the copies unscaled (a transient 4 bytes per fp16
  parameter); the unscaled values are then written back into the fp16 ``.grad``, for the hook
  only: the hook sees ``(scaled.float() / scale).half()`` (the unscaled gradient rounded to fp16;
  magnitudes below fp16's smallest subnormal, 6e-8, read as 0). Clipping and the fused step use
  the fp32 copies, never the rounded fp16 values, so training is the same as without the hook.
  Cost per optimizer step with fp16 gradients: a copy pass (read 2, write 4 bytes per element),
  the unscale pass over the copies (read and write 4), the write-back (read 4, write 2), and the
  step reads 4 instead of 2 bytes per gradient element.
* Skipped steps behave as with torch's scaler (Lightning counts them as optimizer steps and steps
  its LR schedulers; the params, masters and optimizer state are unchanged); checkpoints hold the
  optimizer state with its fp32 masters and the scaler state, and resume bit for bit.

``precision="bf16-true"`` (bf16 params, no autocast) needs no plugin: Lightning's own clipping
works on the bf16 gradients and ``ampfuse.optim.AdamW`` keeps fp32 masters.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Literal

import torch

import ampfuse
from ampfuse.integrations._common import (
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
            elif scaler._per_optimizer_states[id(optimizer)].get("grads_still_scaled"):
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
