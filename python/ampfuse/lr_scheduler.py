"""Learning-rate schedules on the device that advance only on taken steps: torch's own classes.

A device schedule runs torch's schedule class (any of ``torch.optim.lr_scheduler`` but
``ReduceLROnPlateau``) on the host, over a shadow of the optimizer's param groups, ahead of
training; its values fill a table on the device, read at the device's count of taken steps.
``sched.step()`` adds ``1`` to the count when the optimizer's last step was taken, ``0`` when it
was skipped (the optimizer's ``last_step_skipped``, else the ``scaler=``'s ``last_found_inf``,
else every step counts), and copies each group's lr (and cycled momentum) from the table: no host
read, so the whole step can be captured in a CUDA graph. The values are torch's (fp64, rounded
once to the group's fp32 lr tensor) and ``state_dict()`` is torch's state after the steps taken.
The manual's Schedules page says the whole contract.
"""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch

from ampfuse._transfer import capturing, copy_from_host

__all__ = [
    "LRScheduler", "LambdaLR", "MultiplicativeLR", "ConstantLR", "LinearLR", "StepLR", "MultiStepLR",
    "ExponentialLR", "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR",
    "SequentialLR", "ChainedScheduler", "device_twin", "get_scheduler", "counts_taken_steps", "DEFAULT_HORIZON",
]

#: Taken steps past the current ``step()`` call that the device table always covers, for a
#: schedule with no length of its own: what a captured step can replay exactly.
DEFAULT_HORIZON = 256
_MAX_DEFAULT_HORIZON = 1 << 16  # a schedule's own length, as the default horizon, up to this
_SNAPSHOT_EVERY = 256  # rows between snapshots of the schedules' state (a past row is rebuilt from one)


