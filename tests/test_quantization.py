"""The 8-bit block-scaled state form: ``ops.quantize_blocks`` / ``ops.dequantize_blocks``.

Against a reference written here from the format's definition (the dynamic map of Dettmers et al.
(2022) built from its construction, the fp8 tables from torch's own fp8 decoding, nearest entry by
exhaustive search): every table entry, every code's round trip (the property that makes a
checkpoint of 8-bit state, saved as fp32, load back bitwise), the block structure (ragged last
block, absmax per block, blocks marked by an inf or a NaN), the second-moment rules, argument
errors, and ``opcheck``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from ampfuse import ops
from conftest import DEVICES

FORMATS = [  # (dtype, nonnegative)
    (torch.uint8, False),
    (torch.uint8, True),
    (torch.float8_e4m3fn, False),
    (torch.float8_e5m2, False),
    (torch.float8_e4m3fn, True),
]
FORMAT_IDS = ["dynamic-signed", "dynamic-unsigned", "e4m3", "e5m2", "e4m3-nonnegative"]
BLOCK = ops.QUANT_BLOCK


def reference_table(dtype: torch.dtype, nonnegative: bool) -> torch.Tensor:
    """The format's magnitudes in [0, 1], ascending, as float32 (fp8: inf/NaN where the byte is not
    a finite number)."""
    if dtype == torch.uint8:
        # Dettmers et al. (2022), dynamic quantization: in each decade 10^-7..1, the midpoints of an
        # even split of [0.1, 1] into `steps` parts; plus 0 and 1.
        steps = [2 << d for d in range(7)] if nonnegative else [1, 2, 4, 8, 16, 32, 63]
        values = [0.0]
        for d, n in enumerate(steps):
            decade = float(f"1e{d - 6}")
            values += [decade * (0.1 + 0.9 * (2 * k + 1) / (2 * n)) for k in range(n)]
        values.append(1.0)
        return torch.tensor(values, dtype=torch.float64).float()
    top = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    decoded = torch.arange(128, dtype=torch.uint8).view(dtype).double()
    return (decoded / top).float()


def reference_encode(x: torch.Tensor, absmax: float, table: torch.Tensor, signed: bool, nonnegative: bool,
                     marked: bool = False) -> torch.Tensor:
    """Nearest entry to |x| / absmax by exhaustive search (ties: the even index). In a ``marked``
    block (one holding an inf or a NaN): index 1 is inf (with the sign bit -inf), 0x80 (signed) or
    index 2 (unsigned) NaN, and a finite value off those takes the nearer of 0 and the next index up
    (a positive second moment: the next index up)."""
    if marked:
        codes = reference_encode(torch.where(x.isfinite(), x, torch.zeros_like(x)), absmax, table, signed, nonnegative)
        up = 2 if signed else 3
        low = codes.long() & (0x7F if signed else 0xFF)
        a = x.abs() / absmax if absmax > 0 else torch.zeros_like(x)
        down = (a < table[up] - a) & (not nonnegative)
        moved = torch.where(down, torch.zeros_like(low), (codes.long() & 0x80) | up)
        out = torch.where((low != 0) & (low < up), moved, codes.long())
        out = torch.where(x == math.inf, torch.ones_like(out), out)
        out = torch.where(x == -math.inf, torch.full_like(out, 0 if nonnegative else 0x81), out)
        out = torch.where(x.isnan(), torch.full_like(out, 0x80 if signed else 2), out)
        return out.to(torch.uint8)
    a = (x.abs() / absmax) if absmax > 0 else torch.full_like(x, math.nan)
    if nonnegative:
        a = torch.where(x < 0, torch.zeros_like(a), a)
    finite = table[torch.isfinite(table)]
    dist = (a[:, None] - finite[None, :]).abs()  # float32 subtraction, as the rule computes it
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    index = torch.arange(finite.numel())
    # the lowest even index among the nearest, else the lowest
    even = candidates & (index % 2 == 0)
    idx = torch.where(even.any(1), (even * (1000 - index)).argmax(1), (candidates * (1000 - index)).argmax(1))
    idx = torch.where(a > 0, idx, torch.zeros_like(idx))  # 0 and NaN
    if nonnegative:
        idx = torch.where((idx == 0) & (a > 0), torch.ones_like(idx), idx)
    if signed:
        idx = torch.where((x < 0) & (idx != 0), idx | 0x80, idx)
    return idx.to(torch.uint8)


def codes_of(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8).reshape(-1)


def all_codes(dtype: torch.dtype, nonnegative: bool) -> torch.Tensor:
    """Every code the format produces for a block whose absmax is 1."""
    table = reference_table(dtype, nonnegative)
    finite = [i for i in range(table.numel()) if math.isfinite(float(table[i]))]
    if dtype == torch.uint8 and nonnegative:
        return torch.tensor(finite, dtype=torch.uint8)
    negative = [] if nonnegative else [i | 0x80 for i in finite if i != 0]  # nonnegative: no sign
    return torch.tensor(finite + negative, dtype=torch.uint8)


@pytest.mark.parametrize(("dtype", "nonnegative"), FORMATS, ids=FORMAT_IDS)
def test_every_table_entry_is_the_formats_definition(dtype, nonnegative):
    codes = all_codes(dtype, nonnegative)
    signed = not (dtype == torch.uint8 and nonnegative)
    absmax = torch.ones(math.ceil(codes.numel() / BLOCK))
    decoded = ops.dequantize_blocks(codes.view(dtype) if dtype != torch.uint8 else codes, absmax, nonnegative=nonnegative)
    table = reference_table(dtype, nonnegative)
    low = codes.long() & (0x7F if signed else 0xFF)
    expected = table[low] * torch.where(codes.long() & 0x80 != 0, -1.0, 1.0) if signed else table[low]
    assert torch.equal(decoded, expected)
    assert float(table[torch.isfinite(table)].max()) == 1.0  # the block's absmax decodes exactly


@pytest.mark.parametrize(("dtype", "nonnegative"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("absmax", [1.0, 3.7e-3, 2.5e12, 2.0**-90])
def test_every_code_survives_a_round_trip_through_fp32(dtype, nonnegative, absmax):
    # A block of every code, scaled: decode, requantize, and the codes and absmax come back bitwise
    # (an 8-bit state saved as its fp32 values loads back exactly).
    codes = all_codes(dtype, nonnegative)
    codes = torch.cat([codes, codes[codes.numel() // 3:]])  # more than one block, a ragged last
    top = int(torch.nonzero(reference_table(dtype, nonnegative) == 1.0)[0])
    codes[::BLOCK] = top  # every block holds its absmax
    absmax_t = torch.full((math.ceil(codes.numel() / BLOCK),), absmax)
    stored = codes.view(dtype) if dtype != torch.uint8 else codes
    values = ops.dequantize_blocks(stored, absmax_t, nonnegative=nonnegative)
    again, again_absmax = ops.quantize_blocks(values, dtype, nonnegative=nonnegative)
    assert torch.equal(again_absmax, absmax_t)
    assert torch.equal(codes_of(again), codes), (codes_of(again) != codes).nonzero()[:5]


@pytest.mark.parametrize(("dtype", "nonnegative"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_encoding_is_the_nearest_entry(dtype, nonnegative, seed):
    g = torch.Generator().manual_seed(seed)
    n = 3 * BLOCK + 77
    # magnitudes over many decades, both signs, exact zeros, and each block's largest value first
    x = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)).float()
    x[5::31] = 0.0
    table = reference_table(dtype, nonnegative)
    # values exactly between two entries (ties) and exactly on entries, in the first block
    finite = table[torch.isfinite(table)].double()
    x[1:40] = ((finite[10:49] + finite[11:50]) / 2).float() * x[:BLOCK].abs().max()
    codes, absmax = ops.quantize_blocks(x, dtype, nonnegative=nonnegative)
    signed = not (dtype == torch.uint8 and nonnegative)
    for b in range(absmax.numel()):
        block = x[b * BLOCK:(b + 1) * BLOCK]
        m = float(block.abs().max())
        assert float(absmax[b]) == m
        expected = reference_encode(block, m, table, signed, nonnegative)
        got = codes_of(codes)[b * BLOCK:(b + 1) * BLOCK]
        assert torch.equal(got, expected), (b, (got != expected).nonzero()[:5].tolist())


def decision_values(dtype: torch.dtype, nonnegative: bool, ulps: int = 3) -> torch.Tensor:
    """Magnitudes in [0, 1] at and beside every place where an encoder could decide differently
    from the nearest-entry rule: each entry, each midpoint of two neighbours, each power of two and
    each power of ten, with their `ulps` float neighbours on either side."""
    table = reference_table(dtype, nonnegative)
    finite = table[torch.isfinite(table)].double()
    anchors = torch.cat([finite, (finite[1:] + finite[:-1]) / 2,
                         torch.tensor([2.0**-k for k in range(0, 40)] + [10.0**-k for k in range(0, 10)],
                                      dtype=torch.float64)]).float()
    out, up, down = [anchors], anchors, anchors
    for _ in range(ulps):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-1.0))
        out += [up, down]
    v = torch.cat(out)
    return v[(v >= 0) & (v <= 1)].unique()


MARKS = torch.tensor([math.inf, -math.inf, math.nan])


def encode_decision_values(dtype: torch.dtype, nonnegative: bool, marked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """decision_values, both signs, in blocks that each hold 1.0 (so |x| / absmax is |x| itself),
    and when ``marked`` also inf, -inf and NaN: the values and their codes."""
    v = decision_values(dtype, nonnegative)
    v = torch.cat([v, -v])
    head = torch.cat([torch.ones(1), MARKS]) if marked else torch.ones(1)
    per = BLOCK - head.numel()
    blocks = [torch.cat([head, v[i:i + per]]) for i in range(0, v.numel(), per)]
    x = torch.cat(blocks)
    codes, _ = ops.quantize_blocks(x, dtype, nonnegative=nonnegative)
    return x, codes_of(codes)


@pytest.mark.parametrize(("dtype", "nonnegative"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("marked", [False, True], ids=["finite", "marked"])
def test_values_beside_every_decision_encode_as_the_nearest_entry(dtype, nonnegative, marked):
    # An encoder that guesses an index by arithmetic and corrects it once (any fast one) errs, if
    # at all, right at a midpoint, an entry, or where its guess changes rule (binades, decades).
    x, got = encode_decision_values(dtype, nonnegative, marked)
    signed = not (dtype == torch.uint8 and nonnegative)
    expected = reference_encode(x, 1.0, reference_table(dtype, nonnegative), signed, nonnegative, marked)
    bad = (got != expected).nonzero().reshape(-1)
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(expected[i])) for i in bad[:5]]


_CAPABILITY_SCRIPT = """
import sys, torch, ampfuse
sys.path.insert(0, sys.argv[1])
import test_quantization as t
assert ampfuse.cpu_kernel_info()["kernels"] == sys.argv[2], ampfuse.cpu_kernel_info()
torch.save([t.encode_decision_values(d, n, m)[1] for d, n in t.FORMATS for m in (False, True)], sys.argv[3])
"""


@pytest.mark.skipif(os.environ.get("AMPFUSE_CPU_KERNELS") == "cuda-emulated", reason="runs the CPU kernels, not the emulated CUDA ones")
def test_every_cpu_capability_encodes_the_decisions_alike(tmp_path):
    # The CPU kernels are compiled once per capability (DEFAULT, AVX2, AVX-512), each with its own
    # vector code; the process runs one of them, so the others are run in child processes.
    supported = ["DEFAULT", "AVX2", "AVX512"]
    capability = torch.backends.cpu.get_cpu_capability()
    runnable = supported[: supported.index(capability) + 1] if capability in supported else ["DEFAULT"]
    ours = [encode_decision_values(d, n, m)[1] for d, n in FORMATS for m in (False, True)]
    for cap in runnable:
        out = tmp_path / f"{cap}.pt"
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap.lower())
        subprocess.run([sys.executable, "-c", _CAPABILITY_SCRIPT, os.path.dirname(__file__), cap, str(out)],
                       env=env, check=True)
        cases = [(d, n, m) for d, n in FORMATS for m in (False, True)]
        for case, theirs, mine in zip(cases, torch.load(out), ours, strict=True):
            assert torch.equal(theirs, mine), (cap, case)


def test_fp8_codes_are_the_fp8_numbers_of_the_scaled_values():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * BLOCK, generator=g) * 0.01
    for dtype, top in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        codes, absmax = ops.quantize_blocks(x, dtype)
        decoded = ops.dequantize_blocks(codes, absmax)
        scaled = codes.float() * (absmax.repeat_interleave(BLOCK) / top)
        torch.testing.assert_close(decoded, scaled, rtol=2**-22, atol=0)
        # and equal to torch's round-to-nearest cast of the scaled values, away from exact ties
        cast = (x / absmax.repeat_interleave(BLOCK) * top).to(dtype)
        assert (codes.view(torch.uint8) == cast.view(torch.uint8)).float().mean() > 0.99


@pytest.mark.parametrize(("dtype", "nonnegative"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_an_inf_or_nan_stays_itself_and_its_block_keeps_its_other_values(dtype, nonnegative, device):
    """As in an fp32 state: a block holding an inf or a NaN is marked (its absmax, the largest
    finite magnitude, stored negated), the non-finite values decode as themselves (-inf as 0 for a
    second moment) and the finite ones as in a block without them; the blocks beside are untouched;
    a round trip is bitwise. The issue's case: [inf, 1, 2, 3] as a second moment."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(3 * BLOCK + 5, generator=g) + 0.5
    x[BLOCK + 3], x[BLOCK + 7], x[BLOCK + 11] = math.inf, -math.inf, math.nan
    x[2 * BLOCK + 9] = math.nan  # a block marked by a NaN alone
    clean = torch.where(x.isfinite(), x, torch.zeros_like(x))
    codes, absmax = ops.quantize_blocks(x.to(device), dtype, nonnegative=nonnegative)
    clean_codes, clean_absmax = ops.quantize_blocks(clean, dtype, nonnegative=nonnegative)
    codes, absmax = codes.cpu(), absmax.cpu()
    assert torch.equal(absmax.abs(), clean_absmax)  # the largest finite magnitude
    assert torch.equal(absmax.signbit(), torch.tensor([False, True, True, False]))
    out = ops.dequantize_blocks(codes.to(device), absmax.to(device), nonnegative=nonnegative).cpu()
    finite = x.isfinite()
    assert torch.equal(out[finite], ops.dequantize_blocks(clean_codes, clean_absmax, nonnegative=nonnegative)[finite])
    assert out[BLOCK + 3] == math.inf and out[BLOCK + 7] == (0.0 if nonnegative else -math.inf)
    assert out[BLOCK + 11].isnan() and out[2 * BLOCK + 9].isnan() and int(out.isnan().sum()) == 2
    again, again_absmax = ops.quantize_blocks(out.to(device), dtype, nonnegative=nonnegative)
    assert torch.equal(codes_of(again.cpu()), codes_of(codes))
    assert torch.equal(again_absmax.cpu().view(torch.int32), absmax.view(torch.int32))
    second, second_absmax = ops.quantize_blocks(torch.tensor([math.inf, 1.0, 2.0, 3.0], device=device), dtype,
                                                nonnegative=True)
    decoded = ops.dequantize_blocks(second, second_absmax, nonnegative=True).cpu()
    assert decoded[0] == math.inf and decoded[3] == 3.0 and bool(decoded[1:].isfinite().all())
    assert float(second_absmax) == -3.0


