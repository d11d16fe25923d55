"""``master_weights="stochastic"``: bf16 params without a master, each step's fp32 update rounded
into the param stochastically.

- The rule: a value is rounded up in magnitude with probability (its dropped 16 bits) / 65536,
  with draws that are a hash of the seed, the param's step count, the element's index and the
  param's bits before the update (``ops/rules.h``). The ops are compared bit for bit with a
  reference written here from that definition, and the rounding is unbiased.
- The optimizers: no master for bf16 params (fp16 params keep an fp32 one), the same bits from
  the native step plan and the validated way, reproducible runs, a seed that changes the draws,
  a skipped step that writes nothing, checkpoints that resume bit for bit, form switches, and
  the bytes per parameter.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import ampfuse
from ampfuse import ops
from ampfuse.optim import SGD, Adam, AdamW, StepScaling

_MASK = 0xFFFFFFFF


# ---- a reference of the rule, from its definition ------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values (in two halves: no int64 overflow)."""
    lo = (x * (c & 0xFFFF)) & _MASK
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK


def _mix32(x: torch.Tensor | int) -> torch.Tensor:
    x = torch.as_tensor(x, dtype=torch.int64) & _MASK
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _key(seed: int, step: float) -> torch.Tensor:
    step_bits = int(torch.tensor([step], dtype=torch.float32).view(torch.int32).item()) & _MASK
    return _mix32(_mix32(_mix32((seed & _MASK) ^ 0x9E3779B9) ^ ((seed >> 32) & _MASK)) ^ step_bits)


