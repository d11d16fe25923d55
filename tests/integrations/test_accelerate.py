"""ampfuse.integrations.accelerate: a real Accelerate training run on CPU (fp16 autocast, loss
scaling that overflows on some steps, gradient accumulation, clipping that bites, an LR schedule)
with ampfuse's scaler + AdamW against torch's scaler + AdamW, fp16 params with masters, and
save_state/load_state resume; plus the failures of Accelerate alone as regressions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

import ampfuse  # noqa: E402
import ampfuse.lr_scheduler  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from ampfuse.integrations import accelerate as af_accelerate  # noqa: E402

from integ_helpers import (  # noqa: E402
    ACCUM, ATOL, LR, MAX_NORM, MICRO_BATCHES, RTOL, SCALER_KWARGS, assert_bitwise, lr_lambda, make_data,
    count_flag_reads, make_model, masters_of, max_abs_diff, torch_fp16_with_masters,
)


def _accelerator(kind: str, accum: int = ACCUM) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=accum)
    if kind == "ampfuse":
        af_accelerate.enable(acc, **SCALER_KWARGS)
    elif kind == "torch":
        # what Accelerate does for fp16 on a GPU (on a CPU it silently trains in fp32), by hand
        acc.scaler = torch.amp.GradScaler("cpu", **SCALER_KWARGS)
        acc.native_amp = True
    return acc


def run(kind: str, dtype=torch.float32, stop_at: int | None = None, save_dir=None, load_dir=None, max_norm=MAX_NORM,
        accum: int = ACCUM, linear: bool = False, one_cycle: bool = False):
    """Train; returns (model, optimizer, per-step records). ``stop_at``/``save_dir``: save after
    that many micro-batches and stop; ``load_dir``: resume from there."""
    acc = _accelerator(kind, accum)
    model = make_model().to(dtype)
    opt_cls = ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW
    opt = opt_cls(model.parameters(), lr=LR)
    steps = MICRO_BATCHES // accum
    if linear:
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=steps)
    elif one_cycle:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps))
    model, opt, sched = acc.prepare(model, opt, sched)
    data = make_data()
    start = 0
    if load_dir is not None:
        acc.load_state(load_dir)
        start = stop_at
    records = []
    for i in range(start, MICRO_BATCHES):
        x, y = data[i]
        with acc.accumulate(model):
            loss = F.mse_loss(model(x.to(dtype)).float(), y)
            acc.backward(loss)
            norm = None
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            sched.step()
            opt.zero_grad()
            if acc.sync_gradients:
                # an ampfuse optimizer's flag, kept on the device (read after the run)
                flag = getattr(opt, "last_step_skipped", None)
                skipped = flag.clone() if flag is not None else acc.optimizer_step_was_skipped
                records.append(dict(skipped=skipped, lr=sched.get_last_lr()[0], scale=acc.scaler.get_scale(),
                                    norm=float(norm)))
        if stop_at is not None and save_dir is not None and i + 1 == stop_at:
            acc.save_state(save_dir)
            break
    for r in records:
        if isinstance(r["skipped"], torch.Tensor):
            r["skipped"] = bool(r["skipped"].item() != 0)
    return model, opt, records


@pytest.fixture(scope="module")
def runs():
    return {"ampfuse": run("ampfuse"), "torch": run("torch")}


def test_same_skips_lr_and_params_as_torch(runs):
    (m_a, _, rec_a), (m_t, _, rec_t) = runs["ampfuse"], runs["torch"]
    skipped = [r["skipped"] for r in rec_a]
    assert skipped == [r["skipped"] for r in rec_t]
    assert any(skipped) and not all(skipped), skipped
    assert [r["lr"] for r in rec_a] == [r["lr"] for r in rec_t]
    assert [r["scale"] for r in rec_a] == [r["scale"] for r in rec_t]
    # the schedule advanced once per step taken
    assert rec_a[-1]["lr"] == pytest.approx(LR * (1 - sum(not s for s in skipped) / (MICRO_BATCHES // ACCUM)))
    finite = [(a["norm"], t["norm"]) for a, t in zip(rec_a, rec_t) if not a["skipped"]]
    assert any(a > MAX_NORM for a, _ in finite)  # clipping bit
    for a, t in finite:
        assert a == pytest.approx(t, rel=1e-5)
    sa, st = m_a.state_dict(), m_t.state_dict()
    assert max_abs_diff(sa, st) < ATOL + RTOL, max_abs_diff(sa, st)
    for k in sa:
        torch.testing.assert_close(sa[k], st[k], atol=ATOL, rtol=RTOL)


def test_a_device_twin_schedule_gives_torchs_learning_rates_without_reading_the_flag(runs):
    """A prepared LinearLR of an ampfuse optimizer becomes its device twin: the same skips,
    learning rates and params as torch's scaler + AdamW + LinearLR (which reads the flag at every
    step), and no host read of the skip flag in the whole run."""
    with count_flag_reads() as reads:
        ma, _, ra = run("ampfuse", linear=True)
    mt, _, rt = run("torch", linear=True)
    assert reads.flags and reads.reads == []
    assert [r["skipped"] for r in ra] == [r["skipped"] for r in rt] == [r["skipped"] for r in runs["ampfuse"][2]]
    assert [r["lr"] for r in ra] == pytest.approx([r["lr"] for r in rt], rel=1e-6)
    for k, v in mt.state_dict().items():
        torch.testing.assert_close(ma.state_dict()[k], v, atol=ATOL, rtol=RTOL)


def test_fp16_params_with_masters_equal_torch_by_hand():
    """fp16 params + fp32 masters through Accelerate against torch's own path for fp16 params with
    fp32 masters, written by hand (integ_helpers.torch_fp16_with_masters: masters stepped by
    torch.optim.AdamW, torch's scaler, clipping on the fp32 copies of the gradients, the LR advanced
    on steps taken). The same computation, so the fp32 tolerance (ATOL, RTOL) applies: the masters
    differ only by AdamW's arithmetic and the clip norm's summation order (measured 3e-8). An fp32
    params run is not this computation: it starts from weights not rounded to fp16 and stays up
    to 3e-4 away. Without accumulation: fp16 params sum micro-batch gradients in fp16 (inf past
    65504), where the reference sums none."""
    m16, opt16, rec16 = run("ampfuse", dtype=torch.float16, accum=1)
    _, ref_masters, ref_rec = torch_fp16_with_masters(make_data(), lr_steps=MICRO_BATCHES)
    assert [r["scale"] for r in rec16] == [r["scale"] for r in ref_rec]
    assert [r["lr"] for r in rec16] == [r["lr"] for r in ref_rec]
    assert any(r["skipped"] for r in rec16) and not all(r["skipped"] for r in rec16)
    masters = masters_of(m16, opt16)  # fp32, and the params are the masters rounded
    for k, m in ref_masters.items():
        torch.testing.assert_close(masters[k], m, atol=ATOL, rtol=RTOL)


def test_resume_equals_uninterrupted(runs, tmp_path):
    m_full, _, rec_full = runs["ampfuse"]
    stop = 6  # mid-run, after a skipped step
    run("ampfuse", stop_at=stop, save_dir=str(tmp_path))
    m_res, _, rec_res = run("ampfuse", stop_at=stop, load_dir=str(tmp_path))
    assert rec_res == rec_full[stop // ACCUM:]
    assert_bitwise(m_res.state_dict(), m_full.state_dict())


def test_resume_of_a_one_cycle_schedule_through_save_state_equals_uninterrupted(tmp_path):
    """Accelerate's save_state / load_state (torch.load with weights_only) of a device OneCycleLR
    (with the momentum it cycles): the resumed run equals the uninterrupted one bit for bit."""
    m_full, _, rec_full = run("ampfuse", one_cycle=True)
    stop = 6
    run("ampfuse", stop_at=stop, save_dir=str(tmp_path), one_cycle=True)
    m_res, _, rec_res = run("ampfuse", stop_at=stop, load_dir=str(tmp_path), one_cycle=True)
    assert rec_res == rec_full[stop // ACCUM:]
    assert_bitwise(m_res.state_dict(), m_full.state_dict())


def test_a_one_cycle_schedule_shorter_than_the_run_stops_where_accelerate_stops_it():
    """Accelerate steps a schedule with ``total_steps`` only while ``_step_count <= total_steps``:
    on device schedules the guard counts the steps taken, as torch's + Accelerate's does (no error
    past the end, the same learning rates)."""
    lrs = {}
    for kind in ("ampfuse", "torch"):
        acc = _accelerator(kind, accum=1)
        model = make_model()
        opt = (ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW)(model.parameters(), lr=LR)
        model, opt, sched = acc.prepare(model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=5))
        for i, (x, y) in enumerate(make_data(9)):
            scale = float("inf") if i in (1, 2) else 1.0
            acc.backward(F.mse_loss(model(x).float(), y) * scale)
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.setdefault(kind, []).append(sched.get_last_lr()[0])
    assert lrs["ampfuse"] == lrs["torch"]


def test_a_one_cycle_schedule_resumed_past_its_end_stays_stopped(tmp_path):
    """save_state after more steps than total_steps, load_state in a fresh run: Accelerate's guard
    holds across the resume (the loaded state's step count bounds the calls), as with torch's."""
    def run(kind, save=None, load=None, stop=10, n=16):
        acc = _accelerator(kind, accum=1)
        model = make_model()
        opt = (ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW)(model.parameters(), lr=LR)
        model, opt, sched = acc.prepare(model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=5))
        start = 0
        if load is not None:
            acc.load_state(str(load))
            start = stop
        lrs = []
        for i, (x, y) in enumerate(make_data(n)[start:], start):
            acc.backward(F.mse_loss(model(x).float(), y) * (float("inf") if i in (1, 2) else 1.0))
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append(sched.get_last_lr()[0])
            if save is not None and i + 1 == stop:
                acc.save_state(str(save))
                break
        return lrs

    for kind in ("ampfuse", "torch"):
        full = run(kind)
        run(kind, save=tmp_path / kind)
        assert run(kind, load=tmp_path / kind) == full[10:]


def test_clip_grad_value_and_bf16(tmp_path):
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = af_accelerate.enable(Accelerator(cpu=True, mixed_precision="bf16"))
    model = make_model().to(torch.bfloat16)
    opt = ampfuse.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    x, y = make_data(1)[0]
    acc.backward(F.mse_loss(model(x.bfloat16()).float(), y))
    grads = [p.grad.float().clone() for p in model.parameters()]
    norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    assert float(norm) > MAX_NORM
    opt.step()
    assert not acc.optimizer_step_was_skipped
    # the step used the clipped gradient: compare with a manual clipped step
    ref_model = make_model().to(torch.bfloat16)
    ref = ampfuse.optim.AdamW(ref_model.parameters(), lr=LR)
    for p, g in zip(ref_model.parameters(), grads):
        p.grad = (g * min(1.0, MAX_NORM / (float(expected) + 1e-6))).bfloat16()
    ref.step()
    masters = masters_of(model, opt)
    ref_masters = masters_of(ref_model, ref)
    for k in masters:
        torch.testing.assert_close(masters[k], ref_masters[k], atol=1e-6, rtol=1e-5)


def test_clip_grad_value_fp16():
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = af_accelerate.enable(Accelerator(cpu=True, mixed_precision="fp16"), init_scale=16.0)  # no overflow
    model = make_model().half()
    opt = ampfuse.optim.SGD(model.parameters(), lr=1.0)
    model, opt = acc.prepare(model, opt)
    x, y = make_data(1)[0]
    acc.backward(F.mse_loss(model(x.half()).float(), y))
    unscaled = [p.grad.float() / 16 for p in model.parameters()]
    before = [p.detach().float().clone() for p in model.parameters()]
    acc.clip_grad_value_(model.parameters(), 0.01)
    opt.step()
    assert not acc.optimizer_step_was_skipped
    for p, b, g in zip(model.parameters(), before, unscaled):
        # the bound is clip_value * scale rounded to fp16 (0.16 -> 0.16003): 2.1e-6 off after unscaling
        torch.testing.assert_close(opt.state[p]["master_param"], b - g.clamp(-0.01, 0.01), atol=3e-6, rtol=0)


# ---- the failures of Accelerate alone (regressions) -------------------------------------------


def test_skipped_steps_are_reported_and_read_lazily():
    """Accelerate alone: an ampfuse optimizer's step is always "called", so step_was_skipped was
    always False and the scheduler advanced on overflowed steps."""
    acc = _accelerator("ampfuse")
    model = make_model().half()
    opt = ampfuse.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # a host schedule: Accelerate asks about the skip
    model, opt, sched = acc.prepare(model, opt, sched)
    assert isinstance(acc.scaler, ampfuse.GradScaler)
    x, y = make_data(1)[0]
    acc.backward(F.mse_loss(model(x.half()).float(), y))  # scale 2**20: overflows
    opt.step()
    assert opt._ampfuse_skip_flag is not None  # nothing read yet
    sched.step(1.0)  # reads the flag once
    assert opt._ampfuse_skip_flag is None
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped
    assert sched.get_last_lr()[0] == LR  # did not advance


def test_an_epoch_schedule_counts_epochs_not_taken_steps():
    """``step_scheduler_with_optimizer=False``: the loop steps the schedule once per epoch, and it
    stays torch's (an epoch whose last step overflowed is still an epoch), as with Accelerate alone."""
    lrs = {}
    for kind in ("ampfuse", "torch"):
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = Accelerator(cpu=True, mixed_precision="fp16", step_scheduler_with_optimizer=False)
        if kind == "ampfuse":
            af_accelerate.enable(acc, **SCALER_KWARGS)
        else:
            acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu", **SCALER_KWARGS), True
        model = make_model()
        opt = (ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW)(model.parameters(), lr=0.1)
        model, opt, sched = acc.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        assert not isinstance(sched.scheduler, ampfuse.lr_scheduler.LRScheduler)
        data = make_data(6)
        for epoch in range(3):
            for i in range(2):
                x, y = data[2 * epoch + i]
                scale = float("inf") if (epoch, i) == (0, 1) else 1.0  # the first epoch's last step overflows
                acc.backward(F.mse_loss(model(x).float(), y) * scale)
                opt.step()
                opt.zero_grad()
            sched.step()
            lrs.setdefault(kind, []).append(sched.get_last_lr()[0])
    assert lrs["ampfuse"] == lrs["torch"] == [0.05, 0.025, 0.0125]


def test_enable_after_prepare_is_refused():
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    acc.prepare(ampfuse.optim.AdamW(make_model().parameters()))
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        af_accelerate.enable(acc)


def test_cpu_fp16_is_real_after_enable():
    acc = _accelerator("ampfuse")
    model = acc.prepare(make_model())
    out = model(torch.randn(2, 8))
    assert acc.native_amp and isinstance(acc.scaler, ampfuse.GradScaler)
    # autocast ran the Linear in fp16 (the output is converted back to fp32 by Accelerate)
    with acc.autocast():
        assert make_model()(torch.randn(2, 8)).dtype == torch.float16
    assert out.dtype == torch.float32


def _two_optimizer_run(kind: str, overflow_at=(3, 7), steps: int = 8, linear: bool = False):
    """Two prepared optimizers (one per layer) under the accelerator's one scaler, clipped together
    by ``accelerator.clip_grad_norm_`` over all params (Accelerate's own path: unscale every
    optimizer, then torch's clip), each with its own schedule (``linear``: a LinearLR, which has a
    device twin); the second layer's gradients overflow on the steps in ``overflow_at``. Returns
    per-step records."""
    acc = _accelerator(kind, accum=1)
    model = make_model()
    cls = ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW
    o1, o2 = cls(model[0].parameters(), lr=LR), cls(model[2].parameters(), lr=LR)
    if linear:
        s1, s2 = (torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.0, total_iters=steps)
                  for o in (o1, o2))
    else:
        s1 = torch.optim.lr_scheduler.LambdaLR(o1, lr_lambda(steps))
        s2 = torch.optim.lr_scheduler.LambdaLR(o2, lr_lambda(steps))
    model, o1, o2, s1, s2 = acc.prepare(model, o1, o2, s1, s2)
    records = []
    for i, (x, y) in enumerate(make_data(steps)):
        acc.backward(F.mse_loss(model(x).float(), y))
        if i in overflow_at:
            with torch.no_grad():
                getattr(model, "module", model)[2].weight.grad[0, 0] = float("inf")
        acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        for o, s in ((o1, s1), (o2, s2)):
            o.step()
            s.step()
        records.append(dict(skipped=(o1.step_was_skipped, o2.step_was_skipped),
                            accelerator_skipped=acc.optimizer_step_was_skipped,
                            lr=(s1.get_last_lr()[0], s2.get_last_lr()[0]), scale=acc.scaler.get_scale()))
        o1.zero_grad()
        o2.zero_grad()
    return model, records


