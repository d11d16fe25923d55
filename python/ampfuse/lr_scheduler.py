"""Learning-rate schedules on the device that advance only on taken steps.

Each class has the name and constructor of its ``torch.optim.lr_scheduler`` twin and gives the
learning rates torch's would give if it were stepped only after the steps the optimizer really
took. The schedule counts taken steps in a device tensor: ``sched.step()`` adds ``1`` when the
optimizer's last step was taken and ``0`` when it was skipped (an inf/NaN gradient under a
``GradScaler``), and writes each param group's learning rate from that count -- in closed form,
in fp64 on the device, with torch ops only: no host read, so the whole step (and ``sched.step()``
with it) can be captured in a CUDA graph.

Where the skip comes from, in this order: the optimizer's ``last_step_skipped`` (ampfuse's
optimizers: the ``found_inf`` their last step was given), else the ``scaler`` the schedule was
built with (an :class:`ampfuse.GradScaler`: its ``last_found_inf``, for torch's optimizers), else
every step counts (as torch's schedules do).

Each param group's ``lr`` becomes a 0-dim fp32 tensor on the group's device, written in place at
every ``step()`` (so a captured graph or a step plan that holds it sees each new value); the
optimizer must accept a tensor lr (ampfuse's do; torch's with ``capturable=True`` or
``fused=True``, or on the CPU). :meth:`get_last_lr` reads the values only when called.
``state_dict()``/``load_state_dict()`` keep the count of taken steps: a resumed run continues the
schedule exactly.

Beyond torch's classes: :func:`get_scheduler` and the ``get_*_schedule_with_warmup`` functions of
the transformers library (its ``lr_scheduler_type`` names), and :func:`device_twin`, the device
schedule of a torch (or transformers) schedule, which the integrations install.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch

__all__ = [
    "LRScheduler", "LambdaLR", "ConstantLR", "LinearLR", "StepLR", "MultiStepLR", "ExponentialLR",
    "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "OneCycleLR", "SequentialLR",
    "ChainedScheduler", "get_scheduler", "get_linear_schedule_with_warmup", "get_cosine_schedule_with_warmup",
    "get_constant_schedule", "get_constant_schedule_with_warmup", "device_twin", "counts_taken_steps",
]

_F64 = torch.float64
# State that is code or live references, never saved.
_UNSAVED = ("optimizer", "_scaler", "_lr_tensors", "_momentum_tensors", "_values", "lr_lambdas", "_schedulers",
            "_milestones_t", "_starts_t", "_lengths_t")


def _device_of(optimizer: Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _count_dtype(device: torch.device) -> torch.dtype:
    """fp64 where the device has it (the counts and learning rates are computed in it)."""
    return torch.float32 if device.type == "mps" else _F64


class LRScheduler(_torch.LRScheduler):
    """The device schedules' base: a device count of taken steps, and each group's learning rate
    written from it at every :meth:`step`.

    Subclasses give the learning rates at a count ``t`` (a 0-dim device tensor) in
    :meth:`_lrs_at`; schedules that scale each group's base lr by a factor give
    :meth:`_factors_at` instead (and can then be chained, :class:`ChainedScheduler`).
    """

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1, *, scaler: Any = None) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        if scaler is not None and not hasattr(scaler, "last_found_inf"):
            raise TypeError(f"scaler must be an ampfuse.GradScaler (it tells which steps were skipped), "
                            f"got {type(scaler).__name__}.")
        self._scaler = scaler
        device = _device_of(optimizer)
        self._taken = torch.zeros((), dtype=_count_dtype(device), device=device)
        self._lr_tensors: list[torch.Tensor] = []
        self._momentum_tensors: list[torch.Tensor | None] = []
        self._values: list[torch.Tensor] = []
        if last_epoch == -1:
            for group in optimizer.param_groups:
                lr = group["lr"]
                group.setdefault("initial_lr", float(lr) if isinstance(lr, torch.Tensor) else lr)
        super().__init__(optimizer, last_epoch)

    # ---- the count and the learning rates --------------------------------------------------------
    @property
    def taken_steps(self) -> torch.Tensor:
        """The device count of taken steps the learning rates are computed from (0-dim)."""
        return self._taken

    def _lrs_at(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [base * f for base, f in zip(self.base_lrs, self._factors_at(t))]

    def _factors_at(self, t: torch.Tensor) -> list[torch.Tensor]:
        raise TypeError(f"{type(self).__name__} has no multiplicative form.")

    def _momenta_at(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Each group's momentum (SGD) / beta1 (Adam) at count ``t``, for a schedule that cycles
        it (:class:`OneCycleLR`); None: the schedule leaves them alone."""
        return None

    def sees_skips(self) -> bool:
        """Whether :meth:`step` can tell a skipped step: the optimizer reports its skip flag
        (ampfuse's optimizers), or the schedule was given a ``scaler``. Otherwise every call
        counts, and the caller must call :meth:`step` only after taken steps (as with torch's)."""
        return hasattr(self.optimizer, "last_step_skipped") or self._scaler is not None

    def _skip_flag(self) -> torch.Tensor | None:
        flag = getattr(self.optimizer, "last_step_skipped", None)
        if flag is None and self._scaler is not None:
            flag = self._scaler.last_found_inf
        return flag

    def step(self, epoch: int | None = None) -> None:
        """Count the optimizer's last step if it was taken, and write each group's learning rate
        from the count (on the device: no host read)."""
        if epoch is not None:
            raise ValueError(f"{type(self).__name__}.step(epoch) is not supported: a device schedule counts the "
                             "steps taken; call step() after each optimizer step.")
        self._step_count += 1
        self.last_epoch += 1
        if self._is_initial:
            self._taken.fill_(float(self.last_epoch))
        else:
            flag = self._skip_flag()
            if flag is None:
                self._taken.add_(1.0)
            else:
                flag = flag.to(self._taken.device, non_blocking=True).reshape(-1)[0]
                self._taken.add_((flag == 0).to(self._taken.dtype))
        self._write(self._lrs_at(self._taken))

    def _write(self, values: Sequence[torch.Tensor | float]) -> None:
        """Each group's lr tensor (made on first use, or again when the optimizer's lr was replaced,
        e.g. by its load_state_dict) set in place to its value."""
        groups = self.optimizer.param_groups
        if len(values) != len(groups):
            raise ValueError(f"{type(self).__name__}: the optimizer has {len(groups)} param groups, the schedule "
                             f"{len(values)}; build the schedule after adding param groups.")
        if len(self._lr_tensors) != len(groups):
            self._lr_tensors = [None] * len(groups)  # type: ignore[list-item]
        self._values = []
        for i, (group, value) in enumerate(zip(groups, values)):
            mine = self._lr_tensors[i]
            if mine is None or group["lr"] is not mine:
                params = group["params"]
                device = params[0].device if params else self._taken.device
                mine = torch.zeros((), dtype=torch.float32, device=device)
                self._lr_tensors[i] = mine
                group["lr"] = mine
            value = torch.as_tensor(value, dtype=self._taken.dtype, device=self._taken.device)
            mine.copy_(value, non_blocking=True)
            self._values.append(value)
        self._last_lr = self._values  # type: ignore[assignment]
        momenta = self._momenta_at(self._taken)
        if momenta is not None:
            self._write_momenta(momenta)

    def _write_momenta(self, values: Sequence[torch.Tensor]) -> None:
        """Each group's momentum / beta1 tensor (a 0-dim fp32 tensor on the group's device, as the
        lr's; made on first use or when the group's value was replaced) set in place to its value:
        ``group["momentum"]``, or ``group["betas"][0]`` for optimizers with betas."""
        groups = self.optimizer.param_groups
        use_beta1 = "betas" in self.optimizer.defaults
        if len(self._momentum_tensors) != len(groups):
            self._momentum_tensors = [None] * len(groups)
        for i, (group, value) in enumerate(zip(groups, values)):
            mine = self._momentum_tensors[i]
            current = group["betas"][0] if use_beta1 else group["momentum"]
            if mine is None or current is not mine:
                params = group["params"]
                device = params[0].device if params else self._taken.device
                mine = torch.zeros((), dtype=torch.float32, device=device)
                self._momentum_tensors[i] = mine
                if use_beta1:
                    group["betas"] = (mine, *group["betas"][1:])
                else:
                    group["momentum"] = mine
            mine.copy_(torch.as_tensor(value, dtype=self._taken.dtype, device=self._taken.device), non_blocking=True)

    def get_last_lr(self) -> list[float]:  # type: ignore[override]
        """The learning rates the last :meth:`step` wrote, as floats (a host read, here only)."""
        return [float(v) for v in self._values]

    def last_lr_tensors(self) -> list[torch.Tensor]:
        """The learning rates the last :meth:`step` wrote, as copies of their device tensors (fp64
        where the device has it): no host read."""
        return [v.clone() for v in self._values]

    # ---- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """As torch's: the schedule's attributes (not the optimizer, code or live tensors), with
        ``_taken``, the count of taken steps."""
        sd = {k: v for k, v in self.__dict__.items() if k not in _UNSAVED and k != "_last_lr"}
        sd["_taken"] = self._taken.detach().clone()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the count of taken steps included) and write the
        learning rates at that count into the optimizer's groups."""
        state = dict(state_dict)
        taken = state.pop("_taken", None)
        if taken is None:
            if "last_epoch" not in state:
                raise KeyError(f"{type(self).__name__}.load_state_dict: the state has neither '_taken' nor 'last_epoch'.")
            taken = float(state["last_epoch"])  # a torch schedule's state: every step counted
        for key in _UNSAVED:
            state.pop(key, None)
        state.pop("_last_lr", None)
        self.__dict__.update(state)
        self._taken.copy_(torch.as_tensor(taken, dtype=self._taken.dtype))
        self._write(self._lrs_at(self._taken))


