"""The CUDA kernels (csrc/cuda/*.cu), compared case by case with the CPU kernels.

The CUDA table under test is a parameter, AMPFUSE_KERNEL_TABLE:
  * ``cuda-emulated`` (the default, every `make test`): the CUDA kernels compiled for the host
    (libampfuse_cuemu.so) run CPU tensors under the emulator, switched in-process;
  * ``cuda`` (the GPU check, benchmarks/gpu_check.sh): the real kernels on a GPU. Each case's inputs
    are built on the CPU and copied to the GPU with the same storage offsets (so the misaligned
    cases stay misaligned), the same calls run there, and the results are copied back.
Every output is compared: bitwise where both follow the same rule (unscale, inf/NaN flags,
accumulation, the scale update, the optimizer updates of rules.h: the CPU AVX2 and AVX-512 builds
and the CUDA kernels use the same fused multiply-adds), norms within a stated tolerance (the two
backends sum in different orders).

The cases aim at the CUDA code's edges: every dtype; sizes 0, 1, chunk-1, chunk, chunk+1 and
several chunks; data pointers 1 and 3 elements off a 16-byte boundary on each list of a multi-list
op (the scalar paths); inf/NaN at chunk edges; more tensors than one launch holds (the metadata
capacity), so that the norm's cross-launch partials and the per-tensor step counters are
exercised; grids smaller than the chunk count; the skip path. Under emulation the schedule (block
and thread order) is the emulator's: `make test` runs this file under a forward and a seeded
random one.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import ampfuse
from ampfuse import _library, ops
from ampfuse.ops import split_master

TABLE = os.environ.get("AMPFUSE_KERNEL_TABLE", "cuda-emulated")
if TABLE not in ("cuda-emulated", "cuda"):
    raise ValueError(f"AMPFUSE_KERNEL_TABLE must be 'cuda-emulated' or 'cuda', got {TABLE!r}")
ON_GPU = TABLE == "cuda"
if ON_GPU:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="AMPFUSE_KERNEL_TABLE=cuda needs a GPU")
elif _library.emulator() is None:
    if os.environ.get("AMPFUSE_REQUIRE_EMULATION") == "1":
        raise RuntimeError(f"the emulated CUDA kernels are required but {_library.emulator_path()} does not exist")
    pytest.skip("this build has no emulated CUDA kernels (AMPFUSE_CUDA_EMULATION=OFF)", allow_module_level=True)

CHUNK = 32768  # kChunkSize of csrc/cuda/multi_tensor_apply.cuh
SIZES = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
OFFSETS = [0, 1, 3]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# Tensors per launch (TensorListMeta<N>::kMax for N lists: unscale 1, accumulate 2, SGD 5, Adam 6,
# AMSGrad 7).
PER_LAUNCH = {"unscale": 1197, "accumulate": 907, "sgd": 525, "adam": 460, "amsgrad": 410}

_native_name = None


def native_name() -> str:
    """The CPU kernel build (the optimizer rules' fused multiply-adds round twice in DEFAULT)."""
    global _native_name
    if _native_name is None:
        with kernel_table("native"):
            _native_name = ampfuse.cpu_kernel_info()["kernels"]
    return _native_name


@contextlib.contextmanager
def kernel_table(name: str, num_sms: int = 1):
    previous = "cuda-emulated" if os.environ.get("AMPFUSE_CPU_KERNELS") == "cuda-emulated" else "native"
    _library.select_cpu_kernels(name, num_sms)
    try:
        yield
    finally:
        _library.select_cpu_kernels(previous, int(os.environ.get("AMPFUSE_CUEMU_SMS", "1")))


@contextlib.contextmanager
def simulated_capture(on: bool):
    previous = _library.simulate_capture(on)
    try:
        yield
    finally:
        _library.simulate_capture(previous)


@contextlib.contextmanager
def cuda_table(num_sms: int = 1):
    """The CUDA table under test, with grids sized for `num_sms` multiprocessors."""
    if not ON_GPU:
        with kernel_table("cuda-emulated", num_sms):
            yield
        return
    previous = _library.limit_cuda_sms(num_sms)
    try:
        with torch.device("cuda"):  # tensors a call creates (found_inf, lr, ...) are made there
            yield
        torch.cuda.synchronize()
    finally:
        _library.limit_cuda_sms(previous)


def _gpu_twin(t):
    """A GPU copy of CPU tensor `t` with the same storage size, offset and strides."""
    if not isinstance(t, torch.Tensor):
        return t
    base = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="cuda")
    return base.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(t)


def _on_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def both(make, call, num_sms=1):
    """call(make()) through the CPU kernels and through the CUDA table under test; returns the two
    input structures afterwards (make() must build the same inputs each time, on the CPU)."""
    with kernel_table("native"):
        a = make()
        ra = call(a)
    b = make()
    if ON_GPU:
        host = b
        b = tree_map(_gpu_twin, host)
    with cuda_table(num_sms):
        rb = call(b)
    if ON_GPU:
        for h, d in zip(tree_flatten(host)[0], tree_flatten(b)[0]):
            if isinstance(h, torch.Tensor):
                h.copy_(d)
        b, rb = host, tree_map(_on_cpu, rb)
    return (a, ra), (b, rb)


