#!/usr/bin/env python3
"""PyTorch reference for losshead_optimizer_bench: torch.optim.AdamW(fused=True) stepping one fp32
parameter of --count elements (default 128256 x 4096) with a random gradient.

Times optimizer.step() with CUDA events (warm-up, median of --runs), then the same step followed
by grad.zero_() (what losshead's step also does in its one pass). The bench parses the line
"torch_adamw_fused_ms <ms>".
"""
import argparse

import torch

from torch_reference import median_ms  # this script's folder is on sys.path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=128256 * 4096)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.nn.Parameter((torch.rand(args.count, device="cuda", generator=g) * 2 - 1) * 0.05)
    p.grad = (torch.rand(args.count, device="cuda", generator=g) * 2 - 1) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                            fused=True)
    step_ms = median_ms(opt.step, args.runs)

    def step_and_zero():
        opt.step()
        p.grad.zero_()

    zero_ms = median_ms(step_and_zero, args.runs)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.count} fp32 parameters, median of {args.runs}")
    print(f"torch_adamw_fused_ms {step_ms:.4f}")
    print(f"torch_adamw_fused_plus_zero_grad_ms {zero_ms:.4f}", flush=True)


if __name__ == "__main__":
    main()
