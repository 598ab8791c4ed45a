"""deferalloc.optim.StreamedAdamW on the host driver (no GPU): CPU tensors, every tier.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host,... and DEFERALLOC_LIB set.
Checks bit for bit against optim_reference.ReferenceAdamW (torch._fused_adamw_'s CUDA
roundings; torch's CPU AdamW implementations round differently, see the report).
"""
import os
import subprocess
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_reference import ReferenceAdamW  # noqa: E402

import deferalloc  # noqa: E402
from deferalloc import optim  # noqa: E402


def make_params(seed=0, big=False):
    """``big``: the first parameter too big for resident_mb=1 (its three arrays take 1344 KiB
    of 64 KiB granules), the others fit: resident_mb=1 makes parameters 1 to 3 resident."""
    g = torch.Generator().manual_seed(seed)
    shapes = [((400, 250) if big else (33, 20), torch.bfloat16), ((20,), torch.float32), ((7, 9), torch.float16),
              ((50,), torch.bfloat16)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dt)) for s, dt in shapes]


def grads_for(params, t, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + t)
    return [(torch.randn(p.shape, generator=g) * (t + 1)).to(p.dtype) for p in params]


GROUPS = [dict(weight_decay=0.1, betas=(0.9, 0.95)), dict(weight_decay=0.0, eps=1e-6)]


def build(params, tmp=None, tier="host", **kw):
    groups = [dict(params=params[:2], **GROUPS[0]), dict(params=params[2:], **GROUPS[1])]
    return optim.StreamedAdamW(groups, lr=3e-3, window_mb=2, tier=tier,
                               directory=tmp if tier == "file" else None, **kw)


def skipped(t, i):
    return t == 2 and i == 3  # parameter 3 has no gradient at step 2


def train(opt, params, steps, first=0, sched=None):
    for t in range(first, first + steps):
        for i, (p, g) in enumerate(zip(params, grads_for(params, t))):
            p.grad = None if skipped(t, i) else g
        opt.step()
        if sched is not None:
            sched.step()


