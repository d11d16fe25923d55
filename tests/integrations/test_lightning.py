"""ampfuse.integrations.lightning (Trainer) and .fabric: real runs on CPU with fp16 autocast, a
scale that overflows on some steps, gradient accumulation, clipping that bites and a per-step LR
schedule; ampfuse's scaler + AdamW against Lightning's own plugin with torch's scaler + AdamW;
fp16 params with masters; checkpoint resume; and the failures of Lightning alone as regressions."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision as FabricAMP  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as LightningAMP  # noqa: E402

import ampfuse  # noqa: E402
import ampfuse.lr_scheduler  # noqa: E402
from ampfuse.integrations import fabric as af_fabric  # noqa: E402
from ampfuse.integrations import lightning as af_lightning  # noqa: E402

from integ_helpers import (  # noqa: E402
    ACCUM, ATOL, LR, MAX_NORM, MICRO_BATCHES, RTOL, SCALER_KWARGS, assert_bitwise, lr_lambda, make_data,
    count_flag_reads, make_model, masters_of, max_abs_diff,
)

warnings.filterwarnings("ignore", ".*does not have many workers.*")
EPOCH = MICRO_BATCHES // 2  # two epochs; checkpoints are taken at the epoch boundary
STEPS = MICRO_BATCHES // ACCUM


class Module(pl.LightningModule):
    def __init__(self, kind: str, dtype=torch.float32, fp16_init: bool = False, sched: str = "lambda") -> None:
        super().__init__()
        self.kind, self.dtype_, self.sched = kind, dtype, sched
        self.net = make_model(fp16_init=fp16_init).to(dtype)
        self.records: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x.to(self.dtype_)).float(), y)

    def configure_optimizers(self):
        cls = ampfuse.optim.AdamW if self.kind == "ampfuse" else torch.optim.AdamW
        opt = cls(self.parameters(), lr=LR)
        if self.sched == "linear":  # a schedule with a device twin
            sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=STEPS)
        else:
            # an epoch schedule: Lightning steps it as torch's (no device twin), the same in both runs
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(STEPS))
        interval = "step" if self.sched == "linear" else "epoch"
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.records.append(dict(lr=lr.clone() if isinstance(lr, torch.Tensor) else lr,  # a device lr: no read
                                     scale=self.trainer.precision_plugin.scaler.get_scale()))


def _plugin(kind: str, scaler_kwargs=SCALER_KWARGS):
    if kind == "ampfuse":
        return af_lightning.MixedPrecision("16-mixed", "cpu", ampfuse.GradScaler("cpu", **scaler_kwargs))
    return LightningAMP("16-mixed", "cpu", torch.amp.GradScaler("cpu", **scaler_kwargs))


def _trainer(kind: str, epochs: int, scaler_kwargs=SCALER_KWARGS, **kw) -> pl.Trainer:
    kw.setdefault("accumulate_grad_batches", ACCUM)
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, plugins=[_plugin(kind, scaler_kwargs)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      **{"gradient_clip_val": MAX_NORM, **kw})


def _loader():
    return torch.utils.data.DataLoader(make_data(EPOCH), batch_size=None)


def fit(kind: str, dtype=torch.float32, epochs: int = 2, ckpt=None, save=None, fp16_init=False, sched="lambda",
        **kw) -> Module:
    module = Module(kind, dtype, fp16_init, sched)
    trainer = _trainer(kind, epochs, **kw)
    trainer.fit(module, _loader(), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return module


@pytest.fixture(scope="module")
def lightning_runs():
    return {"ampfuse": fit("ampfuse"), "torch": fit("torch")}


def test_lightning_same_skips_lr_and_params_as_torch(lightning_runs):
    a, t = lightning_runs["ampfuse"], lightning_runs["torch"]
    assert [r["scale"] for r in a.records] == [r["scale"] for r in t.records]
    scales = [SCALER_KWARGS["init_scale"]] + [r["scale"] for r in a.records]
    skipped = [after < before for before, after in zip(scales, scales[1:])]
    assert any(skipped) and not all(skipped), skipped
    assert [r["lr"] for r in a.records] == [r["lr"] for r in t.records]
    sa, st = a.net.state_dict(), t.net.state_dict()
    assert max_abs_diff(sa, st) < ATOL + RTOL
    for k in sa:
        torch.testing.assert_close(sa[k], st[k], atol=ATOL, rtol=RTOL)


def test_lightning_step_schedule_advances_only_on_taken_steps_without_reading_the_flag():
    """An interval="step" LinearLR of an ampfuse optimizer becomes its device twin: the learning
    rate follows the steps taken (Lightning alone advances it on skipped steps too), and no host
    read of the skip flag happens in the whole run."""
    with count_flag_reads() as reads:
        module = fit("ampfuse", sched="linear")
    assert len(reads.flags) == STEPS and reads.reads == []
    assert isinstance(module.trainer.lr_scheduler_configs[0].scheduler, ampfuse.lr_scheduler.LinearLR)
    skipped = [bool(f.item() != 0) for f in reads.flags]
    assert any(skipped) and not all(skipped), skipped
    # each record is taken after that step's schedule step: the steps taken up to it
    taken = [sum(not s for s in skipped[:k + 1]) for k in range(STEPS)]
    assert [float(r["lr"]) for r in module.records] == pytest.approx([LR * (1 - t / STEPS) for t in taken], rel=1e-6)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_fp16_params_with_masters_follow_the_fp32_run(lightning_runs, algorithm):
    """fp16 params + ampfuse's fp32 masters against Lightning's plugin with torch's scaler + AdamW
    on fp32 params started from the same weights rounded to fp16 (``fp16_init``): on this model
    (Linear, Tanh under fp16 autocast) that is the same computation -- every op runs in fp16 on
    the same fp16 weights either way -- so the fp32 tolerance (ATOL, RTOL) applies. Measured: 7e-9
    by norm; 1.5e-7 (relative 4e-6) by value, where the bound ``clip_val * scale`` is rounded to
    fp16 for fp16 gradients. (From unrounded fp32 weights the runs differ by that rounding, up
    to 2.9e-4.) Without accumulation: fp16 params sum micro-batch gradients in fp16 (inf past
    65504)."""
    kw = dict(accumulate_grad_batches=1, epochs=1)
    if algorithm == "value":
        kw.update(gradient_clip_algorithm="value", gradient_clip_val=0.01)
    m16, ref = fit("ampfuse", torch.float16, **kw), fit("torch", fp16_init=True, **kw)
    assert [r["scale"] for r in m16.records] == [r["scale"] for r in ref.records]
    assert [r["lr"] for r in m16.records] == [r["lr"] for r in ref.records]
    masters = masters_of(m16.net, m16.trainer.optimizers[0])  # fp32, params are the masters rounded
    for k, p in ref.net.named_parameters():
        torch.testing.assert_close(masters[k], p.detach(), atol=ATOL, rtol=RTOL)


def test_lightning_resume_equals_uninterrupted(lightning_runs, tmp_path):
    full = lightning_runs["ampfuse"]
    fit("ampfuse", epochs=1, save=str(tmp_path / "e1.ckpt"))
    resumed = fit("ampfuse", epochs=2, ckpt=str(tmp_path / "e1.ckpt"))
    assert resumed.records == full.records[len(full.records) - len(resumed.records):]
    assert_bitwise(resumed.net.state_dict(), full.net.state_dict())


def test_lightning_bf16_true_with_masters_clips():
    """bf16-true (bf16 params, no autocast, no plugin needed): ampfuse AdamW keeps fp32 masters
    and Lightning's clipping works on the bf16 gradients."""
    module = Module("ampfuse", torch.bfloat16)
    module.on_train_batch_end = lambda *a: None
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="bf16-true", gradient_clip_val=MAX_NORM,
                         accumulate_grad_batches=ACCUM, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    before = {k: v.clone() for k, v in module.net.state_dict().items()}
    trainer.fit(module, _loader())
    masters_of(module.net, trainer.optimizers[0])
    assert max_abs_diff(before, module.net.state_dict()) > 0