def _draws(key: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The 16 random bits of each element of a flat bf16 param whose bits before the update were `old`."""
    index = torch.arange(old.numel(), dtype=torch.int64)
    bits = old.view(torch.int16).to(torch.int64) & 0xFFFF
    return _mix32(_mix32(key ^ (index & _MASK)) ^ (bits | ((index >> 32) << 16))) & 0xFFFF


def _round_stochastic(x: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    b = x.view(torch.int32).to(torch.int64) & _MASK
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    out = torch.where(nan, (b >> 16) | 0x0040, ((b + draws) & _MASK) >> 16)
    return (out & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.0e38])
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_step_rounds_the_fp32_update_with_the_defined_draws(kind, seed):
    """The bf16 params equal the same step on fp32 copies of them, rounded with the draws of the
    rule (inf, NaN and values past the largest bf16 included), over two steps."""
    n = 40_000
    p16 = _values(n, seed=1)
    p32 = p16.float()
    state16 = [torch.zeros(n), torch.zeros(n)]
    state32 = [torch.zeros(n), torch.zeros(n)]
    s16, s32 = torch.zeros(()), torch.zeros(())
    for k in range(2):
        grad = _values(n, seed=10 + k).float()  # fp32 grads: both calls read the same values
        old = p16.clone()
        step_before = float(s16)
        if kind == "sgd":
            kw = dict(lr=0.3, momentum=0.9, weight_decay=0.01)
            ops.sgd_step_([p32], [grad], [], state32[:1], [s32], **kw)
            ops.sgd_step_([p16], [grad], [], state16[:1], [s16], rounding_seed=seed, **kw)
        else:
            kw = dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, grad_scale=torch.tensor(4.0))
            ops.adam_step_([p32], [grad], [], state32[:1], state32[1:], [], [s32], **kw)
            ops.adam_step_([p16], [grad], [], state16[:1], state16[1:], [], [s16], rounding_seed=seed, **kw)
        expected = _round_stochastic(p32, _draws(_key(seed, step_before), old))
        assert torch.equal(p16.view(torch.int16), expected.view(torch.int16)), k
        p32 = p16.float()  # the next step starts from the rounded param, as the optimizer's does
        state32 = [s.clone() for s in state16]


def test_rounding_is_unbiased_and_reaches_updates_below_half_an_ulp():
    """A step of 1e-3 from 1.0 (an eighth of a bf16 ulp there): round-to-nearest loses it, the
    stochastic rounding keeps it on average, rounding up with probability (dropped bits)/65536."""
    n = 200_000
    p_rne, p_sr = torch.ones(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    grad = torch.ones(n, dtype=torch.bfloat16)
    ops.sgd_step_([p_rne], [grad], [], [], [torch.zeros(())], lr=1e-3)
    ops.sgd_step_([p_sr], [grad], [], [], [torch.zeros(())], lr=1e-3, rounding_seed=5)
    assert torch.all(p_rne == 1.0)
    exact = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(1e-3, dtype=torch.float32)
    assert set(p_sr.float().unique().tolist()) == {1.0 - 2.0**-8, 1.0}  # the two bf16 neighbours
    mean = p_sr.double().mean().item()
    # a binomial mean: within 5 standard deviations of the exact value
    ulp = 2.0**-8
    assert abs(mean - exact.item()) < 5 * ulp / n**0.5


def test_fp32_and_fp16_params_and_masters_ignore_the_seed():
    """Only bf16 params without masters are rounded stochastically: fp16 params, fp32 params and
    params with masters step as without a seed."""
    for dtype, master in [(torch.float16, False), (torch.float32, False), (torch.bfloat16, True)]:
        out = []
        for seed in (None, 3):
            p = _values(5000, 2).to(dtype)
            masters = [p.float()] if master else []
            ops.adam_step_([p], [_values(5000, 3).to(dtype)], masters, [torch.zeros(5000)], [torch.zeros(5000)], [],
                           [torch.zeros(())], lr=1e-2, rounding_seed=seed)
            out.append(p)
        assert torch.equal(_bits(out[0]), _bits(out[1])), dtype


def test_op_opcheck():
    p = _values(300, 4)
    args = ([p], [_values(300, 5)], [], [torch.zeros(300)], [torch.zeros(300)], [], [torch.zeros(())])
    torch.library.opcheck(torch.ops.ampfuse.adam_step_.default, args, dict(lr=1e-2, rounding_seed=9))
    torch.library.opcheck(torch.ops.ampfuse.sgd_step_.default, ([p.clone()], [_values(300, 5)], [], [], [torch.zeros(())]),
                          dict(lr=1e-2, rounding_seed=9))


# ---- the optimizers --------------------------------------------------------------------------------


def _params(seed=0, dtype=torch.bfloat16, shapes=((64, 96), (300,), (5,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _run(opt, params, steps, start=0, skip_at=()):
    for k in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
        found = torch.tensor([1.0 if k in skip_at else 0.0])
        opt.step(scaling=StepScaling(None, found, None))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(xs, ys) -> bool:
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(xs, ys))


OPTIMIZERS = [
    (AdamW, dict(lr=1e-3, weight_decay=0.1)),
    (Adam, dict(lr=1e-3, amsgrad=True)),
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (AdamW, dict(lr=1e-3, state_dtype=torch.uint8)),
]
IDS = ["adamw", "adam-amsgrad", "sgd-nesterov", "adamw-uint8"]


@pytest.mark.parametrize(("cls", "kw"), OPTIMIZERS, ids=IDS)
def test_bf16_params_keep_no_master_and_fp16_params_an_fp32_one(cls, kw):
    bf16 = _params()
    fp16 = _params(dtype=torch.float16)
    opt = cls([{"params": bf16}, {"params": fp16}], master_weights="stochastic", **kw)
    _run(opt, bf16 + fp16, 2)
    for p in bf16:
        assert "master_param" not in opt.state[p] and "master_remainder" not in opt.state[p]
    for p in fp16:
        assert opt.state[p]["master_param"].dtype == torch.float32


@pytest.mark.parametrize(("cls", "kw"), OPTIMIZERS, ids=IDS)
def test_plan_and_validated_way_give_the_same_bits(cls, kw):
    """The native step plan (eager default) and the validated ops (the plan switched off) round
    with the same draws, a skipped step included."""
    a, b = _params(), _params()
    oa = cls(a, master_weights="stochastic", rounding_seed=11, **kw)
    ob = cls(b, master_weights="stochastic", rounding_seed=11, **kw)
    ob._native_kind = ""  # every step the validated way
    _run(oa, a, 6, skip_at=(2,))
    _run(ob, b, 6, skip_at=(2,))
    assert oa._native is not None and ob._native is None
    assert _same(a, b)


def test_runs_are_reproducible_and_the_seed_chooses_the_draws():
    def run(seed):
        ps = _params()
        _run(AdamW(ps, lr=1e-3, master_weights="stochastic", rounding_seed=seed), ps, 5)
        return ps

    assert _same(run(3), run(3))
    other = run(4)
    assert not any(torch.equal(_bits(x), _bits(y)) for x, y in zip(run(3)[:2], other[:2]))


def test_stochastic_rounding_follows_small_updates_that_round_to_nearest_loses():
    """lr * update far below half a bf16 ulp of the weights: the nearest rounding never moves the
    params, the stochastic one tracks the fp32-master run on average."""
    g = torch.Generator().manual_seed(0)
    w0 = (torch.rand(20_000, generator=g) + 1.0)  # in [1, 2): an ulp of 2**-7
    runs = {}
    for mw in (False, "stochastic", True):
        p = w0.to(torch.bfloat16).requires_grad_()
        opt = SGD([p], lr=1e-4, master_weights=mw)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        runs[mw] = opt.state[p]["master_param"] if mw is True else p.detach().float()
    start = w0.to(torch.bfloat16).float()
    assert torch.equal(runs[False], start)  # every update lost
    drift_fp32 = (runs[True] - start).mean().item()  # the fp32 master's: -50 * 1e-4
    drift_sr = (runs["stochastic"] - start).mean().item()
    assert abs(drift_sr - drift_fp32) < 0.05 * abs(drift_fp32)


def test_skipped_step_writes_nothing():
    ps = _params()
    opt = AdamW(ps, lr=1e-3, master_weights="stochastic")
    _run(opt, ps, 2)
    before = [p.detach().clone() for p in ps]
    state = copy.deepcopy({id(p): dict(opt.state[p]) for p in ps})
    _run(opt, ps, 1, start=2, skip_at=(2,))
    assert _same(ps, before)
    for p in ps:
        for key, value in opt.state[p].items():
            assert torch.equal(_bits(value), _bits(state[id(p)][key])), key


def test_checkpoint_resumes_bit_for_bit():
    """A run checkpointed after step 3 and resumed in a fresh optimizer (the seed comes with the
    param groups) gives the bits of the uninterrupted run."""
    ref = _params()
    ro = AdamW(ref, lr=1e-3, master_weights="stochastic", rounding_seed=21)
    _run(ro, ref, 6)

    first = _params()
    fo = AdamW(first, lr=1e-3, master_weights="stochastic", rounding_seed=21)
    _run(fo, first, 3)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in first], "opt": fo.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)
    second = [w.clone().requires_grad_() for w in ck["model"]]
    so = AdamW(second, lr=1e-3, master_weights="stochastic")  # another seed: the checkpoint's wins
    so.load_state_dict(ck["opt"])
    assert so.param_groups[0]["rounding_seed"] == 21
    _run(so, second, 3, start=3)
    assert _same(second, ref)


def test_switching_to_stochastic_drops_the_master_and_back_starts_one_from_the_param():
    ps = _params()
    opt = AdamW(ps, lr=1e-3, master_weights="remainder")
    _run(opt, ps, 2)
    opt.param_groups[0]["master_weights"] = "stochastic"
    _run(opt, ps, 1, start=2)
    assert all("master_remainder" not in opt.state[p] for p in ps)
    opt.param_groups[0]["master_weights"] = True
    _run(opt, ps, 1, start=3)
    for p in ps:
        m = opt.state[p]["master_param"]
        assert torch.equal(m.to(torch.bfloat16), p.detach())


def test_training_state_bytes_per_parameter():
    """bf16 params and grads with no master: 8 B/param with bf16 moments (param 2 + grad 2 +
    moments 4), 6 with 8-bit moments (their block absmax adds 8 B per 256 values)."""
    for state_dtype, expected in [(torch.bfloat16, 8.0), (torch.uint8, 6.0 + 8 / 256)]:
        p = torch.randn(256 * 64).to(torch.bfloat16).requires_grad_()
        opt = AdamW([p], master_weights="stochastic", state_dtype=state_dtype)
        p.grad = torch.randn_like(p) * 1e-2
        opt.step()
        state_bytes = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
        per_param = (state_bytes + p.numel() * 2 + p.grad.numel() * 2) / p.numel()
        assert per_param == pytest.approx(expected, abs=1e-9), state_dtype


def test_a_compiled_step_gives_the_bits_of_the_eager_one():
    """torch.compile (aot_eager) traces the step with its rounding seed through the ops' fake
    kernels and gives the eager step's params."""
    runs = []
    for compiled in (False, True):
        ps = _params()
        opt = AdamW(ps, lr=1e-3, master_weights="stochastic", rounding_seed=9)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        for k in range(3):
            g = torch.Generator().manual_seed(100 + k)
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
            step()
        runs.append(ps)
    assert _same(*runs)


def test_a_non_contiguous_param_draws_by_its_element_order():
    """A transposed param is rounded with the draws of its element order, as its contiguous copy."""
    base = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    p, q = base.t().requires_grad_(), base.t().contiguous().requires_grad_()
    a, b = SGD([p], lr=1e-3, master_weights="stochastic"), SGD([q], lr=1e-3, master_weights="stochastic")
    for k in range(2):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert torch.equal(_bits(p.contiguous()), _bits(q))
