"""The emulated CUDA device (ampfuse.testing.cuemu): torch's tensor semantics on it, every
synchronizing call counted, ampfuse's ops on it equal to the emulated CUDA kernels on CPU tensors,
and training steps that never make the host wait.

Runs in the emulated pass of a test build (where CPU tensors run the same emulated CUDA kernels, so
cuemu and CPU results are compared bitwise)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampfuse
from conftest import HAS_CUEMU, requires_cuemu

pytestmark = requires_cuemu

if HAS_CUEMU:
    import ampfuse.testing.cuemu as cuemu

DEV = "cuemu"


# ---- tensors --------------------------------------------------------------------------------------


def test_tensors_run_torch_operators_with_cpu_results_and_aliasing():
    a = torch.randn(4, 6)
    d = a.to(DEV)
    assert d.device == torch.device("cuemu", 0) and d.is_cuemu
    torch.testing.assert_close((d * 2 + 1).sum(0).cpu(), (a * 2 + 1).sum(0), rtol=0, atol=0)
    v = d[1:3, ::2]  # a strided view writes through to its base
    v.mul_(0)
    assert v.device.type == DEV and not v.is_contiguous()
    ref = a.clone()
    ref[1:3, ::2] = 0
    assert torch.equal(d.cpu(), ref)
    r = d.add_(1)  # in place: the same tensor back
    assert r is d
    out = torch.empty(0, device=DEV)
    res = torch.add(d, d, out=out)  # out= resized to the result
    assert res is out and out.shape == (4, 6) and torch.equal(out.cpu(), 2 * d.cpu())
    assert torch.equal(d.t().contiguous().cpu(), d.cpu().t())


def test_fresh_device_memory_is_not_zero():
    # as on a GPU: an allocation holds garbage (0xFF bytes here), so a kernel that reads memory it
    # never wrote shows it
    e = torch.empty(8, dtype=torch.uint8, device=DEV)
    assert torch.equal(e.cpu(), torch.full((8,), 255, dtype=torch.uint8))


def test_mixed_devices_are_refused_as_on_cuda_except_host_scalars():
    d = torch.ones(3, device=DEV)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        d + torch.ones(3)
    assert torch.equal((d + torch.tensor(2.0)).cpu(), torch.full((3,), 3.0))


def test_autocast_casts_as_on_cuda():
    lin = nn.Linear(4, 4).to(DEV)
    with torch.autocast(DEV, dtype=torch.float16):
        y = lin(torch.randn(2, 4, device=DEV))
        s = torch.softmax(y, -1)
    assert y.dtype == torch.float16 and s.dtype == torch.float32


# ---- synchronizations -----------------------------------------------------------------------------


def _syncs(fn) -> list[str]:
    with cuemu.counting_syncs() as syncs:
        fn()
    return [s.what for s in syncs]


@pytest.mark.parametrize("name, fn, expected", [
    ("item", lambda d, h, p: d.sum().item(), "_local_scalar_dense"),
    ("bool", lambda d, h, p: bool(d[0] > 0), "_local_scalar_dense"),
    ("to host", lambda d, h, p: d.cpu(), "copy to host memory (blocking)"),
    ("to pageable host, non-blocking", lambda d, h, p: h.copy_(d, non_blocking=True), "copy to host memory (pageable)"),
    ("from host", lambda d, h, p: d.copy_(h), "copy from host memory (blocking)"),
    ("from pageable host, non-blocking", lambda d, h, p: d.copy_(h, non_blocking=True),
     "copy from host memory (pageable)"),
    ("nonzero", lambda d, h, p: torch.nonzero(d), "data-dependent output size: aten::nonzero"),
    ("masked_select", lambda d, h, p: d.masked_select(d > 0), "data-dependent output size: aten::masked_select"),
    ("synchronize", lambda d, h, p: torch.cuemu.synchronize(), "device synchronize"),
    ("event synchronize", lambda d, h, p: (lambda e: (e.record(), e.synchronize()))(torch.Event(DEV)),
     "event synchronize"),
])
def test_each_synchronizing_call_is_counted(name, fn, expected):
    d, h = torch.randn(5, device=DEV), torch.randn(5)
    p = torch.randn(5).pin_memory()
    before = cuemu.sync_count()
    syncs = _syncs(lambda: fn(d, h, p))
    assert syncs and syncs[0].startswith(expected), syncs
    assert cuemu.sync_count() - before == len(syncs)


def test_queued_work_and_pinned_copies_are_not_synchronizations():
    d, p = torch.randn(1000, device=DEV), torch.randn(1000).pin_memory()
    assert p.is_pinned()

    def work():
        e = (d * 3).sum() / d.norm()  # a device scalar, never read
        d.copy_(p, non_blocking=True)
        p.copy_(d, non_blocking=True)
        d.clone().add_(e)
        ev = torch.Event(DEV)
        ev.record()
        ev.query()

    assert _syncs(work) == []


def test_a_sync_records_the_python_stack_that_made_it():
    d = torch.ones(2, device=DEV)
    with cuemu.counting_syncs() as syncs:
        d.sum().item()
    assert len(syncs) == 1
    assert any(f.name == "test_a_sync_records_the_python_stack_that_made_it" for f in syncs[0].stack)
    assert "_local_scalar_dense" in str(syncs[0])


# ---- ampfuse on the device ------------------------------------------------------------------------


def _model(device, dtype):
    torch.manual_seed(0)  # the same draws on both devices: cuemu uses the CPU generator
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64)).to(dtype).to(device)


CONFIGS = {
    "adamw-masters": (torch.bfloat16, ampfuse.optim.AdamW, dict(weight_decay=0.1)),
    "adamw-remainder-uint8": (torch.bfloat16, ampfuse.optim.AdamW,
                              dict(master_weights="remainder", state_dtype=torch.uint8)),
    "adam-remainder-fp8": (torch.bfloat16, ampfuse.optim.Adam,
                           dict(master_weights="remainder", state_dtype=torch.float8_e4m3fn)),
    "sgd-fp16-masters": (torch.float16, ampfuse.optim.SGD, dict(momentum=0.9)),
}


def _train(device, config, accumulate, steps=3, syncs_per_step=None):
    """`steps` steps of the fused loop (or of the accumulator, windows of 2) with a device schedule
    and clipping, one micro-batch overflowing; the params after. Counts each step's syncs."""
    dtype, cls, kw = CONFIGS[config]
    model = _model(device, dtype)
    opt = cls(model.parameters(), lr=1e-3, **kw)
    scaler = ampfuse.GradScaler(device, init_scale=2.0**16)
    sched = ampfuse.lr_scheduler.CosineAnnealingLR(opt, T_max=10, scaler=scaler)
    acc = ampfuse.GradAccumulator(model, opt, scaler, steps=2, max_grad_norm=1.0) if accumulate else None
    torch.manual_seed(1)
    data = [(torch.randn(8, 64), torch.randn(8, 64)) for _ in range(2 * steps)]
    data[1][0][0, 0] = float("inf")  # one overflowing micro-batch: a skipped step

    def loss_of(x, y):
        with torch.autocast(device, dtype=dtype):
            return nn.functional.mse_loss(model(x.to(device, non_blocking=True)).float(),
                                          y.to(device, non_blocking=True))

    data = [(x.pin_memory(), y.pin_memory()) if device != "cpu" else (x, y) for x, y in data]
    for i in range(steps):
        with cuemu.counting_syncs() as syncs:
            if acc is not None:
                for x, y in data[2 * i:2 * i + 2]:
                    with acc.accumulate():
                        acc.backward(loss_of(x, y))
            else:
                scaler.scale(loss_of(*data[i])).backward()
                scaler.unscale_and_clip_(opt, max_norm=1.0)
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad(set_to_none=True)
        if syncs_per_step is not None:
            syncs_per_step.append([str(s) for s in syncs])
    return [p.detach().cpu() for p in model.parameters()], scaler.get_scale()