def test_lightning_bf16_mixed_clips_through_the_fused_pass():
    module = Module("ampfuse")
    module.on_train_batch_end = lambda *a: None
    ref = Module("torch")
    ref.on_train_batch_end = lambda *a: None
    for m, plugin in ((module, af_lightning.MixedPrecision("bf16-mixed", "cpu")), (ref, LightningAMP("bf16-mixed", "cpu"))):
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, plugins=[plugin], gradient_clip_val=MAX_NORM,
                   accumulate_grad_batches=ACCUM, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False).fit(m, _loader())
    for k, p in ref.net.state_dict().items():
        torch.testing.assert_close(module.net.state_dict()[k], p, atol=ATOL, rtol=RTOL)


class _GradProbe(pl.Callback):
    """For each optimizer step: the gradients after the backward that completes it (still scaled)
    with the scale they were scaled by, and the gradients ``on_before_optimizer_step`` sees."""

    def __init__(self) -> None:
        self.scaled: list[list[torch.Tensor]] = []
        self.scales: list[float] = []
        self.seen: list[list[torch.Tensor]] = []
        self._last: tuple[list[torch.Tensor], float] | None = None

    def on_after_backward(self, trainer, pl_module):
        self._last = ([p.grad.clone() for p in pl_module.parameters()], trainer.precision_plugin.scaler.get_scale())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        assert self._last is not None
        self.scaled.append(self._last[0])
        self.scales.append(self._last[1])
        self.seen.append([p.grad.clone() for p in pl_module.parameters()])

    def norms(self) -> list[float]:
        return [float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in gs]))) for gs in self.seen]


