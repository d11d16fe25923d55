"""The optimizers' 8-bit state: ``state_dtype`` / ``exp_avg_sq_dtype`` of ``torch.uint8``,
``torch.float8_e4m3fn`` and ``torch.float8_e5m2``.

What the classes add to the fused 8-bit step (``test_quantization.py`` covers the format and the
op): each moment in its own format, small params in fp32, the native step plan equal to the
validated way, the skip, options changed mid-run, and checkpoints (fp32 values: a round trip with
the same options is bitwise; other options and torch's ``AdamW`` convert).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import ampfuse
from ampfuse import ops
from ampfuse.optim import SGD, Adam, AdamW, StepScaling

QUANTIZED = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
BIG = (64, 96)  # 6,144 elements: 24 blocks, 8-bit state
SMALL = (40, 100)  # 4,000 elements: below the threshold, fp32 state
EDGE = (4096,)  # exactly the threshold: 8-bit


def _params(dtype=torch.bfloat16, shapes=(BIG, SMALL, EDGE, (3, 5000)), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _grads(params, step, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    # a spread of magnitudes inside each block, as real gradients have
    return [(torch.randn(p.shape, generator=g) * torch.logspace(-4, 0, p.numel()).reshape(p.shape)
             [torch.randperm(p.shape[0], generator=g)]).to(p.dtype) for p in params]


def _run(opt, params, steps, seed=0, skip_at=()):
    for k in range(steps):
        for p, g in zip(params, _grads(params, k, seed)):
            p.grad = g
        found = torch.tensor([1.0 if k in skip_at else 0.0])
        opt.step(scaling=StepScaling(None, found, None))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8) if t.element_size() == 1 else t.detach().reshape(-1).view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_state(a, b, params_a, params_b):
    for p, q in zip(params_a, params_b):
        assert torch.equal(_bits(p), _bits(q))
        sa, sb = a.state[p], b.state[q]
        assert sorted(sa) == sorted(sb)
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, key
            assert torch.equal(_bits(sa[key]), _bits(sb[key])), key


def _decoded(state, key):
    t = state[key]
    if t.dtype in QUANTIZED:
        return ops.dequantize_blocks(t, state[key + "_absmax"], nonnegative=key != "exp_avg" and key != "momentum_buffer")
    return t.float()


CASES = {  # name: (optimizer, options)
    "adamw-uint8": (AdamW, dict(state_dtype=torch.uint8)),
    "adamw-e4m3-e5m2": (AdamW, dict(state_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e5m2)),
    "adam-amsgrad-uint8-e5m2": (Adam, dict(state_dtype=torch.uint8, exp_avg_sq_dtype=torch.float8_e5m2,
                                           amsgrad=True, weight_decay=0.01)),
    "sgd-e4m3": (SGD, dict(state_dtype=torch.float8_e4m3fn, momentum=0.9)),
}


def _make(name, params, **extra):
    cls, options = CASES[name]
    return cls(params, lr=1e-2, **{**options, **extra})


@pytest.mark.parametrize("name", list(CASES))
def test_each_state_is_kept_in_its_dtype_with_fp32_below_4096_elements(name):
    params = _params()
    opt = _make(name, params)
    _run(opt, params, 2)
    cls, options = CASES[name]
    keys = ("momentum_buffer",) if cls is SGD else ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[:3 if options.get("amsgrad") else 2]
    for p in params:
        st = opt.state[p]
        for key in keys:
            want = options["state_dtype"] if key in ("exp_avg", "momentum_buffer") else options.get(
                "exp_avg_sq_dtype") or options["state_dtype"]
            if p.numel() < 4096:
                assert st[key].dtype == torch.float32 and key + "_absmax" not in st
            else:
                assert st[key].dtype == want and st[key].shape == p.shape and st[key].is_contiguous()
                assert st[key + "_absmax"].dtype == torch.float32
                assert st[key + "_absmax"].shape == ((p.numel() + 255) // 256,)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflowing-square"])
def test_a_step_is_the_fp32_step_on_the_decoded_state_requantized(name, overflow):
    """Step by step, the 8-bit optimizer equals an fp32-state optimizer given the decoded state
    and the same master, with its new state requantized: the formats the class picks (the
    unsigned map for second moments) and the small params' fp32 state. With a finite gradient
    of 1e22 (its square is inf in fp32, so no scaler skips it), the inf second moment stays in
    its element as in fp32 state, and no param becomes NaN."""
    params = _params()
    opt = _make(name, params)
    _run(opt, params, 1)  # state exists
    for k in range(1, 4):
        ref_params = [p.detach().clone().requires_grad_() for p in params]
        cls, options = CASES[name]
        wide = {key: value for key, value in options.items() if key != "exp_avg_sq_dtype"}
        ref = cls(ref_params, lr=1e-2, **{**wide, "state_dtype": torch.float32})
        ref.load_state_dict(opt.state_dict())  # fp32 values: the decoded state
        grads = _grads(params, k)
        if overflow and k == 1:
            grads[0].view(-1)[[5, 300]] = 1e22
            grads[3].view(-1)[7] = -1e22
        for p, q, g in zip(params, ref_params, grads):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        for p, q in zip(params, ref_params):
            assert not p.isnan().any()
            assert torch.equal(_bits(p), _bits(q))
            for key, t in opt.state[p].items():
                if key.endswith("_absmax"):
                    continue
                r = ref.state[q][key]
                if t.dtype in QUANTIZED:
                    codes, absmax = ops.quantize_blocks(r, t.dtype, nonnegative=key in ("exp_avg_sq", "max_exp_avg_sq"))
                    assert torch.equal(_bits(t), _bits(codes)), key
                    assert torch.equal(opt.state[p][key + "_absmax"], absmax), key
                else:
                    assert torch.equal(_bits(t), _bits(r)), key


@pytest.mark.parametrize("name", list(CASES))
def test_the_native_plan_gives_the_bits_of_the_validated_way(name, monkeypatch):
    a_params, b_params = _params(), _params()
    a = _make(name, a_params)
    b = _make(name, b_params)
    b._native_kind = ""  # every step the validated way
    _run(a, a_params, 5, skip_at=(2,))
    _run(b, b_params, 5, skip_at=(2,))
    assert a._native is not None and b._native is None
    _assert_same_state(a, b, a_params, b_params)


@pytest.mark.parametrize("name", list(CASES))
def test_a_skipped_step_writes_no_code_and_no_absmax(name):
    params = _params()
    opt = _make(name, params)
    _run(opt, params, 2)
    live_before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    params_before = [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(params, 7)):
        p.grad = g
    opt.step(scaling=StepScaling(None, torch.tensor([1.0]), None))
    for p, pb in zip(params, params_before):
        assert torch.equal(_bits(p), _bits(pb))
        for key, t in opt.state[p].items():
            assert torch.equal(_bits(t), _bits(live_before[id(p)][key])), key


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_holds_fp32_values_and_round_trips_bitwise(name):
    params = _params()
    opt = _make(name, params)
    _run(opt, params, 3)
    sd = opt.state_dict()
    for st in sd["state"].values():
        assert not any(key.endswith("_absmax") for key in st)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):
            if key in st:
                assert st[key].dtype == torch.float32
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh_params = [p.detach().clone().requires_grad_() for p in params]
    fresh = _make(name, fresh_params)
    fresh.load_state_dict(loaded)
    # the next steps of the resumed run are the bits of the run that went on
    _run(opt, params, 3, seed=1, skip_at=(1,))
    _run(fresh, fresh_params, 3, seed=1, skip_at=(1,))
    _assert_same_state(opt, fresh, params, fresh_params)


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_round_trips_bitwise_with_moments_below_the_normal_range(name):
    """Gradients near fp32's smallest normal: first moments (and the blocks' absmax) land in and
    around the subnormal range, where decoded values would lose bits; the round trip stays bitwise."""
    params = _params()
    opt = _make(name, params, weight_decay=0.0)  # (an L2 decay would add the params' own magnitude)
    for k in range(4):
        for p, gr in zip(params, _grads(params, k)):
            p.grad = (gr.float() * 2.0**-119).to(p.dtype)  # bf16 keeps fp32's exponent range
        opt.step()
    absmax = torch.cat([t for st in opt.state.values() for key, t in st.items() if key.endswith("_absmax")])
    assert bool((absmax == 0).any()) and bool((absmax > 0).any()), absmax  # blocks on both sides
    fresh_params = [p.detach().clone().requires_grad_() for p in params]
    fresh = _make(name, fresh_params, weight_decay=0.0)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for o, ps in ((opt, params), (fresh, fresh_params)):  # a skipped step encodes the loaded state
        for p in ps:
            p.grad = torch.zeros_like(p)
        o.step(scaling=StepScaling(None, torch.tensor([1.0]), None))
    _assert_same_state(opt, fresh, params, fresh_params)


def test_a_checkpoint_loads_into_other_state_dtypes_as_its_values():
    params = _params()
    opt = _make("adamw-uint8", params)
    _run(opt, params, 3)
    decoded = {id(p): {k: _decoded(opt.state[p], k) for k in ("exp_avg", "exp_avg_sq")} for p in params}
    sd = opt.state_dict()
    for dtype, sq in ((torch.float32, None), (torch.bfloat16, None), (torch.float8_e4m3fn, torch.float8_e5m2)):
        others = [p.detach().clone().requires_grad_() for p in params]
        other = AdamW(others, lr=1e-2, state_dtype=dtype, exp_avg_sq_dtype=sq)
        other.load_state_dict(sd)
        _run(other, others, 1, skip_at=(0,))  # a skipped step brings the state to the options
        for p, q in zip(params, others):
            for key in ("exp_avg", "exp_avg_sq"):
                t = other.state[q][key]
                want_dtype = sq if key == "exp_avg_sq" and sq is not None else dtype
                if want_dtype in QUANTIZED and q.numel() < 4096:
                    want_dtype = torch.float32
                assert t.dtype == want_dtype, (key, t.dtype)
                if t.dtype in QUANTIZED:
                    codes, absmax = ops.quantize_blocks(decoded[id(p)][key], t.dtype, nonnegative=key == "exp_avg_sq")
                    assert torch.equal(_bits(t), _bits(codes)) and torch.equal(other.state[q][key + "_absmax"], absmax)
                else:
                    assert torch.equal(t, decoded[id(p)][key].to(t.dtype))


def test_torch_adamw_checkpoints_load_both_ways():
    shapes = (BIG, SMALL)
    torch_params = _params(torch.float32, shapes)
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-2, foreach=False)
    for k in range(2):
        for p, g in zip(torch_params, _grads(torch_params, k)):
            p.grad = g
        torch_opt.step()
    ours_params = [p.detach().clone().requires_grad_() for p in torch_params]
    ours = AdamW(ours_params, lr=1e-2, state_dtype=torch.uint8)
    ours.load_state_dict(torch_opt.state_dict())
    _run(ours, ours_params, 1, skip_at=(0,))
    big = ours.state[ours_params[0]]
    codes, absmax = ops.quantize_blocks(torch_opt.state[torch_params[0]]["exp_avg_sq"], torch.uint8, nonnegative=True)
    assert torch.equal(big["exp_avg_sq"], codes) and torch.equal(big["exp_avg_sq_absmax"], absmax)
    assert torch.equal(ours.state[ours_params[1]]["exp_avg"], torch_opt.state[torch_params[1]]["exp_avg"])
    # and back: torch's optimizer takes ours, with the decoded values
    back = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in ours_params], lr=1e-2, foreach=False)
    back.load_state_dict(ours.state_dict())
    restored = back.state[back.param_groups[0]["params"][0]]["exp_avg_sq"]
    assert torch.equal(restored, ops.dequantize_blocks(codes, absmax, nonnegative=True))


def test_changing_the_state_dtype_of_a_group_converts_its_state():
    params = _params()
    opt = AdamW(params, lr=1e-2)
    _run(opt, params, 2)
    values = {id(p): opt.state[p]["exp_avg"].clone() for p in params}
    opt.param_groups[0]["state_dtype"] = torch.float8_e4m3fn
    _run(opt, params, 1, skip_at=(0,))
    for p in params:
        st = opt.state[p]
        if p.numel() >= 4096:
            codes, absmax = ops.quantize_blocks(values[id(p)], torch.float8_e4m3fn)
            assert torch.equal(_bits(st["exp_avg"]), _bits(codes)) and torch.equal(st["exp_avg_absmax"], absmax)
        else:
            assert torch.equal(st["exp_avg"], values[id(p)])
    opt.param_groups[0]["state_dtype"] = torch.float32
    _run(opt, params, 1, skip_at=(0,))
    for p in params:
        assert opt.state[p]["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in opt.state[p]


def test_state_memory_per_parameter():
    """bf16 params with remainders and 8-bit moments: 2 (remainder) + 2 (moments) bytes per
    parameter, plus 8 bytes of absmax per 256 (0.03 B)."""
    params = _params(shapes=((256, 1024),))
    opt = AdamW(params, lr=1e-2, state_dtype=torch.uint8, master_weights="remainder")
    _run(opt, params, 1)
    st = opt.state[params[0]]
    n = params[0].numel()
    state_bytes = sum(t.numel() * t.element_size() for k, t in st.items() if k != "step")
    assert state_bytes == n * 2 + n * 2 + 2 * (n // 256) * 4


def test_a_checkpoint_with_8bit_entries_is_refused_before_anything_changes():
    params = _params()
    opt = _make("adamw-uint8", params)
    _run(opt, params, 1)
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg_absmax"] = torch.ones(24)
    before = [p.detach().clone() for p in params]
    state_before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    with pytest.raises(ValueError, match=r"state 'exp_avg_absmax' of param_groups\[0\]\['params'\]\[0\]: "
                                         r"checkpoints hold 8-bit state as its fp32 values"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(BIG, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param_groups\[0\]\['params'\]\[0\] must be a "
                                         r"floating-point tensor of values .* got torch.float8_e4m3fn"):
        opt.load_state_dict(bad)
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        for k, v in opt.state[p].items():
            assert torch.equal(_bits(v), _bits(state_before[id(p)][k]))


def test_codes_without_their_absmax_are_named():
    params = _params()
    opt = _make("adamw-uint8", params)
    _run(opt, params, 1)
    del opt.state[params[0]]["exp_avg_absmax"]
    opt.param_groups[0]["state_dtype"] = torch.float32
    with pytest.raises(ValueError, match=r"state 'exp_avg' is torch.uint8 codes without its block absmax"):
        _run(opt, params, 1)


def test_the_scaler_path_steps_8bit_state():
    """GradScaler.step with 8-bit moments: an overflow skips (nothing written), then training goes on."""
    params = _params(torch.float16, shapes=(BIG,))
    opt = AdamW(params, lr=1e-3, state_dtype=torch.uint8)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(BIG)
    for k in range(3):
        loss = (params[0].float() * x).sum() * (float("inf") if k == 1 else 1.0)
        scaler.scale(loss).backward()
        before = opt.state[params[0]]["exp_avg"].clone() if opt.state[params[0]] else None
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if k == 1:
            assert torch.equal(opt.state[params[0]]["exp_avg"], before)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.uint8
    assert float(opt.state[params[0]]["step"]) == 2.0


def test_a_compiled_step_gives_the_bits_of_the_eager_one():
    """torch.compile (aot_eager) traces the 8-bit step through the ops' fake kernels and gives
    the eager step's codes, absmax and params."""
    runs = []
    for compiled in (False, True):
        params = _params(shapes=(BIG, SMALL))
        opt = _make("adamw-e4m3-e5m2", params, master_weights="remainder")
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        for k in range(3):
            for p, g in zip(params, _grads(params, k)):
                p.grad = g
            step()
        runs.append((params, opt))
    _assert_same_state(runs[0][1], runs[1][1], runs[0][0], runs[1][0])


