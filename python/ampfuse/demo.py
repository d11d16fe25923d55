"""A short mixed-precision training loop driven by the ampfuse ops (``python -m ampfuse.demo``).

bf16 weights on the CPU, dynamic loss scaling with ``ops.unscale_check_`` and ``ops.update_scale_``:
every step unscales the gradients and checks them for inf/NaN in one fused pass, skips the update
on overflow, and adjusts the scale on device.
"""

from __future__ import annotations

import argparse

import torch

from ampfuse import ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(dev)
    w_true = torch.randn(32, 1, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scale = torch.full((1,), 2.0**16, device=dev)
    tracker = torch.zeros(1, dtype=torch.int32, device=dev)
    skipped = 0
    for step in range(args.steps):
        x = torch.randn(128, 32, device=dev)
        y = x @ w_true
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        (loss * scale).backward()
        found_inf = torch.zeros(1, device=dev)
        grads = [p.grad for p in model.parameters()]
        ops.unscale_check_(grads, found_inf, scale.double().reciprocal().float())
        if found_inf.item() == 0.0:  # the demo reads it to print; the fused optimizers never do
            opt.step()
        else:
            skipped += 1
        ops.update_scale_(scale, tracker, found_inf, 2.0, 0.5, 50)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.5f}  scale {scale.item():.0f}")
    print(f"done: {args.steps} steps, {skipped} skipped")


if __name__ == "__main__":
    main()
