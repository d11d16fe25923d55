"""Launches per training step: ``unscale_and_clip_`` (or the scaler's own check), ``step`` and
``update`` run three kernels -- check, step, update -- whatever the number of tensors, and no other
op that would launch one (no reciprocal of the scale, no zero-fill of found_inf, no memset, no
copy of the metadata).

Two views: a dispatch log (every op that reaches a backend while the scaler and optimizer work,
on any machine) and the emulator's launch counter (the CUDA launch sequence, in the emulated suite).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampfuse
from ampfuse import _library

EMULATED = ampfuse.cpu_kernel_info()["kernels"] == "cuda-emulated"

# Ops that allocate, re-view or annotate without running a kernel; and the scaler's read of its
# floor counter, which on CPU tensors is a plain host read (on CUDA an asynchronous copy to pinned
# memory, polled later: no kernel and no sync).
NO_KERNEL = {"empty.memory_format", "view.default", "_unsafe_view.default", "alias.default", "detach.default",
             "reshape.default", "as_strided.default", "_record_function_enter_new.default",
             "_record_function_exit._RecordFunction", "select.int", "_local_scalar_dense.default",
             # the engine's check of a group's options: values only, no tensor read, no kernel
             "ampfuse.group_hyper_check.default"}


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(f"{func.namespace}.{func._opname}.{func._overloadname}" if func.namespace == "ampfuse"
                        else f"{func._opname}.{func._overloadname}")
        return func(*args, **(kwargs or {}))


def launches() -> int:
    emu = _library.emulator()
    n, blocks, switches = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_ulonglong()
    emu.cuemu_stats(ctypes.byref(n), ctypes.byref(blocks), ctypes.byref(switches))
    return n.value


def _model(count: int, numel: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(numel, generator=g).to(dtype)) for _ in range(count)]


def _write_grads(params, seed: int, scaler=None) -> None:
    """Fresh gradient tensors, as backward after zero_grad(set_to_none=True) (scaler.scale(loss)
    first, as a training step does: one multiply, outside the scaler's three launches)."""
    if scaler is not None:
        scaler.scale(torch.ones(()))
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1024).to(p.dtype)


CASES = {
    # name: (param dtype, optimizer factory, clip)
    "adamw-bf16-masters-clip": (torch.bfloat16, lambda ps: ampfuse.optim.AdamW(ps, lr=1e-3), True),
    "adamw-bf16-remainder-bf16-state": (
        torch.bfloat16,
        lambda ps: ampfuse.optim.AdamW(ps, lr=1e-3, master_weights="remainder", state_dtype=torch.bfloat16),
        True,
    ),
    "sgd-fp32-noclip": (torch.float32, lambda ps: ampfuse.optim.SGD(ps, lr=1e-2, momentum=0.9), False),
}


def _step(scaler, opt, clip: bool) -> None:
    if clip:
        scaler.unscale_and_clip_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("case", list(CASES))
def test_step_runs_only_check_step_update(case):
    """The ops a step dispatches: the three ampfuse ops and allocations, nothing that computes."""
    dtype, make_opt, clip = CASES[case]
    params = _model(1000, 64, dtype)
    opt = make_opt(params)
    scaler = ampfuse.GradScaler("cpu", init_scale=1024.0)
    _write_grads(params, 0, scaler)
    _step(scaler, opt, clip)  # first step: state, masters, scaler tensors created
    _write_grads(params, 1, scaler)
    with OpLog() as log:
        _step(scaler, opt, clip)
    computing = [op for op in log.ops if op not in NO_KERNEL]
    expected = (["ampfuse.check_norm_.default"], ["ampfuse.adam_step_.default" if "adam" in case else "ampfuse.sgd_step_.default"],
                ["ampfuse.update_scale_.default"])
    assert computing == [*expected[0], *expected[1], *expected[2]], "\n".join(log.ops)


@pytest.mark.skipif(not EMULATED, reason="the launch counter is the emulator's (emulated suite)")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("count", [10, 1000, 3000])
def test_three_launches_whatever_the_number_of_tensors(case, count):
    """Under the emulated CUDA kernels: check, step and update are one launch each, also for more
    tensors than a launch's parameters hold (the metadata goes into a resident table), and the
    step changes the model exactly as the CPU kernels do."""
    dtype, make_opt, clip = CASES[case]
    params = _model(count, 16, dtype)
    opt = make_opt(params)
    scaler = ampfuse.GradScaler("cpu", init_scale=1024.0)
    _write_grads(params, 0, scaler)
    _step(scaler, opt, clip)
    _write_grads(params, 1, scaler)
    before = launches()
    _step(scaler, opt, clip)
    assert launches() - before == 3
