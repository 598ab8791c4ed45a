"""examples/megatron/train_gpt.py with CUDA's AdamW roundings for Megatron's own optimizer
(CPU emulation only): the same arguments, run under torchrun like the example.

On the GPU, Megatron's own run steps with torch._fused_adamw_ on CUDA, whose arithmetic the
deferalloc engine reproduces bit for bit.  On the CPU, torch's fused AdamW kernel rounds
differently (in the tiny model's DP 1 and DP 2 runs the losses part from the engine's at
step 8 or 11), so a bit-for-bit comparison with "Megatron's own optimizer" needs the CUDA
kernel's arithmetic: here Megatron's inner torch.optim.AdamW steps through
optim_reference.ReferenceAdamW (torch._fused_adamw_'s CUDA roundings, element by element;
pure Python, for the tiny model).  Everything else is Megatron's: the DistributedOptimizer,
its FP32 main params, grad reduce-scatter, clipping, the BF16 copy back.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "megatron"))

import torch  # noqa: E402

import train_gpt  # noqa: E402
from optim_reference import ReferenceAdamW  # noqa: E402


class CudaRoundingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (state, param groups, state_dict as torch's) whose step has
    torch._fused_adamw_'s CUDA roundings."""

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "step" not in st:
                    st["step"] = torch.tensor(0.0)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in st:
                        st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                ref = ReferenceAdamW([p])
                ref.m, ref.v = [st["exp_avg"].flatten().tolist()], [st["exp_avg_sq"].flatten().tolist()]
                ref.step_count = [int(st["step"])]
                ref.step(0, p.grad, g["lr"], b1, b2, g["eps"], g["weight_decay"])
                p.copy_(ref.tensor("main", 0, p))
                st["exp_avg"].copy_(ref.tensor("exp_avg", 0, p))
                st["exp_avg_sq"].copy_(ref.tensor("exp_avg_sq", 0, p))
                st["step"] += 1


def main() -> int:
    args = train_gpt.parse_args()
    if not args.cpu_emulation or args.deferalloc != "off" or args.hdo:
        raise SystemExit("megatron_cuda_rounding.py: for Megatron's own optimizer under --cpu-emulation only")
    build = train_gpt.build

    def build_with_cuda_rounding(a):
        gpt, ddp, optimizer, streamed = build(a)
        for dopt in train_gpt.optimizers_of(optimizer):
            assert type(dopt.optimizer) is torch.optim.AdamW, type(dopt.optimizer)
            dopt.optimizer.__class__ = CudaRoundingAdamW
        return gpt, ddp, optimizer, streamed

    train_gpt.build = build_with_cuda_rounding
    return train_gpt.main()


if __name__ == "__main__":
    sys.exit(main())
