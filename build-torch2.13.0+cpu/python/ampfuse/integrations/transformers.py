"""ampfuse in the transformers ``Trainer``: ``enable(trainer)``.

::

    opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True, max_grad_norm=1.0,
                                                          gradient_accumulation_steps=4),
                      train_dataset=ds, optimizers=(opt, None))
    ampfuse.integrations.transformers.enable(trainer)     # after the Trainer is built, before train()
    trainer.train()                                       # or train(resume_from_checkpoint=...)

The Trainer trains through its ``Accelerator``; ``enable`` applies
:func:`ampfuse.integrations.accelerate.enable` to it. With ``fp16=True`` the accelerator's scaler
becomes an :class:`ampfuse.GradScaler` (saved to and resumed from ``scaler.pt`` as usual; on a CPU
fp16 autocast and loss scaling become real, as on a GPU), ``max_grad_norm`` clips through the
fused check + norm pass (fp16 params with fp32 masters included; the gradients are only read), and
``accelerator.optimizer_step_was_skipped`` is true exactly on overflowed steps, so the Trainer
advances its LR scheduler only on steps taken. ``bf16=True`` has no scaler: clipping takes the norm
in the same read-only pass and hands the coefficient to the step.

Not supported: DeepSpeed, FSDP and SageMaker model parallelism (their own optimizer and clipping
paths), ``optim=...`` strings that build a non-ampfuse optimizer (they train, with Accelerate's
behaviour for them), and ``fp16_backend``/``half_precision_backend`` other than the default AMP.
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
