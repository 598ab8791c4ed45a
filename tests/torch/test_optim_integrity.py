"""StreamedAdamW never silently wrong, never a crash, on the host driver (CPU
tensors) or, with --device cuda, on a GPU.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host,... and the libraries set:
  - a parameter's storage replaced under the optimizer (p.data = p.data.clone()) is
    followed; m.half() / m.to(torch.bfloat16) raise InvalidStateError at the next step
    (never a crash, never a write to freed memory);
  - a parameter already held by a live StreamedAdamW, and overlapping views of one
    storage, are refused at construction;
  - load_state_dict into the file tier keeps each parameter's step across a resume, and
    one that fails part-way leaves the state as it was.
"""
import argparse
import gc
import os
import subprocess
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unittest_main import run_tests  # noqa: E402

from deferalloc import optim  # noqa: E402

DEVICE = "cpu"


def model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(DEVICE, dtype)


def train(m, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(DEVICE, next(m.parameters()).dtype)
        m(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


class StorageReplaced(unittest.TestCase):
    def test_replaced_storage_is_followed(self):
        a, b = model(), model()
        oa, ob = optim.StreamedAdamW(a.parameters(), lr=0.1), optim.StreamedAdamW(b.parameters(), lr=0.1)
        train(a, oa, 2)
        train(b, ob, 2)
        for p in b.parameters():
            p.data = p.data.clone()  # the old storage is freed
        gc.collect()
        train(a, oa, 3, seed=2)
        train(b, ob, 3, seed=2)
        for pa, pb in zip(a.parameters(), b.parameters()):
            self.assertTrue(torch.equal(pa, pb), "the replaced parameter was not stepped like the kept one")

    def test_dtype_change_raises_and_never_crashes(self):
        for convert in (lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
            m = model()
            opt = optim.StreamedAdamW(m.parameters(), lr=0.1)
            train(m, opt, 1)
            convert(m)
            gc.collect()
            with self.assertRaisesRegex(optim.InvalidStateError, r"changed from .*float32.* after the optimizer"):
                train(m, opt, 1)
            for p in m.parameters():
                self.assertTrue(torch.isfinite(p.float()).all())
            del opt
            gc.collect()
            opt = optim.StreamedAdamW(m.parameters(), lr=0.1)  # a new optimizer after the conversion works
            train(m, opt, 2)

    def test_numel_change_raises(self):
        m = model()
        opt = optim.StreamedAdamW(m.parameters(), lr=0.1)
        train(m, opt, 1)
        w = m[0].weight
        w.data = w.data[:8]  # same storage start, fewer elements
        w.grad = torch.zeros_like(w)
        with self.assertRaisesRegex(optim.InvalidStateError, "parameter 0 changed"):
            opt.step()


class SharedParameters(unittest.TestCase):
    def test_second_optimizer_over_the_same_params_is_refused(self):
        m = model()
        first = optim.StreamedAdamW(m.parameters(), lr=0.1)
        with self.assertRaisesRegex(optim.InvalidArgumentError, "already held by another live StreamedAdamW"):
            optim.StreamedAdamW(list(m.parameters())[1:], lr=0.1)
        del first
        gc.collect()
        optim.StreamedAdamW(m.parameters(), lr=0.1)  # the first is gone

    def test_overlapping_views_are_refused(self):
        base = torch.zeros(100, device=DEVICE)
        views = [torch.nn.Parameter(base[:60]), torch.nn.Parameter(base[40:])]
        with self.assertRaisesRegex(optim.InvalidArgumentError, "overlap in memory"):
            optim.StreamedAdamW(views, lr=0.1)
        disjoint = [torch.nn.Parameter(base[:50]), torch.nn.Parameter(base[50:])]
        optim.StreamedAdamW(disjoint, lr=0.1)


class FileTierStateDict(unittest.TestCase):
    def state(self, seed):
        """A host-tier state dict whose parameters have different step counts."""
        m = model(seed)
        opt = optim.StreamedAdamW(m.parameters(), lr=0.1)
        train(m, opt, 2, seed)
        m[2].bias.requires_grad_(False)  # no gradient: its step stays
        train(m, opt, 3, seed + 1)
        sd = opt.state_dict()
        del opt
        gc.collect()
        return sd

    @staticmethod
    def steps(sd):
        return [float(v["step"]) for _, v in sorted(sd["state"].items())]

    def test_steps_survive_a_resume(self):
        sd = self.state(3)
        self.assertEqual(len(set(self.steps(sd))), 2, "the state dict should have two step counts")
        with tempfile.TemporaryDirectory() as d:
            m = model()
            opt = optim.StreamedAdamW(m.parameters(), lr=0.1, tier="file", directory=d)
            opt.load_state_dict(sd)
            del opt
            gc.collect()
            opt = optim.StreamedAdamW(m.parameters(), lr=0.1, tier="file", directory=d, resume=True)
            got = opt.state_dict()
            self.assertEqual(self.steps(got), self.steps(sd), "the file tier's resume collapsed the step counts")
            for k, v in sd["state"].items():
                for name in ("exp_avg", "exp_avg_sq", "main_param"):
                    self.assertTrue(torch.equal(got["state"][k][name], v[name]), name)

    def test_failed_load_changes_nothing(self):
        old, new = self.state(3), self.state(5)
        bad = {"state": {k: dict(v) for k, v in new["state"].items()}, "param_groups": new["param_groups"]}
        last = max(bad["state"])
        bad["state"][last]["exp_avg_sq"] = torch.zeros(3)  # wrong size: refused after the others were written
        with tempfile.TemporaryDirectory() as d:
            m = model()
            opt = optim.StreamedAdamW(m.parameters(), lr=0.1, tier="file", directory=d)
            opt.load_state_dict(old)
            with self.assertRaises(optim.InvalidArgumentError):
                opt.load_state_dict(bad)
            got = opt.state_dict()
            self.assertEqual(self.steps(got), self.steps(old))
            for k, v in old["state"].items():
                self.assertTrue(torch.equal(got["state"][k]["exp_avg"], v["exp_avg"]), "a failed load changed the state")
            del opt
            gc.collect()
            opt = optim.StreamedAdamW(m.parameters(), lr=0.1, tier="file", directory=d, resume=True)
            self.assertEqual(self.steps(opt.state_dict()), self.steps(old))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args, rest = ap.parse_known_args()
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda without a GPU")
        sys.exit(77)
    sys.argv = sys.argv[:1] + rest
    run_tests()