def _host(value: Any) -> Any:
    """A param-group value as a host value (a one-element tensor as a number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return tuple(_host(v) for v in value)
    return value


def _fp32(x: Any) -> float:
    return float(torch.tensor(x, dtype=torch.float32)) if isinstance(x, (int, float)) else x


def _base_optimizer(optimizer: Any) -> Any:
    """The optimizer that owns ``optimizer``'s param groups (a framework's wrapper shares them)."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, Optimizer) and inner.param_groups is optimizer.param_groups:
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def _never_stepped(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("the shadow of an optimizer's param groups is never stepped")


_never_stepped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


class _ShadowOptimizer(Optimizer):
    """What torch's schedule classes step: host copies of an optimizer's param groups (their
    ``params`` empty) and its ``defaults``. It is never stepped; torch's checks that the optimizer
    stepped before its schedule pass; torch's messages name it as the optimizer it shadows."""

    def __init__(self, optimizer: Optimizer) -> None:  # no Optimizer.__init__: there are no params
        self.real = weakref.ref(optimizer)
        self.defaults = dict(optimizer.defaults)
        self.param_groups = [{**{k: _host(v) for k, v in g.items() if k != "params"}, "params": []}
                             for g in optimizer.param_groups]
        self.state = collections.defaultdict(dict)
        self.step = _never_stepped  # type: ignore[method-assign,assignment]
        self._opt_called = True

    def __repr__(self) -> str:
        return repr(self.real())


@functools.cache
def _shadow_class(cls: type) -> type[_ShadowOptimizer]:
    """The shadow's class, with the optimizer's class name (torch's messages print it)."""
    return type(cls.__name__, (_ShadowOptimizer,), {"__module__": __name__})


def _momentum_key(optimizer: Any) -> str:
    return "betas" if "betas" in optimizer.defaults else "momentum"


def _momentum_of(group: dict[str, Any], key: str) -> Any:
    return group[key][0] if key == "betas" else group[key]


def _set_momentum(group: dict[str, Any], key: str, value: Any) -> None:
    group[key] = (value, *group[key][1:]) if key == "betas" else value


def _cycles_momentum(schedule: Any) -> bool:
    """Whether ``schedule`` (or a schedule inside it) writes the groups' momentum / beta1."""
    return bool(getattr(schedule, "cycle_momentum", False)) or any(
        _cycles_momentum(s) for s in getattr(schedule, "_schedulers", ()))


def _rehome(schedule: Any, shadow: Optimizer) -> None:
    schedule.optimizer = shadow
    for s in getattr(schedule, "_schedulers", ()):
        _rehome(s, shadow)


class _Entry:
    """A schedule the timeline steps: torch's object and the device schedule that owns it."""

    def __init__(self, owner: LRScheduler, schedule: Any, since: int) -> None:
        self.owner = weakref.ref(owner)
        self.schedule = schedule
        self.since = since  # the iterations begun when it joined: stepped in every one after


class _Timeline:
    """The schedules of one optimizer: torch's classes stepped ahead on a shadow of its param
    groups, the values of each count of taken steps, and their table on the device.

    Row ``k`` holds every group's lr (and momentum / beta1 when a schedule cycles it) after ``k``
    taken steps since row 0; each row steps every schedule once, in the order they were made (the
    order a loop steps schedules chained back to back), so each must be stepped once per
    iteration. The live schedules stand at the last row computed; snapshots of their state every
    ``_SNAPSHOT_EVERY`` rows let any earlier row's state be rebuilt. The device count of taken
    steps never exceeds the iterations stepped since row 0, which the host knows, so the table is
    extended ahead of it without reading it.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.shadow = _shadow_class(type(optimizer))(optimizer)  # type: ignore[arg-type]
        self.entries: list[_Entry] = []
        self.called: set[int] = set()  # the device schedules stepped in the current iteration
        self.device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)  # taken steps since row 0
        self.before = 0  # taken steps before row 0 (read when row 0 was set)
        self.iterations = 0  # iterations stepped (host): the count is at most iterations - origin
        self.origin = 0  # the iteration of row 0
        self.horizon = 0
        self.columns = 1  # lr, and the momentum when a schedule cycles it
        self.rows = torch.empty(0, dtype=torch.float64)  # [capacity, groups, columns], host, fp64
        self.n_rows = 0
        self.held: list[list[float]] = []  # the last row's values
        self.table: torch.Tensor | None = None  # the rows on the device, fp32
        self.on_device = 0
        self.captured: list[torch.Tensor] = []  # tables a CUDA graph may still read
        self.snapshots: dict[int, Any] = {}
        self.end: int | None = None  # the first row torch's classes raised on
        self.error: BaseException | None = None
        self.lr: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor] = []
        self.versions: list[int] = []  # the group tensors' versions after this timeline's last write

    @property
    def schedules(self) -> list[Any]:
        return [e.schedule for e in self.entries]

    # ---- the live schedules' state --------------------------------------------------------------
    def _state(self) -> Any:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.shadow.param_groups]
        return copy.deepcopy((groups, [s.state_dict() for s in self.schedules]))

    def _load(self, state: Any) -> None:
        groups, schedules = copy.deepcopy(state)
        for g, saved in zip(self.shadow.param_groups, groups):
            g.clear()
            g.update(saved, params=[])
        for s, sd in zip(self.schedules, schedules):
            s.load_state_dict(sd)

    def _values(self) -> list[list[float]]:
        key = _momentum_key(self.shadow)
        return [[float(g["lr"])] + ([float(_momentum_of(g, key))] if self.columns == 2 else [])
                for g in self.shadow.param_groups]

    def _last(self, k: int) -> int:
        """The row that holds count ``k``'s values."""
        last = self.n_rows - 1 if self.end is None else min(self.n_rows, self.end) - 1
        return max(0, min(k, last))

    def at(self, k: int, read: Callable[[], Any]) -> Any:
        """``read()`` of the schedules as they stand after ``k`` taken steps since row 0."""
        k = self._last(k)
        start = max(j for j in self.snapshots if j <= k)
        live = self._state()
        try:
            self._load(self.snapshots[start])
            for _ in range(k - start):
                for s in self.schedules:
                    s.step()
            return read()
        finally:
            self._load(live)

    # ---- rows, on the host and on the device ----------------------------------------------------
    def _compute(self, n: int) -> None:
        new: list[list[list[float]]] = []
        schedules = self.schedules
        for _ in range(n):
            if self.end is None:
                try:
                    for s in schedules:
                        s.step()
                    new.append(self._values())
                    row = self.n_rows + len(new) - 1
                    if row % _SNAPSHOT_EVERY == 0:
                        self.snapshots[row] = self._state()
                    continue
                except Exception as e:  # torch's class refuses this step: raised when a call reaches it
                    self.end, self.error = self.n_rows + len(new), e
            new.append(new[-1] if new else self.held)
        self._append(new)

    def _append(self, values: list[list[list[float]]]) -> None:
        rows = torch.tensor(values, dtype=torch.float64).reshape(len(values), -1, self.columns)
        self.held = values[-1]
        n = self.n_rows + rows.shape[0]
        if self.rows.shape[0] < n or self.rows.shape[1:] != rows.shape[1:]:
            grown = torch.empty((max(n, 2 * self.rows.shape[0]), *rows.shape[1:]), dtype=torch.float64)
            if self.n_rows:
                grown[:self.n_rows] = self.rows[:self.n_rows]
            self.rows = grown
        self.rows[self.n_rows:n] = rows
        self.n_rows = n

    def _upload(self) -> None:
        if self.on_device == self.n_rows:
            return
        table = self.table
        if table is None or table.shape[0] < self.n_rows or table.shape[1:] != self.rows.shape[1:]:
            table = torch.empty((max(self.n_rows, 2 * self.on_device), *self.rows.shape[1:]), dtype=torch.float32,
                                device=self.device)
            if self.on_device:
                table[:self.on_device].copy_(self.table[:self.on_device])  # type: ignore[index]
            self.table = table
        copy_from_host(table[self.on_device:self.n_rows], self.rows[self.on_device:self.n_rows].to(torch.float32))
        self.on_device = self.n_rows

    def cover(self) -> None:
        """Rows up to ``horizon`` taken steps past the most the count can be now (none are added
        while a CUDA graph is captured: its replays read the rows already there)."""
        need = self.iterations - self.origin + 1 + self.horizon
        if self.n_rows < need and not capturing(self.device):
            self._compute(need + max(16, self.horizon // 4) - self.n_rows)
        self._upload()

    # ---- the device count and the groups' tensors -----------------------------------------------
    def advance(self, skipped: torch.Tensor | None) -> None:
        if skipped is None:
            self.count.add_(1)
        else:
            flag = skipped.to(self.device, non_blocking=True).reshape(-1)[0]
            self.count.add_((flag == 0).to(torch.int64))

    def write(self) -> None:
        """Each group's lr (and momentum) tensor set in place from the row at the device count."""
        assert self.table is not None
        if capturing(self.device) and (not self.captured or self.captured[-1] is not self.table):
            self.captured.append(self.table)
        row = self.table.index_select(0, self.count.clamp_max(self.on_device - 1).reshape(1))[0]
        torch._foreach_copy_(self.lr, list(row[:, 0].unbind()), non_blocking=True)
        if self.momentum:
            torch._foreach_copy_(self.momentum, list(row[:, 1].unbind()), non_blocking=True)
        self.versions = [t._version for t in (*self.lr, *self.momentum)]

    def _replaced(self) -> bool:
        """Whether a group's lr or momentum is no longer what this timeline last wrote: another
        object (the optimizer's load_state_dict, the user's own write), a write into its tensor
        in place, or a group added."""
        groups = self.optimizer().param_groups  # type: ignore[union-attr]
        if len(groups) != len(self.lr):
            return True
        key = _momentum_key(self.shadow)
        return any(g["lr"] is not t for g, t in zip(groups, self.lr)) or any(
            _momentum_of(g, key) is not t for g, t in zip(groups, self.momentum)) or (
            [t._version for t in (*self.lr, *self.momentum)] != self.versions)

    def _take_groups(self) -> None:
        """The shadow takes each real group's values, as torch's class would find them: a group
        added, a value replaced or written in place. An fp32 tensor lr equal to torch's value
        rounded (the current one, or the one the last schedule gave last: an optimizer checkpoint
        holds it so) stands for torch's fp64 value."""
        real_groups = self.optimizer().param_groups  # type: ignore[union-attr]
        shadows = self.shadow.param_groups
        while len(shadows) < len(real_groups):
            shadows.append({"params": []})
        untouched = {id(t) for t, v in zip((*self.lr, *self.momentum), self.versions) if t._version == v}
        last = getattr(self.schedules[-1], "_last_lr", None) if self.schedules else None
        for i, (real, shadow) in enumerate(zip(real_groups, shadows)):
            for key, value in real.items():
                if key == "params" or id(value) in untouched:
                    continue
                if isinstance(value, tuple) and value and id(value[0]) in untouched:
                    value = (shadow[key][0], *value[1:])
                if key == "lr" and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    rounded = _host(value)
                    exact = [v for v in (shadow.get("lr"), last[i] if last and i < len(last) else None)
                             if isinstance(v, float) and _fp32(v) == rounded]
                    shadow[key] = exact[0] if exact else rounded
                    continue
                shadow[key] = _host(value)

    def _install(self) -> None:
        """The groups' lr (and momentum) as 0-dim fp32 tensors this timeline writes in place."""
        optimizer = self.optimizer()
        assert optimizer is not None
        key = _momentum_key(self.shadow)
        for g, shadow in zip(optimizer.param_groups, self.shadow.param_groups):
            if self.momentum and self.columns == 1:  # no schedule cycles it any more: a number again
                g[key] = shadow[key]
        held_lr, held_m = self.lr, self.momentum
        self.lr, self.momentum = [], []
        for i, g in enumerate(optimizer.param_groups):
            device = g["params"][0].device if g["params"] else self.device
            lr = held_lr[i] if i < len(held_lr) and g["lr"] is held_lr[i] else None
            if lr is None:
                lr = g["lr"] = torch.zeros((), dtype=torch.float32, device=device)
            self.lr.append(lr)
            if self.columns == 2:
                m = held_m[i] if i < len(held_m) and _momentum_of(g, key) is held_m[i] else None
                if m is None:
                    m = torch.zeros((), dtype=torch.float32, device=device)
                    _set_momentum(g, key, m)
                self.momentum.append(m)

    # ---- changes: a new schedule, a loaded state, the user's edits ------------------------------
    def read_count(self) -> int:
        """The count of taken steps since row 0: a host read, unless no step was made since."""
        return 0 if self.iterations == self.origin else int(self.count)

    def change(self, apply: Callable[[], Any], take_groups: bool = False) -> Any:
        """``apply()`` to the schedules as they stand now (after the steps taken: one host read of
        the count if steps were made since row 0), which then become row 0. If it raises, nothing
        changed."""
        k = self.read_count()
        live, entries = self._state(), list(self.entries)
        self._load(self.at(k, self._state) if self.snapshots else live)
        try:
            self.entries = [e for e in self.entries if e.owner() is not None]  # dropped schedules leave
            self.called &= {id(e.owner()) for e in self.entries}
            if take_groups or (self.lr and self._replaced()):
                self._take_groups()
            before = self._state()
            out = apply()
        except BaseException:
            self.entries = entries
            self._load(live)
            raise
        self.before += k
        self._restart(before[0])
        return out

    def _restart(self, groups_before: list[dict[str, Any]]) -> None:
        """Row 0 is the schedules' present state: the table, the count and the groups anew."""
        optimizer = self.optimizer()
        assert optimizer is not None
        key = _momentum_key(self.shadow)
        columns = 2 if any(_cycles_momentum(s) for s in self.schedules) else 1
        for real, now, was in zip(optimizer.param_groups, self.shadow.param_groups, groups_before):
            for k, v in now.items():  # keys a schedule set (initial_lr, max_lr, ...), as torch's leave them
                if k not in ("params", "lr") and not (columns == 2 and k == key) and (k not in was or was[k] != v):
                    real[k] = copy.deepcopy(v)
        if columns != self.columns or not self.lr or self._replaced():
            self.columns = columns
            self._install()
        self.snapshots, self.end, self.error = {}, None, None
        self.n_rows, self.on_device, self.origin = 0, 0, self.iterations
        self.count.zero_()
        self._append([self._values()])
        self.snapshots[0] = self._state()
        self.cover()
        self.write()

    def before_step(self) -> None:
        """Before a step is counted: a group's lr written by hand (or a group added) is taken, a
        dropped schedule leaves; one host read of the count, only then."""
        if self._replaced() or any(e.owner() is None for e in self.entries):
            self.change(lambda: None)

    def starts_iteration(self, owner: LRScheduler) -> bool:
        """Whether ``owner.step()`` begins an iteration (the first schedule stepped since each was
        stepped once). Refuses one that begins before every schedule stepped in the last one."""
        if self.called and id(owner) not in self.called:
            return False
        missing = [e for e in self.entries if self.called and e.since < self.iterations and e.owner() is not None
                   and id(e.owner()) not in self.called]
        if missing:
            names = ", ".join(type(e.schedule).__name__ for e in missing)
            raise RuntimeError(
                f"{type(owner).__name__}.step(): the device schedules of one optimizer are stepped together, once "
                f"per optimizer step (each row of their table steps each once), but {names} of this optimizer was not "
                f"stepped in the last iteration. Step each after every optimizer step, combine them with SequentialLR "
                f"or ChainedScheduler, or keep a schedule stepped at another pace (once per epoch, say) as torch's "
                f"class: what it writes into the learning rate is taken as a write by hand.")
        return True


_TIMELINES: weakref.WeakKeyDictionary[Any, _Timeline] = weakref.WeakKeyDictionary()


def _timeline_of(optimizer: Any) -> _Timeline:
    optimizer = _base_optimizer(optimizer)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
    if optimizer not in _TIMELINES:
        _TIMELINES[optimizer] = _Timeline(optimizer)
    return _TIMELINES[optimizer]


_OWN = frozenset({"optimizer", "_schedule", "_timeline", "_scaler", "_parent"})


class LRScheduler(_torch.LRScheduler):
    """A device schedule: torch's schedule class stepped on the device's count of taken steps.
    Build one by a class below (torch's name and arguments) or :func:`device_twin`.

    Each group's ``lr`` (and, under a schedule that cycles it, ``momentum`` or ``betas[0]``)
    becomes a 0-dim fp32 tensor on the group's device, written in place at every :meth:`step`;
    the optimizer must take tensor values there (ampfuse's do; torch's on the CPU, or with
    ``capturable`` / ``fused``). torch's attributes (``milestones``, ``T_cur``, ``last_epoch``...)
    read and write as they stand after the steps taken (a host read of the count). The device
    schedules of one optimizer are stepped together, once per optimizer step.

    Keyword args (beyond torch's):
        scaler: an :class:`ampfuse.GradScaler` whose ``last_found_inf`` tells skipped steps, for an
            optimizer that does not report them itself (torch's).
        horizon: taken steps past each :meth:`step` call that the device table covers (default:
            the schedule's ``total_steps`` up to 65,536, else :data:`DEFAULT_HORIZON`): what a
            captured CUDA graph replays exactly; past it the values hold the last row's.
    """

    _torch_class: type[_torch.LRScheduler] | None = None

    def __init__(self, *args: Any, scaler: Any = None, horizon: int | None = None, **kwargs: Any) -> None:
        cls = type(self)._torch_class
        if cls is None:
            raise TypeError("ampfuse.lr_scheduler.LRScheduler is the base class: build a named schedule (StepLR, ...) "
                            "or turn a torch schedule into a device schedule with device_twin().")
        found = [a for a in (*args, *kwargs.values()) if isinstance(a, Optimizer)]
        parts = [s for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) for s in a
                 if isinstance(s, _torch.LRScheduler)]
        if not found and not parts:
            cls(*args, **kwargs)  # torch's own error for its arguments
            raise TypeError(f"{cls.__name__}: no optimizer among the arguments.")
        optimizer = found[0] if found else parts[0].optimizer
        timeline = _timeline_of(optimizer)
        subs = [s for s in parts if isinstance(s, LRScheduler)]
        for s in subs:
            if s._parent is not None:
                raise ValueError(f"{cls.__name__}: {type(s).__name__} is already part of {type(s._parent).__name__}.")

        def mapped(a: Any) -> Any:
            if isinstance(a, Optimizer) and _base_optimizer(a) is _base_optimizer(optimizer):
                return timeline.shadow
            if isinstance(a, (list, tuple)) and any(isinstance(s, _torch.LRScheduler) for s in a):
                return type(a)(s._schedule if isinstance(s, LRScheduler) else s for s in a)
            return a

        def build() -> Any:
            theirs = [(s, s.optimizer) for s in parts if not isinstance(s, LRScheduler)
                      and _base_optimizer(s.optimizer) is _base_optimizer(optimizer)]
            for s, _ in theirs:
                _rehome(s, timeline.shadow)
            try:
                made = cls(*map(mapped, args), **{k: mapped(v) for k, v in kwargs.items()})
            except BaseException:
                for s, owner in theirs:
                    _rehome(s, owner)
                raise
            inner = {id(s._schedule if isinstance(s, LRScheduler) else s) for s in parts}
            timeline.entries = [e for e in timeline.entries if id(e.schedule) not in inner]
            timeline.entries.append(_Entry(self, made, timeline.iterations))
            return made

        self._attach(optimizer, timeline, build, scaler, horizon, take_groups=any(
            not isinstance(s, LRScheduler) for s in parts))
        for s in subs:
            object.__setattr__(s, "_parent", self)

    def _attach(self, optimizer: Any, timeline: _Timeline, build: Callable[[], Any], scaler: Any,
                horizon: int | None, take_groups: bool) -> None:
        if scaler is not None and not hasattr(scaler, "last_found_inf"):
            raise TypeError(f"scaler must be an ampfuse.GradScaler (it tells which steps were skipped), "
                            f"got {type(scaler).__name__}.")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0):
            raise ValueError(f"horizon must be an integer >= 0, got {horizon!r}.")
        own = {"optimizer": optimizer, "_timeline": timeline, "_scaler": scaler, "_parent": None}
        for name, value in own.items():
            object.__setattr__(self, name, value)
        schedule = timeline.change(build, take_groups=take_groups)
        object.__setattr__(self, "_schedule", schedule)
        if horizon is None:
            total = getattr(schedule, "total_steps", None)
            horizon = min(total + 1, _MAX_DEFAULT_HORIZON) if isinstance(total, int) else DEFAULT_HORIZON
            horizon = max(horizon, DEFAULT_HORIZON)
        if horizon > timeline.horizon:
            timeline.horizon = horizon
            timeline.cover()

    # ---- torch's attributes, as they stand after the steps taken -------------------------------
    def _present(self, read: Callable[[], Any]) -> Any:
        timeline = self._timeline
        return timeline.at(timeline.read_count(), read)

    def __getattr__(self, name: str) -> Any:
        schedule = self.__dict__.get("_schedule")
        if schedule is None or name.startswith("__"):
            raise AttributeError(name)
        live = getattr(schedule, name)
        if callable(live):
            return live
        return self._present(lambda: copy.deepcopy(getattr(schedule, name)))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
            return
        schedule = self._schedule
        self._timeline.change(lambda: setattr(schedule, name, value))

    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        """torch's ``last_epoch`` after the steps taken (a host read of the count)."""
        return self._present(lambda: self._schedule.last_epoch)

    @property
    def _step_count(self) -> int:  # type: ignore[override]
        """torch's ``_step_count`` after the steps taken (a host read of the count)."""
        return self._present(lambda: self._schedule._step_count)

    @property
    def taken_steps(self) -> torch.Tensor:
        """The device count of taken steps the learning rates are read at (0-dim int64)."""
        return self._timeline.count + self._timeline.before

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"a device schedule ({type(self).__name__}) is not copied or pickled: it writes its "
                        "optimizer's learning rates from a device table. Save its state_dict() and load it into a "
                        "schedule built on the other optimizer.")

    # ---- stepping ------------------------------------------------------------------------------
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
        (and momentum) from the table at the count: no host read.

        Raises what torch's class raises where it refuses a step (a ``OneCycleLR`` stepped past
        ``total_steps``, a bad argument), at the step where the count of taken steps reaches it,
        nothing changed: the count is read on the host only at the calls that may reach it.
        """
        if epoch is not None:
            raise ValueError(f"{type(self).__name__}.step(epoch) is not supported: a device schedule counts the "
                             "steps taken; call step() after each optimizer step.")
        if self._parent is not None:
            raise RuntimeError(f"{type(self).__name__} is part of {type(self._parent).__name__}: step that one.")
        timeline = self._timeline
        timeline.before_step()
        begins = timeline.starts_iteration(self)
        skipped = self._skip_flag() if begins else None
        if (timeline.end is not None and timeline.iterations + begins - timeline.origin >= timeline.end
                and not capturing(timeline.device)):
            # the count may reach the step torch's class refused: read it (here only) to tell
            taken = int(timeline.count)
            if begins:
                taken += 1 if skipped is None or float(skipped.reshape(-1)[0]) == 0 else 0
            if taken >= timeline.end:
                assert timeline.error is not None
                raise copy.copy(timeline.error).with_traceback(None)
        if begins:
            timeline.called = {id(self)}
            timeline.iterations += 1
            timeline.advance(skipped)
        else:
            timeline.called.add(id(self))
        timeline.cover()
        timeline.write()

    def get_last_lr(self) -> list[float]:  # type: ignore[override]
        """torch's ``get_last_lr()`` after the steps taken: its fp64 values (a host read)."""
        timeline = self._timeline
        k = timeline.read_count()
        if k > 0 and timeline.schedules[-1] is self._schedule:  # a stepped row: the last schedule's values
            return timeline.rows[timeline._last(k), :, 0].tolist()
        return timeline.at(k, lambda: list(self._schedule.get_last_lr()))

    def last_lr_tensors(self) -> list[torch.Tensor]:
        """Copies of the groups' learning-rate tensors as the last :meth:`step` wrote them: no host read."""
        return [t.clone() for t in self._timeline.lr]

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state torch's class has after the steps taken (a host read of the count: a
        checkpoint is a sync point): torch's class loads it, and ``torch.load(...,
        weights_only=True)`` reads it wherever torch's own state reads so."""
        return self._present(lambda: copy.deepcopy(self._schedule.state_dict()))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state of torch's class (saved by torch or by ampfuse), continuing from its steps
        with the optimizer's param groups as they are (as torch's class does: the optimizer's
        state may be loaded before or after, either gives torch's values)."""
        if self._parent is not None:
            raise RuntimeError(f"{type(self).__name__} is part of {type(self._parent).__name__}: load that one's state.")
        state = dict(state_dict)
        if "_taken" in state:  # an earlier ampfuse's form: its count of taken steps is torch's last_epoch
            state["last_epoch"] = int(state.pop("_taken"))
            state["_step_count"] = state["last_epoch"] + 1
        def load() -> None:
            self._schedule.load_state_dict(state)
            # an optimizer checkpoint holds each lr as it was written (fp32); the state, torch's value
            for g, last in zip(self._timeline.shadow.param_groups, state.get("_last_lr") or ()):
                if isinstance(last, float) and _fp32(last) == _fp32(g["lr"]):
                    g["lr"] = last

        self._timeline.change(load, take_groups=True)


