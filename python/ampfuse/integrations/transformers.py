"""ampfuse in the transformers ``Trainer``: ``enable(trainer)``, after the Trainer is built.

It applies :func:`ampfuse.integrations.accelerate.enable` to the Trainer's accelerator: with
``fp16=True`` the scaler is an :class:`ampfuse.GradScaler` (saved in ``scaler.pt``),
``max_grad_norm`` clips through the fused pass, and the LR schedule the Trainer builds (or the
one it was given) becomes its device twin (:func:`ampfuse.lr_scheduler.device_twin`) for an
ampfuse optimizer: it advances only on the steps taken. The Trainer's own loop asks whether each
step was skipped and is told the truth (one flag read per optimizer step); it reads the learning
rate only when it logs it.
The whole contract: the manual's Integrations page (``docs/integrations.md``).
"""

from __future__ import annotations

from typing import Any

from ampfuse import lr_scheduler
from ampfuse.integrations._common import device_schedule, require

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
    create_scheduler = trainer.create_scheduler

    def _create_scheduler(num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = create_scheduler(num_training_steps, optimizer)
        owner = trainer.optimizer if optimizer is None else optimizer
        if isinstance(owner, _accelerate._AcceleratedOptimizer) and _accelerate.is_fused(owner.optimizer):
            trainer.lr_scheduler = device_schedule(scheduler) or scheduler
        return trainer.lr_scheduler

    trainer.create_scheduler = _create_scheduler
    _read_learning_rate_when_logging(trainer)
    return trainer


def _read_learning_rate_when_logging(trainer: Any) -> None:
    """The Trainer takes the learning rate of every step (``_get_learning_rate``, before the
    schedule steps) for its logs: with a device schedule, a host read at every step. Instead the
    step's value is kept on the device, and read when the Trainer logs it
    (``_maybe_log_save_evaluate``): the same logged value, one read per log."""
    get_learning_rate, maybe_log = trainer._get_learning_rate, trainer._maybe_log_save_evaluate
    pending: dict[str, Any] = {"logging": False, "value": None}

    def _get_learning_rate() -> float | None:
        schedule = trainer.lr_scheduler
        if pending["logging"] or not isinstance(schedule, lr_scheduler.LRScheduler):
            value, pending["value"] = pending["value"], None
            return float(value) if value is not None else get_learning_rate()
        pending["value"] = schedule.last_lr_tensors()[0]
        return None  # the Trainer then asks again when it logs

    def _maybe_log_save_evaluate(*args: Any, **kwargs: Any) -> Any:
        pending["logging"] = True
        try:
            return maybe_log(*args, **kwargs)
        finally:
            pending["logging"] = False

    trainer._get_learning_rate = _get_learning_rate
    trainer._maybe_log_save_evaluate = _maybe_log_save_evaluate
