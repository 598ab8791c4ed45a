"""deferalloc.overlap on the host driver (CPU tensors): stepping during backward equals
the plain step bit for bit, without clipping and with the speculative step + redo of
clipping (Note [Overlap with backward]), the engine keeping the previous state (Note
[Speculative steps]) or the state copied out; clipping that never / always / every other
iteration fires under each clip_policy; gradient accumulation over micro-batches
(accumulating()); the file tier (one commit per step); also moment_dtype and resident_mb.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host,... and DEFERALLOC_LIB set;
test_overlap_gpu.py runs the same tests on the GPU (DFA_OVERLAP_DEVICE=cuda).
"""
import os
import tempfile
import time
import unittest

import torch

import deferalloc._engine
from deferalloc import optim
from deferalloc.overlap import overlap_with_backward

DEVICE = torch.device(os.environ.get("DFA_OVERLAP_DEVICE", "cpu"))
CUDA = DEVICE.type == "cuda"
WINDOW_MB = 64 if CUDA else 1  # (the CUDA driver's granule is 2 MiB)
RESIDENT_MB = 8 if CUDA else 1  # some parameters resident, not all


def model(seed=0):
    torch.manual_seed(seed)
    # (Sized so that resident_mb=RESIDENT_MB holds some parameters, not all: an FP32
    # parameter is its own main, so a resident one takes two arrays' granules.)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 128), torch.nn.GELU(),
                            torch.nn.Linear(128, 16))
    m[2].to(torch.bfloat16)  # mixed parameter types
    return m.to(DEVICE)


def forward(m, x):
    h = m[1](m[0](x))
    h = m[3](m[2](h.to(torch.bfloat16)).float())
    return m[4](h)


def batch(t, scale=None):
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(32, 64, generator=g) * (1 + t if scale is None else scale(t))
    return x.to(DEVICE), torch.randn(32, 16, generator=g).to(DEVICE)


def make_opt(m, **kw):
    groups = [dict(params=list(m[0].parameters()) + list(m[2].parameters()), weight_decay=0.1),
              dict(params=list(m[4].parameters()), weight_decay=0.0)]
    return optim.StreamedAdamW(groups, lr=1e-2, window_mb=WINDOW_MB, **kw)