def _per_group(groups: list[dict[str, Any]], name: str, value: Any) -> list[Any]:
    """One value per param group: a list or tuple of as many, or one value for all (torch's rule)."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"expected {len(groups)} values for {name}, got {len(value)}")
        return list(value)
    return [value] * len(groups)


def _pow(base: float, e: torch.Tensor) -> torch.Tensor:
    # (full_like: a fill on the device, no host-to-device copy, so a CUDA-graph capture may record it)
    return torch.pow(torch.full_like(e, base), e)


class LambdaLR(LRScheduler):
    """``torch.optim.lr_scheduler.LambdaLR``: lr = base lr * ``lr_lambda(t)``, with ``t`` the count
    of taken steps as a 0-dim fp64 device tensor. The lambda must be written in torch ops (e.g.
    ``torch.where(t < 100, t / 100, 1.0)``): Python control flow on ``t`` would read it on the host."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable | list[Callable], last_epoch: int = -1, *,
                 scaler: Any = None) -> None:
        n = len(optimizer.param_groups)
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != n:
                raise ValueError(f"Expected {n} lr_lambdas, but got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * n
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _factors_at(self, t):
        return [torch.as_tensor(f(t), dtype=t.dtype, device=t.device) for f in self.lr_lambdas]


class ConstantLR(LRScheduler):
    """``torch.optim.lr_scheduler.ConstantLR``: base lr * ``factor`` until ``total_iters`` taken steps."""

    def __init__(self, optimizer: Optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1, *,
                 scaler: Any = None) -> None:
        if factor > 1.0 or factor < 0:
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
        self.factor, self.total_iters = factor, total_iters
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _factors_at(self, t):
        f = self.factor + (t >= self.total_iters).to(t.dtype) * (1 - self.factor)
        return [f] * len(self.base_lrs)


class LinearLR(LRScheduler):
    """``torch.optim.lr_scheduler.LinearLR``: the factor moves linearly from ``start_factor`` to
    ``end_factor`` over ``total_iters`` taken steps."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1, *, scaler: Any = None) -> None:
        if start_factor > 1.0 or start_factor <= 0:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.")
        if end_factor > 1.0 or end_factor < 0:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _factors_at(self, t):
        f = self.start_factor + (self.end_factor - self.start_factor) * torch.clamp(t, max=self.total_iters) / self.total_iters
        return [f] * len(self.base_lrs)


class StepLR(LRScheduler):
    """``torch.optim.lr_scheduler.StepLR``: base lr * ``gamma`` ** (taken steps // ``step_size``)."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1, *,
                 scaler: Any = None) -> None:
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _factors_at(self, t):
        return [_pow(self.gamma, torch.div(t, self.step_size, rounding_mode="floor"))] * len(self.base_lrs)


class MultiStepLR(LRScheduler):
    """``torch.optim.lr_scheduler.MultiStepLR``: base lr * ``gamma`` per milestone passed (a
    milestone given twice counts twice)."""

    def __init__(self, optimizer: Optimizer, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1, *,
                 scaler: Any = None) -> None:
        self.milestones = Counter(milestones)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _factors_at(self, t):
        ms = _constant(self, "_milestones_t", sorted(self.milestones.elements()), t)
        return [_pow(self.gamma, (ms <= t).sum().to(t.dtype))] * len(self.base_lrs)


class ExponentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.ExponentialLR``: base lr * ``gamma`` ** taken steps."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1, *, scaler: Any = None) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _factors_at(self, t):
        return [_pow(self.gamma, t)] * len(self.base_lrs)


class PolynomialLR(LRScheduler):
    """``torch.optim.lr_scheduler.PolynomialLR``: base lr * (1 - min(t, ``total_iters``) /
    ``total_iters``) ** ``power``."""

    def __init__(self, optimizer: Optimizer, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1, *,
                 scaler: Any = None) -> None:
        self.total_iters, self.power = total_iters, power
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _factors_at(self, t):
        return [(1.0 - torch.clamp(t, max=self.total_iters) / self.total_iters) ** self.power] * len(self.base_lrs)


def _constant(owner: Any, name: str, values: list[float] | Callable[[], list[float]], t: torch.Tensor) -> torch.Tensor:
    """A schedule's table of constants on ``t``'s device, made once (on the first step, before any
    CUDA-graph capture: a capture cannot record the host-to-device copy) and kept out of its state."""
    cached = owner.__dict__.get(name)
    if cached is None or cached.device != t.device or cached.dtype != t.dtype:
        cached = torch.tensor(values() if callable(values) else values, dtype=t.dtype, device=t.device)
        owner.__dict__[name] = cached
    return cached


def _cosine(t: torch.Tensor, period: torch.Tensor | float) -> torch.Tensor:
    """(1 + cos(pi * t / period)) / 2."""
    return (1 + torch.cos(math.pi * t / period)) / 2


class CosineAnnealingLR(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingLR``: eta_min + (base lr - eta_min) *
    (1 + cos(pi * t / ``T_max``)) / 2 (torch's closed form; its stepped form agrees)."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1, *,
                 scaler: Any = None) -> None:
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _lrs_at(self, t):
        c = _cosine(t, self.T_max)
        return [self.eta_min + (base - self.eta_min) * c for base in self.base_lrs]

    def _factors_at(self, t):
        if self.eta_min != 0:
            raise TypeError("CosineAnnealingLR with eta_min != 0 has no multiplicative form (it cannot be chained).")
        return [_cosine(t, self.T_max)] * len(self.base_lrs)


class CosineAnnealingWarmRestarts(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``: cosine annealing restarted after
    ``T_0`` taken steps, each period ``T_mult`` times the one before."""

    def __init__(self, optimizer: Optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1, *,
                 scaler: Any = None) -> None:
        if T_0 <= 0 or not isinstance(T_0, int):
            raise ValueError(f"Expected positive integer T_0, but got {T_0}")
        if T_mult < 1 or not isinstance(T_mult, int):
            raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
        if not isinstance(eta_min, (float, int)):
            raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type {type(eta_min)}")
        self.T_0, self.T_mult, self.eta_min = T_0, T_mult, eta_min
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _starts(self) -> list[float]:
        """The periods' starts, up to what an fp64 count can reach."""
        starts, length = [0.0], float(self.T_0)
        while starts[-1] < 2.0**53:
            starts.append(starts[-1] + length)
            length *= self.T_mult
        return starts

    def _period(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T_cur, T_i): steps into the current period and its length."""
        if self.T_mult == 1:
            return torch.remainder(t, self.T_0), torch.full_like(t, float(self.T_0))
        s = _constant(self, "_starts_t", self._starts, t)
        lengths = _constant(self, "_lengths_t", lambda: [self.T_0 * float(self.T_mult) ** k for k in range(len(s))], t)
        n = (s <= t).sum() - 1
        return t - s[n], lengths[n]

    def _lrs_at(self, t):
        t_cur, t_i = self._period(t)
        c = _cosine(t_cur, t_i)
        return [self.eta_min + (base - self.eta_min) * c for base in self.base_lrs]


class _OneCyclePhase(NamedTuple):
    end: float  # the phase's last step
    lr: tuple[str, str]  # the group keys it anneals lr from and to
    momentum: tuple[str, str]  # and momentum


class OneCycleLR(LRScheduler):
    """``torch.optim.lr_scheduler.OneCycleLR`` (the 1cycle policy). With ``cycle_momentum``
    (torch's default) each group's momentum -- SGD's ``momentum``, or ``betas[0]`` of an optimizer
    with betas -- becomes a 0-dim fp32 device tensor too, written in place at every step from the
    count of taken steps, which the fused step reads on the device as it reads the lr (ampfuse's
    optimizers; torch's SGD/Adam take it on the CPU). Past ``total_steps`` taken steps the learning
    rate and momentum stay at the end of the last phase (torch raises there, which needs the count
    on the host)."""

    def __init__(self, optimizer: Optimizer, max_lr: float | list[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True, base_momentum: float | list[float] = 0.85,
                 max_momentum: float | list[float] = 0.95, div_factor: float = 25.0, final_div_factor: float = 1e4,
                 three_phase: bool = False, last_epoch: int = -1, *, scaler: Any = None) -> None:
        if total_steps is not None:
            if total_steps <= 0 or not isinstance(total_steps, int):
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            self.total_steps = total_steps
        elif epochs is not None and steps_per_epoch is not None:
            if not isinstance(epochs, int) or epochs <= 0:
                raise ValueError(f"Expected positive integer epochs, but got {epochs}")
            if not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
                raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
            self.total_steps = epochs * steps_per_epoch
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        if pct_start < 0 or pct_start > 1 or not isinstance(pct_start, float):
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
        self.anneal_strategy = anneal_strategy
        # torch's phases: (end step, lr keys from/to, momentum keys from/to)
        first = _OneCyclePhase(float(pct_start * self.total_steps) - 1, ("initial_lr", "max_lr"),
                               ("max_momentum", "base_momentum"))
        if three_phase:
            self._phases = [first,
                            _OneCyclePhase(float(2 * pct_start * self.total_steps) - 2, ("max_lr", "initial_lr"),
                                           ("base_momentum", "max_momentum")),
                            _OneCyclePhase(self.total_steps - 1, ("initial_lr", "min_lr"),
                                           ("max_momentum", "max_momentum"))]
        else:
            self._phases = [first, _OneCyclePhase(self.total_steps - 1, ("max_lr", "min_lr"),
                                                  ("base_momentum", "max_momentum"))]
        groups = optimizer.param_groups
        per_group = functools.partial(_per_group, groups)
        max_lrs = per_group("max_lr", max_lr)
        if cycle_momentum:  # every check before a group changes
            if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
                raise ValueError("optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
            momenta = list(zip(per_group("max_momentum", max_momentum), per_group("base_momentum", base_momentum)))
            self.use_beta1 = "betas" in optimizer.defaults
        self.cycle_momentum = cycle_momentum
        if last_epoch == -1:
            for m, group in zip(max_lrs, groups):
                group["initial_lr"] = m / div_factor
                group["max_lr"] = m
                group["min_lr"] = group["initial_lr"] / final_div_factor
            if cycle_momentum:
                for (high, low), group in zip(momenta, groups):
                    group["max_momentum"] = high
                    group["base_momentum"] = low
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _anneal(self, start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _at(self, t: torch.Tensor, momentum: bool) -> list[torch.Tensor]:
        """Each group's lr (or momentum) at count ``t``: the phase of ``t`` annealed from its start to
        its end."""
        out = []
        for group in self.optimizer.param_groups:
            value: torch.Tensor | None = None
            start = 0.0
            for phase in self._phases:
                a, b = phase.momentum if momentum else phase.lr
                v = self._anneal(group[a], group[b], (t - start) / (phase.end - start))
                value = v if value is None else torch.where(t <= start, value, v)
                start = phase.end
            assert value is not None  # there are always two or three phases
            out.append(value)
        return out

    def _lrs_at(self, t):
        return self._at(t, momentum=False)

    def _momenta_at(self, t):
        return self._at(t, momentum=True) if self.cycle_momentum else None


class _Composite(LRScheduler):
    """A schedule of schedules: their states saved and loaded with its own."""

    _schedulers: list[LRScheduler]

    def _check_schedules(self, schedulers: Sequence[Any], optimizer: Optimizer, hint: str = "") -> None:
        """At least one, each an ampfuse schedule of ``optimizer`` (torch's messages)."""
        name = type(self).__name__
        if len(schedulers) < 1:
            raise ValueError(f"{name} expects at least one scheduler, but got no scheduler.")
        for i, s in enumerate(schedulers):
            if not isinstance(s, LRScheduler):
                raise TypeError(f"{name}: schedulers[{i}] must be an ampfuse.lr_scheduler schedule, got "
                                f"{type(s).__name__}{hint}.")
            if s._momenta_at(s.taken_steps) is not None:
                raise ValueError(f"{name}: schedulers[{i}] ({type(s).__name__}) cycles the momentum, which a "
                                 f"composite schedule does not; build it with cycle_momentum=False.")
            if s.optimizer is not optimizer:
                raise ValueError(f"{name} expects all schedulers to belong to the same optimizer, but got scheduler "
                                 f"{type(s).__name__} at index {i} has {s.optimizer}, which is different from "
                                 f"{type(optimizer).__name__}.")

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        for s, sub in zip(self._schedulers, state.pop("_schedulers", [])):
            s.__dict__.update({k: v for k, v in sub.items() if k not in _UNSAVED and k not in ("_taken", "_last_lr")})
        super().load_state_dict(state)


class SequentialLR(_Composite):
    """``torch.optim.lr_scheduler.SequentialLR``: ``schedulers[i]`` from milestone ``i - 1`` on,
    each counting its taken steps from 0 at its milestone (the schedules must be ampfuse's)."""

    def __init__(self, optimizer: Optimizer, schedulers: list[LRScheduler], milestones: list[int],
                 last_epoch: int = -1, *, scaler: Any = None) -> None:
        self._check_schedules(schedulers, optimizer, " (device_twin() converts torch's)")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError("Sequential Schedulers expects number of schedulers provided to be one more than the number "
                             f"of milestone points, but got number of schedulers {len(schedulers)} and the number of "
                             f"milestones to be equal to {len(milestones)}")
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        super().__init__(optimizer, last_epoch, scaler=scaler)

    def _lrs_at(self, t):
        out = self._schedulers[0]._lrs_at(t)
        for m, s in zip(self._milestones, self._schedulers[1:]):
            later = s._lrs_at(t - m)
            out = [torch.where(t >= m, b, a) for a, b in zip(out, later)]
        return out


class ChainedScheduler(_Composite):
    """``torch.optim.lr_scheduler.ChainedScheduler``: the product of the schedules' factors (each
    multiplicative: torch's chained steps compose them so)."""

    def __init__(self, schedulers: Sequence[LRScheduler], optimizer: Optimizer | None = None, *,
                 scaler: Any = None) -> None:
        if len(schedulers) < 1:
            raise ValueError(f"{type(self).__name__} expects at least one scheduler to be chained, but got no scheduler.")
        optimizer = optimizer or schedulers[0].optimizer
        self._check_schedules(schedulers, optimizer)
        for s in schedulers:
            s._factors_at(s.taken_steps)  # refuses a schedule without a multiplicative form
        self._schedulers = list(schedulers)
        super().__init__(optimizer, -1, scaler=scaler)

    def _factors_at(self, t):
        out = None
        for s in self._schedulers:
            f = s._factors_at(t)
            out = f if out is None else [a * b for a, b in zip(out, f)]
        return out


# ---- the transformers library's schedules (its lr_scheduler_type names) ------------------------


def _warmup(t: torch.Tensor, warmup: int) -> torch.Tensor:
    return t / max(1.0, float(warmup))


def get_constant_schedule(optimizer: Optimizer, last_epoch: int = -1, *, scaler: Any = None) -> LambdaLR:
    """transformers' ``constant``: the base learning rate throughout."""
    return LambdaLR(optimizer, lambda t: torch.ones_like(t), last_epoch, scaler=scaler)


def get_constant_schedule_with_warmup(optimizer: Optimizer, num_warmup_steps: int, last_epoch: int = -1, *,
                                      scaler: Any = None) -> LambdaLR:
    """transformers' ``constant_with_warmup``: linear warmup, then the base learning rate."""
    return LambdaLR(optimizer, functools.partial(_constant_warmup, w=num_warmup_steps), last_epoch, scaler=scaler)


def _constant_warmup(t, *, w):
    return torch.where(t < w, _warmup(t, w), torch.ones_like(t))


def get_linear_schedule_with_warmup(optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int,
                                    last_epoch: int = -1, *, scaler: Any = None) -> LambdaLR:
    """transformers' ``linear``: linear warmup, then linear decay to 0 at ``num_training_steps``."""
    return LambdaLR(optimizer, functools.partial(_linear_warmup, w=num_warmup_steps, n=num_training_steps),
                    last_epoch, scaler=scaler)


def _linear_warmup(t, *, w, n):
    decay = torch.clamp((n - t) / max(1.0, float(n - w)), min=0.0)
    return torch.where(t < w, _warmup(t, w), decay)


def get_cosine_schedule_with_warmup(optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int,
                                    num_cycles: float = 0.5, last_epoch: int = -1, *, scaler: Any = None) -> LambdaLR:
    """transformers' ``cosine``: linear warmup, then cosine decay (``num_cycles`` waves, 0.5: to 0)."""
    return LambdaLR(optimizer, functools.partial(_cosine_warmup, w=num_warmup_steps, n=num_training_steps,
                                                 c=num_cycles), last_epoch, scaler=scaler)


def _cosine_warmup(t, *, w, n, c):
    progress = (t - w) / max(1.0, float(n - w))
    decay = torch.clamp(0.5 * (1.0 + torch.cos(math.pi * float(c) * 2.0 * progress)), min=0.0)
    return torch.where(t < w, _warmup(t, w), decay)


_NAMED = {
    "linear": lambda opt, w, n, s: get_linear_schedule_with_warmup(opt, w, n, scaler=s),
    "cosine": lambda opt, w, n, s: get_cosine_schedule_with_warmup(opt, w, n, scaler=s),
    "constant": lambda opt, w, n, s: get_constant_schedule(opt, scaler=s),
    "constant_with_warmup": lambda opt, w, n, s: get_constant_schedule_with_warmup(opt, w, scaler=s),
}


def get_scheduler(name: str, optimizer: Optimizer, num_warmup_steps: int | None = None,
                  num_training_steps: int | None = None, *, scaler: Any = None) -> LambdaLR:
    """The device twin of transformers' ``get_scheduler(name, ...)`` for ``name`` in ``linear``,
    ``cosine``, ``constant``, ``constant_with_warmup``."""
    name = getattr(name, "value", name)
    if name not in _NAMED:
        raise ValueError(f"get_scheduler: name must be one of {', '.join(map(repr, _NAMED))}, got {name!r}.")
    if name != "constant" and num_warmup_steps is None:
        raise ValueError(f"get_scheduler: {name!r} requires num_warmup_steps.")
    if name in ("linear", "cosine") and num_training_steps is None:
        raise ValueError(f"get_scheduler: {name!r} requires num_training_steps.")
    return _NAMED[name](optimizer, num_warmup_steps, num_training_steps, scaler)


# ---- device twins of torch's and transformers' schedules ------------------------------------------


def _transformers_lambda(f: Any) -> Callable | None:
    """The torch-op twin of a transformers schedule lambda (its module's ``_get_constant_lambda``,
    or a functools.partial of one of its ``_get_*_lr_lambda`` functions), or None."""
    if getattr(f, "__name__", "") == "_get_constant_lambda" and getattr(f, "__module__", "").startswith("transformers"):
        return lambda t: torch.ones_like(t)
    if not isinstance(f, functools.partial):
        return None
    name, kw = getattr(f.func, "__name__", ""), f.keywords
    if name == "_get_linear_schedule_with_warmup_lr_lambda":
        return functools.partial(_linear_warmup, w=kw["num_warmup_steps"], n=kw["num_training_steps"])
    if name == "_get_cosine_schedule_with_warmup_lr_lambda":
        return functools.partial(_cosine_warmup, w=kw["num_warmup_steps"], n=kw["num_training_steps"],
                                 c=kw.get("num_cycles", 0.5))
    if name == "_get_constant_schedule_with_warmup_lr_lambda":
        return functools.partial(_constant_warmup, w=kw["num_warmup_steps"])
    return None


def counts_taken_steps(scheduler: Any) -> bool:
    """Whether ``scheduler`` is a device schedule that tells skipped steps itself (its
    :meth:`LRScheduler.sees_skips`): step it after every optimizer step, with no read of the skip
    flag. Any other schedule is stepped only after the steps taken."""
    return isinstance(scheduler, LRScheduler) and scheduler.sees_skips()


def device_twin(scheduler: Any, *, scaler: Any = None) -> LRScheduler:
    """The device schedule that gives ``scheduler``'s learning rates on taken steps (a torch
    ``LRScheduler`` of a class above, or a transformers schedule), continuing from its state: the
    steps it counted are taken as taken. Its optimizer's groups get the twin's lr tensors.

    Raises:
        TypeError: a schedule with no device twin (a ``LambdaLR`` of an arbitrary function,
            ``ReduceLROnPlateau``, ``CyclicLR``...).
    """
    if isinstance(scheduler, LRScheduler):
        return scheduler
    opt, kind = scheduler.optimizer, type(scheduler).__name__
    simple = {
        "ConstantLR": ("factor", "total_iters"), "LinearLR": ("start_factor", "end_factor", "total_iters"),
        "StepLR": ("step_size", "gamma"), "ExponentialLR": ("gamma",), "PolynomialLR": ("total_iters", "power"),
        "CosineAnnealingLR": ("T_max", "eta_min"), "CosineAnnealingWarmRestarts": ("T_0", "T_mult", "eta_min"),
    }
    if isinstance(scheduler, _torch.LRScheduler) and kind in simple:
        twin = globals()[kind](opt, **{k: getattr(scheduler, k) for k in simple[kind]}, scaler=scaler)
    elif isinstance(scheduler, _torch.MultiStepLR):
        twin = MultiStepLR(opt, list(scheduler.milestones.elements()), scheduler.gamma, scaler=scaler)
    elif isinstance(scheduler, _torch.LambdaLR):
        found = [_transformers_lambda(f) for f in scheduler.lr_lambdas]
        fs = [f for f in found if f is not None]
        if len(fs) != len(found):
            raise TypeError("device_twin: a LambdaLR of an arbitrary function has no device twin; write its lambda in "
                            "torch ops with ampfuse.lr_scheduler.LambdaLR.")
        twin = LambdaLR(opt, fs, scaler=scaler)
    elif isinstance(scheduler, _torch.SequentialLR):
        subs = [device_twin(s, scaler=scaler) for s in scheduler._schedulers]
        twin = SequentialLR(opt, subs, list(scheduler._milestones), scaler=scaler)
    else:
        raise TypeError(f"device_twin: {kind} has no device twin.")
    # the twin starts where the torch schedule is: its initial learning rates, its count
    base_lrs = getattr(scheduler, "base_lrs", None) or [g["initial_lr"] for g in opt.param_groups]
    twin.base_lrs = list(base_lrs)
    if isinstance(twin, SequentialLR):
        for s in twin._schedulers:
            s.base_lrs = list(base_lrs)
    twin.last_epoch = scheduler.last_epoch
    twin._taken.fill_(float(scheduler.last_epoch))
    twin._write(twin._lrs_at(twin._taken))
    return twin

