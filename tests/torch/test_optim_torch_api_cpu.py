"""StreamedAdamW keeps the promises of a torch optimizer, on the host driver.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host,... and the libraries set.
``opt.state`` through the engine, DCP round trips on every tier and with torch.optim.AdamW
both ways, an all-or-nothing load_state_dict, frozen parameters, FSDP2 at world size 2
(gloo, CPU) against the reference on FP32 copies of the shards and a DCP save at world
size 2 loaded at world size 1, GradScaler, the file tier's existing state, pickling, sizes,
``deferalloc.__version__``, torch.compile and progress through the logger.
"""
import copy
import logging
import os
import pickle
import re
import sys
import tempfile
import unittest
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_reference import ReferenceAdamW  # noqa: E402
from process_group import exit_now, free_port, run_in_process_group  # noqa: E402

import deferalloc  # noqa: E402
from deferalloc import optim  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("step", "exp_avg", "exp_avg_sq", "main_param")


class Net(torch.nn.Module):
    def __init__(self, seed=0, dtype=torch.bfloat16):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 2)
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(t, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 2, generator=g).to(dtype)


def train(m, opt, steps, first=0, dtype=torch.bfloat16):
    for t in range(first, first + steps):
        x, y = batch(t, dtype)
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot(opt):
    """Everything a load could change: hyper-parameters and every state tensor."""
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for i, st in sd["state"].items()}
    return groups, state


def same_snapshot(tc, a, b, what):
    tc.assertEqual(a[0], b[0], f"{what}: hyper-parameters")
    tc.assertEqual(sorted(a[1]), sorted(b[1]), f"{what}: parameters with state")
    for i in a[1]:
        for k in a[1][i]:
            tc.assertTrue(torch.equal(a[1][i][k], b[1][i][k]), f"{what}: {k} of parameter {i}")


def make(m, tier="host", tmp=None, **kw):
    return optim.StreamedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, window_mb=2, tier=tier,
                               directory=tmp if tier == "file" else None, **kw)


def dcp_save(m, opt, ck):
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)


def dcp_load(m, opt, ck):
    """DCP's resume: the targets from get_state_dict, dcp.load into them, set_state_dict."""
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ck)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class StateView(unittest.TestCase):
    def test_opt_state_reads_the_engine(self):
        m = Net()
        opt = make(m)
        self.assertEqual(len(opt.state), 0, "no state before the first step (as torch)")
        self.assertFalse(opt.state)
        train(m, opt, 3)
        params = list(m.parameters())
        self.assertEqual(len(opt.state), len(params))
        sd = opt.state_dict()["state"]
        for i, p in enumerate(params):
            self.assertIn(p, opt.state)
            st = opt.state[p]
            self.assertEqual(sorted(st), sorted(KEYS))
            self.assertEqual(st["step"].dtype, torch.float32)
            self.assertEqual(float(st["step"]), 3.0)
            for k in KEYS:
                self.assertTrue(torch.equal(st[k], sd[i][k]), k)
            self.assertEqual(st["exp_avg"].shape, p.shape)
            self.assertEqual(st["exp_avg"].dtype, torch.float32)
            self.assertIsNot(st["exp_avg"], st["exp_avg"], "read on each access, never a kept copy")

    def test_opt_state_writes_through(self):
        m = Net()
        opt = make(m)
        train(m, opt, 2)
        p = m.a.weight
        new = torch.full(p.shape, 0.25)
        opt.state[p]["exp_avg"] = new
        opt.state[p]["step"] = 7
        self.assertTrue(torch.equal(opt.state[p]["exp_avg"], new))
        self.assertEqual(float(opt.state_dict()["state"][0]["step"]), 7.0)
        # in place, through the tensors the view returns
        opt.state[p]["exp_avg"].mul_(2)
        st = opt.state[p]
        st["exp_avg_sq"][1, 2] = 9.0
        st["exp_avg_sq"] += 1.0
        st["step"] += 1
        self.assertTrue(torch.equal(opt.state[p]["exp_avg"], new * 2))
        self.assertEqual(float(opt.state[p]["exp_avg_sq"][1, 2]), 10.0)
        self.assertEqual(float(opt.state[p]["step"]), 8.0)
        with tempfile.TemporaryDirectory() as tmp:  # saved and copied as plain tensors
            torch.save(dict(opt.state[p]), os.path.join(tmp, "st.pt"))
            self.assertIs(type(torch.load(os.path.join(tmp, "st.pt"))["exp_avg"]), torch.Tensor)
        copied = copy.deepcopy(dict(opt.state[p]))
        copied["exp_avg"].zero_()
        self.assertIs(type(copied["exp_avg"]), torch.Tensor)
        doubled = opt.state[p]["exp_avg"] * 2  # other operations: plain tensors, nothing written
        self.assertIs(type(doubled), torch.Tensor)
        self.assertTrue(torch.equal(opt.state[p]["exp_avg"], new * 2))
        with self.assertRaises(optim.InvalidArgumentError):
            opt.state[p]["exp_avg"] = torch.zeros(p.numel())  # same numel, wrong shape
        with self.assertRaises(optim.InvalidArgumentError):
            opt.state[p]["step"] = -1
        with self.assertRaises(KeyError):
            opt.state[p]["momentum_buffer"] = torch.zeros(p.shape)
        with self.assertRaises(optim.InvalidStateError):
            del opt.state[p]

    def test_get_state_dict_takes_no_step(self):
        m = Net()
        opt = make(m)
        train(m, opt, 5)
        before = snapshot(opt)
        weights = [p.detach().clone() for p in m.parameters()]
        for _ in range(2):
            get_state_dict(m, opt)
        same_snapshot(self, before, snapshot(opt), "after get_state_dict")
        for p, w in zip(m.parameters(), weights):
            self.assertTrue(torch.equal(p.detach(), w))


