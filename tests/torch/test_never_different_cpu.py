"""StreamedAdamW is never silently different from torch.optim.AdamW, on the host driver.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host and the libraries set.  Each
test reproduces a way a user got a result other than torch's without an error: an FP32
weight edited between steps, a parameter made a transposed view or another parameter's
alias after construction, a directory that rewrote the settings, a refused param group
left behind, betas of the wrong length, a state with step 0 and moments, two threads'
first steps on the file tier.  Each fails on the code before these fixes.
"""
import os
import sys
import tempfile
import threading
import unittest
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_reference import ReferenceAdamW  # noqa: E402

import deferalloc  # noqa: E402
from deferalloc import optim  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in (64, 33)]


def grads_for(ps, t):
    g = torch.Generator().manual_seed(1000 + t)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


class EditsBetweenSteps(unittest.TestCase):
    """An FP32 parameter is the truth: an edit between steps is what the next step starts from."""

    def run_edit(self, tier, **kw):
        with tempfile.TemporaryDirectory() as tmp:
            ps = params()
            opt = optim.StreamedAdamW(ps, lr=1e-2, weight_decay=0.1, tier=tier, window_mb=2,
                                      directory=tmp if tier == "file" else None, **kw)
            ref = ReferenceAdamW(ps)  # torch's fused AdamW arithmetic, element by element
            for t in range(4):
                if t == 2:
                    with torch.no_grad():
                        ps[0].zero_()
                        ps[1].copy_(torch.arange(33, dtype=torch.float32))
                    ref.main = [p.detach().float().flatten().tolist() for p in ps]
                grads_for(ps, t)
                opt.step()
                for i, p in enumerate(ps):
                    ref.step(i, p.grad, 1e-2, 0.9, 0.999, 1e-8, 0.1)
            for i, p in enumerate(ps):
                want = torch.tensor(ref.main[i], dtype=torch.float32).view(p.shape)
                self.assertTrue(torch.equal(p.detach(), want),
                                f"tier {tier}: the edit between steps was not honoured "
                                f"(max |diff| {(p.detach() - want).abs().max().item()})")
            del opt

    def test_host(self):
        self.run_edit("host")

    def test_file(self):
        self.run_edit("file")

    def test_device(self):
        self.run_edit("device")


class ParameterChanges(unittest.TestCase):
    def test_a_transposed_view_is_refused(self):
        m = torch.nn.Linear(4, 3).float()
        opt = optim.StreamedAdamW(m.parameters(), lr=1e-2, window_mb=2)
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        m.weight.data = m.weight.data.t()  # the same pointer, dtype and element count
        m.weight.grad = torch.randn(m.weight.shape)
        with self.assertRaisesRegex(optim.InvalidStateError, "no longer contiguous"):
            opt.step()

    def test_an_alias_of_another_parameter_is_refused(self):
        ps = [torch.randn(8).requires_grad_() for _ in range(2)]
        opt = optim.StreamedAdamW(ps, lr=1e-2, window_mb=2)
        grads_for(ps, 0)
        opt.step()
        ps[1].data = ps[0].data
        grads_for(ps, 1)
        with self.assertRaisesRegex(optim.InvalidStateError, "overlap in memory .after a parameter's storage"):
            opt.step()


