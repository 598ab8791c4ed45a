"""A reference AdamW with the roundings of torch._fused_adamw_ on CUDA, element by element.

Written from torch 2.11's kernel (aten/src/ATen/native/cuda/fused_adam_utils.cuh): every
hyper-parameter cast to float and the whole update in float, with the fmas the kernel
writes or nvcc makes (see Note [Torch's fused AdamW, bit for bit] in
optimizer/kernels/adamw_math.hpp).  Pure Python: each float fma is computed exactly with fractions
and rounded once to float; each other float operation is done in double and rounded to
float, which is exact for +, -, *, / and sqrt of floats (53 >= 2 * 24 + 2).
Slow (tens of microseconds per element): for tests of a few thousand elements.
"""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _f32_next(x: float, up: bool) -> float:
    """The float32 neighbour of the float32 value x."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if x == 0.0:
        return struct.unpack("<f", struct.pack("<I", 1 if up else 0x80000001))[0]
    grow = (x > 0) == up
    return struct.unpack("<f", struct.pack("<I", bits + 1 if grow else bits - 1))[0]


def fmaf(a: float, b: float, c: float) -> float:
    """fmaf: a*b+c exact, rounded once to float32 (to nearest, ties to even)."""
    x = Fraction(a) * Fraction(b) + Fraction(c)
    f = f32(float(x))  # within one float32 ulp of the answer: pick among it and its neighbours
    best = None
    for cand in (_f32_next(f, False), f, _f32_next(f, True)):
        err = abs(Fraction(cand) - x)
        even = struct.unpack("<I", struct.pack("<f", cand))[0] % 2 == 0
        if best is None or err < best[0] or (err == best[0] and even):
            best = (err, cand)
    return best[1]


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
        t = f32(float(self.step_count[i]))
        lr, beta1, beta2, eps, wd = f32(lr), f32(beta1), f32(beta2), f32(eps), f32(wd)
        bc1 = f32(1.0 - f32(beta1 ** t))
        step_size = f32(lr / bc1)
        bc2_sqrt = f32(math.sqrt(f32(1.0 - f32(beta2 ** t))))
        lr_wd = f32(lr * wd)
        p, m, v = self.main[i], self.m[i], self.v[i]
        for j, g in enumerate(grad.detach().float().flatten().tolist()):
            pp = p[j]
            if wd != 0:
                pp = fmaf(-lr_wd, pp, pp)
            mm = fmaf(beta1, m[j], fmaf(-beta1, g, g))
            gg = f32(g * g)
            vv = fmaf(beta2, v[j], fmaf(-beta2, gg, gg))
            denom = f32(f32(f32(math.sqrt(vv)) / bc2_sqrt) + eps)
            p[j] = f32(pp - f32(f32(step_size * mm) / denom))
            m[j], v[j] = mm, vv

    def tensor(self, which: str, i: int, like: torch.Tensor) -> torch.Tensor:
        src = {"main": self.main, "exp_avg": self.m, "exp_avg_sq": self.v}[which][i]
        return torch.tensor(src, dtype=torch.float32).reshape(like.shape)
