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
stepped; fp16/bf16 gradients are summed in fp32.

FP32 accumulation: for fp16/bf16 parameters, after each micro-batch's backward one fused kernel
(``ampfuse.ops.accumulate_grads_``) adds the gradients into fp32 buffers, zeroes ``.grad`` and checks
for inf/NaN in the same pass. With an ampfuse optimizer those buffers are exactly what the fused
step reads (no extra copy); with another optimizer they are written back into ``.grad`` once per
window. fp32 parameters accumulate in ``.grad`` as torch does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ampfuse import ops
from ampfuse.grad_scaler import GradScaler as _AmpfuseScaler

__all__ = ["GradAccumulator"]

_LOW = (torch.float16, torch.bfloat16)


def _unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    return model, ddp


class GradAccumulator:
    """Accumulate ``steps`` micro-batches per optimizer step, correctly under loss scaling.

    Args:
        model: the module being trained (``DistributedDataParallel`` supported).
        optimizer: an ``ampfuse.optim`` optimizer (fused; reads the fp32 buffers directly) or any
            ``torch.optim.Optimizer`` (correct, not fused).
        scaler: an ``ampfuse.GradScaler`` or ``torch.amp.GradScaler``, or ``None`` (bf16/fp32).
        steps: micro-batches per optimizer step (>= 1).
        max_grad_norm: clip the global gradient norm at each step (``None``: no clipping).
        norm_type: norm for clipping (2 or inf are fused).
        lr_scheduler: advanced once per window that actually stepped.
        fp32_accumulation: accumulate fp16/bf16 gradients in fp32 buffers (default ``True``).
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
    ) -> None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}.")
        self.model, self._ddp = _unwrap(model)
        self.optimizer = optimizer
        self.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        self.steps = steps
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self.lr_scheduler = lr_scheduler
        self._fused_opt = bool(getattr(optimizer, "_ampfuse_fused_step", False))
        self.micro_step = 0  #: micro-batches in the current window
        self.windows = 0  #: windows completed (stepped or skipped)
        self.skipped_windows_host = 0  #: windows known (on the host) to have been skipped
        self.window_ended = False  #: True right after the micro-batch that closed a window
        self.last_window_skipped: torch.Tensor | None = None  #: device flag (> 0: skipped)
        self._in_context = False
        self._backward_called = False

        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._low = [p for p in params if p.dtype in _LOW] if fp32_accumulation else []
        self._flat: dict[torch.device, torch.Tensor] = {}
        self._buffers: list[torch.Tensor] = []
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        if self._low:
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in self._low:
                by_device.setdefault(p.device, []).append(p)
            buffers: dict[int, torch.Tensor] = {}
            for device, ps in by_device.items():
                flat = torch.zeros(sum(p.numel() for p in ps), dtype=torch.float32, device=device)
                self._flat[device] = flat
                self._found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
                offset = 0
                for p in ps:
                    buffers[id(p)] = flat[offset : offset + p.numel()].view(p.shape)
                    offset += p.numel()
            self._buffers = [buffers[id(p)] for p in self._low]
            if self._fused_opt:
                for p, b in zip(self._low, self._buffers):
                    optimizer._grad_buffers[p] = b  # the fused step reads the fp32 sums
        self._has_grad = [False] * len(self._low)

    # ---- the loop ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self) -> Iterator[GradAccumulator]:
        """Context for one micro-batch. Under DDP, gradient synchronisation is suppressed on all
        but the window's last micro-batch (on all of them when fp32 buffers are used: those are
        all-reduced once, at the window end). At the end of a window the optimizer steps."""
        if self._in_context:
            raise RuntimeError("GradAccumulator.accumulate() contexts cannot be nested.")
        self.window_ended = False
        last = self.micro_step == self.steps - 1
        sync = last and not self._flat
        ctx = self.model.no_sync() if (self._ddp and not sync) else contextlib.nullcontext()
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
        if self.micro_step == self.steps:
            self._end_window(self.steps)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss`` times the loss scale and ``1/steps``, backpropagated."""
        if not self._in_context:
            raise RuntimeError("GradAccumulator.backward() must be called inside acc.accumulate().")
        loss = loss / self.steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)
        self._backward_called = True

    def flush(self) -> bool:
        """Step an incomplete window now (e.g. at the end of an epoch), scaling the update as the
        mean over the micro-batches it holds. Returns whether there was anything to step. Under
        DDP, only use it when every rank holds the same number of micro-batches."""
        if self.micro_step == 0:
            return False
        if self._ddp and not self._flat:
            # the last micro-batch ran under no_sync: synchronise the .grad sums now
            self._all_reduce([p.grad for p in self._params_with_grad()])
        self._end_window(self.micro_step)
        return True

    # ---- internals ----------------------------------------------------------------------------
    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _collect(self) -> None:
        """After a micro-batch's backward: fp16/bf16 grads into the fp32 buffers (one fused pass
        per device, zeroing .grad and checking for inf/NaN on the way)."""
        if not self._low:
            return
        per_device: dict[torch.device, tuple[list, list]] = {}
        for k, (p, b) in enumerate(zip(self._low, self._buffers)):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("GradAccumulator does not support sparse gradients.")
            self._has_grad[k] = True
            accs, grads = per_device.setdefault(p.device, ([], []))
            accs.append(b)
            grads.append(p.grad)
        with torch.no_grad():
            for device, (accs, grads) in per_device.items():
                ops.accumulate_grads_(accs, grads, self._found_inf[device])

    def _all_reduce(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        world = dist.get_world_size()
        for t in tensors:
            dist.all_reduce(t)
            t.div_(world)

    def _end_window(self, micro_batches: int) -> None:
        opt = self.optimizer
        buffered = {id(p) for p in self._low}
        others = [p for p in self._all_params() if id(p) not in buffered and p.grad is not None]
        with torch.no_grad():
            if self._ddp and self._flat:
                # Every micro-batch ran under no_sync: one all-reduce per device buffer (plus the
                # .grad of parameters not buffered), and every rank skips the same windows.
                import torch.distributed as dist

                self._all_reduce(list(self._flat.values()) + [p.grad for p in others])
                for fi in self._found_inf.values():
                    dist.all_reduce(fi, op=dist.ReduceOp.MAX)
            if micro_batches != self.steps:  # incomplete window: the sums hold sum / steps
                tensors = list(self._flat.values()) + [p.grad for p in others]
                if tensors:
                    torch._foreach_mul_(tensors, self.steps / micro_batches)
            if self._low and not self._fused_opt:
                # An ordinary optimizer reads .grad: hand it the fp32 sums, rounded once.
                for k, (p, b) in enumerate(zip(self._low, self._buffers)):
                    p.grad = b.to(p.dtype) if self._has_grad[k] else None
        if self._low and self._fused_opt:
            # Parameters that got no gradient in this window are not stepped.
            for k, (p, b) in enumerate(zip(self._low, self._buffers)):
                if self._has_grad[k]:
                    opt._grad_buffers[p] = b
                else:
                    opt._grad_buffers.pop(p)
        self.last_window_skipped = self._step()
        with torch.no_grad():
            for flat in self._flat.values():
                flat.zero_()
            for fi in self._found_inf.values():
                fi.zero_()
        for p in self._all_params():
            if not (id(p) in buffered and self._fused_opt):
                p.grad = None  # buffered grads were zeroed by the accumulation kernel
        self._has_grad = [False] * len(self._low)
        self.micro_step = 0
        self.windows += 1
        self.window_ended = True

    def _step(self) -> torch.Tensor | None:
        """unscale (+ clip), step, update; returns the device skip flag (None without a scaler)."""
        opt, scaler = self.optimizer, self.scaler
        if scaler is None:
            if self.max_grad_norm is not None:
                self._clip_unscaled()
            opt.step()
            if hasattr(opt, "clip_coef"):
                del opt.clip_coef
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            return None
        ours = isinstance(scaler, _AmpfuseScaler)
        if self.max_grad_norm is not None:
            if ours:
                scaler.unscale_and_clip_(opt, self.max_grad_norm, self.norm_type)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self._clip_params(), self.max_grad_norm, self.norm_type)
        elif ours and self._fused_opt and self._low and len(self._low) == len(self._all_params()):
            # The accumulation kernel already checked every gradient: no check pass at the end.
            scaler._record_external_check(opt, dict(self._found_inf))
        scaler.step(opt)
        found = list(scaler._found_inf_per_device(opt).values())
        device = scaler._scale.device if scaler._scale is not None else None
        flag = sum(f.to(device, non_blocking=True) for f in found) if found else None
        scaler.update()
        if self.lr_scheduler is not None:
            # One host read per window (the flag of a step that has just been queued).
            if flag is not None and flag.item() != 0.0:
                self.skipped_windows_host += 1
            else:
                self.lr_scheduler.step()
        return flag

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _clip_params(self) -> list[torch.Tensor]:
        return [p for p in self._all_params() if p.grad is not None]

    def _clip_unscaled(self) -> None:
        """Clipping without a scaler: the fused step takes the coefficient; others clip .grad."""
        opt = self.optimizer
        if self._fused_opt:
            grads = [g for g in (opt._grad_of(p) for p in self._all_params()) if g is not None]
            if not grads:
                return
            device = grads[0].device
            _, coef = ops.check_norm_(grads, torch.zeros(1, device=device), torch.ones(1, device=device),
                                      norm_type=self.norm_type, max_norm=float(self.max_grad_norm))
            opt.clip_coef = coef
        else:
            torch.nn.utils.clip_grad_norm_(self._clip_params(), self.max_grad_norm, self.norm_type)

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters plus the optimizer's, scaler's and scheduler's state (and the partial fp32
        sums when taken inside a window)."""
        sd: dict[str, Any] = {
            "steps": self.steps,
            "micro_step": self.micro_step,
            "windows": self.windows,
            "skipped_windows_host": self.skipped_windows_host,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
        }
        if self.micro_step != 0:
            sd["buffers"] = {str(d): f.clone() for d, f in self._flat.items()}
            sd["found_inf"] = {str(d): f.clone() for d, f in self._found_inf.items()}
            sd["has_grad"] = list(self._has_grad)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["steps"] != self.steps:
            raise ValueError(f"state_dict was saved with steps={state_dict['steps']}, this accumulator has steps={self.steps}.")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        if self.lr_scheduler is not None and state_dict.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.micro_step = state_dict["micro_step"]
        self.windows = state_dict["windows"]
        self.skipped_windows_host = state_dict.get("skipped_windows_host", 0)
        with torch.no_grad():
            for d, f in self._flat.items():
                saved = state_dict.get("buffers", {}).get(str(d))
                f.copy_(saved) if saved is not None else f.zero_()
            for d, f in self._found_inf.items():
                saved = state_dict.get("found_inf", {}).get(str(d))
                f.copy_(saved) if saved is not None else f.zero_()
        self._has_grad = list(state_dict.get("has_grad", [False] * len(self._low)))
