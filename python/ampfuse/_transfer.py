"""Host-to-device copies that never make the host wait, and the CUDA-graph capture test: what the
scaler, the schedules and the accumulator share when they move host values to the device."""

from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """Whether work queued now on ``device`` is being captured into a CUDA graph (then nothing
    may wait for or read back the device: no event queries, no copies to the host)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` (host memory) on ``dev`` without making the host wait: a copy from pageable memory
    waits for the device, one from pinned memory is queued."""
    if dev.type == "cpu":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for ``src`` in host memory, queued (from pinned memory) where ``dst`` is
    on a device: the host does not wait."""
    if dst.device.type == "cpu":
        dst.copy_(src)
    else:
        dst.copy_(src.pin_memory(), non_blocking=True)
