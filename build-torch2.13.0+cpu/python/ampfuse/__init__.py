"""ampfuse: fused, sync-free mixed-precision training steps for PyTorch.

- :class:`ampfuse.GradScaler`: drop-in replacement for ``torch.amp.GradScaler``.
- :mod:`ampfuse.optim`: SGD / Adam / AdamW with fp32 master weights, fused into one pass.
- :class:`ampfuse.GradAccumulator`: loss-scaling-correct gradient accumulation in fp32.
- :mod:`ampfuse.ops`: the fused kernels as torch custom ops (``torch.ops.ampfuse.*``).
"""

from ampfuse._version import __version__
from ampfuse._library import build_info, cmake_prefix_path, cpu_kernel_info, library_path, load_library

load_library()

from ampfuse import cpu, cuda, ops, optim  # noqa: E402
from ampfuse.accumulation import GradAccumulator  # noqa: E402
from ampfuse.grad_scaler import GradScaler, OverflowReport  # noqa: E402

__all__ = [
    "GradAccumulator",
    "GradScaler",
    "OverflowReport",
    "cpu",
    "cuda",
    "ops",
    "optim",
    "build_info",
    "cmake_prefix_path",
    "cpu_kernel_info",
    "library_path",
    "__version__",
]