class TypedOptions(unittest.TestCase):
    def test_a_directory_is_never_read_as_settings(self):
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("x,tier:host", "plain,comma", "colon:in:name"):
                d = os.path.join(tmp, name)
                os.makedirs(d)
                opt = optim.StreamedAdamW(params(), lr=1e-2, window_mb=2, tier="file", directory=d)
                grads_for(opt.held_params, 0)
                opt.step()
                self.assertEqual(opt.tier, "file")
                self.assertTrue(os.path.exists(os.path.join(d, "deferalloc-rank0.state")), os.listdir(d))
                del opt

    def test_the_tier_attribute_is_the_engine_s(self):
        opt = optim.StreamedAdamW(params(), window_mb=2, tier="host", settings="tier:device")
        self.assertEqual(opt.tier, "device")  # settings= comes last, and opt.tier says what runs
        grads_for(opt.held_params, 0)
        opt.step()
        n = sum(p.numel() for p in opt.held_params)
        self.assertEqual(opt.stats()["state_bytes"], 8 * n)  # FP32 parameters: their own main

    def test_settings_typos_name_the_argument(self):
        with self.assertRaisesRegex(optim.InvalidArgumentError, r"StreamedAdamW\(settings='windw_mb:4'\): .*windw_mb"):
            optim.StreamedAdamW(params(), settings="windw_mb:4")
        with self.assertRaisesRegex(optim.InvalidArgumentError, "tier='disk'"):
            optim.StreamedAdamW(params(), tier="disk")

    def test_driver_cuda_with_cpu_parameters_is_refused(self):
        old = os.environ.get("DEFERALLOC_CONF", "")
        os.environ["DEFERALLOC_CONF"] = old + ",driver:cuda"
        try:
            with self.assertRaisesRegex(optim.NoDeviceError, "driver:cuda"):
                optim.StreamedAdamW(params(), window_mb=2)
        finally:
            os.environ["DEFERALLOC_CONF"] = old


class GroupsAndHyperParameters(unittest.TestCase):
    def test_a_refused_param_group_is_not_kept(self):
        ps = params()
        opt = optim.StreamedAdamW(ps[:1], lr=1e-2, window_mb=2)
        with self.assertRaises(optim.InvalidArgumentError):
            opt.add_param_group({"params": [torch.randn(4, 4).t().requires_grad_()]})  # not contiguous
        other = optim.StreamedAdamW(ps[1:], lr=1e-2, window_mb=2)
        with self.assertRaisesRegex(optim.InvalidArgumentError, "already held by another"):
            opt.add_param_group({"params": [ps[1]]})
        with self.assertRaisesRegex(optim.InvalidArgumentError, "betas"):
            opt.add_param_group({"params": [torch.randn(3).requires_grad_()], "betas": (0.9,)})
        self.assertEqual(len(opt.param_groups), 1)
        grads_for(ps, 0)
        opt.step()  # was: IndexError
        del other

    def test_betas_of_the_wrong_length_are_refused_at_construction(self):
        for betas in ((0.9, 0.99, 0.5), (0.9,)):
            with self.assertRaisesRegex(optim.InvalidArgumentError, "betas="):
                optim.StreamedAdamW(params(), betas=betas, window_mb=2)

    def test_a_state_with_step_0_and_moments_is_refused(self):
        ps = params()
        opt = optim.StreamedAdamW(ps, lr=1e-2, window_mb=2)
        grads_for(ps, 0)
        opt.step()
        sd = opt.state_dict()
        sd["state"][0]["step"] = torch.tensor(0.0)
        with self.assertRaisesRegex(optim.InvalidArgumentError, "step 0 with non-zero"):
            opt.load_state_dict(sd)
        self.assertEqual(float(opt.state_dict()["state"][0]["step"]), 1.0)  # unchanged


class Threads(unittest.TestCase):
    def test_two_threads_first_steps_on_the_file_tier(self):
        with tempfile.TemporaryDirectory() as tmp:
            ps = params()
            opt = optim.StreamedAdamW(ps, lr=1e-2, window_mb=2, tier="file", directory=tmp)
            grads_for(ps, 0)
            errors = []

            def run():
                try:
                    opt.step()
                except BaseException as e:  # noqa: BLE001 (reported below)
                    errors.append(e)
            ts = [threading.Thread(target=run) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(errors, [])
            self.assertEqual(opt.shard_step(ps[0]), 2)
            del opt


if __name__ == "__main__":
    deferalloc.driver_name()
    unittest.main(verbosity=2)