def _device_class(torch_class: type[_torch.LRScheduler]) -> type[LRScheduler]:
    name = torch_class.__name__
    doc = (f"``torch.optim.lr_scheduler.{name}`` on the device: torch's arguments (an optimizer is the "
           f"optimizer stepped; schedules inside may be device schedules or torch's), plus ``scaler=`` and "
           f"``horizon=`` (:class:`LRScheduler`).")
    params = [p for p in inspect.signature(torch_class.__init__).parameters.values() if p.name != "self"]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in ("scaler", "horizon")]
    return type(name, (LRScheduler,), {"_torch_class": torch_class, "__doc__": doc, "__module__": __name__,
                                       "__signature__": inspect.Signature(params)})


LambdaLR = _device_class(_torch.LambdaLR)
MultiplicativeLR = _device_class(_torch.MultiplicativeLR)
ConstantLR = _device_class(_torch.ConstantLR)
LinearLR = _device_class(_torch.LinearLR)
StepLR = _device_class(_torch.StepLR)
MultiStepLR = _device_class(_torch.MultiStepLR)
ExponentialLR = _device_class(_torch.ExponentialLR)
PolynomialLR = _device_class(_torch.PolynomialLR)
CosineAnnealingLR = _device_class(_torch.CosineAnnealingLR)
CosineAnnealingWarmRestarts = _device_class(_torch.CosineAnnealingWarmRestarts)
CyclicLR = _device_class(_torch.CyclicLR)
OneCycleLR = _device_class(_torch.OneCycleLR)
SequentialLR = _device_class(_torch.SequentialLR)
ChainedScheduler = _device_class(_torch.ChainedScheduler)
_BY_TORCH_CLASS = {c._torch_class: c for c in LRScheduler.__subclasses__()}