@pytest.mark.parametrize("accumulate", [False, True], ids=["fused-loop", "accumulator"])
@pytest.mark.parametrize("config", CONFIGS)
def test_training_steps_make_no_synchronizing_call_and_equal_cpu(config, accumulate):
    syncs: list[list[str]] = []
    ours, scale = _train(DEV, config, accumulate, syncs_per_step=syncs)
    assert syncs == [[]] * len(syncs), "\n".join(s for step in syncs for s in step)
    ref, ref_scale = _train("cpu", config, accumulate)
    assert scale == ref_scale < 2.0**16  # the overflow was seen and skipped on both
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.int16) if a.dtype != torch.float32 else a,
                           b.view(torch.int16) if b.dtype != torch.float32 else b)


def test_ops_run_the_cuda_kernel_table_on_the_device_stream_of_the_call():
    # an op on a side stream: the launch context follows the guard's current stream
    grads = [torch.randn(300, device=DEV) for _ in range(3)]
    found, inv = torch.zeros(1, device=DEV), torch.full((1,), 0.5, device=DEV)
    ref = [g.cpu() * 0.5 for g in grads]
    with torch.Stream(DEV):
        ampfuse.ops.unscale_check_(grads, found, inv)
    for g, r in zip(grads, ref):
        assert torch.equal(g.cpu(), r)
    assert found.cpu().item() == 0