@pytest.mark.parametrize(("dtype", "nonnegative"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_marked_block_of_absmax_zero_keeps_its_inf_and_nan(dtype, nonnegative, device):
    """A block whose finite values are all 0 or below fp32's normal range has absmax -0: its
    finite values are stored as zeros, its inf and NaN still as themselves (an inf once took the
    finite values' magnitude of 0 and decoded as 0 in the fp8 formats)."""
    x = torch.cat([torch.tensor([math.inf, 0.0, 1e-45, -math.inf, math.nan, -3e-39]), torch.zeros(250),
                   torch.tensor([math.inf])])
    codes, absmax = ops.quantize_blocks(x.to(device), dtype, nonnegative=nonnegative)
    assert absmax.cpu().view(torch.int32).tolist() == [-2**31, -2**31]  # -0.0: marked, no magnitude
    out = ops.dequantize_blocks(codes, absmax, nonnegative=nonnegative).cpu()
    assert out[0] == math.inf and out[-1] == math.inf and out[4].isnan()
    assert out[3] == (0.0 if nonnegative else -math.inf)
    assert bool((out[[1, 2, 5]] == 0).all()) and bool((out[6:-1] == 0).all())


@pytest.mark.parametrize(("dtype", "nonnegative"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_every_code_of_a_marked_block_survives_a_round_trip(dtype, nonnegative, device):
    """Every code a marked block can hold (the marks, and every finite code but the ones the marks
    take), decoded and encoded again: the same codes and absmax."""
    signed = not (dtype == torch.uint8 and nonnegative)
    codes = all_codes(dtype, nonnegative)
    low = codes.long() & (0x7F if signed else 0xFF)
    codes = codes[(low == 0) | (low >= (2 if signed else 3))]
    marks = [1, 0x80] + ([] if nonnegative else [0x81]) if signed else [1, 2]
    top = int(torch.nonzero(reference_table(dtype, nonnegative) == 1.0)[0])
    codes = torch.cat([torch.tensor([top] + marks, dtype=torch.uint8), codes])
    codes[BLOCK::BLOCK] = top  # every block holds its absmax
    for absmax in (-1.0, -3.7e-3, -2.0**-90):
        absmax_t = torch.full((math.ceil(codes.numel() / BLOCK),), absmax)
        absmax_t[1:] = abs(absmax)  # the blocks past the first hold no mark
        stored = codes.view(dtype) if dtype != torch.uint8 else codes
        values = ops.dequantize_blocks(stored.to(device), absmax_t.to(device), nonnegative=nonnegative)
        again, again_absmax = ops.quantize_blocks(values, dtype, nonnegative=nonnegative)
        assert torch.equal(again_absmax.cpu(), absmax_t)
        assert torch.equal(codes_of(again.cpu()), codes), (codes_of(again.cpu()) != codes).nonzero()[:5]


def test_zero_block_and_empty_tensor():
    codes, absmax = ops.quantize_blocks(torch.zeros(BLOCK + 1), torch.uint8)
    assert torch.equal(absmax, torch.zeros(2)) and not codes.any()
    assert torch.equal(ops.dequantize_blocks(codes, absmax), torch.zeros(BLOCK + 1))
    codes, absmax = ops.quantize_blocks(torch.empty(0, 3), torch.uint8)
    assert codes.shape == (0, 3) and absmax.shape == (0,)
    assert ops.dequantize_blocks(codes, absmax).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_second_moment_never_encodes_a_positive_value_as_zero(dtype):
    x = torch.tensor([1.0, 1e-30, 0.0, -2e-3, 1e-9] + [0.5] * 10)
    codes, absmax = ops.quantize_blocks(x, dtype, nonnegative=True)
    out = ops.dequantize_blocks(codes, absmax, nonnegative=True)
    assert (out[[0, 1, 4]] > 0).all()  # the tiny ones decode to the smallest positive entry
    assert out[2] == 0 and out[3] == 0  # zero, and a negative value, decode as 0
    signed, sabsmax = ops.quantize_blocks(x, dtype)
    assert ops.dequantize_blocks(signed, sabsmax)[1] == 0  # without the rule 1e-30 rounds to 0


def test_shapes_and_layouts():
    x = torch.randn(6, 100).t()  # not contiguous: blocks follow the flat (row-major) order
    codes, absmax = ops.quantize_blocks(x, torch.uint8)
    flat_codes, flat_absmax = ops.quantize_blocks(x.contiguous().reshape(-1), torch.uint8)
    assert codes.shape == x.shape and torch.equal(codes.reshape(-1), flat_codes)
    assert torch.equal(absmax, flat_absmax)
    assert ops.dequantize_blocks(codes, absmax).shape == x.shape


def test_results_do_not_depend_on_the_thread_count():
    x = torch.randn(40 * BLOCK * 64 + 3) * 5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.quantize_blocks(x, torch.uint8)
        torch.set_num_threads(2)
        two = ops.quantize_blocks(x, torch.uint8)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_bad_arguments_are_named():
    x = torch.randn(300)
    with pytest.raises(RuntimeError, match=r"values must be a torch.float32 tensor, got torch.float16"):
        ops.quantize_blocks(x.half(), torch.uint8)
    with pytest.raises(RuntimeError, match=r"dtype must be torch.uint8, torch.float8_e4m3fn or torch.float8_e5m2, got torch.int8"):
        ops.quantize_blocks(x, torch.int8)
    codes, absmax = ops.quantize_blocks(x, torch.uint8)
    with pytest.raises(RuntimeError, match=r"absmax must hold one value per block of 256 codes \(2 for 300 codes\), got 3"):
        ops.dequantize_blocks(codes, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"absmax must be a 1-D torch.float32 tensor"):
        ops.dequantize_blocks(codes, absmax.double())
    with pytest.raises(RuntimeError, match=r"codes' dtype must be torch.uint8, .* got torch.int16"):
        ops.dequantize_blocks(codes.short(), absmax)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.uint16, torch.float8_e8m0fnu,
                                   torch.complex32, torch.qint8], ids=str)
def test_refused_dtypes_are_named_as_torch_names_them(dtype):
    """The messages name a dtype as ``str(dtype)`` does (torch's own spelling)."""
    x = torch.randn(300)
    with pytest.raises(RuntimeError, match=rf"dtype must be torch.uint8, torch.float8_e4m3fn or torch.float8_e5m2, got {re.escape(str(dtype))}\."):
        ops.quantize_blocks(x, dtype)
    if dtype.itemsize == 1 and not dtype.is_complex and dtype != torch.qint8:
        codes, absmax = ops.quantize_blocks(x, torch.uint8)
        with pytest.raises(RuntimeError, match=rf"codes' dtype must be torch.uint8, .* got {re.escape(str(dtype))}\."):
            ops.dequantize_blocks(codes.view(dtype), absmax)


@pytest.mark.parametrize("device", DEVICES)
def test_a_round_trip_is_bitwise_for_every_absmax_through_the_subnormal_range(device):
    """Encode, decode, encode again: the same codes and absmax for blocks whose largest magnitude
    runs from fp32's largest subnormal down to below its smallest (a block below the normal range
    is stored as zeros: decoded there, values would lose bits). The block of 1.4e-45 and
    631161 * 2**-149 once gave code 1, decoded to 0.0, then code 0."""
    g = torch.Generator().manual_seed(7)
    blocks = [torch.tensor([1.4e-45, 631161 * 2.0**-149] + [0.0] * 254)]
    for e in range(-151, -118):  # magnitudes 2**e .. 2**(e+1): across the subnormal range
        blocks.append(torch.rand(256, generator=g) * 2.0**e * (1 + torch.rand(1, generator=g)))
    x = torch.cat(blocks)
    signs = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    for dtype, nonnegative in FORMATS:
        values = (x if nonnegative else x * signs).to(device)
        codes, absmax = ops.quantize_blocks(values, dtype, nonnegative=nonnegative)
        again, absmax_again = ops.quantize_blocks(ops.dequantize_blocks(codes, absmax, nonnegative=nonnegative), dtype,
                                                  nonnegative=nonnegative)
        assert torch.equal(codes.view(torch.uint8).cpu(), again.view(torch.uint8).cpu()), dtype
        assert torch.equal(absmax.cpu().view(torch.int32), absmax_again.cpu().view(torch.int32)), dtype
        normal = absmax.cpu() >= 2.0**-126
        assert bool((absmax.cpu()[~normal] == 0).all()) and bool(normal.any())  # below it: zeros


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(3, 200, device=device)
    for dtype, nonnegative in FORMATS:
        values = x.abs() if nonnegative else x
        # torch's schema check compares fp8 tensors with arithmetic fp8 does not have on the CPU
        # ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): the uint8 formats run it
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        if dtype == torch.uint8:
            utils = ("test_schema",) + utils
        torch.library.opcheck(torch.ops.ampfuse.quantize_blocks.default, (values, dtype), {"nonnegative": nonnegative},
                              test_utils=utils)
        codes, absmax = ops.quantize_blocks(values, dtype, nonnegative=nonnegative)
        torch.library.opcheck(torch.ops.ampfuse.dequantize_blocks.default, (codes, absmax), {"nonnegative": nonnegative},
                              test_utils=utils)


def test_meta_gives_the_shapes():
    x = torch.empty(5, 300, device="meta")
    codes, absmax = ops.quantize_blocks(x, torch.float8_e5m2)
    assert codes.shape == (5, 300) and codes.dtype == torch.float8_e5m2 and absmax.shape == (6,)
    assert ops.dequantize_blocks(codes, absmax).dtype == torch.float32


# ---- the fused steps with 8-bit state ------------------------------------------------------------

STATE_FORMATS = {  # (first moment / momentum, second moments)
    "uint8": (torch.uint8, torch.uint8),
    "fp8": (torch.float8_e4m3fn, torch.float8_e5m2),
    "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "mixed": (torch.uint8, torch.float8_e5m2),
}
STEP_SIZES = [1, 255, 257, 4099, 2 * 16384 + 5, 32768 + 300]


def _quantized(x: torch.Tensor, dtype: torch.dtype, nonnegative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.quantize_blocks(x.float(), dtype, nonnegative=nonnegative)


def _step_inputs(kind, pdtype, master, formats, seed, sizes=STEP_SIZES):
    g = torch.Generator().manual_seed(seed)
    params, grads, masters, steps = [], [], [], []
    nstates = {"sgd": 1, "adam": 2, "amsgrad": 3}[kind]
    states = [[] for _ in range(nstates)]
    for n in sizes:
        w = torch.randn(n, generator=g)
        params.append(w.to(pdtype))
        grads.append((torch.randn(n, generator=g) * 64).to(pdtype))
        if master == "float":
            masters.append(w.clone())
        elif master == "remainder":
            masters.append(ops.split_master(w)[1])
        for k in range(nstates):
            nonneg = k > 0
            x = torch.randn(n, generator=g) * 1e-2
            x = x * x if nonneg else x
            dtype = formats[0] if k == 0 else formats[1]
            states[k].append(_quantized(x, dtype, nonneg))
        steps.append(torch.full((), 3.0))
    return params, grads, masters, states, steps


def _run_step(kind, inputs, quantized, scaling):
    params, grads, masters, states, steps = (
        [t.clone() for t in inputs[0]], inputs[1], [t.clone() for t in inputs[2]],
        [[(c.clone(), a.clone()) for c, a in lst] for lst in inputs[3]], [t.clone() for t in inputs[4]])
    nonneg = [k > 0 for k in range(len(states))]
    if quantized:
        codes = [[c for c, _ in lst] for lst in states]
        absmax = [[a for _, a in lst] for lst in states]
        lists = codes
    else:
        lists = [[ops.dequantize_blocks(c, a, nonnegative=nonneg[k]) for c, a in lst] for k, lst in enumerate(states)]
    if kind == "sgd":
        extra = {"momentum_absmax": absmax[0]} if quantized else {}
        ops.sgd_step_(params, grads, masters, lists[0], steps, lr=0.1, momentum=0.9, dampening=0.1,
                      weight_decay=1e-2, nesterov=False, **scaling, **extra)
    else:
        extra = {}
        if quantized:
            extra = {"exp_avg_absmax": absmax[0], "exp_avg_sq_absmax": absmax[1]}
            if kind == "amsgrad":
                extra["max_exp_avg_sq_absmax"] = absmax[2]
        ops.adam_step_(params, grads, masters, lists[0], lists[1], lists[2] if kind == "amsgrad" else [], steps,
                       lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=1e-2, amsgrad=kind == "amsgrad",
                       decoupled_weight_decay=True, **scaling, **extra)
    if quantized:
        out_states = [list(zip(codes[k], absmax[k])) for k in range(len(states))]
    else:
        dtypes = [states[k][0][0].dtype for k in range(len(states))]
        out_states = [[_quantized(x, dtypes[k], nonneg[k]) for x in lists[k]] for k in range(len(states))]
    return params, masters, out_states, steps


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bitwise(a, b):
    """Params, masters, steps, codes and absmax of two step results, bit for bit."""
    (pa, ma, sa, ta), (pb, mb, sb, tb) = a, b
    assert len(pa + ma + ta) == len(pb + mb + tb)
    for i, (x, y) in enumerate(zip(pa + ma + ta, pb + mb + tb)):
        assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), i
    for k, (la, lb) in enumerate(zip(sa, sb)):
        for i, ((ca, aa), (cb, ab)) in enumerate(zip(la, lb)):
            assert torch.equal(_bits(aa), _bits(ab)), (k, i, "absmax")
            assert torch.equal(_bits(ca), _bits(cb)), (k, i, (_bits(ca) != _bits(cb)).nonzero()[:5])


def _scaling(case):
    if case == "plain":
        return {}
    return {"grad_scale": torch.full((1,), 64.0), "clip_coef": torch.full((1,), 0.5), "found_inf": torch.zeros(1)}


@pytest.mark.parametrize("kind", ["adam", "amsgrad", "sgd"])
@pytest.mark.parametrize("formats", list(STATE_FORMATS), ids=list(STATE_FORMATS))
@pytest.mark.parametrize(("pdtype", "master"), [(torch.float32, "none"), (torch.bfloat16, "float"),
                                                 (torch.bfloat16, "remainder"), (torch.float16, "float"),
                                                 (torch.bfloat16, "none")],
                         ids=["fp32", "bf16-master", "bf16-remainder", "fp16-master", "bf16"])
@pytest.mark.parametrize("scaling", ["plain", "scaled"])
def test_the_8bit_step_is_the_fp32_step_on_the_dequantized_state_requantized(kind, formats, pdtype, master, scaling):
    # One pass: each block dequantized, updated in fp32 registers, requantized with its new absmax;
    # bitwise what the fp32 step gives on the decoded state, quantized again.
    inputs = _step_inputs(kind, pdtype, master, STATE_FORMATS[formats], seed=7)
    got = _run_step(kind, inputs, True, _scaling(scaling))
    expected = _run_step(kind, inputs, False, _scaling(scaling))
    _assert_bitwise(got, expected)


@pytest.mark.parametrize("kind", ["adam", "amsgrad", "sgd"])
@pytest.mark.parametrize("formats", list(STATE_FORMATS), ids=list(STATE_FORMATS))
def test_an_inf_or_nan_in_a_moment_block_is_kept_as_the_fp32_step_keeps_it(kind, formats):
    """Moments holding inf and NaN, and gradients whose squares overflow: the 8-bit step is the fp32
    step on the decoded state requantized, bitwise, and a param is NaN only where the fp32 step's is."""
    inputs = _step_inputs(kind, torch.float32, "none", STATE_FORMATS[formats], seed=11)
    params, grads, masters, states, steps = inputs
    grads = [g.clone() for g in grads]
    grads[3][[3, 600]] = 1e22
    grads[4][9] = -3e38
    for k, lst in enumerate(states):
        nonneg = k > 0
        for i in (3, 5):
            values = ops.dequantize_blocks(*lst[i], nonnegative=nonneg)
            values[[1, 700]] = math.inf
            values[[2, 1300]] = math.nan if i == 5 else (0.0 if nonneg else -math.inf)
            lst[i] = _quantized(values, lst[i][0].dtype, nonneg)
    inputs = (params, grads, masters, states, steps)
    got = _run_step(kind, inputs, True, {})
    expected = _run_step(kind, inputs, False, {})
    _assert_bitwise(got, expected)
    for i, p in enumerate(got[0]):  # NaN only in planted elements, not in their blocks
        planted = torch.zeros(p.numel(), dtype=torch.bool)
        if i in (3, 5):
            planted[[1, 2, 700, 1300]] = True
        assert not bool(p.isnan()[~planted].any()), i


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_a_skipped_8bit_step_writes_nothing(kind):
    inputs = _step_inputs(kind, torch.bfloat16, "remainder", STATE_FORMATS["fp8"], seed=2)
    scaling = {"found_inf": torch.ones(1), "grad_scale": torch.full((1,), 2.0)}
    got = _run_step(kind, inputs, True, scaling)
    params, _, masters, states, steps = inputs
    _assert_bitwise(got, (params, masters, states, steps))


def test_sgd_8bit_momentum_starts_from_the_first_gradient():
    inputs = list(_step_inputs("sgd", torch.float32, "none", STATE_FORMATS["uint8"], seed=4))
    inputs[4] = [torch.zeros(()) for _ in inputs[4]]  # first step: the buffer is the gradient
    got = _run_step("sgd", inputs, True, {})
    expected = _run_step("sgd", inputs, False, {})
    _assert_bitwise(got, expected)


def test_8bit_state_argument_errors():
    p, gr = [torch.randn(300)], [torch.randn(300)]
    m = [ops.quantize_blocks(torch.zeros(300), torch.uint8)[0]]
    v, va = ops.quantize_blocks(torch.zeros(300), torch.uint8, nonnegative=True)
    ma = [torch.zeros(2)]
    common = dict(lr=1e-3)
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] has dtype torch.float32 but exp_avgs\[0\] has dtype torch.uint8; the state lists of a call are all 8-bit"):
        ops.adam_step_(p, gr, [], m, [torch.zeros(300)], [], [torch.zeros(())], **common, exp_avg_absmax=ma)
    with pytest.raises(RuntimeError, match=r"exp_avg_sq_absmax must have one tensor per param \(1\) when exp_avg_sqs are 8-bit, got 0"):
        ops.adam_step_(p, gr, [], m, [v], [], [torch.zeros(())], **common, exp_avg_absmax=ma)
    with pytest.raises(RuntimeError, match=r"exp_avg_absmax\[0\] must be a contiguous 1-D torch.float32 tensor on cpu with one value per block of 256 elements of params\[0\] \(2\), got shape \[3\]"):
        ops.adam_step_(p, gr, [], m, [v], [], [torch.zeros(())], **common, exp_avg_absmax=[torch.zeros(3)],
                       exp_avg_sq_absmax=[va])
    with pytest.raises(RuntimeError, match=r"exp_avg_absmax must be empty when exp_avgs are not 8-bit, got 1"):
        ops.adam_step_(p, gr, [], [torch.zeros(300)], [torch.zeros(300)], [], [torch.zeros(())], **common,
                       exp_avg_absmax=ma)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] is 8-bit state and must be contiguous"):
        big = ops.quantize_blocks(torch.zeros(2, 300), torch.uint8)[0].t()
        ops.adam_step_([torch.randn(300, 2)], [torch.randn(300, 2)], [], [big], [big.clone()], [], [torch.zeros(())],
                       **common, exp_avg_absmax=[torch.zeros(3)], exp_avg_sq_absmax=[torch.zeros(3)])
