"""A reference AdamW with the roundings of torch._fused_adamw_ on CUDA, element by element.

Written from torch's kernel (aten/src/ATen/native/cuda/fused_adam_utils.cuh, adam_math):
float state, double hyper-parameters, and the two DFMAs nvcc makes of the moment updates
and one of the weight decay (see Note [Torch's fused AdamW, bit for bit] in
optimizer/adamw_math.hpp).  Pure Python: each double fma is computed exactly with
fractions and rounded once to double; each float operation is done in double and
rounded to float, which is exact for +, -, *, / and sqrt of floats (53 >= 2 * 24 + 2).
Slow (tens of microseconds per element): for tests of a few thousand elements.
"""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def fma(a: float, b: float, c: float) -> float:
    return float(Fraction(a) * Fraction(b) + Fraction(c))


class ReferenceAdamW:
    """State per parameter: FP32 main (list of floats), exp_avg, exp_avg_sq, step."""

    def __init__(self, params: list[torch.Tensor]):
        self.main = [p.detach().float().flatten().tolist() for p in params]
        self.m = [[0.0] * p.numel() for p in params]
        self.v = [[0.0] * p.numel() for p in params]
        self.step_count = [0] * len(params)

    def step(self, i: int, grad: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
             wd: float) -> None:
        if grad is None:
            return
        self.step_count[i] += 1
        t = float(f32(float(self.step_count[i])))
        bc1 = f32(1 - beta1 ** t)
        step_size = f32(lr / bc1)
        bc2_sqrt = f32(math.sqrt(1 - beta2 ** t))
        lr_wd = lr * wd
        omb1, omb2 = 1 - beta1, 1 - beta2
        p, m, v = self.main[i], self.m[i], self.v[i]
        for j, g in enumerate(grad.detach().float().flatten().tolist()):
            pp = p[j]
            if lr_wd != 0:
                pp = f32(fma(-lr_wd, pp, pp))
            mm = f32(fma(omb1, g, beta1 * m[j]))
            vv = f32(fma(omb2 * g, g, beta2 * v[j]))
            denom = f32(f32(f32(math.sqrt(vv)) / bc2_sqrt) + eps)
            p[j] = f32(pp - f32(f32(step_size * mm) / denom))
            m[j], v[j] = mm, vv

    def tensor(self, which: str, i: int, like: torch.Tensor) -> torch.Tensor:
        src = {"main": self.main, "exp_avg": self.m, "exp_avg_sq": self.v}[which][i]
        return torch.tensor(src, dtype=torch.float32).reshape(like.shape)
