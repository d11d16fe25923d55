"""``ampfuse.cuda``: mirrors ``torch.cuda`` where ampfuse offers a drop-in (``ampfuse.cuda.amp``)."""

from ampfuse.cuda import amp

__all__ = ["amp"]
