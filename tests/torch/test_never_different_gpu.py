"""An FP32 model whose weights are edited between steps ends bit-identical to
torch.optim.AdamW(fused=True) on CUDA: the host, file and device tiers, and the step inside
backward with clipping that fires (a speculation discarded and redone).  Exit status 77
(ctest: skipped) without a CUDA device.  Labels torch, gpu."""
import os
import sys
import tempfile
import unittest

import torch

from deferalloc import optim
from deferalloc.overlap import overlap_with_backward

STEPS = 5


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()


def batch(t):
    g = torch.Generator(device="cuda").manual_seed(100 + t)
    return torch.randn(32, 96, device="cuda", generator=g), torch.randn(32, 64, device="cuda", generator=g)


def edit(m, t):
    """What a user does between steps: a re-initialised weight, a loaded value."""
    if t == 2:
        with torch.no_grad():
            m[0].weight.zero_()
            m[2].bias.copy_(torch.linspace(-1, 1, 64, device="cuda"))


def run_torch(clip=None):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for t in range(STEPS):
        edit(m, t)
        x, y = batch(t)
        ((m(x) - y) ** 2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


def run_streamed(tier, overlap=False, clip=None):
    with tempfile.TemporaryDirectory() as tmp:
        m = model()
        opt = optim.StreamedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, tier=tier, window_mb=64,
                                  directory=tmp if tier == "file" else None)
        ov = overlap_with_backward(m, opt, max_grad_norm=clip, clip_policy="speculate", bucket_mb=0) if overlap else None
        for t in range(STEPS):
            if ov is not None:
                ov.synchronize()  # an edit between steps waits for the step in flight
            edit(m, t)
            x, y = batch(t)
            ((m(x) - y) ** 2).mean().backward()
            if ov is not None:
                ov.step()
            else:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                opt.step()
            opt.zero_grad()
        stats = ov.stats() if ov is not None else {}
        if ov is not None:
            ov.remove()
        out = [p.detach().clone() for p in m.parameters()]
        del opt
        return out, stats


class EditsBetweenStepsOnCuda(unittest.TestCase):
    def same(self, want, got, what):
        for i, (a, b) in enumerate(zip(want, got)):
            self.assertTrue(torch.equal(a, b), f"{what}: parameter {i} differs from torch's fused AdamW "
                                               f"(max |diff| {(a - b).abs().max().item()})")

    def test_tiers(self):
        want = run_torch()
        for tier in ("host", "file", "device"):
            got, _ = run_streamed(tier)
            self.same(want, got, f"tier {tier}")
            print(f"PASS tier {tier}: bit-identical to torch.optim.AdamW(fused=True) with an edit between steps")

    def test_step_inside_backward_with_clipping_that_fires(self):
        want = run_torch(clip=0.05)
        for tier in ("host", "file"):
            got, stats = run_streamed(tier, overlap=True, clip=0.05)
            self.same(want, got, f"overlap, tier {tier}")
            self.assertGreater(stats["redos"], 0, "clipping never fired: the redo is not tested")
            print(f"PASS overlap tier {tier}: bit-identical with {stats['redos']} redos")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (test_never_different_cpu runs the host-driver form)")
        sys.exit(77)
    os.environ.setdefault("DEFERALLOC_CONF", "")
    unittest.main(verbosity=2)
