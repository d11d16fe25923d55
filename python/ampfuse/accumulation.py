"""``ampfuse.GradAccumulator``: gradient accumulation that is correct under loss scaling.

The loss scale is constant inside a window of ``steps`` micro-batches; an overflow in any of them
skips the whole window, backs the scale off once and resets the buffers; fp16/bf16 gradients are
summed in fp32 by one fused pass per micro-batch that also checks the sums for inf/NaN; DDP and
FSDP2 synchronise once per window; an attached LR scheduler advances only on windows that
stepped; ``flush()`` steps an incomplete window with the right scale; ``backward(loss, count=n)``
weights each micro-batch by its count of items (e.g. non-padding tokens) and divides the window's
sum by the window's total count at the step, on the device; checkpoints resume bit for bit, inside a
window too. The whole contract: the manual's GradAccumulator page
(``docs/accumulator.md``).
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any, cast

import torch

from ampfuse import ops
from ampfuse._checks import engine_value
from ampfuse._library import dtensor_support
from ampfuse.grad_scaler import GradScaler as _AmpfuseScaler, ScalerHandOff
from ampfuse._transfer import host_to_device
from ampfuse.lr_scheduler import counts_taken_steps
from ampfuse.optim import FusedOptimizer, SourcedGrads, StepScaling

__all__ = ["GradAccumulator"]

_LOW = (torch.float16, torch.bfloat16)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor
        return False
    return isinstance(t, DTensor)


def _fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` made FSDP2 modules: the root, or only some
    layers (a valid layout: the layers' params are sharded all the same)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _framework_wrapper_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any | None:
    """The wrapper a training framework steps in place of ``optimizer``, when ``model`` says there
    is one; duck-typed, nothing is imported. Lightning: a LightningModule's ``optimizers()``
    returns ``LightningOptimizer`` wrappers (``.optimizer`` is the raw one), and Lightning counts
    ``global_step`` only from the wrapper's ``step()``."""
    get = getattr(model, "optimizers", None)
    if not callable(get) or not hasattr(model, "automatic_optimization"):
        return None
    try:
        wrapped = get()
    except Exception:  # not attached to a trainer, or not Lightning's optimizers()
        return None
    for w in wrapped if isinstance(wrapped, (list, tuple)) else [wrapped]:
        if w is not optimizer and getattr(w, "optimizer", None) is optimizer:
            return w
    return None


def _running_lightning_modules() -> Iterator[Any]:
    """The LightningModules whose methods are running on this thread (the ``self`` of each frame up
    the stack that is one), when Lightning is loaded (it is never imported here). They find a
    Lightning run when the accumulator's ``model`` is a submodule (``self.net``), which does not
    lead to its LightningModule."""
    modules = [m for m in (sys.modules.get("lightning.pytorch"), sys.modules.get("pytorch_lightning")) if m is not None]
    if not modules:
        return
    kinds = tuple(m.LightningModule for m in modules)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, kinds):
            yield obj
        frame = frame.f_back