class Dcp(unittest.TestCase):
    def round_trip(self, tier):
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "a"))
            os.makedirs(os.path.join(tmp, "b"))
            ck = os.path.join(tmp, "ck")
            m = Net()
            opt = make(m, tier, os.path.join(tmp, "a"))
            train(m, opt, 5)
            dcp_save(m, opt, ck)
            train(m, opt, 3, first=5)
            m2 = Net(seed=1)  # other weights: everything must come from the checkpoint
            opt2 = make(m2, tier, os.path.join(tmp, "b"))
            dcp_load(m2, opt2, ck)
            train(m2, opt2, 3, first=5)
            for (n, p), q in zip(m.named_parameters(), m2.parameters()):
                self.assertTrue(torch.equal(p.detach(), q.detach()), f"{tier}: {n} after the resumed steps")
            same_snapshot(self, snapshot(opt), snapshot(opt2), f"{tier}: state after the resumed steps")

    def test_round_trip_host(self):
        self.round_trip("host")

    def test_round_trip_file(self):
        self.round_trip("file")

    def test_round_trip_device(self):
        self.round_trip("device")

    def test_torch_adamw_checkpoint_loads_and_back(self):
        with tempfile.TemporaryDirectory() as tmp:
            m = Net(dtype=torch.float32)
            ref = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
            train(m, ref, 3, dtype=torch.float32)
            dcp_save(m, ref, os.path.join(tmp, "torch"))
            m2 = Net(seed=1, dtype=torch.float32)
            opt = make(m2, main_param_in_state_dict=False)  # torch's keys only: main from the loaded weights
            dcp_load(m2, opt, os.path.join(tmp, "torch"))
            for p, q in zip(m.parameters(), m2.parameters()):
                self.assertTrue(torch.equal(p.detach(), q.detach()))
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    self.assertTrue(torch.equal(ref.state[p][k].float(), opt.state[q][k]), f"{k} from torch AdamW")
                self.assertTrue(torch.equal(opt.state[q]["main_param"], q.detach()), "main from the parameter")
            # and back: StreamedAdamW's checkpoint into a fresh torch.optim.AdamW
            train(m2, opt, 2, first=3, dtype=torch.float32)
            dcp_save(m2, opt, os.path.join(tmp, "ours"))
            m3 = Net(seed=2, dtype=torch.float32)
            ref3 = torch.optim.AdamW(m3.parameters(), lr=1e-2, weight_decay=0.1)
            dcp_load(m3, ref3, os.path.join(tmp, "ours"))
            for p, q in zip(m2.parameters(), m3.parameters()):
                self.assertTrue(torch.equal(p.detach(), q.detach()))
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    self.assertTrue(torch.equal(opt.state[p][k], ref3.state[q][k]), f"{k} into torch AdamW")