class BitIdentity(unittest.TestCase):
    def check_tier(self, tier, params=None, **kw):
        params = params or make_params()
        ref = ReferenceAdamW(params)
        with tempfile.TemporaryDirectory() as tmp:
            opt = build(params, tmp, tier, **kw)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            for t in range(5):
                grads = grads_for(params, t)
                for i, (p, g) in enumerate(zip(params, grads)):
                    p.grad = None if skipped(t, i) else g
                    gi = 0 if i < 2 else 1
                    grp = opt.param_groups[gi]
                    ref.step(i, p.grad, grp["lr"], grp["betas"][0], grp["betas"][1], grp["eps"], grp["weight_decay"])
                opt.step()
                sched.step()
            sd = opt.state_dict()
            for i, p in enumerate(params):
                st = sd["state"][i]
                self.assertEqual(float(st["step"]), ref.step_count[i], f"step of param {i}")
                for key, which in (("main_param", "main"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                    want = ref.tensor(which, i, p)
                    self.assertEqual(st[key].dtype, torch.float32)
                    self.assertEqual(st[key].shape, p.shape)
                    self.assertTrue(torch.equal(st[key], want), f"{tier}: {key} of param {i} ({p.dtype}) differs in "
                                    f"{int((st[key] != want).sum())} of {p.numel()} elements")
                self.assertTrue(torch.equal(p.detach(), ref.tensor("main", i, p).to(p.dtype)),
                                f"{tier}: param {i} is not {p.dtype}(main)")
            self.assertEqual(ref.step_count[3], 4, "the skipped parameter kept its step")

    def test_host_tier(self):
        self.check_tier("host")

    def test_device_tier(self):
        self.check_tier("device")

    def test_file_tier(self):
        self.check_tier("file")

    def test_file_tier_with_resident_parameters(self):
        # Note [Resident shards on the file tier]: parameters 1 to 3 resident, 0 streamed.
        self.check_tier("file", make_params(big=True), resident_mb=1)


def resident_of(opt, params):
    """Which of ``params`` are resident (a resident parameter cannot speculate)."""
    return [not opt.can_speculate(p) for p in params]


class FileTierResident(unittest.TestCase):
    """resident_mb on the file tier (Note [Resident shards on the file tier]): committed to the
    state file at every step, so a resume, a state_dict and "auto" work as without it."""

    def test_resume_after_a_kill_between_steps_continues_bit_identically(self):
        ref_params, params = make_params(big=True), make_params(seed=4, big=True)
        with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as r:
            ref = build(ref_params, r, "file")  # all streamed, never stopped
            train(ref, ref_params, 5)
            code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import test_optim_cpu as T
params = T.make_params(big=True)
opt = T.build(params, {d!r}, "file", resident_mb=1, overwrite=True)
T.train(opt, params, 3)
assert T.resident_of(opt, params) == [False, True, True, True], T.resident_of(opt, params)
os._exit(0)  # killed between steps: no destructor, no flush
"""
            subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
            for resident_mb in (1, 0):  # resumed with and without resident parameters
                params = make_params(seed=4, big=True)
                opt = build(params, d, "file", resume=True, resident_mb=resident_mb)
                self.assertEqual(resident_of(opt, params), [False] + [resident_mb == 1] * 3)
                train(opt, params, 2, first=3)
                want, got = ref.state_dict()["state"], opt.state_dict()["state"]
                for i in want:
                    for k in ("main_param", "exp_avg", "exp_avg_sq", "step"):
                        self.assertTrue(torch.equal(want[i][k], got[i][k]), f"resident_mb={resident_mb}: {k} of {i}")
                for p, q in zip(params, ref_params):
                    self.assertTrue(torch.equal(p.detach(), q.detach()), f"resident_mb={resident_mb}: parameters")
                del opt
                if resident_mb == 1:  # the file is at step 5 now: the second resume starts over
                    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())

    def test_state_dict_round_trips_with_the_host_tier(self):
        f_params, h_params, g_params = make_params(big=True), make_params(seed=3, big=True), make_params(seed=5, big=True)
        with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as d2:
            f = build(f_params, d, "file", resident_mb=1)
            train(f, f_params, 3)
            h = build(h_params)  # the host tier, all streamed
            h.load_state_dict(f.state_dict())
            g = build(g_params, d2, "file", resident_mb=1)  # and back into a resident file tier
            g.load_state_dict(h.state_dict())
            with torch.no_grad():
                for p, q, r in zip(h_params, g_params, f_params):
                    p.copy_(r)
                    q.copy_(r)
            for o, ps in ((f, f_params), (h, h_params), (g, g_params)):
                train(o, ps, 2, first=3)
            want = f.state_dict()["state"]
            for name, o in (("host", h), ("file again", g)):
                got = o.state_dict()["state"]
                for i in want:
                    for k in ("main_param", "exp_avg", "exp_avg_sq", "step"):
                        self.assertTrue(torch.equal(want[i][k], got[i][k]), f"{name}: {k} of {i}")
            for p, q, r in zip(f_params, h_params, g_params):
                self.assertTrue(torch.equal(p.detach(), q.detach()) and torch.equal(p.detach(), r.detach()))

    def test_auto_is_accepted_and_compressed_moments_refuse_a_number(self):
        params = make_params()
        with tempfile.TemporaryDirectory() as d:
            opt = build(params, d, "file", resident_mb="auto")  # (0 off CUDA: Note [resident_mb="auto"])
            train(opt, params, 1)
            self.assertEqual(optim.resident_budgets("auto", "file", 2, torch.device("cpu")), [0])
        del opt
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaisesRegex(optim.InvalidArgumentError, "resident_mb.*fp32 moments"):
                build(params, d, "file", resident_mb=1, moment_dtype="bf16")
            build(params, d, "file", resident_mb="auto", moment_dtype="bf16")  # "auto": 0, accepted


class Behaviour(unittest.TestCase):
    def test_scheduler_and_group_changes_reach_the_engine(self):
        params = make_params()
        a = build(params)
        train(a, params, 2)
        before = [p.detach().clone() for p in params]
        for g in a.param_groups:
            g["lr"] = 0.0
            g["weight_decay"] = 0.0
        train(a, params, 1, first=3)
        for p, b in zip(params, before):
            self.assertTrue(torch.equal(p.detach(), b), "lr 0 and no decay must leave the parameters")

    def test_skipped_parameter_is_untouched(self):
        params = make_params()
        opt = build(params)
        train(opt, params, 2)
        keep = params[0].detach().clone()
        for i, p in enumerate(params):
            p.grad = None if i == 0 else torch.ones_like(p)
        opt.step()
        self.assertTrue(torch.equal(params[0].detach(), keep))
        sd = opt.state_dict()
        self.assertEqual(float(sd["state"][0]["step"]), 2.0)
        self.assertEqual(float(sd["state"][1]["step"]), 3.0)

    def test_zero_grad_and_empty_state_before_the_first_step(self):
        params = make_params()
        opt = build(params)
        self.assertEqual(opt.state_dict()["state"], {})
        for p in params:
            p.grad = torch.ones_like(p)
        opt.zero_grad()
        self.assertTrue(all(p.grad is None for p in params))
        opt.step()  # every parameter skipped
        self.assertEqual(opt.state_dict()["state"], {})

    def test_state_dict_round_trip_in_a_new_process(self):
        params = make_params()
        opt = build(params)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        train(opt, params, 3, sched=sched)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt.pt")
            torch.save({"model": [p.detach().clone() for p in params], "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, path)
            train(opt, params, 3, first=3, sched=sched)
            out = os.path.join(tmp, "after.pt")
            code = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import test_optim_cpu as T
params = T.make_params(seed=5)   # other values: everything must come from the checkpoint
ck = torch.load({path!r})
with torch.no_grad():
    for p, v in zip(params, ck["model"]):
        p.copy_(v)
opt = T.build(params)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
opt.load_state_dict(ck["opt"])
sched.load_state_dict(ck["sched"])
T.train(opt, params, 3, first=3, sched=sched)
torch.save({{"model": [p.detach() for p in params], "opt": opt.state_dict()}}, {out!r})
"""
            subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
            got = torch.load(out)
            for p, q in zip(params, got["model"]):
                self.assertTrue(torch.equal(p.detach(), q), "parameters after the resumed steps")
            mine = opt.state_dict()["state"]
            for i in mine:
                for k in ("main_param", "exp_avg", "exp_avg_sq", "step"):
                    self.assertTrue(torch.equal(mine[i][k], got["opt"]["state"][i][k]), f"{k} of {i}")

    def test_file_tier_takes_a_state_dict_and_resumes_its_file(self):
        a_params, b_params = make_params(), make_params(seed=3)
        with tempfile.TemporaryDirectory() as da, tempfile.TemporaryDirectory() as db:
            a = build(a_params, da, "file")
            train(a, a_params, 3)
            b = build(b_params, db, "file")
            b.load_state_dict(a.state_dict())
            with torch.no_grad():
                for p, q in zip(b_params, a_params):
                    p.copy_(q)
            train(a, a_params, 2, first=3)
            train(b, b_params, 2, first=3)
            for p, q in zip(a_params, b_params):
                self.assertTrue(torch.equal(p.detach(), q.detach()), "file tier after load_state_dict")
            want = a.state_dict()["state"]
            del a
            c_params = make_params(seed=4)
            c = build(c_params, da, "file", resume=True)
            got = c.state_dict()["state"]
            for i in want:
                for k in ("main_param", "exp_avg", "exp_avg_sq"):
                    self.assertTrue(torch.equal(want[i][k], got[i][k]), f"resumed {k} of {i}")
            for p, q in zip(c_params, a_params):
                self.assertTrue(torch.equal(p.detach(), q.detach()), "resume writes the parameters from main")

    def test_file_tier_with_compressed_moments_equals_the_host_tier(self):
        # Note [File tier moments]: the host tier's bits; the state file keeps its format.
        for dt in ("bf16", "int8"):
            h_params, f_params = make_params(), make_params()
            with tempfile.TemporaryDirectory() as tmp:
                h = build(h_params, moment_dtype=dt)
                f = optim.StreamedAdamW([dict(params=f_params[:2], **GROUPS[0]), dict(params=f_params[2:], **GROUPS[1])],
                                        lr=3e-3, window_mb=48, depth=2, tier="file", directory=tmp, moment_dtype=dt)
                train(h, h_params, 3)
                train(f, f_params, 3)
                want, got = h.state_dict()["state"], f.state_dict()["state"]
                for i in want:
                    for k in ("main_param", "exp_avg", "exp_avg_sq"):
                        self.assertTrue(torch.equal(want[i][k], got[i][k]), f"{dt}: {k} of {i}")
                del f
                other = "int8" if dt == "bf16" else "bf16"
                with self.assertRaisesRegex(optim.InvalidArgumentError, f"holds moments in {dt}.*{other}"):
                    g = optim.StreamedAdamW(make_params(), lr=3e-3, window_mb=48, depth=2, tier="file",
                                            directory=tmp, resume=True, moment_dtype=other)
                    g.state_dict()

    def test_loads_torch_adamw_state(self):
        params = make_params()
        ref = torch.optim.AdamW(params, lr=1e-3)
        for p in params:
            p.grad = torch.ones_like(p)
        ref.step()
        opt = optim.StreamedAdamW(params, lr=1e-3, window_mb=2)
        opt.load_state_dict(ref.state_dict())
        st = opt.state_dict()["state"]
        for i, p in enumerate(params):
            self.assertTrue(torch.equal(st[i]["exp_avg"], ref.state[p]["exp_avg"].float()))
            self.assertTrue(torch.equal(st[i]["main_param"], p.detach().float()), "main from the parameter")
            self.assertEqual(float(st[i]["step"]), 1.0)

    def test_engine_checkpoint(self):
        params = make_params()
        opt = build(params)
        train(opt, params, 2)
        with tempfile.TemporaryDirectory() as tmp:
            opt.save_checkpoint(tmp)
            want = opt.state_dict()["state"]
            train(opt, params, 1, first=2)
            opt.load_checkpoint(tmp)
            got = opt.state_dict()["state"]
            for i in want:
                self.assertTrue(torch.equal(want[i]["exp_avg_sq"], got[i]["exp_avg_sq"]))
            self.assertTrue(torch.equal(params[0].detach(), got[0]["main_param"].to(torch.bfloat16)))

    def test_stats(self):
        params = make_params()
        opt = build(params)
        train(opt, params, 2)
        s = opt.stats()
        n = sum(p.numel() for p in params)
        # An FP32 parameter is its own main: its moments move alone (8 B each way).
        moved = sum((8 if p.dtype == torch.float32 else 12) * p.numel() for p in params)
        self.assertEqual(s["steps"], 2)
        self.assertEqual(s["params"], n)
        self.assertEqual(s["bytes_to_device"], moved)
        self.assertEqual(s["bytes_from_device"], moved)
        self.assertLessEqual(s["peak_backed_bytes"], 2 << 20)
        self.assertGreater(s["peak_backed_bytes"], 0)
        self.assertGreaterEqual(s["python_seconds"], 0.0)

    def test_progress_callback(self):
        seen = []
        params = make_params()
        opt = build(params, progress=lambda ph, d, t, s: seen.append((ph, d, t)))
        train(opt, params, 1)
        self.assertIn("init", [s[0] for s in seen])
        self.assertEqual(seen[-1][0], "step")
        self.assertEqual(seen[-1][1], seen[-1][2])


class Errors(unittest.TestCase):
    def test_refused_options(self):
        for kw in (dict(amsgrad=True), dict(maximize=True), dict(capturable=True)):
            with self.assertRaises(optim.InvalidArgumentError) as cm:
                optim.StreamedAdamW(make_params(), **kw)
            self.assertIn("not supported", str(cm.exception))
            self.assertIsInstance(cm.exception, ValueError)
            self.assertIsInstance(cm.exception, deferalloc.DeferallocError)

    def test_invalid_hyper_parameters(self):
        # Each message names the argument as the user passed it.
        for kw, word in ((dict(lr=-1.0), "lr=-1.0"), (dict(betas=(1.0, 0.9)), "betas=(1.0, 0.9)"),
                         (dict(betas=(0.9, -0.1)), "betas=(0.9, -0.1)"), (dict(eps=-1e-8), "eps=-1e-08"),
                         (dict(weight_decay=-0.1), "weight_decay=-0.1"), (dict(lr=float("nan")), "lr=nan"),
                         (dict(betas=(0.9, 0.99, 0.5)), "betas=(0.9, 0.99, 0.5)"), (dict(betas=(0.9,)), "betas=(0.9,)")):
            with self.assertRaises(optim.InvalidArgumentError) as cm:
                optim.StreamedAdamW(make_params(), **kw)
            self.assertIn(word, str(cm.exception))

    def test_a_scheduler_setting_a_bad_lr_fails_at_the_step(self):
        params = make_params()
        opt = build(params)
        opt.param_groups[0]["lr"] = -1.0
        for p in params:
            p.grad = torch.ones_like(p)
        with self.assertRaises(optim.InvalidArgumentError):
            opt.step()
        opt.param_groups[0]["lr"] = 1e-3
        opt.step()

    def test_bad_parameters(self):
        with self.assertRaises(optim.InvalidArgumentError):
            optim.StreamedAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))])
        with self.assertRaises(optim.InvalidArgumentError):
            optim.StreamedAdamW([torch.nn.Parameter(torch.zeros(4, 4).t())])
        with self.assertRaises(optim.InvalidArgumentError):
            optim.StreamedAdamW(make_params(), tier="file")
        with self.assertRaises(optim.InvalidArgumentError):
            optim.StreamedAdamW(make_params(), tier="disk")

    def test_non_contiguous_gradient_is_taken_as_its_values(self):
        a, b = make_params(), make_params()
        oa, ob = build(a), build(b)
        for pa, pb in zip(a, b):
            g = torch.randn(tuple(reversed(pa.shape))).to(pa.dtype).t() if pa.dim() == 2 else torch.randn(pa.shape)
            pa.grad = g.to(pa.dtype)
            pb.grad = g.to(pb.dtype).contiguous()
        self.assertFalse(a[0].grad.is_contiguous())
        oa.step()
        ob.step()
        for pa, pb in zip(a, b):
            self.assertTrue(torch.equal(pa.detach(), pb.detach()))

    def test_groups_are_fixed_after_the_first_step(self):
        params = make_params()
        opt = build(params)
        train(opt, params, 1)
        with self.assertRaises(optim.InvalidStateError):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})

    def test_mismatched_state_dict(self):
        a = build(make_params())
        b = optim.StreamedAdamW(make_params()[:2])
        with self.assertRaises(optim.InvalidArgumentError):
            b.load_state_dict(a.state_dict())

    def test_out_of_memory_is_torch_out_of_memory(self):
        # A parameter of 4 MiB FP32: the window's slots, backed for the pass's largest piece,
        # need more than the 1 MiB capacity (for the small ones alone, a granule per array
        # and slot would fit: Note [Window slots]).
        params = make_params() + [torch.nn.Parameter(torch.zeros(1 << 20))]
        opt = optim.StreamedAdamW(params, window_mb=8, settings="host_capacity_mb:1")
        for p in params:
            p.grad = torch.ones_like(p)
        with self.assertRaises(torch.OutOfMemoryError) as cm:
            opt.step()
        self.assertIsInstance(cm.exception, optim.OutOfMemoryError)
        self.assertIn("out of memory", str(cm.exception).lower())


if __name__ == "__main__":
    from unittest_main import run_tests
    run_tests()
