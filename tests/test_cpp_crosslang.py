"""Cross-language test: the same fixed sequence of mixed-precision steps through the C++ API
(``tests/cpp/crosslang_sequence.cpp``, built as ``ampfuse_crosslang`` by ``make build``) and the
Python API gives bitwise identical tensors.

The sequence (CPU): bf16 params, ``AdamW`` with fp32 masters, a ``GradScaler`` with hysteresis and
a short growth interval, an inf and a NaN injected, ``unscale_and_clip_`` on some iterations; then
a ``GradAccumulator`` (2 micro-batches, clipping) over three windows, one of them overflowing. The
C++ program writes its inputs too, so both sides start from the same bits.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.jit._pickle

import ampfuse

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NUM_PARAMS = 3


def _binary() -> str:
    build_dir = os.environ.get("AMPFUSE_CPP_BUILD_DIR", os.path.join(_ROOT, "build"))
    path = os.path.join(build_dir, "tests", "cpp", "ampfuse_crosslang")
    if not os.path.exists(path):
        pytest.fail(
            f"{path} does not exist: build the C++ tests first (`make build`, or set "
            "AMPFUSE_CPP_BUILD_DIR to the CMake build directory)."
        )
    return path


@pytest.fixture(scope="module")
def cpp_results(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("crosslang") / "cpp.pt"
    subprocess.run([_binary(), str(out)], check=True, timeout=120)
    # torch::pickle_save tags the typed dict with torch.jit._pickle.restore_type_tag.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(out)


def _loss(params: list[torch.Tensor], xs: list[torch.Tensor]) -> torch.Tensor:
    loss = torch.zeros(())
    for p, x in zip(params, xs):
        loss = loss + (p.float() * x).sum()
    return loss


def _run_python(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    res: dict[str, torch.Tensor] = {}
    params = [d[f"init/{i}"].clone().requires_grad_(True) for i in range(_NUM_PARAMS)]
    opt = ampfuse.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    scaler = ampfuse.GradScaler("cpu", init_scale=1024.0, growth_interval=2, hysteresis=2)
    for step in range(8):
        xs = [d[f"x/{step}/{i}"] for i in range(_NUM_PARAMS)]
        scaler.scale(_loss(params, xs)).backward()
        if step % 3 == 1:
            res[f"norm/{step}"] = scaler.unscale_and_clip_(opt, 0.5).clone()
        scaler.step(opt)
        scaler.update()
        res[f"scale/{step}"] = scaler._scale.clone()
        res[f"found_inf/{step}"] = scaler.last_found_inf.clone()
        opt.zero_grad()

    acc = ampfuse.GradAccumulator(torch.nn.Module(), opt, scaler, steps=2, max_grad_norm=1.0)
    for k in range(6):
        xs = [d[f"x2/{k}/{i}"] for i in range(_NUM_PARAMS)]
        with acc.accumulate():
            acc.backward(_loss(params, xs))
        res[f"scale2/{k}"] = scaler._scale.clone()

    for i, p in enumerate(params):
        state = opt.state[p]
        res[f"out/param/{i}"] = p.detach().clone()
        res[f"out/master/{i}"] = state["master_param"].clone()
        res[f"out/exp_avg/{i}"] = state["exp_avg"].clone()
        res[f"out/exp_avg_sq/{i}"] = state["exp_avg_sq"].clone()
        res[f"out/step/{i}"] = state["step"].clone()
    res["out/scale"] = scaler._scale.clone()
    res["out/growth_tracker"] = torch.tensor(scaler._get_growth_tracker())
    res["out/stats"] = scaler._stats.clone()
    return res


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_cpp_and_python_give_bitwise_identical_tensors(cpp_results):
    py = _run_python(cpp_results)
    compared = [k for k in cpp_results if not (k.startswith("init/") or k.startswith("x"))]
    assert set(compared) == set(py), sorted(set(compared) ^ set(py))
    for key in sorted(compared):
        a, b = cpp_results[key], py[key]
        assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(_bits(a), _bits(b)), (key, a, b)


def test_the_sequence_exercises_skips_growth_and_clipping(cpp_results):
    # Guards the sequence itself: if it stopped overflowing or growing, the parity test above
    # would cover less than it claims.
    found = [float(cpp_results[f"found_inf/{s}"]) for s in range(8)]
    assert found == [0, 0, 0, 1, 1, 0, 1, 0]
    scales = [float(cpp_results[f"scale/{s}"]) for s in range(8)]
    assert scales == [1024, 2048, 2048, 2048, 1024, 1024, 512, 512]  # hysteresis 2 absorbs one
    assert [float(cpp_results[f"scale2/{k}"]) for k in range(6)] == [512, 1024, 1024, 1024, 1024, 1024]
    assert cpp_results["out/stats"].tolist() == [11, 4, 2, 0]  # updates, overflows, backoffs, floor
    assert all(float(cpp_results[f"out/step/{i}"]) == 7 for i in range(_NUM_PARAMS))
    assert 0.5 < float(cpp_results["norm/1"]) < float("inf")  # clipping was active
    assert cpp_results["out/master/0"].dtype == torch.float32
    assert cpp_results["out/param/0"].dtype == torch.bfloat16