def assert_same(x: torch.Tensor, y: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{msg}: {m}")


def assert_all_same(xs, ys, what: str) -> None:
    assert len(xs) == len(ys)
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert_same(x, y, f"{what}[{i}]")


def offset_tensor(values: torch.Tensor, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """`values` as a contiguous tensor of `dtype` whose data starts `offset` elements past a
    64-byte aligned allocation (offsets 1 and 3 break every vector alignment) and ends exactly where
    the allocation ends, so that a read or write one element past the end leaves the allocation (the
    sanitizer pass, `make test-sanitize`, reports it)."""
    n = values.numel()
    base = torch.empty(n + offset, dtype=dtype)
    t = base[offset:]
    t.copy_(values.reshape(-1))
    return t


def randn(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64, device="cpu") * scale


# ------------------------------------------------------------------------------------------------
# unscale_check_ / unscale_check_norm_ / check_norm_
# ------------------------------------------------------------------------------------------------


def _unscale_inputs(dtypes, sizes, offsets, seed, scale=300.0, nonfinite=()):
    tensors = []
    k = 0
    for dtype in dtypes:
        for n in sizes:
            for off in offsets:
                tensors.append(offset_tensor(randn(n, seed + k, scale), dtype, off))
                k += 1
    for i, pos, val in nonfinite:
        if tensors[i].numel():
            tensors[i][pos % tensors[i].numel()] = val
    return tensors


def _unscale_call(kind, inv, norm_type=2.0, max_norm=0.5, by_scale=False, overwrite=False, found_init=0.0):
    """by_scale: pass scale=1/inv instead of inv_scale; overwrite: overwrite_found_inf, with
    found_inf starting at found_init (e.g. a stale 1 or NaN garbage)."""
    def call(tensors):
        found_inf = torch.full((1,), found_init)
        flags = torch.zeros(len(tensors))
        scale_kw = dict(scale=torch.full((1,), 1.0 / inv)) if by_scale else {}
        inv_t = None if by_scale else torch.full((1,), inv)
        extra = dict(overwrite_found_inf=True) if overwrite else {}
        if kind == "unscale_check_":
            ops.unscale_check_(tensors, found_inf, inv_t, **scale_kw, **extra)
            return found_inf, None, None, None
        fn = ops.unscale_check_norm_ if kind == "unscale_check_norm_" else ops.check_norm_
        norm, coef = fn(tensors, found_inf, inv_t, norm_type=norm_type, max_norm=max_norm, per_tensor_found_inf=flags,
                        **scale_kw, **extra)
        return found_inf, flags, norm, coef

    return call


def _compare_unscale(a, b, norm_type):
    (ta, (fa, flags_a, norm_a, coef_a)), (tb, (fb, flags_b, norm_b, coef_b)) = a, b
    assert_all_same(ta, tb, "tensors")
    assert_same(fa, fb, "found_inf")
    if flags_a is None:
        return
    assert_same(flags_a, flags_b, "per_tensor_found_inf")
    if norm_type == math.inf or not math.isfinite(norm_a.item()):
        assert_same(norm_a, norm_b, "norm")  # a max (or inf/NaN) is exact
        assert_same(coef_a, coef_b, "clip_coef")
    else:
        torch.testing.assert_close(norm_b, norm_a, rtol=2e-6, atol=0)  # summation order differs
        assert coef_b.item() == pytest.approx(coef_a.item(), rel=4e-6)


@pytest.mark.parametrize("kind", ["unscale_check_", "unscale_check_norm_", "check_norm_"])
@pytest.mark.parametrize("dtype", DTYPES + ["mixed"])
@pytest.mark.parametrize("inv", [1.0 / 1024, 1.0])
def test_unscale_every_dtype_size_and_offset(kind, dtype, inv):
    dtypes = DTYPES if dtype == "mixed" else [dtype]
    sizes = [1, CHUNK + 1, 7] if dtype == "mixed" else SIZES
    for norm_type in ([2.0, math.inf] if kind != "unscale_check_" else [2.0]):
        a, b = both(lambda: _unscale_inputs(dtypes, sizes, OFFSETS, seed=11), _unscale_call(kind, inv, norm_type))
        _compare_unscale(a, b, norm_type)
        assert a[1][0].item() == 0.0


@pytest.mark.parametrize("kind", ["unscale_check_", "unscale_check_norm_", "check_norm_"])
@pytest.mark.parametrize("found_init", [1.0, math.nan], ids=["stale-1", "garbage"])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_unscale_from_scale_overwriting_found_inf(kind, found_init, num_sms):
    """scale= (the kernel takes float(1 / double(scale)) itself) and overwrite_found_inf (found_inf
    := 0 or 1 whatever it held): the GradScaler's check without reciprocal or fill launches. The
    result equals inv_scale= on a zeroed flag; a non-finite value in any block sets it."""
    for nonfinite in ([], [(4, CHUNK + 2, math.inf)]):
        make = lambda: _unscale_inputs(DTYPES, [5, 2 * CHUNK + 9], [0, 1], seed=13, nonfinite=nonfinite)  # noqa: E731
        for norm_type in ([2.0, math.inf] if kind != "unscale_check_" else [2.0]):
            with kernel_table("native"):  # the reference: inv_scale= on a zeroed flag, CPU kernels
                ref_in = make()
                ref = (ref_in, _unscale_call(kind, 1.0 / 512, norm_type)(ref_in))
            a, b = both(make, _unscale_call(kind, 1.0 / 512, norm_type, by_scale=True, overwrite=True, found_init=found_init),
                        num_sms=num_sms)
            _compare_unscale(ref, a, norm_type)
            _compare_unscale(a, b, norm_type)
            assert b[1][0].item() == (1.0 if nonfinite else 0.0)


def test_scale_reciprocal_is_torchs():
    """scale= multiplies by float(1 / double(scale)), torch's GradScaler inv_scale, also where
    that differs from the fp32 reciprocal."""
    scale = torch.tensor([3.0e-5 * 1.37], dtype=torch.float32)
    inv = scale.double().reciprocal().float()
    x = torch.linspace(-5, 5, 1001)
    _, (y, _) = both(lambda: [x.clone()], lambda y: ops.unscale_check_(y, torch.zeros(1), scale=torch.full((1,), scale.item())))
    assert_same(y[0], x * inv, "unscaled")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_unscale_nonfinite_at_chunk_edges(dtype, value):
    """A non-finite value at each chunk edge, found by every kind of pass. Where a value sits does
    not depend on the norm's type, so the two norm types take turns over the positions (each meets
    an edge at the start, inside and at the end); unscale_check_ has no norm."""
    n = 3 * CHUNK + 5
    for i, pos in enumerate([0, CHUNK - 1, CHUNK, 2 * CHUNK, n - 1]):
        norm_type = (2.0, math.inf)[i % 2]
        for kind in ["unscale_check_", "unscale_check_norm_", "check_norm_"]:
            make = lambda: _unscale_inputs([dtype], [5, n, 9], [0, 3], seed=3, nonfinite=[(3, pos, value)])  # noqa: E731
            a, b = both(make, _unscale_call(kind, 1.0 / 8, norm_type))
            _compare_unscale(a, b, norm_type)
            assert a[1][0].item() == 1.0 and b[1][0].item() == 1.0, (pos, kind)
            if a[1][1] is not None:
                assert b[1][1].tolist() == [0, 0, 0, 1, 0, 0], (pos, kind)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize("capture", [False, True], ids=["resident-table", "capture-split"])
def test_unscale_more_tensors_than_one_launch(norm_type, num_sms, capture):
    """Three launches' worth of tensors in one launch over a resident table, or (as under capture)
    in three launches: the norm combines the partials of every block of every launch, and
    per-tensor flags map back to positions in the caller's list."""
    count = 2 * PER_LAUNCH["unscale"] + 7
    sizes = [0 if i % 101 == 0 else (i * 37) % 50 + 1 + (CHUNK + 3 if i % 400 == 5 else 0) for i in range(count)]

    def make():
        tensors = [offset_tensor(randn(n, i, 50.0), DTYPES[i % 4], i % 3) for i, n in enumerate(sizes)]
        for i in (PER_LAUNCH["unscale"] + 3, count - 1):  # in the second and third launches
            tensors[i][0] = math.nan
        return tensors

    for kind in ["unscale_check_norm_", "check_norm_"]:
        with simulated_capture(capture):
            a, b = both(make, _unscale_call(kind, 0.25, norm_type, overwrite=capture), num_sms=num_sms)
        _compare_unscale(a, b, norm_type)
        flags = b[1][1]
        assert flags.nonzero().flatten().tolist() == [PER_LAUNCH["unscale"] + 3, count - 1]
    # and without non-finite values, a finite norm that agrees with float64
    def make_finite():
        return [offset_tensor(randn(n, i, 50.0), torch.float32, i % 3) for i, n in enumerate(sizes)]

    with simulated_capture(capture):  # split: every launch's partials at its own offset
        a, b = both(make_finite, _unscale_call("check_norm_", 0.25, norm_type, overwrite=capture), num_sms=num_sms)
    _compare_unscale(a, b, norm_type)
    ref = torch.linalg.vector_norm(torch.cat([t.double() for t in make_finite()]) * 0.25, norm_type)
    torch.testing.assert_close(b[1][2].double(), ref, rtol=1e-5, atol=0)


def test_unscale_empty_list_writes_norm_and_coef():
    a, b = both(lambda: [], _unscale_call("check_norm_", 0.5))
    assert b[1][2].item() == 0.0 and b[1][3].item() == 1.0
    _compare_unscale(a, b, 2.0)


# ------------------------------------------------------------------------------------------------
# accumulate_grads_
# ------------------------------------------------------------------------------------------------


def _accumulate_inputs(gdtype, sizes, offsets, seed, nonfinite=()):
    accs, grads = [], []
    k = 0
    for n in sizes:
        for acc_off, grad_off in offsets:
            accs.append(offset_tensor(randn(n, seed + k), torch.float32, acc_off))
            grads.append(offset_tensor(randn(n, seed + 1000 + k, 10.0), gdtype, grad_off))
            k += 1
    for i, pos, val in nonfinite:
        if grads[i].numel():
            grads[i][pos % grads[i].numel()] = val
    return accs, grads


def _accumulate_call(zero_grads):
    def call(inputs):
        accs, grads = inputs
        found_inf = torch.zeros(1)
        ops.accumulate_grads_(accs, grads, found_inf, zero_grads=zero_grads)
        return found_inf

    return call


def _compare_accumulate(a, b):
    ((acc_a, g_a), f_a), ((acc_b, g_b), f_b) = a, b
    assert_all_same(acc_a, acc_b, "accumulators")
    assert_all_same(g_a, g_b, "grads")
    assert_same(f_a, f_b, "found_inf")


ACC_OFFSETS = [(0, 0), (1, 0), (0, 1), (3, 3), (0, 3)]


@pytest.mark.parametrize("gdtype", OPT_DTYPES)
@pytest.mark.parametrize("zero_grads", [True, False])
def test_accumulate_every_dtype_size_and_offset(gdtype, zero_grads):
    a, b = both(lambda: _accumulate_inputs(gdtype, SIZES, ACC_OFFSETS, seed=5), _accumulate_call(zero_grads))
    _compare_accumulate(a, b)
    assert b[1].item() == 0.0
    if zero_grads:
        assert all(not g.any() for g in b[0][1])


@pytest.mark.parametrize("gdtype", OPT_DTYPES)
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_accumulate_nonfinite_at_chunk_edges(gdtype, value):
    n = 2 * CHUNK + 9
    for pos in [0, CHUNK - 1, CHUNK, n - 1]:
        for target in (2, 3):  # aligned (the vector path) and misaligned (the scalar path)
            a, b = both(lambda: _accumulate_inputs(gdtype, [3, n], [(0, 0), (1, 3)], seed=8, nonfinite=[(target, pos, value)]),
                        _accumulate_call(True))
            _compare_accumulate(a, b)
            assert b[1].item() == 1.0


@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize("capture", [False, True], ids=["resident-table", "capture-split"])
def test_accumulate_more_tensors_than_one_launch(num_sms, capture):
    count = PER_LAUNCH["accumulate"] + 11
    sizes = [(i * 13) % 40 + 1 for i in range(count)]

    def make():
        accs = [offset_tensor(randn(n, i), torch.float32, i % 2) for i, n in enumerate(sizes)]
        grads = [offset_tensor(randn(n, 5000 + i), OPT_DTYPES[i % 3], (i // 2) % 3) for i, n in enumerate(sizes)]
        grads[count - 2][0] = math.inf  # in the second launch
        return accs, grads

    with simulated_capture(capture):
        a, b = both(make, _accumulate_call(True), num_sms=num_sms)
    _compare_accumulate(a, b)
    assert b[1].item() == 1.0


# ------------------------------------------------------------------------------------------------
# update_scale_
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(hysteresis=3),
        dict(hysteresis=2, consecutive_hysteresis=True, min_scale=2.0**-3, max_scale=2.0**20),
        dict(min_scale=1.0, max_scale=2.0**18),
    ],
    ids=["torch", "hysteresis", "all", "bounds"],
)
def test_update_scale_sequences(options):
    import random

    rng = random.Random(4)
    found = [1.0 if rng.random() < (0.7 if (s // 50) % 2 else 0.05) else 0.0 for s in range(400)]

    def make():
        return (torch.full((1,), 2.0**16), torch.zeros(1, dtype=torch.int32),
                torch.full((1,), options.get("hysteresis", 1), dtype=torch.int32), torch.zeros(4, dtype=torch.int64))

    def call(state):
        scale, tracker, hyst, stats = state
        trace = []
        for f in found:
            ops.update_scale_(scale, tracker, torch.full((1,), f), 2.0, 0.5, 7, hysteresis_tracker=hyst, stats=stats, **options)
            trace.append(scale.item())
        return trace

    (sa, ta), (sb, tb) = both(make, call)
    assert ta == tb
    assert_all_same(list(sa), list(sb), "scale state")


# ------------------------------------------------------------------------------------------------
# sgd_step_ / adam_step_
# ------------------------------------------------------------------------------------------------

# Lists of an optimizer row: 0 param, 1 grad, 2 master, 3.. states. Offset patterns (elements) per
# list, cycled over the tensors of a call: aligned, each list alone off by 1 or 3, all off.
def _offset_patterns(nlists):
    pats = [[0] * nlists]
    for k in range(nlists):
        for off in (1, 3):
            p = [0] * nlists
            p[k] = off
            pats.append(p)
    pats.append([1] * nlists)
    pats.append([3, 1, 3, 1, 3, 1, 3][:nlists])
    return pats


def _optim_inputs(kind, pdtype, gdtype, master, sizes, nstates, seed, misalign=True, state_dtype=torch.float32):
    """master: False/None (no masters), True/"float" (fp32 masters) or "remainder" (bf16 params:
    int16 remainders, the param holding the master's upper half)."""
    master = {False: None, True: "float"}.get(master, master)
    nlists = 3 + nstates
    pats = _offset_patterns(nlists) if misalign else [[0] * nlists]
    params, grads, masters, states, steps = [], [], [], [[] for _ in range(nstates)], []
    for i, n in enumerate(sizes):
        pat = pats[i % len(pats)]
        p = randn(n, seed + i)
        if master == "remainder":
            hi, rem = split_master(p.float())
            params.append(offset_tensor(hi, pdtype, pat[0]))
            masters.append(offset_tensor(rem, torch.int16, pat[2]))
        else:
            params.append(offset_tensor(p, pdtype, pat[0]))
            if master == "float":
                masters.append(offset_tensor(p, torch.float32, pat[2]))
        grads.append(offset_tensor(randn(n, seed + 10_000 + i, 3.0), gdtype, pat[1]))
        for k in range(nstates):
            init = randn(n, seed + 20_000 + 1000 * k + i, 0.1)
            states[k].append(offset_tensor(init.abs() if k > 0 else init, state_dtype, pat[3 + k]))
        steps.append(torch.full((), float(i % 3)))
    return params, grads, masters, states, steps


def _optim_call(kind, hyper, schedule):
    """Several steps: `schedule` lists (found_inf, grad_scale, clip_coef, lr_tensor[, momentum
    tensor: SGD's momentum (configs with one) or Adam's beta1]) per step."""

    def call(inputs):
        params, grads, masters, states, steps = inputs
        for k, (found, scale, clip, lr_t, *momentum_t) in enumerate(schedule):
            scaling = dict(
                found_inf=torch.full((), found) if found is not None else None,
                grad_scale=torch.full((), scale) if scale is not None else None,
                clip_coef=torch.full((), clip) if clip is not None else None,
            )
            lr = torch.full((), lr_t) if lr_t is not None else hyper["lr"]
            if k:  # fresh gradients for every step (in place, so offsets stay)
                for i, g in enumerate(grads):
                    g.copy_(randn(g.numel(), 777 * k + i, 3.0).reshape(g.shape))
            h = {key: v for key, v in hyper.items() if key != "lr"}
            if momentum_t and (kind != "sgd" or hyper.get("momentum")):
                h["momentum" if kind == "sgd" else "beta1"] = torch.full((), momentum_t[0])
            if kind == "sgd":
                ops.sgd_step_(params, grads, masters, states[0] if states else [], steps, lr=lr, **h, **scaling)
            else:
                ops.adam_step_(params, grads, masters, states[0], states[1], states[2] if len(states) > 2 else [],
                               steps, lr=lr, **h, **scaling)
        return None

    return call


def _compare_optim(a, b, bitwise):
    (ia, _), (ib, _) = a, b
    names = ["params", "grads", "masters"]
    for name, xs, ys in zip(names, ia[:3], ib[:3]):
        if bitwise or name == "grads":
            assert_all_same(xs, ys, name)
        else:
            for x, y in zip(xs, ys):
                torch.testing.assert_close(y.float(), x.float(), rtol=1e-5, atol=1e-6)
    for k, (xs, ys) in enumerate(zip(ia[3], ib[3])):
        if bitwise:
            assert_all_same(xs, ys, f"state{k}")
        else:
            for x, y in zip(xs, ys):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    assert_all_same(ia[4], ib[4], "steps")


def _bitwise() -> bool:
    return native_name() in ("AVX2", "AVX512")


SGD_CONFIGS = {
    "plain": dict(lr=0.1),
    "momentum_wd": dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    "dampening_maximize": dict(lr=0.05, momentum=0.8, dampening=0.3, maximize=True),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
}
ADAM_CONFIGS = {
    "adam": dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8),
    "adam_wd_maximize": dict(lr=1e-2, weight_decay=0.01, maximize=True),
    "adamw": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "amsgrad": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, amsgrad=True, beta1=0.5, beta2=0.99),
}
# (found_inf, grad_scale, clip_coef, lr_tensor[, momentum tensor]) per step: plain, scaled+clipped,
# skipped, tensor lr and momentum (beta1).
SCHEDULE = [(None, None, None, None), (0.0, 1024.0, 0.5, None), (1.0, 1024.0, 0.5, None), (0.0, 2.0, None, 3e-3, 0.75)]


def _sizes():
    return [0, 1, 5, 17, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 3] + [33 + i for i in range(12)]


# (param dtype, grad dtype, master, state dtype): every combination the kernels admit -- grads of
# the param's dtype or fp32 (an accumulator's sums), fp32 masters for fp16/bf16 params, int16
# remainders for bf16 params, fp32 or bf16 state.
F16, B16, F32 = torch.float16, torch.bfloat16, torch.float32
OPTIM_VARIANTS = [
    (F32, F32, None, F32), (F32, F32, None, B16),
    (F16, F16, None, F32), (F16, F16, "float", F32), (F16, F32, "float", F32), (F16, F16, "float", B16),
    (B16, B16, None, F32), (B16, B16, "float", F32), (B16, F32, "float", F32), (B16, B16, "float", B16),
    (B16, B16, "remainder", F32), (B16, F32, "remainder", F32), (B16, B16, "remainder", B16),
]


def _variant_id(v):
    names = {F16: "fp16", B16: "bf16", F32: "fp32"}
    return f"{names[v[0]]}-grad_{names[v[1]]}-{v[2] or 'nomaster'}-state_{names[v[3]]}"


@pytest.mark.parametrize("variant", OPTIM_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("config", list(SGD_CONFIGS))
def test_sgd_step_every_dtype_offset_and_option(variant, config):
    pdtype, gdtype, master, sdtype = variant
    hyper = SGD_CONFIGS[config]
    nstates = 1 if hyper.get("momentum") else 0
    a, b = both(lambda: _optim_inputs("sgd", pdtype, gdtype, master, _sizes(), nstates, seed=21, state_dtype=sdtype),
                _optim_call("sgd", hyper, SCHEDULE))
    _compare_optim(a, b, _bitwise())


@pytest.mark.parametrize("variant", OPTIM_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
def test_adam_step_every_dtype_offset_and_option(variant, config):
    pdtype, gdtype, master, sdtype = variant
    hyper = ADAM_CONFIGS[config]
    nstates = 3 if hyper.get("amsgrad") else 2
    a, b = both(lambda: _optim_inputs("adam", pdtype, gdtype, master, _sizes(), nstates, seed=31, state_dtype=sdtype),
                _optim_call("adam", hyper, SCHEDULE))
    _compare_optim(a, b, _bitwise())


@pytest.mark.parametrize(("kind", "config", "gdtype"), [
    ("sgd", "nesterov", B16), ("adam", "adamw", B16), ("adam", "amsgrad", F32)], ids=["sgd", "adamw", "amsgrad-grad_fp32"])
def test_stochastic_rounding_every_offset(kind, config, gdtype):
    """bf16 params without masters rounded stochastically (rounding_seed): each element's draw
    from its index in the tensor (chunks past the first included), the param's bits before the
    update and the step count, on every offset and through the schedule's skipped step."""
    hyper = dict((SGD_CONFIGS if kind == "sgd" else ADAM_CONFIGS)[config], rounding_seed=2**33 + 5)
    nstates = {"nesterov": 1, "adamw": 2, "amsgrad": 3}[config]
    a, b = both(lambda: _optim_inputs(kind, B16, gdtype, None, _sizes(), nstates, seed=71),
                _optim_call(kind, hyper, SCHEDULE))
    _compare_optim(a, b, _bitwise())


@pytest.mark.parametrize("kind", ["sgd", "adam", "amsgrad"])
@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize("capture", [False, True], ids=["resident-table", "capture-split"])
def test_optim_more_tensors_than_one_launch(kind, num_sms, capture):
    """More tensors than one launch's parameters hold: one launch over a resident metadata table,
    or (as under CUDA-graph capture, before the table is resident) two or three launches with
    workspace the kernels zero themselves. Every tensor's step counter advances exactly once per
    step taken, also for empty tensors and tensors split over several chunks."""
    count = 2 * PER_LAUNCH[kind] + 5
    sizes = [(i * 29) % 60 + (2 * CHUNK if i % 300 == 7 else 0) for i in range(count)]
    hyper = SGD_CONFIGS["momentum_wd"] if kind == "sgd" else ADAM_CONFIGS["amsgrad" if kind == "amsgrad" else "adamw"]
    nstates = {"sgd": 1, "adam": 2, "amsgrad": 3}[kind]
    schedule = [(0.0, 8.0, 0.75, None), (1.0, 8.0, 0.75, None), (0.0, 8.0, None, None)]
    with simulated_capture(capture):
        a, b = both(lambda: _optim_inputs("sgd" if kind == "sgd" else "adam", torch.bfloat16, torch.bfloat16,
                                          "remainder" if kind == "adam" else True, sizes, nstates, seed=41, misalign=False),
                    _optim_call("sgd" if kind == "sgd" else "adam", hyper, schedule), num_sms=num_sms)
    _compare_optim(a, b, _bitwise())
    steps_b = b[0][4]
    assert [s.item() for s in steps_b] == [float(i % 3) + 2 for i in range(count)]


@pytest.mark.parametrize("num_sms", [1, 2])
def test_optim_tensors_of_many_chunks_grid_smaller_than_chunks(num_sms):
    """Tensors of 5 to 11 chunks on grids of 4 or 8 blocks: blocks loop over chunks, and the last
    block to finish a tensor (not the last launched) advances its step counter once."""
    sizes = [5 * CHUNK + 11, 11 * CHUNK, 7 * CHUNK - 1]
    for kind, hyper, nstates in [("sgd", SGD_CONFIGS["nesterov"], 1), ("adam", ADAM_CONFIGS["amsgrad"], 3)]:
        a, b = both(lambda: _optim_inputs(kind, torch.float16, torch.float32, True, sizes, nstates, seed=51),
                    _optim_call(kind, hyper, SCHEDULE), num_sms=num_sms)
        _compare_optim(a, b, _bitwise())
        assert [s.item() for s in b[0][4]] == [float(i % 3) + 3 for i in range(len(sizes))]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optim_skip_changes_nothing(kind):
    """A set found_inf: no element and no step counter changes, on the first step too."""
    hyper = SGD_CONFIGS["momentum_wd"] if kind == "sgd" else ADAM_CONFIGS["amsgrad"]
    nstates = 1 if kind == "sgd" else 3

    def make():
        return _optim_inputs(kind, torch.bfloat16, torch.bfloat16, True, _sizes(), nstates, seed=61)

    before = make()
    a, b = both(make, _optim_call(kind, hyper, [(1.0, 4.0, 0.5, None), (3.0, None, None, 1e-2)]))
    for x, y in zip([before[0], before[2], *before[3]], [b[0][0], b[0][2], *b[0][3]]):
        assert_all_same(x, y, "unchanged")
    assert_all_same(before[4], b[0][4], "steps")
    _compare_optim(a, b, True)


@pytest.mark.skipif(ON_GPU, reason="the emulator's launch counter (on a GPU, tests/test_launches.py counts)")
def test_emulator_counts_launches():
    """The emulator's launch counter sees the CUDA launch sequence of one call."""
    emu = _library.emulator()
    import ctypes

    def launches():
        n, blocks, switches = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_ulonglong()
        emu.cuemu_stats(ctypes.byref(n), ctypes.byref(blocks), ctypes.byref(switches))
        return n.value

    with kernel_table("cuda-emulated"):
        grads = [torch.randn(10) for _ in range(PER_LAUNCH["unscale"] + 1)]
        before = launches()
        ops.check_norm_(grads, torch.zeros(1), torch.ones(1))
        assert launches() - before == 1  # one launch over a resident metadata table
        with simulated_capture(True):  # no table uploads during a capture: two launches' worth
            before = launches()
            ops.check_norm_([g.clone() for g in grads], torch.zeros(1), torch.ones(1))
            assert launches() - before == 2
        before = launches()
        ops.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 10)
        assert launches() - before == 1


def test_remainder_special_values_bit_for_bit():
    """Remainder masters next to params no split produces (edited to zero, inf or NaN) and NaN or
    infinite masters: the vectorised CPU join/split and the CUDA kernels (ops/rules.h) agree on
    every bit of the params and remainders (NaN payloads included), in the vector body and the
    tail."""
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -2.5, 3.0e38, -3.0e38, 1e-40]

    def make():
        n = 67  # 2 vectors of 32 (AVX-512) / 4 of 16 (AVX2) and a tail
        vals = torch.tensor([specials[i % len(specials)] for i in range(n)], dtype=torch.float32)
        params = [vals.to(torch.bfloat16)]
        rem = torch.tensor([(-1) ** i * (i * 977 % 32768) for i in range(n)], dtype=torch.int16)
        grads = [torch.tensor([((i % 7) - 3) * 0.25 for i in range(n)], dtype=torch.bfloat16)]
        states = [[torch.zeros(n)], [torch.zeros(n)]]
        return params, grads, [rem], states, [torch.zeros(())]

    a, b = both(make, _optim_call("adam", ADAM_CONFIGS["adamw"], [(None, None, None, None), (0.0, 2.0, 0.5, None)]))
    for x, y, what in [(a[0][0][0], b[0][0][0], "params"), (a[0][2][0], b[0][2][0], "remainders")]:
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), what


# ------------------------------------------------------------------------------------------------
# quantize_blocks / dequantize_blocks
# ------------------------------------------------------------------------------------------------

QUANT_FORMATS = [(torch.uint8, False), (torch.uint8, True), (torch.float8_e4m3fn, False), (torch.float8_e5m2, True)]
QUANT_SIZES = [0, 1, 255, 256, 257, 1000 * 256 + 3]  # the last: more blocks than the grid holds


@pytest.mark.parametrize(("dtype", "nonnegative"), QUANT_FORMATS, ids=["signed", "unsigned", "e4m3", "e5m2"])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_quantize_every_size_and_format(dtype, nonnegative, num_sms):
    """Codes and absmax bitwise equal to the CPU kernels' (one CUDA block reduces one quantization
    block; the grid strides over the rest), magnitudes over many decades, zeros, a NaN block and a
    zero block; then the decoding of those codes, bitwise."""

    def make():
        out = []
        for k, n in enumerate(QUANT_SIZES):
            x = (randn(n, 100 + k) * torch.exp(randn(n, 200 + k) * 5)).float()
            if nonnegative:
                x = x.abs()
            if n > 600:
                x[300] = math.nan  # the second block
                x[512:768] = 0.0  # the third
            out.append(x)
        return out

    def call(xs):
        return [ops.quantize_blocks(x, dtype, nonnegative=nonnegative) for x in xs]

    (_, ra), (_, rb) = both(make, call, num_sms)
    for k, ((ca, ma), (cb, mb)) in enumerate(zip(ra, rb)):
        assert torch.equal(ca.view(torch.uint8), cb.view(torch.uint8)), QUANT_SIZES[k]
        assert torch.equal(ma.view(torch.int32), mb.view(torch.int32)), QUANT_SIZES[k]

    def call_decode(pairs):
        return [ops.dequantize_blocks(c, m, nonnegative=nonnegative) for c, m in pairs]

    (_, da), (_, db) = both(lambda: [(c.clone(), m.clone()) for c, m in ra], call_decode, num_sms)
    for k, (x, y) in enumerate(zip(da, db)):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), QUANT_SIZES[k]


@pytest.mark.parametrize(("kind", "formats", "stochastic"), [
    ("adam", (torch.uint8, torch.uint8), False), ("adam", (torch.float8_e4m3fn, torch.float8_e5m2), False),
    ("amsgrad", (torch.uint8, torch.float8_e5m2), False), ("sgd", (torch.float8_e4m3fn,), False),
    ("adam", (torch.uint8, torch.uint8), True)],
    ids=["adam-uint8", "adam-fp8", "amsgrad-mixed", "sgd-e4m3", "adam-uint8-stochastic"])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_8bit_state_steps(kind, formats, stochastic, num_sms):
    """The fused steps with 8-bit state against the CPU kernels: bf16 params with remainders (the
    widest master path) or rounded stochastically, quantization blocks inside CUDA chunks and
    ragged at tensors' ends, more tensors than one launch holds (the step counters' tickets across
    launches), the schedule's scaled, skipped and tensor-lr steps; params, remainders, codes,
    absmax and steps bitwise."""
    nstates = {"sgd": 1, "adam": 2, "amsgrad": 3}[kind]
    sizes = [1, 255, 257, CHUNK + 300] + [1 + i % 7 for i in range(600)]

    def make():
        params, grads, masters, states, absmax, steps = [], [], [], [[] for _ in range(nstates)], [[] for _ in range(nstates)], []
        for k, n in enumerate(sizes):
            w = randn(n, 10 + k).float()
            params.append(w.to(torch.bfloat16))
            if not stochastic:
                masters.append(ops.split_master(w)[1])
            grads.append((randn(n, 5000 + k) * 8).to(torch.bfloat16))
            for j in range(nstates):
                x = randn(n, 9000 + 7 * k + j).float() * 1e-2
                c, a = ops.quantize_blocks(x * x if j else x, formats[min(j, len(formats) - 1)], nonnegative=j > 0)
                states[j].append(c)
                absmax[j].append(a)
            steps.append(torch.full((), 2.0))
        return params, grads, masters, states, absmax, steps

    def call(x):
        params, grads, masters, states, absmax, steps = x
        for found, scale, clip, lr, *momentum in SCHEDULE:
            sc = dict(found_inf=None if found is None else torch.full((1,), found),
                      grad_scale=None if scale is None else torch.full((1,), scale),
                      clip_coef=None if clip is None else torch.full((1,), clip),
                      rounding_seed=17 if stochastic else None)
            if kind == "sgd":
                ops.sgd_step_(params, grads, masters, states[0], steps, lr=torch.full((1,), lr) if lr else 0.05,
                              momentum=torch.full((1,), momentum[0]) if momentum else 0.9, weight_decay=0.01, momentum_absmax=absmax[0], **sc)
            else:
                ops.adam_step_(params, grads, masters, states[0], states[1], states[2] if kind == "amsgrad" else [],
                               steps, lr=torch.full((1,), lr) if lr else 1e-2, weight_decay=0.1, decoupled_weight_decay=True,
                               beta1=torch.full((1,), momentum[0]) if momentum else 0.9,
                               amsgrad=kind == "amsgrad", exp_avg_absmax=absmax[0], exp_avg_sq_absmax=absmax[1],
                               max_exp_avg_sq_absmax=absmax[2] if kind == "amsgrad" else [], **sc)

    (a, _), (b, _) = both(make, call, num_sms)
    if not _bitwise():  # the DEFAULT CPU build rounds its multiply-adds twice
        pytest.skip(f"the {native_name()} CPU kernels are not bitwise comparable")
    for what, i in [("params", 0), ("remainders", 2), ("steps", 5)]:
        assert_all_same([t.view(torch.int16) if t.dtype == torch.bfloat16 else t for t in a[i]],
                        [t.view(torch.int16) if t.dtype == torch.bfloat16 else t for t in b[i]], what)
    for j in range(nstates):
        assert_all_same([c.view(torch.uint8) for c in a[3][j]], [c.view(torch.uint8) for c in b[3][j]], f"codes{j}")
        assert_all_same(a[4][j], b[4][j], f"absmax{j}")


def test_mutation_list_matches_the_kernel_sources():
    """`make cuda-mutants` injects each bug by replacing a text of the kernel sources: every such
    text must still occur exactly once, or the mutant no longer tests anything."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("ampfuse_mutants", os.path.join(root, "tests", "cuemu", "mutants.py"))
    mutants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutants)
    assert len(mutants.MUTANTS) >= 8
    for what, fname, old, new, *mode in mutants.MUTANTS:
        assert mode in ([], ["sanitize"]), what
        with open(os.path.join(root, "csrc", "cuda", fname), encoding="utf-8") as f:
            assert f.read().count(old) == 1, what
        assert old != new, what
