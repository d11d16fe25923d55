"""ampfuse in Lightning Fabric: the precision plugin :class:`MixedPrecision`.

A subclass of Fabric's ``MixedPrecision`` plugin with its constructor, whose scaler defaults to
:class:`ampfuse.GradScaler`. Without clipping, ``optimizer.step()`` with an ampfuse optimizer is
the fused, sync-free step; ``fabric.clip_gradients`` unscales once in one fused pass (fp16
gradients into fp32 copies, which torch clips and the step reads), where Fabric's own plugin
refuses. The whole contract: the manual's Integrations page (``docs/integrations.md``).
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