class AtomicLoad(unittest.TestCase):
    def bad_dicts(self, m, good):
        """(what, state dict) pairs that must be refused."""
        def edited(fn):
            sd = copy.deepcopy(good)
            fn(sd)
            return sd
        other = Net()
        other.a = torch.nn.Linear(6, 13).to(torch.bfloat16)
        other.b = torch.nn.Linear(13, 2).to(torch.bfloat16)
        o = make(other)
        train(other, o, 1)
        sgd = torch.optim.SGD(Net().parameters(), lr=0.5, momentum=0.9)
        mm = Net()
        train(mm, sgd, 1)
        yield "another model", o.state_dict()
        yield "an SGD state dict", sgd.state_dict()
        yield "a group count", edited(lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0], params=[])))
        yield "a group size", edited(lambda sd: sd["param_groups"][0]["params"].pop())
        yield "a shape (same numel)", edited(lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].t()))
        yield "a last parameter's numel", edited(lambda sd: sd["state"][3].update(exp_avg_sq=torch.zeros(3)))
        yield "an integer dtype", edited(lambda sd: sd["state"][1].update(exp_avg=torch.zeros(12, dtype=torch.int32)))
        yield "a missing key", edited(lambda sd: sd["state"][2].pop("exp_avg_sq"))
        yield "an amsgrad key", edited(lambda sd: sd["state"][2].update(max_exp_avg_sq=torch.zeros(2, 12)))
        yield "step -5", edited(lambda sd: sd["state"][3].update(step=torch.tensor(-5.0)))
        yield "step 1e30", edited(lambda sd: sd["state"][3].update(step=torch.tensor(1e30)))
        yield "step 2.7", edited(lambda sd: sd["state"][3].update(step=2.7))
        yield "three betas", edited(lambda sd: sd["param_groups"][0].update(betas=(0.9, 0.99, 0.5)))
        yield "a negative lr", edited(lambda sd: sd["param_groups"][0].update(lr=-1.0))
        yield "amsgrad", edited(lambda sd: sd["param_groups"][0].update(amsgrad=True))

    def test_a_refused_dict_changes_nothing(self):
        m = Net()
        opt = make(m)
        train(m, opt, 3)
        good = opt.state_dict()
        train(m, opt, 1, first=3)
        opt.param_groups[0]["lr"] = 1e-3
        before = snapshot(opt)
        weights = [p.detach().clone() for p in m.parameters()]
        for what, sd in self.bad_dicts(m, good):
            with self.subTest(what):
                with self.assertRaises(optim.InvalidArgumentError):
                    opt.load_state_dict(sd)
                same_snapshot(self, before, snapshot(opt), what)
                for p, w in zip(m.parameters(), weights):
                    self.assertTrue(torch.equal(p.detach(), w))
        train(m, opt, 1, first=4)  # still steps
        opt.load_state_dict(good)  # and a good one loads
        same_snapshot(self, (snapshot(opt)[0], {i: {k: good["state"][i][k] for k in KEYS} for i in good["state"]}),
                      snapshot(opt), "the good dict")

    def test_step_messages(self):
        m = Net()
        opt = make(m)
        train(m, opt, 1)
        sd = opt.state_dict()
        for bad in (-5, 1e30, 2.7, float("nan")):
            sd["state"][0]["step"] = torch.tensor(bad)
            with self.assertRaisesRegex(optim.InvalidArgumentError, r"step .* whole number"):
                opt.load_state_dict(sd)


