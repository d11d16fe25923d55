"""ampfuse in the transformers ``Trainer``: ``enable(trainer)``, after the Trainer is built.

It applies :func:`ampfuse.integrations.accelerate.enable` to the Trainer's accelerator: with
``fp16=True`` the scaler is an :class:`ampfuse.GradScaler` (saved in ``scaler.pt``),
``max_grad_norm`` clips through the fused pass, and the LR scheduler advances only on steps taken.
The whole contract: the manual's Integrations page (``docs/integrations.md``).
"""

from __future__ import annotations

from typing import Any

from ampfuse.integrations._common import require

require("transformers", "transformers", "transformers", "transformers")

from ampfuse.integrations import accelerate as _accelerate  # noqa: E402

__all__ = ["enable"]


def enable(trainer: Any, **grad_scaler_kwargs: Any) -> Any:
    """Make ``trainer`` (a ``transformers.Trainer``, built, not yet trained) train with ampfuse.

    Args:
        trainer: the Trainer; its ``accelerator`` is passed to
            :func:`ampfuse.integrations.accelerate.enable`.
        **grad_scaler_kwargs: arguments of :class:`ampfuse.GradScaler` (fp16 only).

    Returns:
        ``trainer``.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None:
        raise TypeError(f"enable() needs a transformers Trainer with an accelerator, got {type(trainer).__name__}.")
    _accelerate.enable(accelerator, **grad_scaler_kwargs)
    return trainer
