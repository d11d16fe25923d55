"""``ampfuse.GradAccumulator``: gradient accumulation that is correct under loss scaling.

Replaces the hand-written loop::

    for i, (x, y) in enumerate(loader):
        with autocast():
            loss = loss_fn(model(x), y) / accum_steps
        scaler.scale(loss).backward()                 # DDP all-reduces on every micro-batch
        if (i + 1) % accum_steps == 0:
            scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scheduler.step()                          # advances even when the step was skipped
    # a last incomplete window is silently dropped (or stepped with a wrong 1/accum_steps)

with::

    acc = ampfuse.GradAccumulator(model, optimizer, scaler, steps=accum_steps, max_grad_norm=max_norm,
                                  lr_scheduler=scheduler)
    for x, y in loader:
        with acc.accumulate():
            with autocast():
                loss = loss_fn(model(x), y)
            acc.backward(loss)
    acc.flush()   # end of epoch: steps an incomplete window with the right scale

What it guarantees: the loss scale is constant inside a window (``update`` only at window ends);
an overflow in any micro-batch skips the whole window, backs the scale off once and resets the
buffers; DDP synchronises once per window; an attached LR scheduler advances only on windows that
stepped; fp16/bf16 gradients are summed in fp32; a parameter that got no gradient in a window is
not stepped.

FP32 accumulation: for fp16/bf16 parameters, after each micro-batch's backward one fused kernel
(``ampfuse.ops.accumulate_grads_``) adds the gradients into fp32 buffers and checks the sums for
inf/NaN in the same pass; ``.grad`` is then set to ``None``. With an ampfuse optimizer driven by
``ampfuse.GradScaler`` (or no scaler) the fused step reads those buffers directly, handed to it
explicitly for the window's step (``optimizer.step(grads=...)``); with ``torch.amp.GradScaler``
or another optimizer, which read ``.grad``, the sums are written into ``.grad`` (rounded once)
at the window's end. fp32 parameters accumulate in ``.grad`` as torch does.

Distributed training (torch.distributed):

* **DDP**: every micro-batch runs under ``no_sync``; at the window's end the ranks exchange, on
  DDP's own process group and with the same list of collectives on every rank: one all-reduce
  (MAX) of the found_inf flag and of which parameters got a gradient (one host read of that mask
  per window), then one all-reduce per device of the fp32 sums and one per (device, dtype) bucket
  of the other parameters' ``.grad`` (zeros where a rank has none). A parameter that got a
  gradient on any rank is stepped on every rank with the averaged sum; one that got none anywhere
  is not stepped.
* **FSDP2** (``fully_shard``): gradients are synchronised once per window --
  ``set_requires_gradient_sync`` is off for all but the window's last micro-batch, FSDP2
  accumulates the unsharded gradients meanwhile (in fp32 when its ``MixedPrecisionPolicy`` has
  ``reduce_dtype=torch.float32``, which is recommended), and its reduce-scatter of the last
  micro-batch hands the window's sum to the fp32 buffers, which are shaped like each rank's
  local shard (DTensors). ``fsdp_sync="micro_batch"`` instead reduce-scatters after every
  micro-batch and sums the local shards in fp32 (more communication; allows ``flush()`` of an
  incomplete window, which the once-per-window mode refuses: FSDP2 reduces only in a backward).
  found_inf and the clip norm are agreed across ranks by the ops themselves (``ampfuse.distributed``).
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ampfuse import ops
from ampfuse.grad_scaler import GradScaler as _AmpfuseScaler, _fresh_optimizer_state
from ampfuse.optim import StepScaling, _FusedOptimizer, _SourcedGrads

__all__ = ["GradAccumulator"]

_LOW = (torch.float16, torch.bfloat16)


def _is_fsdp2(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


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
    frame = sys._getframe(1)
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
        self._fsdp = _is_fsdp2(model)
        self._fsdp_sync_window = self._fsdp and fsdp_sync == "window"
        self._group = getattr(model, "process_group", None) if self._ddp else None
        self.optimizer = optimizer
        self.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        self.steps = steps
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self.lr_scheduler = lr_scheduler
        self._fused_opt = isinstance(optimizer, _FusedOptimizer)
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

        params = self._all_params()
        self._fp32_accumulation = fp32_accumulation
        self._low: list[torch.Tensor] = []
        self._flat: dict[torch.device, torch.Tensor] = {}
        self._buffers: list[torch.Tensor] = []
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        # Per buffered param, whether its buffer holds a gradient this window (while a native
        # plan runs the micro-batches it holds them: see the _has_grad property).
        self._flags: list[bool] = []
        # The native plan of the micro-batch pass (torch.classes.ampfuse.AccumulatePlan), the
        # param groups it was built for (each list and a copy of its entries), and the params it
        # does not buffer or watch (not fp16/bf16: their .grad sums itself).
        self._plan: Any = None
        self._acc_plan_groups: list[tuple[list, list]] = []
        self._acc_free: list[torch.Tensor] = []
        self._unit_scale: dict[torch.device, torch.Tensor] = {}  # the clip pass's scale (no scaler)
        self._layout(self._wanted_low())
        if self._ddp and len({p.device for p in params}) > 1:
            raise ValueError("GradAccumulator under DDP supports one device per process (as DDP recommends).")
        # The gradients handed to the fused step (one dict, updated every window).
        self._step_grads: Mapping[torch.Tensor, torch.Tensor | None] = {}

    @property
    def _acc_plan(self) -> Any:
        return self._plan

    @_acc_plan.setter
    def _acc_plan(self, plan: Any) -> None:
        """A plan keeps the window's flags while it runs: they move into it and back out."""
        if self._plan is not None:
            self._flags = list(self._plan.has_grad())
        if plan is not None:
            plan.set_has_grad(self._flags)
        self._plan = plan

    @property
    def _has_grad(self) -> list[bool]:
        """Per buffered param, whether its buffer holds a gradient this window (a copy while a
        plan holds them)."""
        return list(self._plan.has_grad()) if self._plan is not None else self._flags

    @_has_grad.setter
    def _has_grad(self, flags: list[bool]) -> None:
        self._flags = list(flags)
        if self._plan is not None:
            self._plan.set_has_grad(self._flags)

    # ---- the loop ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self) -> Iterator[GradAccumulator]:
        """Context for one micro-batch. Under DDP, gradient synchronisation is suppressed on all
        but the window's last micro-batch (on all of them when fp32 buffers are used: those are
        all-reduced once, at the window end). At the end of a window the optimizer steps."""
        if self._in_context:
            raise RuntimeError("GradAccumulator.accumulate() contexts cannot be nested.")
        self.window_ended = False
        if self.micro_step == 0 and not self._same_layout():
            self._layout(self._wanted_low())  # a window starts: buffer the params that require grad now
        last = self.micro_step == self.steps - 1
        sync = last and not self._low
        ctx = self.model.no_sync() if (self._ddp and not sync) else contextlib.nullcontext()
        if self._fsdp:
            self.model.set_requires_gradient_sync(last or not self._fsdp_sync_window)
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

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss`` times the loss scale and ``1/steps``, backpropagated."""
        if not self._in_context:
            raise RuntimeError("GradAccumulator.backward() must be called inside acc.accumulate().")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor, got {type(loss).__name__}.")
        loss = loss / self.steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)
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

    def _wanted_low(self) -> list[torch.Tensor]:
        """The params summed in fp32 buffers: the fp16/bf16 ones that require grad now."""
        if not self._fp32_accumulation:
            return []
        return [p for p in self._all_params() if p.dtype in _LOW and p.requires_grad]

    def _layout(self, low: list[torch.Tensor]) -> None:
        """(Re)builds the fp32 buffers for ``low``, keeping the partial sums and has-gradient flags
        of the params it keeps. Which params are buffered is decided again at every window start
        (a layer unfrozen later is summed in fp32 too; a frozen one gives its buffer back) and
        widened inside a window when a param without a buffer gets a gradient."""
        if [id(p) for p in low] == [id(p) for p in self._low]:
            return
        self._acc_plan = None  # its flags come back into self._has_grad
        old = {id(p): (b, h) for p, b, h in zip(self._low, self._buffers, self._has_grad)}
        flat_by_device: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            if self._fsdp:
                # one fp32 buffer per parameter, sharded like it (a DTensor over the local shard)
                buffers = [old[id(p)][0] if id(p) in old else torch.zeros_like(p, dtype=torch.float32) for p in low]
            else:
                by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
                for p in low:
                    by_device[p.device].append(p)
                views: dict[int, torch.Tensor] = {}
                for device, ps in by_device.items():
                    flat = torch.zeros(sum(p.numel() for p in ps), dtype=torch.float32, device=device)
                    flat_by_device[device] = flat
                    offset = 0
                    for p in ps:
                        views[id(p)] = v = flat[offset : offset + p.numel()].view(p.shape)
                        if id(p) in old:
                            v.copy_(old[id(p)][0])
                        offset += p.numel()
                buffers = [views[id(p)] for p in low]
        for p in low:
            if p.device not in self._found_inf:
                self._found_inf[p.device] = torch.zeros((), dtype=torch.float32, device=p.device)
        self._has_grad = [old[id(p)][1] if id(p) in old else False for p in low]
        self._low, self._buffers, self._flat = list(low), buffers, flat_by_device

    def _collect(self) -> None:
        """After a micro-batch's backward: fp16/bf16 grads into the fp32 buffers (one fused pass
        per device, checking the sums for inf/NaN on the way), then ``.grad = None``.

        In the steady state this is one native call (the accumulator's plan, built by the first
        pass that went the validated way): it checks every gradient itself, and anything it was
        not built for (a gradient on a param it does not buffer, an odd layout, a sparse
        gradient) sends the pass the validated way below, which names the problem or rebuilds
        the plan."""
        plan = self._acc_plan
        if plan is not None and self._acc_plan_live() and plan.collect():
            return
        self._acc_plan = None
        self._collect_validated()
        self._acc_plan = self._build_acc_plan()

    def _same_layout(self) -> bool:
        """Whether the params buffered now are those :meth:`_wanted_low` would choose, told by
        the live plan (no Python per param); False without one."""
        plan = self._acc_plan
        return plan is not None and self._acc_plan_live() and plan.same_layout()

    def _no_grads(self) -> bool:
        """Whether no param of the optimizer has a ``.grad``."""
        plan = self._acc_plan
        if plan is not None and self._acc_plan_live():
            return plan.no_grads() and all(p.grad is None for p in self._acc_free)
        return not any(p.grad is not None for p in self._all_params())

    def _window_grads(self) -> dict[torch.Tensor, torch.Tensor | None]:
        """The gradients the window's fused step reads: each buffered param's fp32 sum (None: it
        had no gradient this window, and is not stepped)."""
        return {p: (b if h else None) for p, b, h in zip(self._low, self._buffers, self._has_grad)}

    def _acc_plan_live(self) -> bool:
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return False
        groups = self.optimizer.param_groups
        if len(groups) != len(self._acc_plan_groups):
            return False
        for (params, snapshot), group in zip(self._acc_plan_groups, groups):
            p = group["params"]
            if p is not params or len(p) != len(snapshot) or not all(map(operator.is_, p, snapshot)):
                return False
        return True

    def _build_acc_plan(self) -> Any:
        """The native plan of the micro-batch pass, for plain tensors on one device."""
        if (not self._low or self._fsdp or os.environ.get("AMPFUSE_STEP_PLAN", "1") == "0"
                or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()):
            return None
        device = self._low[0].device
        python_key = torch._C.DispatchKey.Python
        for p in self._low:
            if p.device != device or torch._C._dispatch_keys(p).has(python_key):
                return None
        buffered = {id(p) for p in self._low}
        plan = torch.classes.ampfuse.AccumulatePlan()
        plan.add(self._low, self._buffers, self._found_inf[device])
        watched = [p for p in self._all_params() if p.dtype in _LOW and id(p) not in buffered]
        if watched:
            plan.add_watched(watched)
        self._acc_free = [p for p in self._all_params() if p.dtype not in _LOW]
        if self._acc_free:
            plan.add_free(self._acc_free)
        plan.finalize()
        self._acc_plan_groups = [(g["params"], list(g["params"])) for g in self.optimizer.param_groups]
        return plan

    def _collect_validated(self) -> None:
        if self._fp32_accumulation:
            buffered = {id(p) for p in self._low}
            extra = [p for p in self._all_params() if p.dtype in _LOW and p.grad is not None and id(p) not in buffered]
            if extra:  # unfrozen inside the window: summed in fp32 from this micro-batch on
                self._layout(self._low + extra)
        if not self._low:
            return
        per_device: dict[torch.device, tuple[list, list]] = {}
        taken = []
        for k, (p, b) in enumerate(zip(self._low, self._buffers)):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("GradAccumulator does not support sparse gradients.")
            taken.append(k)
            accs, grads = per_device.setdefault(p.device, ([], []))
            accs.append(b)
            grads.append(g)
        with torch.no_grad():
            for device, (accs, grads) in per_device.items():
                ops.accumulate_grads_(accs, grads, self._found_inf[device], zero_grads=False)
        for k in taken:
            self._has_grad[k] = True
            self._low[k].grad = None

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
        mask = torch.tensor([float(h) for h in self._has_grad] + [float(p.grad is not None) for p in others],
                            dtype=torch.float32).to(device, non_blocking=True)
        meta = torch.cat([fi.reshape(1), mask])
        dist.all_reduce(meta, op=dist.ReduceOp.MAX, group=group)
        fi.copy_(meta[0])
        agreed = meta[1:].tolist()  # the one host read of the window: which parameters are stepped
        self._has_grad = [bool(v) for v in agreed[: len(self._low)]]
        for flat in self._flat.values():
            dist.all_reduce(flat, group=group)
            flat.div_(world)
        buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for p, has in zip(others, agreed[len(self._low):]):
            if has:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                buckets[(p.device, p.dtype)].append(p)
            else:
                p.grad = None
        for ps in buckets.values():
            grads = [p.grad for p in ps]
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
        plan = self._acc_plan
        planned = plan is not None and self._acc_plan_live()
        try:
            if (planned and self._step_reads_buffers and not self._ddp and micro_batches == self.steps):
                # The steady state: the step plan reads the sums from the accumulator's plan (the
                # mapping is built only if something goes the validated way).
                self._step_grads = _SourcedGrads(plan, self._window_grads)
            else:
                buffered = {id(p) for p in self._low}
                others = [p for p in self._all_params() if id(p) not in buffered and p.grad is not None]
                with torch.no_grad():
                    if self._ddp and self._low:
                        # Every micro-batch ran under no_sync: one exchange, the same on every rank.
                        self._sync_ddp()
                        others = [p for p in self._all_params() if id(p) not in buffered and p.grad is not None]
                    if micro_batches != self.steps:  # incomplete window: the sums hold sum / steps
                        tensors = list(self._flat.values()) + [p.grad for p in others]
                        if self._fsdp:
                            tensors += [b for b, h in zip(self._buffers, self._has_grad) if h]
                        for t in tensors:
                            t.mul_(self.steps / micro_batches)
                    if self._low and not self._step_reads_buffers:
                        # The optimizer (or torch's scaler) reads .grad: hand it the sums, rounded once.
                        for k, (p, b) in enumerate(zip(self._low, self._buffers)):
                            p.grad = b.to(p.dtype) if self._has_grad[k] else None
                self._step_grads = self._window_grads() if self._step_reads_buffers else {}
            self.last_window_skipped = self._step()
        except BaseException:
            if self.scaler is not None:  # a failed step must not leave this iteration half-recorded
                self.scaler._per_optimizer_states = defaultdict(_fresh_optimizer_state)
            raise
        finally:
            with torch.no_grad():
                for flat in self._flat.values():
                    flat.zero_()
                if self._fsdp:
                    for b in self._buffers:
                        b.zero_()
                for fi in self._found_inf.values():
                    fi.zero_()
            plan = self._acc_plan
            if plan is not None and self._acc_plan_live():
                plan.end_window()  # no flags, no .grad on the params it buffers or watches
                for p in self._acc_free:
                    p.grad = None
            else:
                for p in self._all_params():
                    p.grad = None
                self._has_grad = [False] * len(self._low)
            self._step_grads = {}
            self.micro_step = 0
            self.windows += 1
            self.window_ended = True

    def _step(self) -> torch.Tensor | None:
        """unscale (+ clip), step, update; returns the device skip flag (None without a scaler)."""
        opt, scaler = self.optimizer, self.scaler
        grads = self._step_grads if self._step_reads_buffers else None
        if scaler is None:
            if self.max_grad_norm is None:
                opt.step(grads=grads) if self._fused_opt else opt.step()
            elif self._fused_opt:
                opt.step(grads=grads, scaling=StepScaling(clip_coef=self._clip_coef(grads)))
            else:
                torch.nn.utils.clip_grad_norm_(self._params_with_grad(), self.max_grad_norm, self.norm_type)
                opt.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            return None
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
        if grads is not None:
            scaler.step(opt, grads=grads)
        else:
            scaler.step(opt)
        found = list(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        device = scaler._scale.device if scaler._scale is not None else None
        flag = sum(f.to(device, non_blocking=True) for f in found).clone() if found else None
        scaler.update()
        if self.lr_scheduler is not None:
            # One host read per window (the flag of a step that has just been queued).
            if flag is not None and flag.item() != 0.0:
                self.skipped_windows_host += 1
            else:
                self.lr_scheduler.step()
        return flag

    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for p in self._all_params() if p.grad is not None]

    def _clip_coef(self, grads: Mapping | None) -> torch.Tensor | None:
        """The clip coefficient of the gradients the fused step reads (no scaler: unscaled)."""
        native = self.optimizer._live_native(grads.source) if isinstance(grads, _SourcedGrads) else None
        if native is not None and native.devices <= 1:
            device = self._low[0].device
            one = self._unit_scale.get(device)
            if one is None:
                self._unit_scale[device] = one = torch.ones((), device=device)
            out = native.plan.check(one, False, True, self.norm_type, float(self.max_grad_norm))
            if out:
                return out[2]
        tensors = [g for g in (grads.get(p, p.grad) if grads is not None else p.grad for p in self._all_params()) if g is not None]
        if not tensors:
            return None
        device = tensors[0].device
        with torch.no_grad():
            _, coef = ops.check_norm_(tensors, torch.zeros(1, device=device), torch.ones(1, device=device),
                                      norm_type=self.norm_type, max_norm=float(self.max_grad_norm))
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
            sd["buffers"] = {str(d): f.clone() for d, f in self._flat.items()}
            sd["found_inf"] = {str(d): f.clone() for d, f in self._found_inf.items()}
            sd["has_grad"] = list(self._has_grad)
            index = {id(p): i for i, p in enumerate(self._all_params())}
            sd["buffered"] = [index[id(p)] for p in self._low]  # which params the buffers hold
            buffered = {id(p) for p in self._low}
            sd["grads"] = {i: p.grad.detach().clone() for i, p in enumerate(self._all_params())
                           if id(p) not in buffered and p.grad is not None}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`. Everything the accumulator and an ampfuse scaler hold is
        checked before anything (optimizer, scaler, scheduler, sums) is loaded."""
        for key in ("steps", "micro_step", "windows", "optimizer"):
            if key not in state_dict:
                raise KeyError(f"GradAccumulator state dict has no '{key}' entry.")
        if state_dict["steps"] != self.steps:
            raise ValueError(f"state_dict was saved with steps={state_dict['steps']}, this accumulator has steps={self.steps}.")
        micro = state_dict["micro_step"]
        if not (isinstance(micro, int) and not isinstance(micro, bool) and 0 <= micro < self.steps):
            raise ValueError(f"the state dict's micro_step must be an integer in [0, {self.steps}), got {micro!r}.")
        for key in ("windows", "skipped_windows_host"):
            v = state_dict.get(key, 0)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ValueError(f"the state dict's {key} must be an integer >= 0, got {v!r}.")
        sched = state_dict.get("lr_scheduler")
        if self.lr_scheduler is not None and sched is not None and not isinstance(sched, Mapping):
            raise ValueError(f"the state dict's lr_scheduler must be a scheduler's state dict (a dict) or None, got {type(sched).__name__}.")
        params = self._all_params()
        buffers, found_infs, grads = {}, {}, {}
        low = self._wanted_low() if micro == 0 else self._low
        if micro != 0 and self._fsdp:
            raise ValueError("a mid-window GradAccumulator state cannot be loaded under FSDP2; load one saved at a window boundary.")
        if micro != 0 and "buffered" not in state_dict:
            raise ValueError("the state dict's buffered entry is missing: a mid-window state dict lists the params its "
                             "buffers hold (the indices of their parameters).")
        if micro != 0:  # the params the saved buffers hold, in order
            idx = state_dict["buffered"]
            if not (isinstance(idx, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in idx)
                    and len(set(idx)) == len(idx) and all(0 <= i < len(params) and params[i].dtype in _LOW for i in idx)):
                raise ValueError(f"the state dict's buffered must list distinct indices of fp16/bf16 parameters of this accumulator's optimizer, got {idx!r}.")
            low = [params[i] for i in idx]
        has_grad = [False] * len(low)
        if micro != 0:
            sizes: dict[torch.device, int] = defaultdict(int)
            for p in low:
                sizes[p.device] += p.numel()
            for d, n in sizes.items():
                b = state_dict.get("buffers", {}).get(str(d))
                if not (isinstance(b, torch.Tensor) and tuple(b.shape) == (n,) and b.dtype == torch.float32):
                    raise ValueError(f"the state dict's buffers['{d}'] must be a float32 tensor of shape {(n,)}, got {b!r}.")
                fi = state_dict.get("found_inf", {}).get(str(d))
                if not (isinstance(fi, torch.Tensor) and fi.numel() == 1):
                    raise ValueError(f"the state dict's found_inf['{d}'] must be a 1-element tensor, got {fi!r}.")
                buffers[d], found_infs[d] = b, fi
            has_grad = list(state_dict.get("has_grad", has_grad))
            if len(has_grad) != len(low):
                raise ValueError(f"the state dict's has_grad has {len(has_grad)} entries; this accumulator buffers {len(low)} parameters.")
            for i, g in dict(state_dict.get("grads", {})).items():
                if not (isinstance(i, int) and 0 <= i < len(params) and isinstance(g, torch.Tensor)
                        and g.shape == params[i].shape):
                    raise ValueError(f"the state dict's grads[{i!r}] does not match a parameter of this accumulator's optimizer.")
                grads[id(params[i])] = g
        if self._our_scaler and state_dict.get("scaler"):
            self.scaler._validate_state_dict(state_dict["scaler"])
        # apply
        self._acc_plan = None
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        if self.lr_scheduler is not None and state_dict.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.micro_step = micro
        self.windows = state_dict["windows"]
        self.skipped_windows_host = state_dict.get("skipped_windows_host", 0)
        self._layout(low)
        buffered = {id(q) for q in self._low}
        with torch.no_grad():
            for d, f in self._flat.items():
                f.copy_(buffers[d]) if d in buffers else f.zero_()
            if self._fsdp:
                for b in self._buffers:
                    b.zero_()
            for d, f in self._found_inf.items():
                f.copy_(found_infs[d].reshape(())) if d in found_infs else f.zero_()
            for p in params:
                if id(p) not in buffered:
                    g = grads.get(id(p))
                    p.grad = g.to(device=p.device, dtype=p.dtype).clone() if g is not None else None
        self._has_grad = has_grad
        self.window_ended = False