def _refuse_raw_framework_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises when ``optimizer`` is the raw optimizer of a framework wrapper that must be stepped
    instead (``model`` itself, or a LightningModule running now, says so)."""
    for owner in (model, *_running_lightning_modules()):
        if _framework_wrapper_of(owner, optimizer) is not None:
            raise TypeError(
                "GradAccumulator got the raw optimizer of a LightningModule: pass self.optimizers() (the "
                "LightningOptimizer) instead of self.optimizers().optimizer, or Lightning never sees a step "
                "(global_step stays 0 and max_steps never ends the run)."
            )


def _engine_list(v: Any) -> Any:
    """A checkpoint's list of indices or flags as the engine's checks take it (a 1-d tensor: an
    empty list has no type to pass as); anything else as engine_value gives it."""
    if isinstance(v, (list, tuple)) and all(type(x) is int for x in v):
        return torch.tensor(v, dtype=torch.long)
    if isinstance(v, (list, tuple)) and all(type(x) is bool for x in v):
        return torch.tensor(v, dtype=torch.bool)
    return engine_value(v)


class GradAccumulator:
    """Accumulate ``steps`` micro-batches per optimizer step, correctly under loss scaling.

    Args:
        model: the module being trained (``DistributedDataParallel`` supported).
        optimizer: an ``ampfuse.optim`` optimizer (fused; reads the fp32 buffers directly) or any
            ``torch.optim.Optimizer`` (correct, not fused). Inside a LightningModule (manual
            optimization), ``self.optimizers()``: Lightning counts ``global_step`` from that
            wrapper's ``step()``; its raw ``.optimizer`` is refused (``TypeError``), whether
            ``model`` is the LightningModule or one of its submodules.
        scaler: an ``ampfuse.GradScaler`` or ``torch.amp.GradScaler``, or ``None`` (bf16/fp32).
        steps: micro-batches per optimizer step (>= 1).
        max_grad_norm: clip the global gradient norm at each step (``None``: no clipping).
        norm_type: norm for clipping (2 or inf are fused).
        lr_scheduler: advanced once per window that actually stepped.
        fp32_accumulation: accumulate fp16/bf16 gradients in fp32 buffers (default ``True``).
        fsdp_sync: under FSDP2, ``"window"`` (default: one reduce-scatter per window) or
            ``"micro_batch"`` (one per micro-batch; see the module docstring).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
        steps: int = 1,
        max_grad_norm: float | None = None,
        *,
        norm_type: float = 2.0,
        lr_scheduler: Any | None = None,
        fp32_accumulation: bool = True,
        fsdp_sync: str = "window",
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        _refuse_raw_framework_optimizer(model, optimizer)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler (ampfuse.GradScaler included) or None, got {type(scaler).__name__}.")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}.")
        if not (isinstance(norm_type, (int, float)) and (norm_type > 0 or norm_type == math.inf)):
            raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}.")
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler must have a step() method, got {type(lr_scheduler).__name__}.")
        if fsdp_sync not in ("window", "micro_batch"):
            raise ValueError(f"fsdp_sync must be 'window' or 'micro_batch', got {fsdp_sync!r}.")
        self.model = model
        self._ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self._fsdp_modules = _fsdp2_modules(model)
        self._fsdp = bool(self._fsdp_modules)
        self._fsdp_sync_window = self._fsdp and fsdp_sync == "window"
        self._group = getattr(model, "process_group", None) if self._ddp else None
        self.optimizer = optimizer
        self.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        self.steps = steps
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self.lr_scheduler = lr_scheduler
        self._fused_opt = isinstance(optimizer, FusedOptimizer)
        self._our_scaler = isinstance(self.scaler, _AmpfuseScaler)
        # The fused step reads the fp32 sums when nothing else has to read .grad first.
        self._step_reads_buffers = self._fused_opt and (self.scaler is None or self._our_scaler)
        # Whether the first window's end looked for a framework run (the accumulator may have been
        # built before the run started).
        self._framework_checked = False
        self.micro_step = 0  #: micro-batches in the current window
        self.windows = 0  #: windows completed (stepped or skipped)
        self.skipped_windows_host = 0  #: windows known (on the host) to have been skipped
        self.window_ended = False  #: True right after the micro-batch that closed a window
        self.last_window_skipped: torch.Tensor | None = None  #: device flag (> 0: skipped)
        self._in_context = False
        self._backward_called = False
        # Token weighting (backward's count): whether this window's micro-batches came with counts
        # (None: no micro-batch yet), and their sum so far (a device tensor).
        self._counting: bool | None = None
        self._count_total: torch.Tensor | None = None

        params = self._all_params()
        # The buffers, flags and micro-batch plan (engine/accumulator_window.h); the param groups
        # its plan was built for (each list and a copy of its entries).
        # per-param buffers for DTensor params (FSDP2 anywhere in the model, or tensor parallel):
        # a DTensor over each local shard, as the gradients are
        per_param = self._fsdp or any(_is_dtensor(p) for p in params)
        self._window = torch.classes.ampfuse.AccumulatorWindow(bool(fp32_accumulation), per_param)
        self._window.start(params)
        self._acc_plan_groups: list[tuple[list, list]] = []
        self._plan_ref: tuple[int, Any] = (0, None)  # the plan's id and its Python object
        self._unit_scale: dict[torch.device, torch.Tensor] = {}  # the clip pass's scale (no scaler)
        if self._ddp and len({p.device for p in params}) > 1:
            raise ValueError("GradAccumulator under DDP supports one device per process (as DDP recommends).")
        # The gradients handed to the fused step (one dict, updated every window).
        self._step_grads: Mapping[torch.Tensor, torch.Tensor | None] = {}

    # What the window holds, as Python values.
    @property
    def _low(self) -> list[torch.Tensor]:
        """The params summed in fp32 buffers."""
        return self._window.params()

    @property
    def _buffers(self) -> list[torch.Tensor]:
        return self._window.buffers()

    @property
    def _flat(self) -> dict[torch.device, torch.Tensor]:
        """One flat fp32 buffer per device (none under FSDP2: a buffer per param)."""
        return {torch.device(d): f for d, f in zip(self._window.device_names(), self._window.flats())}

    @property
    def _found_inf(self) -> dict[torch.device, torch.Tensor]:
        return {torch.device(d): f for d, f in zip(self._window.device_names(), self._window.found_infs())}

    @property
    def _has_grad(self) -> list[bool]:
        """Per buffered param, whether its buffer holds a gradient this window."""
        return list(self._window.flags())

    @_has_grad.setter
    def _has_grad(self, flags: list[bool]) -> None:
        self._window.set_flags([bool(f) for f in flags])

    @property
    def _acc_plan(self) -> Any:
        """The window's micro-batch plan (a StepPlan binds it as its gradients' source), or None:
        one Python object per plan, so that the optimizer's step plan knows it by identity."""
        plan_id = self._window.plan_id()
        if plan_id != self._plan_ref[0]:
            self._plan_ref = (plan_id, self._window.plan() if plan_id else None)
        return self._plan_ref[1]

    @_acc_plan.setter
    def _acc_plan(self, plan: None) -> None:
        if plan is not None:
            raise ValueError("GradAccumulator._acc_plan can only be dropped (set to None).")
        self._window.drop_plan()

    # ---- the loop ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self) -> Iterator[GradAccumulator]:
        """Context for one micro-batch. Under DDP, gradient synchronisation is suppressed on all
        but the window's last micro-batch (on all of them when fp32 buffers are used: those are
        all-reduced once, at the window end). At the end of a window the optimizer steps."""
        if self._in_context:
            raise RuntimeError("GradAccumulator.accumulate() contexts cannot be nested.")
        self.window_ended = False
        if self.micro_step == 0 and not (self._check_plan() and self._window.plan_says_same_layout()):
            self._window.start(self._all_params())  # a window starts: buffer what requires grad now
        last = self.micro_step == self.steps - 1
        sync = last and not self._low
        model: Any = self.model  # DDP's no_sync, FSDP2's set_requires_gradient_sync
        ctx = model.no_sync() if (self._ddp and not sync) else contextlib.nullcontext()
        for fsdp_module in self._fsdp_modules:  # (the root need not be one of them)
            cast(Any, fsdp_module).set_requires_gradient_sync(last or not self._fsdp_sync_window, recurse=False)
        self._in_context = True
        self._backward_called = False
        try:
            with ctx:
                yield self
        finally:
            self._in_context = False
        if not self._backward_called:
            raise RuntimeError("GradAccumulator.accumulate(): call acc.backward(loss) inside the context.")
        self._collect()
        self.micro_step += 1
        if self.micro_step >= self.steps:
            self._end_window(self.steps)

    def backward(self, loss: torch.Tensor, *, count: torch.Tensor | float | None = None, **kwargs: Any) -> None:
        """``loss`` times the loss scale and ``1/steps``, backpropagated.

        With ``count`` -- the number of items ``loss`` is the mean over, e.g. the micro-batch's
        non-padding tokens (a number, or a 1-element tensor: no host read) -- ``loss`` is weighted
        by ``count`` instead, and the window's gradient is divided at the step by the window's
        total count: the mean over every item of the window, not a mean of micro-batch means. The
        division is folded into the factor the step applies (``1/scale``). A window whose total is
        0 has no mean: it is skipped on the device as an overflowed one is (nothing written, the
        schedule not advanced, ``last_window_skipped`` set; with a scaler, the scale backs off). Give it at every micro-batch of a window or at none. Under
        DDP/FSDP2 the total is taken over the ranks.
        """
        if not self._in_context:
            raise RuntimeError("GradAccumulator.backward() must be called inside acc.accumulate().")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor, got {type(loss).__name__}.")
        counting = count is not None
        if self._counting is not None and counting != self._counting:
            raise ValueError(f"GradAccumulator.backward(): count must be given at every micro-batch of a window or at "
                             f"none; this window's earlier micro-batches were given {'one' if self._counting else 'none'}.")
        if counting:
            if isinstance(count, torch.Tensor):
                if count.numel() != 1 or count.is_complex() or count.dtype == torch.bool:
                    raise ValueError(f"count must be a number or a 1-element real tensor, got shape {tuple(count.shape)}, "
                                     f"{count.dtype}.")
            elif isinstance(count, bool) or not isinstance(count, (int, float)) or not math.isfinite(count) or count < 0:
                raise ValueError(f"count must be a non-negative finite number or a 1-element tensor, got {count!r}.")
            c = count.detach() if isinstance(count, torch.Tensor) else torch.tensor(float(count))
            c = c.reshape(()).to(torch.float32)
            if c.device != loss.device:  # from host memory without a wait (pinned, queued)
                c = host_to_device(c, loss.device) if c.device.type == "cpu" else c.to(loss.device)
            loss = loss * c
        else:
            loss = loss / self.steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)
        # the micro-batch's gradient arrived: only now does its count join the window's
        if counting:
            self._count_total = c.clone() if self._count_total is None else self._count_total + c
        self._counting = counting
        self._backward_called = True

    def flush(self) -> bool:
        """Step an incomplete window now (e.g. at the end of an epoch), scaling the update as the
        mean over the micro-batches it holds. Returns whether there was anything to step. Under
        DDP, only use it when every rank holds the same number of micro-batches."""
        self.window_ended = False
        if self.micro_step == 0:
            return False
        if self._fsdp_sync_window:
            raise RuntimeError(
                "GradAccumulator.flush() of an incomplete window under FSDP2 with fsdp_sync='window': the "
                "window's gradients are still unsharded inside FSDP2, which reduce-scatters them only in a "
                "backward. Use fsdp_sync='micro_batch' to flush incomplete windows, or end epochs on a window boundary."
            )
        if self._ddp and not self._low:
            # the last micro-batch ran under no_sync: synchronise the .grad sums now
            self._sync_ddp(flush=True)
        self._end_window(self.micro_step)
        return True

    # ---- internals ----------------------------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        """Every param of the optimizer, frozen ones included: a param frozen inside a window still
        holds that window's gradient (stepped once, at the window end, then cleared as torch's
        ``zero_grad()`` clears it)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _collect(self) -> None:
        """After a micro-batch's backward: fp16/bf16 grads into the fp32 buffers (one fused pass
        per device, checking the sums for inf/NaN on the way), then ``.grad = None``. In the
        steady state one native call (the window's plan, built by the first pass that went the
        validated way: anything it was not built for sends the pass that way again)."""
        if self._check_plan() and self._window.collect_planned():
            return
        dtensor_support()  # the validated pass reaches the ops with DTensors under FSDP2
        had = self._window.has_plan()
        allow = not (os.environ.get("AMPFUSE_STEP_PLAN", "1") == "0" or torch.compiler.is_compiling()
                     or torch._C._len_torch_dispatch_stack())
        self._window.collect(self._all_params(), allow)
        if not had and self._window.has_plan():
            self._acc_plan_groups = [(g["params"], list(g["params"])) for g in self.optimizer.param_groups]

    def _check_plan(self) -> bool:
        """Whether the window's plan still serves the optimizer's params (same lists, same
        entries) and this is an eager run; drops it otherwise."""
        if not self._window.has_plan():
            return False
        groups = self.optimizer.param_groups
        live = not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()) and len(groups) == len(self._acc_plan_groups)
        for (params, snapshot), group in zip(self._acc_plan_groups, groups) if live else ():
            p = group["params"]
            if p is not params or len(p) != len(snapshot) or not all(map(operator.is_, p, snapshot)):
                live = False
                break
        if not live:
            self._window.drop_plan()
        return live

    def _no_grads(self) -> bool:
        """Whether no param of the optimizer has a ``.grad``."""
        if self._check_plan():
            return self._window.plan_says_no_grads()
        return not any(p.grad is not None for p in self._all_params())

    def _window_grads(self) -> dict[torch.Tensor, torch.Tensor | None]:
        """The gradients the window's fused step reads: each buffered param's fp32 sum (None: it
        had no gradient this window, and is not stepped)."""
        w = self._window
        return {p: (b if h else None) for p, b, h in zip(w.params(), w.buffers(), w.flags())}

    def _sync_ddp(self, flush: bool = False) -> None:
        """The window's gradient exchange under DDP (every micro-batch ran under no_sync): the same
        collectives on every rank whatever gradients it holds. One all-reduce (MAX) of found_inf and
        of the has-gradient mask, then the averaged sums: the fp32 buffers (one all-reduce per
        device) and the other parameters' .grad in one bucket per (device, dtype)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        group = self._group
        world = dist.get_world_size(group)
        buffered = {id(p) for p in self._low}
        others = [p for p in self._all_params() if id(p) not in buffered]
        device = (self._low or others)[0].device if (self._low or others) else None
        if device is None:
            return
        fi = self._found_inf.get(device, torch.zeros((), dtype=torch.float32, device=device))
        low = self._low
        mask = torch.tensor([float(h) for h in self._has_grad] + [float(p.grad is not None) for p in others],
                            dtype=torch.float32).to(device, non_blocking=True)
        meta = torch.cat([fi.reshape(1), mask])
        dist.all_reduce(meta, op=dist.ReduceOp.MAX, group=group)
        fi.copy_(meta[0])
        agreed = meta[1:].tolist()  # the one host read of the window: which parameters are stepped
        self._has_grad = [bool(v) for v in agreed[: len(low)]]
        for flat in self._window.flats():
            dist.all_reduce(flat, group=group)
            flat.div_(world)
        buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for p, has in zip(others, agreed[len(low):]):
            if has:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                buckets[(p.device, p.dtype)].append(p)
            else:
                p.grad = None
        for ps in buckets.values():
            grads = [g for p in ps if (g := p.grad) is not None]  # every param of a bucket has one
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def _end_window(self, micro_batches: int) -> None:
        """Step (or skip) the window; whatever happens, the next window starts clean."""
        if not self._framework_checked:
            _refuse_raw_framework_optimizer(self.model, self.optimizer)
            self._framework_checked = True
        planned = self._check_plan()
        try:
            self._reduce_count()
            if planned and self._step_reads_buffers and not self._ddp and micro_batches == self.steps:
                # The steady state: the step plan reads the sums from the window's plan (the
                # mapping is built only if something goes the validated way).
                self._step_grads = SourcedGrads(self._acc_plan, self._window_grads)
            else:
                low = self._low
                buffered = {id(p) for p in low}
                with torch.no_grad():
                    if self._ddp and low:
                        # Every micro-batch ran under no_sync: one exchange, the same on every rank.
                        self._sync_ddp()
                    if micro_batches != self.steps and not self._counting:  # incomplete: the sums hold sum / steps
                        self._window.scale(self.steps / micro_batches)
                        for p in self._all_params():
                            if id(p) not in buffered and p.grad is not None:
                                p.grad.mul_(self.steps / micro_batches)
                    if low and not self._step_reads_buffers:
                        # The optimizer (or torch's scaler) reads .grad: hand it the sums, rounded once.
                        for p, g in self._window_grads().items():
                            p.grad = g.to(p.dtype) if g is not None else None
                self._step_grads = self._window_grads() if self._step_reads_buffers else {}
            self.last_window_skipped = self._step()
        except BaseException:
            if self.scaler is not None:  # a failed step must not leave this iteration half-recorded
                ScalerHandOff(self.scaler).forget_iteration()
            raise
        finally:
            # zero sums and flags, no .grad anywhere
            self._window.end(None if self._check_plan() else self._all_params())
            self._step_grads = {}
            self._counting, self._count_total = None, None
            self.micro_step = 0
            self.windows += 1
            self.window_ended = True

    def _reduce_count(self) -> None:
        """Under DDP/FSDP2 the window's sums are averaged over the ranks (DDP over its group,
        FSDP2 over its mesh): the window's divisor becomes the mean of the ranks' totals, summed
        over the same ranks (a tensor-parallel dim of the mesh holds equal counts, so summing and
        dividing over it too changes nothing). One small all-reduce per mesh dim."""
        total = self._count_total
        if not self._counting or total is None or not (self._ddp or self._fsdp):
            return
        import torch.distributed as dist

        with torch.no_grad():
            if self._ddp:
                dist.all_reduce(total, group=self._group)
                total.div_(dist.get_world_size(self._group))
                return
            mesh = next((p.device_mesh for p in self._all_params() if hasattr(p, "device_mesh")), None)
            if mesh is None:
                return
            for dim in range(mesh.ndim):
                dist.all_reduce(total, group=mesh.get_group(dim))
            total.div_(mesh.size())

    def _divisor(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What the window's sums are divided by at the step -- the window's total count, under
        backward's count; else None (the sums are already means) -- and the device flag of a
        window with no items (1.0 where the total is 0: its mean is undefined, and the window is
        skipped as an overflowed one is)."""
        if not self._counting or self._count_total is None:
            return None, None
        total = self._count_total
        empty = (total == 0).to(torch.float32)
        return torch.where(total > 0, total, torch.ones_like(total)), empty

    def _step(self) -> torch.Tensor | None:
        """unscale (+ clip), step, update; returns the device skip flag (None without a scaler)."""
        # torch's or ampfuse's: the calls only ampfuse's objects take are behind _fused_opt / _our_scaler
        opt: Any = self.optimizer
        scaler: Any = self.scaler
        grads = self._step_grads if self._step_reads_buffers else None
        divisor, empty = self._divisor()
        flag: torch.Tensor | None
        if scaler is None:
            flag = empty
            if divisor is not None and not self._fused_opt:
                # torch's optimizer reads .grad and cannot skip on the device: one host read of
                # the empty-window flag per window.
                assert empty is not None
                if empty.item() != 0.0:
                    if self.lr_scheduler is not None:
                        self.skipped_windows_host += 1
                    return flag
                with torch.no_grad():  # the window's mean in place
                    for g in (p.grad for p in self._params_with_grad()):
                        if g is not None:
                            g.div_(divisor.to(g.device, non_blocking=True))
                divisor = None
            scaling = StepScaling(grad_scale=divisor, found_inf=empty if self._fused_opt else None)
            if self.max_grad_norm is None:
                opt.step(grads=grads, scaling=scaling) if self._fused_opt else opt.step()
            elif self._fused_opt:
                opt.step(grads=grads, scaling=scaling._replace(clip_coef=self._clip_coef(grads, divisor)))
            else:
                torch.nn.utils.clip_grad_norm_(self._params_with_grad(), self.max_grad_norm, self.norm_type)
                opt.step()
        else:
            hand_off = ScalerHandOff(scaler)
            with hand_off.scale_multiplied(divisor):  # the scale the check and the step divide by
                self._unscale_and_step(opt, scaler, grads, empty)
            flag = hand_off.found_inf(opt)
            scaler.update()
        if self.lr_scheduler is not None:
            if counts_taken_steps(self.lr_scheduler):
                self.lr_scheduler.step()  # it counts only the windows that stepped, on the device
            # One host read per window (the flag of a step that has just been queued).
            elif flag is not None and flag.item() != 0.0:
                self.skipped_windows_host += 1
            else:
                self.lr_scheduler.step()
        return flag

    def _unscale_and_step(self, opt: Any, scaler: Any, grads: Any, empty: torch.Tensor | None) -> None:
        """The scaler's check (and clip) of the window's gradients, then its step; a window with
        no items (``empty`` non-zero) is skipped as an overflowed one."""
        if self.max_grad_norm is not None:
            if self._our_scaler:
                scaler.unscale_and_clip_(opt, self.max_grad_norm, self.norm_type, grads=grads)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self._params_with_grad(), self.max_grad_norm, self.norm_type)
        elif self._low and grads is not None and self._no_grads():
            # Every gradient the step reads is an fp32 sum the accumulation kernel already checked:
            # no check pass at the end of the window.
            scaler.record_inf_check(opt, dict(self._found_inf))
        elif empty is not None:
            # The check now (the one the step would run), so that the empty flag joins its result.
            if self._our_scaler and self._fused_opt:
                scaler.check_for_step(opt, grads=grads)
            else:
                scaler.unscale_(opt)
        if empty is not None:
            ScalerHandOff(scaler).add_found_inf(opt, empty)
        if grads is not None:
            scaler.step(opt, grads=grads)
        else:
            scaler.step(opt)

    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for p in self._all_params() if p.grad is not None]

    def _clip_coef(self, grads: Mapping | None, divisor: torch.Tensor | None = None) -> torch.Tensor | None:
        """The clip coefficient of the gradients the fused step reads (no scaler: unscaled; divided
        by ``divisor`` when given)."""
        opt: Any = self.optimizer  # an ampfuse optimizer: only the fused step asks for a coefficient
        assert self.max_grad_norm is not None
        if self.norm_type not in (2.0, math.inf):  # torch's norm (the fused check has 2 and inf)
            tensors = [g for g in (grads.get(p, p.grad) if grads is not None else p.grad for p in self._all_params())
                       if g is not None]
            if not tensors:
                return None
            with torch.no_grad():
                total = torch.nn.utils.get_total_norm(tensors, self.norm_type)
                if divisor is not None:
                    total = total / divisor.to(total.device, non_blocking=True)
            return ops.clip_coef(total, float(self.max_grad_norm))
        device = self._low[0].device if self._low else None
        if device is not None and grads is not None:
            one = self._unit_scale.get(device)
            if one is None:
                self._unit_scale[device] = one = torch.ones((), device=device)
            scale = one if divisor is None else divisor.to(device, non_blocking=True)
            out = opt.scaler_check(scale, norm_type=self.norm_type, max_norm=float(self.max_grad_norm), grads=grads)
            if out is not None and len(out) == 3:  # one device: its clip coefficient
                return out[2]
        tensors = [g for g in (grads.get(p, p.grad) if grads is not None else p.grad for p in self._all_params()) if g is not None]
        if not tensors:
            return None
        device = tensors[0].device
        with torch.no_grad():
            scale = torch.ones(1, device=device) if divisor is None else divisor.to(device, non_blocking=True).reshape(1)
            _, coef = ops.check_norm_(tensors, torch.zeros(1, device=device), norm_type=self.norm_type,
                                      max_norm=float(self.max_grad_norm), scale=scale)
        return coef

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, *, per_rank: bool = False) -> dict[str, Any]:
        """Counters plus the optimizer's, scaler's and scheduler's state, and, when taken inside a
        window, the partial sums: the fp32 buffers and the ``.grad`` of the other parameters.

        Under DDP/FSDP2 the partial sums are per rank: inside a window this raises unless
        ``per_rank=True`` (then save each rank's dict separately)."""
        sd: dict[str, Any] = {
            "steps": self.steps,
            "micro_step": self.micro_step,
            "windows": self.windows,
            "skipped_windows_host": self.skipped_windows_host,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
        }
        if self.micro_step != 0 and (self._ddp or self._fsdp) and not per_rank:
            raise RuntimeError(
                "GradAccumulator.state_dict() inside a window under DDP/FSDP2: the partial sums differ per "
                "rank, and a distributed checkpoint would treat them as replicated (every rank would load "
                "rank 0's). Save at a window boundary (acc.micro_step == 0), or pass per_rank=True and save "
                "each rank's state dict itself (e.g. torch.save to a per-rank file)."
            )
        if self.micro_step != 0 and self._fsdp:
            raise RuntimeError(
                "GradAccumulator.state_dict() inside a window under FSDP2: part of the window's gradients "
                "lives inside FSDP2 (unsharded, not yet reduce-scattered) and cannot be saved. Save at a "
                "window boundary (acc.micro_step == 0)."
            )
        if self.micro_step != 0:
            w, params = self._window, self._all_params()
            sd["buffers"] = {d: f.clone() for d, f in zip(w.device_names(), w.flats())}
            sd["found_inf"] = {d: f.clone() for d, f in zip(w.device_names(), w.found_infs())}
            sd["has_grad"] = list(w.flags())
            sd["buffered"] = w.indices_of_buffered(params)  # which params the buffers hold
            buffered = {id(p) for p in w.params()}
            sd["grads"] = {i: p.grad.detach().clone() for i, p in enumerate(params)
                           if id(p) not in buffered and p.grad is not None}
            # backward's counts: the window's total so far (None: micro-batches without counts)
            total = self._count_total
            sd["count_total"] = total.detach().clone() if self._counting and total is not None else None
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`. Everything the accumulator and an ampfuse scaler hold is
        checked before anything (optimizer, scaler, scheduler, sums) is loaded."""
        for key in ("steps", "micro_step", "windows", "optimizer"):
            if key not in state_dict:
                raise KeyError(f"GradAccumulator state dict has no '{key}' entry.")
        micro, windows, skipped = torch.ops.ampfuse.accumulator_counters_check(
            {k: engine_value(state_dict[k]) for k in ("steps", "micro_step", "windows", "skipped_windows_host")
             if k in state_dict},
            self.steps, "state_dict", "the state dict's {}")
        sched = state_dict.get("lr_scheduler")
        if self.lr_scheduler is not None and sched is not None and not isinstance(sched, Mapping):
            raise ValueError(f"the state dict's lr_scheduler must be a scheduler's state dict (a dict) or None, got {type(sched).__name__}.")
        params = self._all_params()
        if micro != 0:
            if self._fsdp:
                raise ValueError("a mid-window GradAccumulator state cannot be loaded under FSDP2; load one saved at a window boundary.")
            grads = state_dict.get("grads") or {}
            bad = [k for k in (grads if isinstance(grads, Mapping) else [repr(grads)]) if not isinstance(k, int) or isinstance(k, bool)]
            if bad:
                raise ValueError(f"the state dict's grads entry must map parameter indices to tensors, got the key {bad[0]!r}.")

            def entries(key: str) -> dict[str, Any]:
                d = state_dict.get(key)
                return {k: engine_value(v) for k, v in d.items() if isinstance(k, str)} if isinstance(d, Mapping) else {}

            self._window.check_checkpoint(
                params, _engine_list(state_dict.get("buffered")), entries("buffers"), entries("found_inf"),
                _engine_list(state_dict.get("has_grad")), {k: engine_value(v) for k, v in grads.items()},
                "the state dict's {} entry", True)
        if micro != 0:  # the partial sums are in the units of the loss scale they were taken under
            torch.ops.ampfuse.accumulator_sums_scale_check(
                bool(state_dict.get("scaler")), self.scaler is not None and bool(self.scaler.is_enabled()),
                "the state dict")
        count_total = state_dict.get("count_total") if micro != 0 else None
        if count_total is not None and not (isinstance(count_total, torch.Tensor) and count_total.numel() == 1
                                            and count_total.is_floating_point()):
            raise ValueError(f"the state dict's count_total must be a 1-element floating-point tensor or None, got "
                             f"{count_total!r}.")
        if self._our_scaler and state_dict.get("scaler"):
            cast(_AmpfuseScaler, self.scaler)._validate_state_dict(state_dict["scaler"])
        # apply
        # the schedule's state is checked by loading it (a refused one changes nothing), so first
        if self.lr_scheduler is not None and state_dict.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        self.micro_step = micro
        self.windows = windows
        self.skipped_windows_host = skipped
        self._counting = (count_total is not None) if micro != 0 else None
        device = params[0].device if params else torch.device("cpu")
        self._count_total = count_total.detach().reshape(()).to(device, torch.float32) if count_total is not None else None
        self._window.load(params, micro != 0)
        self.window_ended = False
