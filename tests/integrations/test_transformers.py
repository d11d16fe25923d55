"""ampfuse.integrations.transformers: the transformers Trainer on CPU with fp16 (autocast and
loss scaling made real by enable), a scale that overflows on some steps, gradient accumulation,
max_grad_norm clipping that bites and the linear LR schedule; ampfuse's scaler + AdamW against
torch's scaler + AdamW; fp16 params with masters; resume_from_checkpoint; and the Trainer's
silent failure (the LR advancing on skipped steps) as a regression."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from accelerate.state import AcceleratorState  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import ampfuse  # noqa: E402
from ampfuse.integrations import transformers as af_transformers  # noqa: E402

import ampfuse.lr_scheduler  # noqa: E402
from conftest import HostReads  # noqa: E402
from integ_helpers import (  # noqa: E402
    ACCUM, ATOL, LR, MAX_NORM, MICRO_BATCHES, RTOL, SCALER_KWARGS, count_flag_reads, make_data, make_model, masters_of,
)

STEPS = MICRO_BATCHES // ACCUM


class LossModel(nn.Module):
    """A plain module returning the loss dict the Trainer accepts."""

    def __init__(self, dtype, fp16_init: bool = False) -> None:
        super().__init__()
        self.net = make_model(fp16_init=fp16_init).to(dtype)
        self.dtype_ = dtype

    def forward(self, x, labels):
        return {"loss": F.mse_loss(self.net(x.to(self.dtype_)).float(), labels)}


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.trainer = None

    def on_step_end(self, args, state, control, lr_scheduler=None, **kw):
        acc = self.trainer.accelerator
        # an ampfuse optimizer's flag is kept on the device and read after the run (here, not to
        # add reads to the Trainer's own)
        flag = getattr(self.trainer.optimizer, "last_step_skipped", None)
        skipped = flag.clone() if flag is not None else acc.optimizer_step_was_skipped
        self.records.append(dict(skipped=skipped, lr=lr_scheduler.get_last_lr()[0], scale=acc.scaler.get_scale()))


def _dataset():
    return [{"x": x, "labels": y} for x, y in make_data(MICRO_BATCHES, batch=1)]


def train(kind: str, out_dir, dtype=torch.float32, resume=None, enable=True, fp16_init=False, logging_steps=1,
          schedule="linear", schedule_kwargs=None):
    AcceleratorState._reset_state(reset_partial_state=True)
    model = LossModel(dtype, fp16_init)
    cls = ampfuse.optim.AdamW if kind == "ampfuse" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=LR, weight_decay=0.0)
    args = TrainingArguments(output_dir=str(out_dir), use_cpu=True, fp16=True, per_device_train_batch_size=1,
                             gradient_accumulation_steps=ACCUM, max_grad_norm=MAX_NORM, max_steps=STEPS,
                             learning_rate=LR, lr_scheduler_type=schedule, lr_scheduler_kwargs=schedule_kwargs or {},
                             warmup_steps=0, report_to=[],
                             save_strategy="steps", save_steps=STEPS // 2, logging_steps=logging_steps, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    rec = Recorder()
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(), optimizers=(opt, None), callbacks=[rec])
    rec.trainer = trainer
    if kind == "ampfuse" and enable:
        af_transformers.enable(trainer, **SCALER_KWARGS)
    elif kind == "torch" or not enable:
        # what the Trainer gets from Accelerate for fp16 on a GPU (on a CPU: fp32, silently), by hand
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", **SCALER_KWARGS)
        trainer.accelerator.native_amp = True
    trainer.train(resume_from_checkpoint=resume)
    for r in rec.records:
        if isinstance(r["skipped"], torch.Tensor):
            r["skipped"] = bool(r["skipped"].item() != 0)
    return model, trainer, rec.records


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with count_flag_reads() as reads:
        out = {"ampfuse": train("ampfuse", tmp_path_factory.mktemp("ampfuse"))}
    out["torch"] = train("torch", tmp_path_factory.mktemp("torch"))
    out["flag_reads"] = reads
    return out


def test_the_trainer_is_told_the_truth_about_each_skip(runs):
    """The Trainer's linear schedule becomes its device twin. The Trainer itself asks after every
    step whether it was skipped (``accelerator.optimizer_step_was_skipped``, to decide whether to
    step its schedule): the answer is the step's own flag, read once per step (8 reads of 8 flags),
    and equals what torch's scaler reports for the same steps."""
    _, trainer, records = runs["ampfuse"]
    assert isinstance(trainer.lr_scheduler, ampfuse.lr_scheduler.LambdaLR)
    reads = runs["flag_reads"]
    assert len(reads.flags) == STEPS and len(reads.reads) == STEPS
    assert [r["skipped"] for r in records] == [r["skipped"] for r in runs["torch"][2]]


