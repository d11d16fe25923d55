"""``ampfuse.cuda.amp.GradScaler``: the drop-in for the deprecated ``torch.cuda.amp.GradScaler``, whose first
positional argument is ``init_scale`` (``ampfuse.GradScaler``'s, like ``torch.amp.GradScaler``'s, is
the device)."""

import torch

from ampfuse.grad_scaler import init_scale_first

__all__ = ["GradScaler"]

GradScaler = init_scale_first("cuda", torch.cuda.amp.GradScaler, __name__)
