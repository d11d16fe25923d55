"""ampfuse in Lightning Fabric: the precision plugin :class:`MixedPrecision`.

::

    from ampfuse.integrations.fabric import MixedPrecision
    fabric = L.Fabric(accelerator="cuda", devices=1, plugins=[MixedPrecision("16-mixed", "cuda")])
    model, optimizer = fabric.setup(model, ampfuse.optim.AdamW(model.parameters(), lr=1e-3))
    ...
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)   # refused by Fabric's own plugin
    optimizer.step()

A subclass of ``lightning.fabric.plugins.precision.MixedPrecision`` with its constructor; the
scaler defaults to an :class:`ampfuse.GradScaler`. Without clipping, ``optimizer.step()`` with an
ampfuse optimizer is the fused, sync-free step (the gradients stay scaled, the step divides).

``fabric.clip_gradients`` with an ampfuse optimizer: Fabric's strategy asks the plugin to unscale
the gradients and then runs ``torch.nn.utils.clip_grad_norm_`` (or ``clip_grad_value_``) over
the plugin's ``main_params`` -- the max norm never reaches the plugin, so the fused norm pass
cannot be used and the gradients are unscaled once, in one fused pass, before torch clips them:

* fp32 and bf16 gradients are unscaled in place (one read-write pass, as with torch's scaler);
* fp16 gradients are not written (that would lose range; torch's ``unscale_`` refuses them):
  they are copied to fp32 and unscaled there (a transient 4 bytes per fp16 parameter),
  ``main_params`` hands torch those fp32 gradients to measure and clip, and the fused step reads
  them instead of ``.grad``. The norm is thus the fp32 norm of the unscaled gradients.

Skipped steps, the scaler's state in ``fabric.save``/``fabric.load`` and the optimizer's fp32
masters behave as with torch's scaler; checkpoints resume bit for bit.
"""

from __future__ import annotations

from typing import Any, Iterator, Literal

import torch

import ampfuse
from ampfuse.integrations._common import (
    is_fused,
    main_params_with_copies,
    require,
    scaler_enabled,
    unscale_into_fp32_copies_,
    unscale_stage_open,
)

require("lightning.fabric", "lightning", "lightning", "fabric")

from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision  # noqa: E402

__all__ = ["MixedPrecision"]


class MixedPrecision(_FabricMixedPrecision):
    """Fabric's AMP precision plugin, with ampfuse's scaler and clipping for ampfuse optimizers.

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
        # per optimizer: the unscaled fp32 copies of its fp16 gradients, for this iteration
        self._fp32_grads: dict[int, dict[torch.Tensor, torch.Tensor]] = {}

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale before clipping; fp16 gradients of an ampfuse optimizer into fp32 copies."""
        if not is_fused(optimizer):
            super().unscale_gradients(optimizer)
            return
        if not scaler_enabled(self.scaler) or not unscale_stage_open(self.scaler, optimizer):
            return  # nothing to unscale, or already unscaled in this iteration
        fp32 = unscale_into_fp32_copies_(self.scaler, optimizer)
        if fp32:
            self._fp32_grads[id(optimizer)] = fp32
        return None

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The params whose ``.grad`` the step reads: for fp16 params with fp32 gradient copies, a
        stand-in tensor whose ``.grad`` is the copy (so that torch's clipping measures and clips it)."""
        return main_params_with_copies(optimizer, self._fp32_grads.get(id(optimizer)))

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's AMP step; an ampfuse optimizer reads the fp32 copies made for clipping, if any."""
        fp32 = self._fp32_grads.pop(id(optimizer), None)
        if fp32 is not None and is_fused(optimizer) and scaler_enabled(self.scaler) \
                and not unscale_stage_open(self.scaler, optimizer):
            out = self.scaler.step(optimizer, grads=fp32, **kwargs)
            self.scaler.update()
            return out
        return super().optimizer_step(optimizer, **kwargs)