class Frozen(unittest.TestCase):
    def test_frozen_parameters_get_no_state(self):
        m = Net()
        m.a.weight.requires_grad_(False)
        opt = make(m)
        frozen = m.a.weight.detach().clone()
        train(m, opt, 2)
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        s = opt.stats()
        self.assertEqual(s["state_params"], trainable)
        self.assertEqual(s["state_bytes"], 12 * trainable)
        self.assertEqual(s["params"], trainable)
        self.assertNotIn(m.a.weight, opt.state)
        self.assertEqual(len(opt.state), 3)
        self.assertTrue(torch.equal(m.a.weight.detach(), frozen))
        sd = opt.state_dict()
        self.assertNotIn(0, sd["state"], "no state for the frozen parameter")
        self.assertEqual(len(sd["param_groups"][0]["params"]), 4, "it stays in its group, as in torch")
        # same model with torch AdamW: the same state keys
        ref = torch.optim.AdamW(m.parameters())
        train(m, ref, 1)
        self.assertEqual(sorted(ref.state_dict()["state"]), sorted(sd["state"]))
        m.a.weight.requires_grad_(True)  # unfrozen behind the optimizer's back: refused, not skipped
        x, y = batch(0)
        ((m(x) - y) ** 2).mean().backward()
        with self.assertRaisesRegex(optim.InvalidStateError, "requires_grad=False"):
            opt.step()

    def test_add_param_group_before_the_first_step(self):
        a, b = Net(), Net()
        opt_a = optim.StreamedAdamW(a.a.parameters(), lr=1e-2, window_mb=2)
        opt_a.add_param_group({"params": list(a.b.parameters()), "lr": 5e-3})
        opt_b = optim.StreamedAdamW([{"params": list(b.a.parameters())},
                                     {"params": list(b.b.parameters()), "lr": 5e-3}], lr=1e-2, window_mb=2)
        train(a, opt_a, 2)
        train(b, opt_b, 2)
        for p, q in zip(a.parameters(), b.parameters()):
            self.assertTrue(torch.equal(p.detach(), q.detach()))
        with self.assertRaisesRegex(optim.InvalidStateError, "state exists already"):
            opt_a.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        self.assertIn("Refused after it", optim.StreamedAdamW.add_param_group.__doc__)


def fsdp_net(seed=0):
    """Net with a one-row last layer: at world size 2 one rank's shard of it is empty."""
    m = Net(seed, dtype=torch.float32)
    m.b = torch.nn.Linear(12, 1)
    return m


def _fsdp2_worker(rank, world, port, tmp):
    run_in_process_group(_fsdp2_work, "gloo", rank, world, port, rank, world, tmp)
    exit_now()