@pytest.mark.parametrize("linear", [False, True], ids=["lambda-schedules", "device-twin-schedules"])
def test_two_optimizers_each_report_their_own_skip(linear):
    """An overflow in the second optimizer's gradients skips its step alone: the first optimizer
    stepped, says so (``step_was_skipped`` is its own, not the scaler's last check), and its
    schedule advances, as with torch's scaler. With schedules that have a device twin (which count
    the skips themselves and never ask) the flags tell the truth as well: ``step_was_skipped`` and
    ``accelerator.optimizer_step_was_skipped`` are what users count, log and decide by."""
    m_a, rec_a = _two_optimizer_run("ampfuse", linear=linear)
    m_t, rec_t = _two_optimizer_run("torch", linear=linear)
    assert [r["skipped"] for r in rec_a] == [r["skipped"] for r in rec_t]
    assert [r["accelerator_skipped"] for r in rec_a] == [r["accelerator_skipped"] for r in rec_t]
    assert [r["skipped"] for r in rec_a][3] == (False, True)  # the planted overflow, at a clean scale
    assert [lr for r in rec_a for lr in r["lr"]] == pytest.approx([lr for r in rec_t for lr in r["lr"]], rel=1e-6)
    assert [r["scale"] for r in rec_a] == [r["scale"] for r in rec_t]
    sa, st = m_a.state_dict(), m_t.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], st[k], atol=ATOL, rtol=RTOL)