def test_same_skips_lr_and_params_as_torch(runs):
    (ma, _, ra), (mt, _, rt) = runs["ampfuse"], runs["torch"]
    skipped = [r["skipped"] for r in ra]
    assert skipped == [r["skipped"] for r in rt]
    assert any(skipped) and not all(skipped), skipped
    assert [r["lr"] for r in ra] == [r["lr"] for r in rt]
    assert [r["scale"] for r in ra] == [r["scale"] for r in rt]
    # the linear schedule advanced once per step taken
    assert ra[-1]["lr"] == pytest.approx(LR * (1 - sum(not s for s in skipped) / STEPS))
    for k, v in mt.state_dict().items():
        torch.testing.assert_close(ma.state_dict()[k], v, atol=ATOL, rtol=RTOL)


def test_a_schedule_with_its_own_arguments_keeps_them(tmp_path):
    """``cosine_with_min_lr`` with ``min_lr_rate``: the device schedule is transformers' own, built
    by the Trainer (its arguments kept): the Trainer's learning rates with torch's scaler."""
    kw = dict(schedule="cosine_with_min_lr", schedule_kwargs={"min_lr_rate": 0.1})
    _, trainer, ours = train("ampfuse", tmp_path / "ampfuse", **kw)
    _, _, ref = train("torch", tmp_path / "torch", **kw)
    assert isinstance(trainer.lr_scheduler, ampfuse.lr_scheduler.LambdaLR)
    assert [r["lr"] for r in ours] == [r["lr"] for r in ref]
    assert min(r["lr"] for r in ours) >= 0.1 * LR * (1 - 1e-12)


def test_the_trainer_reads_the_learning_rate_only_when_it_logs(tmp_path):
    """With logging every 4 steps, the learning rate is read on the host at the 2 logs of the 8
    steps only (kept on the device in between), and the logged values are those the Trainer logs
    with torch's schedule: each logged step's learning rate before its schedule step."""
    made: list[torch.Tensor] = []
    copies = ampfuse.lr_scheduler.LRScheduler.last_lr_tensors

    def recording(self):
        out = copies(self)
        made.extend(out)
        return out

    with mock.patch.object(ampfuse.lr_scheduler.LRScheduler, "last_lr_tensors", recording):
        with HostReads(ignore=lambda t: not any(t is m for m in made)) as reads:
            _, ours, _ = train("ampfuse", tmp_path / "ours", logging_steps=4)
    _, theirs, _ = train("torch", tmp_path / "torch", logging_steps=4)
    assert len(made) == STEPS and len(reads.reads) == 2
    logged = [[e["learning_rate"] for e in t.state.log_history if "learning_rate" in e] for t in (ours, theirs)]
    assert len(logged[0]) == 2 and logged[0] == pytest.approx(logged[1], rel=1e-6)


def test_fp16_params_with_masters(runs, tmp_path):
    """fp16 params + fp32 masters against torch's scaler + AdamW on fp32 params started from the
    same weights rounded to fp16 (``fp16_init``; from unrounded weights the runs differ by that
    rounding, up to 2.9e-4). Not the same computation here: with accumulation 2 the fp16 params
    sum the two micro-batch gradients in fp16 (relative rounding <= 2**-11 per element, per step),
    where fp32 params sum in fp32. Through Adam's m / sqrt(v) that moves each update by at most
    about 2 * 2**-11 of lr (1e-5), so 8 steps stay within 8e-5 (the tolerance); measured 3.7e-6.
    (The exact comparison, with torch's fp16-with-masters path by hand, is in test_accelerate.py
    and test_plain_loop.py.)"""
    m16, trainer, r16 = train("ampfuse", tmp_path / "fp16", dtype=torch.float16)
    ref, _, rref = train("torch", tmp_path / "ref", fp16_init=True)
    assert r16 == rref == runs["ampfuse"][2]
    masters = masters_of(m16, trainer.optimizer)  # fp32, and the params are the masters rounded
    for k, p in ref.named_parameters():
        torch.testing.assert_close(masters[k], p.detach(), atol=8e-5, rtol=0)


def test_resume_from_checkpoint_equals_uninterrupted(runs, tmp_path):
    m_full, trainer_full, r_full = runs["ampfuse"]
    ckpt = f"{trainer_full.args.output_dir}/checkpoint-{STEPS // 2}"
    m_res, _, r_res = train("ampfuse", tmp_path, resume=ckpt)
    assert r_res == r_full[STEPS // 2:]
    for k, v in m_full.state_dict().items():
        torch.testing.assert_close(m_res.state_dict()[k], v, atol=0, rtol=0)


def test_trainer_alone_advances_the_lr_on_skipped_steps(tmp_path):
    """The Trainer's silent failure without the integration (kept as a regression): with an ampfuse
    optimizer and a plain scaler, optimizer_step_was_skipped is never true."""
    _, _, records = train("ampfuse", tmp_path, enable=False)
    assert not any(r["skipped"] for r in records)
    assert records[-1]["lr"] == pytest.approx(0.0)