@pytest.mark.parametrize("state_dtype", QUANTIZED, ids=["uint8", "e4m3", "e5m2"])
@pytest.mark.parametrize("cls", [AdamW, SGD], ids=["adamw", "sgd"])
def test_a_step_compiled_with_symbolic_shapes_gives_the_bits_of_the_eager_one(cls, state_dtype):
    """torch.compile with dynamic=True, and a second optimizer of other shapes compiled in the
    same process (which makes dynamo mark the shapes dynamic by itself): the 8-bit checks of the
    ops' Meta kernels take symbolic sizes."""
    torch._dynamo.reset()
    extra = dict(momentum=0.9) if cls is SGD else {}
    runs = []
    for compiled in (False, True):
        opts = []
        for shapes, dynamic in (((BIG, EDGE), True), (((80, 96), (5000,)), None), (((96, 80), (6000,)), None)):
            params = _params(shapes=shapes)
            opt = cls(params, lr=1e-2, state_dtype=state_dtype, **extra)
            step = torch.compile(opt.step, backend="aot_eager", dynamic=dynamic) if compiled else opt.step
            for k in range(2):
                for p, g in zip(params, _grads(params, k)):
                    p.grad = g
                step()
            opts.append((params, opt))
        runs.append(opts)
    for (params_a, a), (params_b, b) in zip(*runs):
        _assert_same_state(a, b, params_a, params_b)


def test_a_non_contiguous_param_keeps_its_blocks_in_element_order():
    """A transposed param's 8-bit moments are cut in its element order (as the contiguous copy's)
    and a state converted to 8-bit from its strided fp32 moments is that order's encoding."""
    base = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    p = base.t().requires_grad_()
    q = base.t().contiguous().requires_grad_()
    assert not p.is_contiguous()
    a, b = AdamW([p], lr=1e-2, state_dtype=torch.uint8), AdamW([q], lr=1e-2, state_dtype=torch.uint8)
    _run(a, [p], 3)
    _run(b, [q], 3)
    _assert_same_state(a, b, [p], [q])
    c = AdamW([p], lr=1e-2)
    _run(c, [p], 1)
    values = c.state[p]["exp_avg"].clone()
    assert not values.is_contiguous()
    c.param_groups[0]["state_dtype"] = torch.uint8
    _run(c, [p], 1, skip_at=(0,))
    codes, absmax = ops.quantize_blocks(values.contiguous(), torch.uint8)
    assert torch.equal(c.state[p]["exp_avg"], codes) and torch.equal(c.state[p]["exp_avg_absmax"], absmax)