#: a first scale that overflows on the first step only, then grows every 2 clean steps and
#: overflows again: overflowed and clean steps within one epoch (with SCALER_KWARGS' 2**20 the
#: first four steps of an epoch overflow, and a probe over one epoch saw only inf/NaN)
PROBE_SCALER = dict(init_scale=2.0**15, growth_interval=2)


def test_lightning_on_before_optimizer_step_sees_unscaled_grads():
    """fp32 params: the hook sees what it sees with Lightning's own plugin and torch's scaler (the
    gradients unscaled in place), and the fused step does not divide by the scale again (a
    second division would change every clipped Adam step by about 1%, far outside ATOL)."""
    probes, nets = {}, {}
    for kind in ("ampfuse", "torch"):
        probes[kind] = probe = _GradProbe()
        module = Module(kind)
        module.on_train_batch_end = lambda *a: None
        _trainer(kind, 1, scaler_kwargs=PROBE_SCALER, callbacks=[probe]).fit(module, _loader())
        nets[kind] = module.net
    a, t = probes["ampfuse"].norms(), probes["torch"].norms()
    assert len(a) == len(t) == EPOCH // ACCUM
    finite = [math.isfinite(n) for n in t]
    assert any(finite) and not all(finite), t
    for na, nt, ok in zip(a, t, finite):
        assert math.isfinite(na) == ok
        if ok:
            assert na == pytest.approx(nt, rel=1e-6) and na < 1e3  # unscaled (the scale is >= 2**14 here)
    for k, p in nets["torch"].state_dict().items():
        torch.testing.assert_close(nets["ampfuse"].state_dict()[k], p, atol=ATOL, rtol=RTOL)


def test_lightning_on_before_optimizer_step_fp16_params():
    """fp16 params: the hook sees exactly ``(scaled.float() / scale).half()`` in ``.grad`` (the
    unscaled gradient rounded to fp16; inf/NaN on overflowed steps), while clipping and the step
    use the unscaled fp32 copies: the run equals the one without the hook (ATOL, RTOL: clipped by
    torch's clip_grad_norm_ on the copies instead of the fused norm pass)."""
    kw = dict(accumulate_grad_batches=1, epochs=1)
    probe = _GradProbe()
    hooked = fit("ampfuse", torch.float16, callbacks=[probe], scaler_kwargs=PROBE_SCALER, **kw)
    plain = fit("ampfuse", torch.float16, scaler_kwargs=PROBE_SCALER, **kw)
    assert len(probe.seen) == len(probe.scaled) == EPOCH
    finite = [all(bool(torch.isfinite(g).all()) for g in gs) for gs in probe.seen]
    assert any(finite) and not all(finite), finite
    for seen, scaled, scale in zip(probe.seen, probe.scaled, probe.scales):
        for g, s in zip(seen, scaled):
            assert g.dtype == s.dtype == torch.float16
            torch.testing.assert_close(g, (s.float() / scale).half(), atol=0, rtol=0, equal_nan=True)
    assert max(n for n, ok in zip(probe.norms(), finite) if ok) < 1e3  # unscaled (the scale is >= 2**14)
    assert [r["scale"] for r in hooked.records] == [r["scale"] for r in plain.records]
    mh = masters_of(hooked.net, hooked.trainer.optimizers[0])
    mp = masters_of(plain.net, plain.trainer.optimizers[0])
    for k in mp:
        torch.testing.assert_close(mh[k], mp[k], atol=ATOL, rtol=RTOL)


def test_lightning_alone_refuses_clipping_with_ampfuse_optimizers():
    """The failure the plugin fixes (kept as a regression: Lightning's own plugin refuses)."""
    module = Module("ampfuse")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, plugins=[LightningAMP("16-mixed", "cpu")],
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trainer.fit(module, _loader())