def device_twin(scheduler: Any, *, scaler: Any = None, horizon: int | None = None) -> LRScheduler:
    """The device schedule of ``scheduler``, a torch schedule already built (torch's classes,
    a subclass of ``torch.optim.lr_scheduler.LRScheduler``, the transformers library's), which it
    takes over: it continues from the steps ``scheduler`` counted, and ``scheduler`` must not be
    stepped any more. A device schedule is returned as it is.

    Raises:
        TypeError: ``ReduceLROnPlateau`` (it steps on a metric the host holds), or not a schedule.
    """
    if isinstance(scheduler, LRScheduler):
        return scheduler
    kind = type(scheduler).__name__
    if isinstance(scheduler, _torch.ReduceLROnPlateau):
        raise TypeError("device_twin: ReduceLROnPlateau has no device twin: it steps on a metric the host holds; "
                        "step it on the host.")
    if not isinstance(scheduler, _torch.LRScheduler):
        raise TypeError(f"device_twin: {kind} is not a torch.optim.lr_scheduler.LRScheduler.")
    optimizer = scheduler.optimizer
    timeline = _timeline_of(optimizer)

    twin = LRScheduler.__new__(_BY_TORCH_CLASS.get(type(scheduler), LRScheduler))

    def build() -> Any:
        _rehome(scheduler, timeline.shadow)
        timeline.entries.append(_Entry(twin, scheduler, timeline.iterations))
        return scheduler

    twin._attach(optimizer, timeline, build, scaler, horizon, take_groups=True)
    return twin


