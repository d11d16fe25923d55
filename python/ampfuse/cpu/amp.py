"""``ampfuse.cpu.amp.GradScaler``: the drop-in for the deprecated ``torch.cpu.amp.GradScaler``, whose first
positional argument is ``init_scale`` (``ampfuse.GradScaler``'s, like ``torch.amp.GradScaler``'s, is
the device)."""

import torch

from ampfuse.grad_scaler import init_scale_first

__all__ = ["GradScaler"]

GradScaler = init_scale_first("cpu", torch.cpu.amp.GradScaler, __name__)