def train(steps, mode, max_norm=None, bucket_mb=256, ov_kw=None, micro=1, scale=None, replace_at=None, **kw):
    """``micro`` micro-batches per step (accumulated into .grad; overlap: all but the last
    inside accumulating()); ``scale(t)``: the inputs' scale at step t (default 1 + t);
    ``replace_at``: before that step every parameter gets a new storage (p.data = clone)."""
    m = model()
    opt = make_opt(m, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ov = (overlap_with_backward(m, opt, bucket_mb=bucket_mb, max_grad_norm=max_norm, **(ov_kw or {}))
          if mode == "overlap" else None)
    losses = []
    for t in range(steps):
        if t == replace_at:
            if ov is not None:
                ov.synchronize()  # the parameters are written until the next forward waits for them
            for p in m.parameters():
                p.data = p.data.clone()
        for k in range(micro):
            x, y = batch(t * micro + k, scale)
            loss = torch.nn.functional.mse_loss(forward(m, x), y) / micro
            if ov is not None and k < micro - 1:
                with ov.accumulating():
                    loss.backward()
            else:
                loss.backward()
            losses.append(loss.item())
        if ov is not None:
            ov.step()
        else:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    stats = None
    if ov is not None:
        ov.synchronize()
        stats = ov.stats()
        ov.remove()
    return m, opt, losses, stats


class Overlap(unittest.TestCase):
    def same(self, a, b):
        ma, oa, la, _ = a
        mb, ob, lb, _ = b
        self.assertEqual(la, lb)
        for (n, p), q in zip(ma.named_parameters(), mb.parameters()):
            self.assertTrue(torch.equal(p, q), n)
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        for i in sa:
            for k in ("main_param", "exp_avg", "exp_avg_sq", "step"):
                self.assertTrue(torch.equal(sa[i][k], sb[i][k]), f"{k} of {i}")

    def test_replaced_storage_is_followed_by_the_bucket_steps(self):
        # p.data = p.data.clone() between iterations: the overlap's worker steps the new
        # storage, as step() does (it stepped the freed one before).  Without clipping only:
        # while a speculation is pending the engine refuses to re-point a shard.
        self.same(train(4, "plain", replace_at=2), train(4, "overlap", bucket_mb=0, replace_at=2))

    def test_state_reads_after_step_wait_for_the_buckets(self):
        # Note [Overlap steps settle first]: step() returns before the worker is done (the
        # next forward waits per module); a slow worker makes the gap certain.  The
        # optimizer's state_dict, opt.state and the model's state_dict read after all of it.
        plain = train(2, "plain")
        m = model()
        opt = make_opt(m)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        ov = overlap_with_backward(m, opt, bucket_mb=0)
        slow = ov._step_bucket
        ov._step_bucket = lambda items: (time.sleep(0.05), slow(items))[1]
        try:
            for t in range(2):
                x, y = batch(t)
                torch.nn.functional.mse_loss(forward(m, x), y).backward()
                ov.step()
                if t == 0:
                    opt.zero_grad(set_to_none=True)
                    sched.step()
            got = opt.state_dict()["state"]
            steps = [float(opt.state[p]["step"]) for p in opt.held_params]
            weights = m.state_dict()
        finally:
            ov.remove()
        want = plain[1].state_dict()["state"]
        for i in want:
            for k in ("main_param", "exp_avg", "exp_avg_sq", "step"):
                self.assertTrue(torch.equal(got[i][k], want[i][k]), f"{i} {k}")
        self.assertEqual(steps, [2.0] * len(opt.held_params))
        for (n, p) in plain[0].named_parameters():
            self.assertTrue(torch.equal(weights[n], p.detach()), n)

    def test_no_clipping_is_bit_identical(self):
        plain = train(6, "plain")
        for bucket_mb in (0, 256):  # one parameter per bucket; one bucket
            got = train(6, "overlap", bucket_mb=bucket_mb)
            self.same(plain, got)
            self.assertGreater(got[3]["buckets"], 0)
            self.assertEqual(got[3]["redos"], 0)

    def test_coalesced_passes_on_the_host_tier_are_bit_identical(self):
        # coalesce=True: every bucket whose gradients are done goes into one engine pass;
        # coalesce=2: at most two a pass.
        plain = train(6, "plain")
        got = train(6, "overlap", bucket_mb=0, ov_kw=dict(coalesce=True))
        self.same(plain, got)
        self.assertGreaterEqual(got[3]["buckets"], got[3]["passes"])
        got = train(6, "overlap", bucket_mb=0, ov_kw=dict(coalesce=2))
        self.same(plain, got)
        self.assertGreaterEqual(2 * got[3]["passes"], got[3]["buckets"])
        # Which buckets a pass takes: with the worker stopped, five done buckets queued.
        from deferalloc.overlap import _Bucket, _Item
        m = model()
        for k, want in ((None, [4]), (2, [4, 3]), (True, [4, 3, 2, 1, 0])):
            ov = overlap_with_backward(m, make_opt(m), bucket_mb=0, coalesce=k)
            ov.remove()
            ov._pending = [_Item(0, i, _Bucket(i, []), speculative=False) for i in (1, 3, 0, 4, 2)]
            self.assertEqual([x.bucket.index for x in ov._take()], want, f"coalesce={k}")
            del ov  # one optimizer per parameter: the next make_opt(m) needs this one gone
        clipped = train(6, "plain", max_norm=1.0)
        self.same(clipped, train(6, "overlap", max_norm=1.0, bucket_mb=0, ov_kw=dict(coalesce=True)))

    def test_clipping_speculative_steps_and_redos_are_bit_identical(self):
        # The inputs grow with t: the first steps' norms are below max_norm, later ones above.
        plain = train(6, "plain", max_norm=1.0)
        reads = []
        real_read = deferalloc._engine.Engine.read  # every read of the engine's state arrays
        deferalloc._engine.Engine.read = lambda self, *a: reads.append(a[0]) or real_read(self, *a)
        try:
            spec = dict(clip_policy="speculate")
            got = train(6, "overlap", max_norm=1.0, bucket_mb=0, ov_kw=spec)  # the engine keeps the state
            engine_reads, reads[:] = len(reads), []
            old = train(6, "overlap", max_norm=1.0, bucket_mb=0, ov_kw=dict(engine_speculation=False, **spec))
            copy_reads = len(reads)
        finally:
            deferalloc._engine.Engine.read = real_read
        for ov in (got, old):
            self.same(plain, ov)
            self.assertGreater(ov[3]["redos"], 0, "no step needed clipping: the test does not test the redo")
            self.assertLess(ov[3]["redos"], 6, "every step needed clipping: the test does not test a kept step")
            self.assertEqual(ov[3]["speculations"], 6)
        self.assertEqual(got[3]["kept_copies"], 0)
        self.assertEqual(engine_reads, 0, "the engine's speculation copies no state out")
        # One parameter per bucket: each speculative bucket step copied one shard out (a
        # redo drops the buckets still queued, so their number varies with timing).
        self.assertEqual(old[3]["kept_copies"], old[3]["speculative_steps"])
        self.assertEqual(copy_reads, 3 * old[3]["kept_copies"], "the fallback copies 3 arrays per parameter")

    def test_clipping_with_compressed_moments_and_resident_shards(self):
        for kw in (dict(moment_dtype="int8"), dict(resident_mb=RESIDENT_MB)):
            plain = train(5, "plain", max_norm=1.0, **kw)
            got = train(5, "overlap", max_norm=1.0, bucket_mb=0, ov_kw=dict(clip_policy="speculate"), **kw)
            self.same(plain, got)
            self.assertGreater(got[3]["redos"], 0, kw)
            resident = sum(not got[1].can_speculate(p) for p in got[1].held_params)
            # Resident shards are copied out at each speculative step of theirs (a redo
            # drops the buckets still queued): at most once per step.
            self.assertLessEqual(got[3]["kept_copies"], 5 * resident, kw)
            self.assertEqual(got[3]["kept_copies"] > 0, resident > 0, kw)
            if "resident_mb" in kw:
                self.assertTrue(0 < resident < len(got[1].held_params), f"resident_mb={RESIDENT_MB} should make some parameters resident")

    def test_auto_holds_resident_buckets_instead_of_copying_them(self):
        # clip_policy "auto": a bucket with a resident shard waits for the clip coefficient
        # (no copy of its state); the streamed buckets still speculate.  Clipping never
        # firing (max_norm 1e9) and firing on the later steps (1.0): both bit-identical.
        for max_norm in (1e9, 1.0):
            plain = train(6, "plain", max_norm=max_norm, resident_mb=RESIDENT_MB)
            got = train(6, "overlap", max_norm=max_norm, bucket_mb=0, resident_mb=RESIDENT_MB)
            self.same(plain, got)
            resident = sum(not got[1].can_speculate(p) for p in got[1].held_params)
            self.assertTrue(0 < resident < len(got[1].held_params), "the test needs resident and streamed shards")
            self.assertEqual(got[3]["kept_copies"], 0, max_norm)
            if max_norm > 1:
                self.assertEqual(got[3]["speculations"], 5, "every iteration after the first speculates")
                self.assertEqual(got[3]["speculative_steps"], 5 * (len(got[1].held_params) - resident),
                                 "one parameter a bucket: the streamed ones speculate, the resident ones wait")

    def test_clipping_never_always_every_other_iteration(self):
        # The inputs' scale sets the gradient norm: 1 stays under max_norm 1e3 and 1e3
        # above it.  Every policy is bit-identical to clip_grad_norm_ + step().
        patterns = dict(never=lambda t: 1.0, always=lambda t: 1e3, every_other=lambda t: 1e3 if t % 2 else 1.0)
        for name, scale in patterns.items():
            plain = train(9, "plain", max_norm=1e3, scale=scale)
            runs = {pol: train(9, "overlap", max_norm=1e3, scale=scale, bucket_mb=0, ov_kw=dict(clip_policy=pol))
                    for pol in ("auto", "speculate", "after")}
            for pol, got in runs.items():
                with self.subTest(pattern=name, policy=pol):
                    self.same(plain, got)
            auto, spec, after = (runs[p][3] for p in ("auto", "speculate", "after"))
            fired = sum(scale(t) > 1 for t in range(9))
            with self.subTest(pattern=name):
                self.assertEqual(spec["speculations"], 9)
                self.assertEqual(spec["redos"], fired, "always speculating redoes every iteration that clips")
                self.assertEqual(after["speculations"] + after["redos"] + after["switches"], 0)
                self.assertEqual(after["commits"], 0, "plain host-tier steps commit nothing")
                if name == "never":  # the first iteration does not speculate, then every one does
                    self.assertEqual((auto["speculations"], auto["redos"], auto["switches"]), (8, 0, 1))
                    self.assertEqual(auto["commits"], 8)
                elif name == "always":  # nothing to learn: never speculates
                    self.assertEqual((auto["speculations"], auto["redos"], auto["switches"]), (0, 0, 0))
                else:  # speculates once (after iteration 0), redoes it, then stops
                    self.assertEqual((auto["speculations"], auto["redos"], auto["switches"]), (1, 1, 2))

    def test_gradient_accumulation(self):
        # 4 micro-batches per step, with and without clipping: the overlap steps once per
        # step, at the last micro-batch, bit-identical to accumulate-then-step.
        for max_norm, pol in ((None, "auto"), (1.0, "auto"), (1.0, "speculate")):
            with self.subTest(max_norm=max_norm, policy=pol):
                plain = train(4, "plain", max_norm=max_norm, micro=4)
                got = train(4, "overlap", max_norm=max_norm, micro=4, bucket_mb=0, ov_kw=dict(clip_policy=pol))
                self.same(plain, got)
                n, st = len(list(got[0].parameters())), got[3]
                # Buckets stepped plainly: every parameter (one per bucket) in the steps that
                # did not speculate and in the redos; the others were speculative.
                self.assertEqual(st["buckets"] - st["speculative_steps"], n * (4 - st["speculations"] + st["redos"]),
                                 "one step per parameter and step, none at the earlier micro-batches")
        m = model()
        ov = overlap_with_backward(m, make_opt(m))
        with ov.accumulating():
            with self.assertRaises(RuntimeError):
                ov.step()
        ov.remove()

    def test_file_tier_commits_once_per_step(self):
        # One commit per step (the engine's step count, also the state file's on resume),
        # however many buckets; bit-identical to the file tier's plain step, with clipping too.
        for max_norm, pol in ((None, "auto"), (1.0, "speculate"), (1.0, "auto")):
            with self.subTest(max_norm=max_norm, policy=pol), tempfile.TemporaryDirectory() as d1, \
                    tempfile.TemporaryDirectory() as d2:
                plain = train(5, "plain", max_norm=max_norm, tier="file", directory=d1)
                got = train(5, "overlap", max_norm=max_norm, bucket_mb=0, tier="file", directory=d2,
                            ov_kw=dict(clip_policy=pol))
                self.same(plain, got)
                st = got[3]
                self.assertEqual(got[1].stats()["steps"], 5, "one committed step per step()")
                self.assertEqual(st["commits"], 5)
                self.assertEqual(st["kept_copies"], 0, "the file tier keeps the state in its inactive slot")
                self.assertLess(st["passes"], st["buckets"] + 1)
                if pol == "speculate":
                    self.assertGreater(st["redos"], 0)
                del got, st  # one optimizer per state file: the first lets go of it
                m = model()
                again = make_opt(m, tier="file", directory=d2, resume=True)
                self.assertEqual(again.stats()["steps"], 5, "the state file holds one step per step()")
                del again

    def test_file_tier_with_resident_shards(self):
        # Note [Resident shards on the file tier]: resident parameters step in HBM and are
        # copied out for a speculative step (as on the host tier); bit-identical to the file
        # tier's plain step and to the host tier all streamed, one commit per step.
        with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
            plain = train(5, "plain", max_norm=1.0, tier="file", directory=d1, resident_mb=RESIDENT_MB)
            self.same(train(5, "plain", max_norm=1.0), plain)
            got = train(5, "overlap", max_norm=1.0, bucket_mb=0, tier="file", directory=d2, resident_mb=RESIDENT_MB,
                        ov_kw=dict(clip_policy="speculate"))
            self.same(plain, got)
            self.assertGreater(got[3]["redos"], 0)
            self.assertEqual(got[3]["commits"], 5)
            resident = sum(not got[1].can_speculate(p) for p in got[1].held_params)
            self.assertTrue(0 < resident < len(got[1].held_params), f"resident_mb={RESIDENT_MB}: some resident")

    def test_speculative_step_from_python(self):
        x, y = batch(0)

        def backward(mm):
            for p in mm.parameters():
                p.grad = None
            torch.nn.functional.mse_loss(forward(mm, x), y).backward()

        m, m2 = model(), model()
        opt, ref = make_opt(m), make_opt(m2)
        for mm, o in ((m, opt), (m2, ref)):
            backward(mm)
            o.step()  # one committed step each
        before = opt.state_dict()["state"]
        backward(m), backward(m2)
        self.assertTrue(all(opt.can_speculate(p) for p in m.parameters()))
        opt.step_speculative()
        self.assertEqual(opt.speculation_pending(), len(list(m.parameters())))
        with self.assertRaises(optim.InvalidStateError):
            opt.load_state_dict(opt.state_dict())
        with self.assertRaises(optim.InvalidStateError):
            opt.step()  # every parameter is pending
        opt.discard_speculation()
        after = opt.state_dict()["state"]
        for i in before:
            for k in before[i]:
                self.assertTrue(torch.equal(before[i][k], after[i][k]), f"{k} of {i}")
        opt.step_speculative()
        opt.commit_speculation()
        ref.step()
        self.assertEqual(opt.speculation_pending(), 0)
        self.same((m, opt, [], None), (m2, ref, [], None))
        with self.assertRaises(optim.InvalidStateError):
            optim.StreamedAdamW(model().parameters(), tier="device").step_speculative()

    def test_run_after(self):
        """run_after: queued behind a bucket's queued step (run on the worker right after it),
        at once for a bucket with no step queued (deferalloc.megatron's grad zeroing)."""
        m = model()
        opt = make_opt(m)
        ov = overlap_with_backward(m, opt, bucket_mb=0)  # one bucket per parameter
        events = []
        step_grads = opt.step_grads

        def slow(grads, *a, **k):  # 50 ms a pass: the steps are still queued when step() returns
            time.sleep(0.05)
            out = step_grads(grads, *a, **k)
            events.append(("step", {id(p) for p, _ in grads}))
            return out
        opt.step_grads = slow
        x, y = batch(0)
        # The worker takes nothing until run_after is queued: otherwise a bucket stepped
        # alone before step() returns could already be done (run_after then runs at once).
        ov.pause_worker()
        torch.nn.functional.mse_loss(forward(m, x), y).backward()
        ov.step()
        last = ov.buckets[0]
        self.assertTrue(ov.run_after(last, lambda: events.append("after")))
        ov.resume_worker()
        ov.synchronize()
        self.assertEqual(events.count("after"), 1)
        steps = [e for e in events if e != "after"]
        self.assertEqual(sum(len(e[1]) for e in steps), sum(len(b.params) for b in ov.buckets))
        # right behind the pass that stepped bucket 0 (whatever else that pass held)
        at = events.index("after")
        self.assertGreater(at, 0)
        self.assertTrue({id(p) for p in last.params} <= events[at - 1][1])
        self.assertFalse(ov.run_after(last, lambda: events.append("now")))
        self.assertEqual(events[-1], "now")
        ov.remove()

    def test_moment_dtype_and_resident_from_python(self):
        for dt in ("bf16", "int8"):
            a = train(4, "plain", moment_dtype=dt)
            b = train(4, "overlap", moment_dtype=dt)
            self.same(a, b)
            st = a[1].stats()
            self.assertLess(st["bytes_to_device"], 12 * sum(p.numel() for p in a[0].parameters()))
        self.same(train(4, "plain"), train(4, "plain", resident_mb=RESIDENT_MB))
        self.same(train(4, "plain"), train(4, "overlap", bucket_mb=0, settings="keep_window:1"))
        with self.assertRaises(optim.InvalidArgumentError):
            train(1, "plain", moment_dtype="int4")


if __name__ == "__main__":
    unittest.main()
