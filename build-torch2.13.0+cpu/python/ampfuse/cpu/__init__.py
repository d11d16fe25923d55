"""``ampfuse.cpu``: mirrors ``torch.cpu`` where ampfuse offers a drop-in (``ampfuse.cpu.amp``)."""

from ampfuse.cpu import amp

__all__ = ["amp"]