def _fsdp2_work(rank, world, tmp):
    """FSDP2 (fully_shard) over gloo: StreamedAdamW on the local shards against the
    reference AdamW on FP32 copies of the same shards, with clip_grad_norm_; then a DCP save."""
    from torch.distributed.fsdp import fully_shard
    m = fsdp_net()
    fully_shard(m.a)
    fully_shard(m.b)
    fully_shard(m)
    opt = optim.StreamedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, window_mb=2)
    params = list(m.parameters())
    ref = ReferenceAdamW([p.to_local() for p in params])
    for t in range(3):
        x, y = batch(t, torch.float32)
        ((m(x[rank::world]) - y[rank::world, :1]) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        for i, p in enumerate(params):
            ref.step(i, p.grad.to_local(), 1e-2, 0.9, 0.999, 1e-8, 0.1)
        opt.step()
        opt.zero_grad()
    bad = []
    for i, p in enumerate(params):
        st = opt.state[p]
        if type(st["exp_avg"]).__name__ != "DTensor" or st["exp_avg"].placements != p.placements:
            bad.append(f"param {i}: state is not a DTensor of the param's placements")
        for k, w in (("main_param", "main"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            if not torch.equal(st[k].to_local(), ref.tensor(w, i, p.to_local())):
                bad.append(f"param {i}: {k} differs from the reference on the FP32 shard")
        if not torch.equal(p.to_local(), ref.tensor("main", i, p.to_local())):
            bad.append(f"param {i}: parameter differs")
    dcp_save(m, opt, os.path.join(tmp, "ck"))
    full = {n: {k: (v.full_tensor() if k != "step" else v) for k, v in opt.state[p].items()}
            for n, p in m.named_parameters()}
    weights = {n: p.full_tensor() for n, p in m.named_parameters()}
    if rank == 0:
        torch.save({"bad": bad, "state": full, "weights": weights}, os.path.join(tmp, "rank0.pt"))
    elif bad:
        torch.save({"bad": bad}, os.path.join(tmp, f"rank{rank}.pt"))


class Fsdp2(unittest.TestCase):
    @unittest.skipIf(torch.torch_version.TorchVersion(torch.__version__) < "2.7",
                     "torch < 2.7's FSDP2 cannot run on the CPU (its CPU streams lack record_event)")
    def test_world_size_2_then_a_load_at_world_size_1(self):
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_fsdp2_worker, args=(2, free_port(), tmp), nprocs=2, join=True)
            got = torch.load(os.path.join(tmp, "rank0.pt"))
            bad = got["bad"] + (torch.load(os.path.join(tmp, "rank1.pt"))["bad"]
                                if os.path.exists(os.path.join(tmp, "rank1.pt")) else [])
            self.assertEqual(bad, [])
            m = fsdp_net(seed=3)
            opt = optim.StreamedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, window_mb=2)
            dcp_load(m, opt, os.path.join(tmp, "ck"))
            for n, p in m.named_parameters():
                self.assertTrue(torch.equal(p.detach(), got["weights"][n]), n)
                for k in KEYS:
                    self.assertTrue(torch.equal(opt.state[p][k], got["state"][n][k]), f"{n} {k}")


class Amp(unittest.TestCase):
    def check(self, dtype):
        a, b = Net(dtype=dtype), Net(dtype=dtype)
        oa, ob = make(a), make(b)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for t in range(3):
            x, y = batch(t, dtype)
            scaler.scale(((a(x) - y) ** 2).mean()).backward()
            scaler.step(oa)
            scaler.update()
            oa.zero_grad()
        train(b, ob, 3, dtype=dtype)
        for p, q in zip(a.parameters(), b.parameters()):
            self.assertTrue(torch.equal(p.detach(), q.detach()), f"{dtype}: GradScaler's steps = unscaled steps")
        # an inf: the step is skipped (no parameter, no step count), the scale backs off
        before = snapshot(oa)
        weights = [p.detach().clone() for p in a.parameters()]
        x, y = batch(9, dtype)
        scaler.scale(((a(x) - y) ** 2).mean()).backward()
        a.a.weight.grad[0, 0] = float("inf")
        scale = scaler.get_scale()
        scaler.step(oa)
        scaler.update()
        self.assertEqual(scaler.get_scale(), scale / 2)
        same_snapshot(self, before, snapshot(oa), "a step with inf")
        for p, w in zip(a.parameters(), weights):
            self.assertTrue(torch.equal(p.detach(), w))

    def test_fp16(self):
        self.check(torch.float16)

    def test_bf16(self):
        self.check(torch.bfloat16)


class Rest(unittest.TestCase):
    def test_file_tier_refuses_an_existing_state_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            m = Net()
            opt = make(m, "file", tmp)
            train(m, opt, 2)
            want = snapshot(opt)
            del opt
            with self.assertRaisesRegex(optim.InvalidStateError, "resume=True.*overwrite=True"):
                make(Net(), "file", tmp)
            resumed = make(Net(seed=4), "file", tmp, resume=True)
            same_snapshot(self, want, snapshot(resumed), "resume=True after the refusal")
            del resumed
            fresh = make(Net(), "file", tmp, overwrite=True)
            self.assertEqual(len(fresh.state), 0)
            with self.assertRaises(optim.InvalidArgumentError):
                make(Net(), "file", tmp, overwrite=True, resume=True)

    def test_the_file_tier_directory_is_checked_by_the_engine(self):
        # Note [Arguments are checked where they enter]: the engine refuses a file tier
        # without a directory; a directory given in settings= counts, and its existing state
        # file is refused as the keyword's is (overwrite is Python's alone).
        with self.assertRaisesRegex(optim.InvalidArgumentError, "file tier needs a directory"):
            optim.StreamedAdamW(Net().parameters(), window_mb=2, tier="file")
        with tempfile.TemporaryDirectory() as tmp:
            m = Net()
            opt = optim.StreamedAdamW(m.parameters(), lr=1e-2, window_mb=2, tier="file", settings=f"directory:{tmp}")
            train(m, opt, 1)
            del opt
            with self.assertRaisesRegex(optim.InvalidStateError, "holds optimizer state already"):
                optim.StreamedAdamW(Net().parameters(), window_mb=2, tier="file", settings=f"directory:{tmp}")
            optim.StreamedAdamW(Net().parameters(), window_mb=2, tier="file", settings=f"directory:{tmp}",
                                overwrite=True)

    def test_pickle_and_deepcopy_raise_type_error(self):
        m = Net()
        opt = make(m)
        train(m, opt, 1)
        for fn in (copy.deepcopy, copy.copy, pickle.dumps):
            with self.assertRaisesRegex(TypeError, "state_dict"):
                fn(opt)
        with tempfile.TemporaryDirectory() as tmp, self.assertRaises(TypeError):
            torch.save(opt, os.path.join(tmp, "opt.pt"))

    def test_sizes_are_whole_mib(self):
        for kw in (dict(window_mb=0.5), dict(resident_mb=1.5), dict(window_mb="8")):
            with self.assertRaisesRegex(optim.InvalidArgumentError, "whole number of MiB"):
                optim.StreamedAdamW(Net().parameters(), **kw)
        for key in ("window_mb", "resident_mb"):
            with self.assertRaisesRegex(optim.InvalidArgumentError, f"StreamedAdamW: {key}=-1 \\(a whole number"):
                optim.StreamedAdamW(Net().parameters(), **{key: -1})
        optim.StreamedAdamW(Net().parameters(), window_mb=2.0)

    def test_version(self):
        with open(os.path.join(ROOT, "pyproject.toml")) as f:
            want = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
        self.assertEqual(deferalloc.__version__, want)

    def test_step_inside_torch_compile(self):
        torch._dynamo.reset()
        a, b = Net(dtype=torch.float32), Net(dtype=torch.float32)
        oa, ob = make(a), make(b)
        ca = torch.compile(a)

        @torch.compile
        def train_step(x, y):
            loss = ((ca(x) - y) ** 2).mean()
            loss.backward()
            oa.step()  # a graph break (Note [step under torch.compile])
            oa.zero_grad()
            return loss.detach()

        cb = torch.compile(b)

        @torch.compile
        def forward_backward(x, y):
            loss = ((cb(x) - y) ** 2).mean()
            loss.backward()
            return loss.detach()

        for t in range(2):
            train_step(*batch(t, torch.float32))
            forward_backward(*batch(t, torch.float32))
            ob.step()  # eager, outside the compiled function
            ob.zero_grad()
        self.assertEqual(float(oa.state[a.a.weight]["step"]), 2.0)
        for p, q in zip(a.parameters(), b.parameters()):
            self.assertTrue(torch.equal(p.detach(), q.detach()))

    def test_progress_true_logs_through_the_deferalloc_logger(self):
        old = optim._PROGRESS_AFTER_S
        optim._PROGRESS_AFTER_S = -1.0  # every pass reports, however short
        try:
            m = Net()
            opt = make(m, progress=True)
            with self.assertLogs("deferalloc", level=logging.INFO) as logs:
                train(m, opt, 1)
        finally:
            optim._PROGRESS_AFTER_S = old
        lines = [r.getMessage() for r in logs.records]
        self.assertTrue(any(re.match(r"init +100\.0%  [0-9.]+ Gparam/s", line) for line in lines), lines)
        self.assertTrue(any(re.match(r"step +100\.0%", line) for line in lines), lines)

    def test_docstrings_have_examples(self):
        self.assertIn("Example::", optim.StreamedAdamW.__doc__)
        self.assertIn("Example::", optim.__doc__)


if __name__ == "__main__":
    from unittest_main import run_tests
    run_tests()