def get_scheduler(name: Any, optimizer: Optimizer, num_warmup_steps: int | None = None,
                  num_training_steps: int | None = None, scheduler_specific_kwargs: dict[str, Any] | None = None, *,
                  scaler: Any = None, horizon: int | None = None) -> LRScheduler:
    """The device schedule of the transformers library's ``get_scheduler(name, ...)`` (every
    ``lr_scheduler_type`` it has but ``reduce_lr_on_plateau``), built by transformers itself.

    Raises:
        ImportError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("ampfuse.lr_scheduler.get_scheduler builds the transformers library's schedules: "
                          "pip install transformers.") from e
    schedule = transformers.get_scheduler(name, optimizer, num_warmup_steps=num_warmup_steps,
                                          num_training_steps=num_training_steps,
                                          scheduler_specific_kwargs=scheduler_specific_kwargs)
    return device_twin(schedule, scaler=scaler, horizon=horizon)


def counts_taken_steps(scheduler: Any) -> bool:
    """Whether ``scheduler`` is a device schedule that tells skipped steps itself (its
    :meth:`LRScheduler.sees_skips`): step it after every optimizer step, with no read of the skip
    flag. Any other schedule is stepped only after the steps taken."""
    return isinstance(scheduler, LRScheduler) and scheduler.sees_skips()