# ---- Fabric -------------------------------------------------------------------------------------


def fabric_run(kind: str, dtype=torch.float32, stop_at=None, save=None, load=None, value=False, accum=ACCUM,
               fp16_init=False):
    if kind == "ampfuse":
        plugin = af_fabric.MixedPrecision("16-mixed", "cpu", ampfuse.GradScaler("cpu", **SCALER_KWARGS))
    else:
        plugin = FabricAMP("16-mixed", "cpu", torch.amp.GradScaler("cpu", **SCALER_KWARGS))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_model(fp16_init=fp16_init).to(dtype)
    cls = ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW
    opt = cls(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(MICRO_BATCHES // accum))
    model, opt = fabric.setup(net, opt)
    state = {"model": model, "optimizer": opt, "sched": sched, "scaler": plugin.scaler}
    start = 0
    if load is not None:
        fabric.load(load, state)
        start = stop_at
    records = []
    data = make_data()
    for i in range(start, MICRO_BATCHES):
        x, y = data[i]
        step = (i + 1) % accum == 0
        with fabric.no_backward_sync(model, enabled=not step):
            fabric.backward(F.mse_loss(model(x.to(dtype)).float(), y))
        if step:
            if value:
                fabric.clip_gradients(model, opt, clip_val=0.01)
                norm = None
            else:
                norm = float(fabric.clip_gradients(model, opt, max_norm=MAX_NORM, error_if_nonfinite=False))
            opt.step()
            sched.step()
            opt.zero_grad()
            norm = norm if norm is None or math.isfinite(norm) else None  # nan != nan
            records.append(dict(lr=sched.get_last_lr()[0], scale=plugin.scaler.get_scale(), norm=norm))
        if save is not None and i + 1 == stop_at:
            fabric.save(save, state)
            break
    return net, opt, records


@pytest.fixture(scope="module")
def fabric_runs():
    return {"ampfuse": fabric_run("ampfuse"), "torch": fabric_run("torch")}


def test_fabric_same_skips_lr_and_params_as_torch(fabric_runs):
    (na, _, ra), (nt, _, rt) = fabric_runs["ampfuse"], fabric_runs["torch"]
    assert [r["scale"] for r in ra] == [r["scale"] for r in rt]
    assert [r["lr"] for r in ra] == [r["lr"] for r in rt]
    finite = [(a["norm"], t["norm"]) for a, t in zip(ra, rt) if t["norm"] is not None]
    assert finite and any(a > MAX_NORM for a, _ in finite)
    for a, t in finite:
        assert a == pytest.approx(t, rel=1e-6)
    for k, v in nt.state_dict().items():
        torch.testing.assert_close(na.state_dict()[k], v, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("value", [False, True], ids=["norm", "value"])
def test_fabric_fp16_params_with_masters(fabric_runs, value):
    """As the Lightning test above: against torch's path on fp32 params started from the weights
    rounded to fp16 (the same computation on this model), so the fp32 tolerance applies. fp16
    gradients are clipped on unscaled fp32 copies here, as torch clips the fp32 gradients. Without
    accumulation: fp16 params sum micro-batch gradients in fp16 (inf past 65504)."""
    n16, o16, r16 = fabric_run("ampfuse", torch.float16, value=value, accum=1)
    n32, _, r32 = fabric_run("torch", value=value, accum=1, fp16_init=True)
    assert [r["scale"] for r in r16] == [r["scale"] for r in r32]
    assert [r["lr"] for r in r16] == [r["lr"] for r in r32]
    masters = masters_of(n16, o16)  # fp32, and the params are the masters rounded
    for k, p in n32.named_parameters():
        torch.testing.assert_close(masters[k], p.detach(), atol=ATOL, rtol=RTOL)


def test_fabric_resume_equals_uninterrupted(fabric_runs, tmp_path):
    net_full, _, rec_full = fabric_runs["ampfuse"]
    fabric_run("ampfuse", stop_at=6, save=str(tmp_path / "ckpt"))
    net_res, _, rec_res = fabric_run("ampfuse", stop_at=6, load=str(tmp_path / "ckpt"))
    assert rec_res == rec_full[6 // ACCUM:]
    assert_bitwise(net_res.state_dict(), net_full.state_dict())


def test_fabric_alone_refuses_clipping_with_ampfuse_optimizers():
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricAMP("16-mixed", "cpu")])
    model, opt = fabric.setup(net := make_model(), ampfuse.optim.AdamW(net.parameters()))
    fabric.backward(model(torch.randn(2, 8)).float().sum())
    with pytest.raises(NotImplementedError, match="not implemented for optimizers handling the unscaling"):
        fabric.clip_gradients(model, opt, max_norm=1.0)


# ---- GradAccumulator inside a LightningModule (manual optimization) ------------------------------


class AccumModule(pl.LightningModule):
    """Manual optimization with ampfuse.GradAccumulator and its own ampfuse.GradScaler (Lightning's
    precision stays "32-true": the accumulator scales, unscales and steps)."""

    def __init__(self, raw: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = make_model()
        self.raw = raw

    def configure_optimizers(self):
        return ampfuse.optim.AdamW(self.parameters(), lr=LR)

    def on_train_start(self):
        opt = self.optimizers()
        self.acc = ampfuse.GradAccumulator(self, opt.optimizer if self.raw else opt,
                                           ampfuse.GradScaler("cpu", **SCALER_KWARGS), steps=ACCUM, max_grad_norm=MAX_NORM)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with self.acc.accumulate():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(self.net(x), y)
            self.acc.backward(loss)


def _accum_loop() -> torch.nn.Module:
    """The same accumulation outside Lightning."""
    model = make_model()
    opt = ampfuse.optim.AdamW(model.parameters(), lr=LR)
    acc = ampfuse.GradAccumulator(model, opt, ampfuse.GradScaler("cpu", **SCALER_KWARGS), steps=ACCUM, max_grad_norm=MAX_NORM)
    for x, y in make_data(EPOCH):
        with acc.accumulate():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            acc.backward(loss)
    return model


def test_grad_accumulator_in_lightning_module_counts_global_step():
    """With ``self.optimizers()`` (the LightningOptimizer) Lightning counts every window's step in
    ``global_step`` (skipped windows too, as with its own AMP plugin) and the training equals the
    same loop outside Lightning bit for bit."""
    module = AccumModule()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _loader())
    assert trainer.global_step == module.acc.windows == EPOCH // ACCUM
    assert_bitwise(module.net.state_dict(), _accum_loop().state_dict())


def test_grad_accumulator_refuses_the_raw_optimizer_of_a_lightning_module():
    """With the raw optimizer (``self.optimizers().optimizer``) Lightning would never see a step
    (``global_step`` stays 0, ``max_steps`` never ends the run): refused, naming what to pass."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match=r"self\.optimizers\(\)"):
        trainer.fit(AccumModule(raw=True), _loader())


# ---- manual optimization: clip_gradients and several optimizers under the plugin's scaler --------


class ManualModule(pl.LightningModule):
    """Manual optimization under the precision plugin: ``self.clip_gradients(opt, ...)`` before
    ``opt.step()`` on the ``LightningOptimizer`` wrappers; one optimizer, or one per layer."""

    def __init__(self, kind: str, two: bool = False, algorithm: str = "norm") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.kind, self.two, self.algorithm = kind, two, algorithm
        self.net = make_model()

    def configure_optimizers(self):
        cls = ampfuse.optim.AdamW if self.kind == "ampfuse" else torch.optim.AdamW
        if self.two:
            return [cls(self.net[0].parameters(), lr=LR), cls(self.net[2].parameters(), lr=LR)]
        return cls(self.parameters(), lr=LR)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        self.manual_backward(F.mse_loss(self.net(x).float(), y))
        for opt in opts:
            self.clip_gradients(opt, gradient_clip_val=MAX_NORM, gradient_clip_algorithm=self.algorithm)
            opt.step()
        for opt in opts:
            opt.zero_grad()


def _manual_fit(two: bool, algorithm: str = "norm") -> torch.nn.Module:
    module = ManualModule("ampfuse", two, algorithm)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, plugins=[_plugin("ampfuse")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _loader())
    return module.net


def _manual_torch_loop(two: bool, algorithm: str = "norm") -> torch.nn.Module:
    """The plain torch loop of the same steps: per optimizer ``unscale_``, torch's clip, ``step``,
    ``update`` (the plugin updates the scale after each optimizer's step)."""
    model = make_model()
    groups = [model[0].parameters(), model[2].parameters()] if two else [model.parameters()]
    opts = [torch.optim.AdamW(list(g), lr=LR) for g in groups]
    scaler = torch.amp.GradScaler("cpu", **SCALER_KWARGS)
    for x, y in make_data(EPOCH):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        for opt in opts:
            scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            if algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            else:
                torch.nn.utils.clip_grad_value_(params, MAX_NORM)
            scaler.step(opt)
            scaler.update()
        for opt in opts:
            opt.zero_grad()
    return model


@pytest.mark.parametrize("two", [False, True], ids=["one_optimizer", "two_optimizers"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_manual_optimization_clip_gradients_applies(two, algorithm):
    """``self.clip_gradients(opt, ...)`` on the ``LightningOptimizer`` before ``opt.step()`` clips
    the step that follows (the scaler's stage is the raw optimizer's), with one optimizer or two
    under the plugin's one scaler: the same training as the plain torch loop."""
    got, want = _manual_fit(two, algorithm).state_dict(), _manual_torch_loop(two, algorithm).state_dict()
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=RTOL, msg=lambda m, k=k: f"{k}: {m}")


class _HookModule(ManualModule):
    def on_before_optimizer_step(self, optimizer):
        pass


def test_lightning_manual_clip_before_step_with_a_hook_is_refused():
    """A clip before ``opt.step()`` keeps the gradients scaled, so an overriding
    ``on_before_optimizer_step`` would see them scaled: refused, saying where to clip instead."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, plugins=[_plugin("ampfuse")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="inside on_before_optimizer_step"):
        trainer.fit(_HookModule("ampfuse"), _loader())


class SubmoduleAccumModule(AccumModule):
    def on_train_start(self):
        self.acc = ampfuse.GradAccumulator(self.net, self.optimizers().optimizer,
                                           ampfuse.GradScaler("cpu", **SCALER_KWARGS), steps=ACCUM)


def test_grad_accumulator_refuses_the_raw_optimizer_with_a_submodule_as_model():
    """The raw optimizer is refused when the accumulator's model is a submodule (``self.net``) too."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match=r"self\.optimizers\(\)"):
        trainer.fit(SubmoduleAccumModule(), _loader())


class EarlyAccumModule(AccumModule):
    """The accumulator built in ``__init__`` from an optimizer made there (returned by
    ``configure_optimizers``), on the submodule: no Lightning run to look at yet."""

    def __init__(self) -> None:
        super().__init__()
        self.opt = ampfuse.optim.AdamW(self.net.parameters(), lr=LR)
        self.acc = ampfuse.GradAccumulator(self.net, self.opt, ampfuse.GradScaler("cpu", **SCALER_KWARGS), steps=ACCUM)

    def configure_optimizers(self):
        return self.opt

    def on_train_start(self):
        pass


def test_grad_accumulator_built_before_the_run_refuses_the_raw_optimizer_at_the_first_step():
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match=r"self\.optimizers\(\)"):
        trainer.fit(EarlyAccumModule(), _loader())


def _fabric_two_optimizers(kind: str, dtype=torch.float32):
    """Two optimizers (one per layer) under the plugin's one scaler, each clipped by
    ``fabric.clip_gradients`` and stepped in turn (the plugin updates the scale after each)."""
    if kind == "ampfuse":
        plugin = af_fabric.MixedPrecision("16-mixed", "cpu", ampfuse.GradScaler("cpu", **SCALER_KWARGS))
    else:
        plugin = FabricAMP("16-mixed", "cpu", torch.amp.GradScaler("cpu", **SCALER_KWARGS))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_model().to(dtype)
    cls = ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW
    model, o1, o2 = fabric.setup(net, cls(net[0].parameters(), lr=LR), cls(net[2].parameters(), lr=LR))
    scales = []
    for x, y in make_data(EPOCH):
        fabric.backward(F.mse_loss(model(x.to(dtype)).float(), y))
        for opt in (o1, o2):
            fabric.clip_gradients(model, opt, max_norm=MAX_NORM, error_if_nonfinite=False)
            opt.step()
            scales.append(plugin.scaler.get_scale())
        for opt in (o1, o2):
            opt.zero_grad()
    return net, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fabric_two_optimizers_under_one_scaler(dtype):
    """Per-optimizer stages and one update per optimizer step, as with Fabric's own plugin and
    torch's scaler: the same scale sequence, and with fp32 params the same params (fp16 params go
    through the plugin's fp32 gradient copies, one set per optimizer)."""
    net_a, scales_a = _fabric_two_optimizers("ampfuse", dtype)
    net_t, scales_t = _fabric_two_optimizers("torch")
    assert scales_a == scales_t and len(set(scales_a)) > 1
    if dtype == torch.float16:
        return
    sa, st = net_a.state_dict(), net_t.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], st[k], atol=ATOL, rtol=RTOL)
