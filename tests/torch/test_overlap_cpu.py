"""deferalloc.overlap on the host driver (CPU tensors): stepping during backward equals
the plain step bit for bit, without clipping and with the speculative step + redo of
clipping (Note [Overlap with backward]), the engine keeping the previous state (Note
[Speculative steps]) or the state copied out; also moment_dtype and resident_mb from Python.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host,... and DEFERALLOC_LIB set.
"""
import unittest

import torch

from deferalloc import optim
from deferalloc.overlap import overlap_with_backward


def model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
                            torch.nn.Linear(128, 16))
    m[2].to(torch.bfloat16)  # mixed parameter types
    return m


def forward(m, x):
    h = m[1](m[0](x))
    h = m[3](m[2](h.to(torch.bfloat16)).float())
    return m[4](h)


def batch(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(32, 64, generator=g) * (1 + t), torch.randn(32, 16, generator=g)


def make_opt(m, **kw):
    groups = [dict(params=list(m[0].parameters()) + list(m[2].parameters()), weight_decay=0.1),
              dict(params=list(m[4].parameters()), weight_decay=0.0)]
    return optim.StreamedAdamW(groups, lr=1e-2, window_mb=1, **kw)


def train(steps, mode, max_norm=None, bucket_mb=256, ov_kw=None, **kw):
    m = model()
    opt = make_opt(m, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ov = (overlap_with_backward(m, opt, bucket_mb=bucket_mb, max_grad_norm=max_norm, **(ov_kw or {}))
          if mode == "overlap" else None)
    losses = []
    for t in range(steps):
        x, y = batch(t)
        loss = torch.nn.functional.mse_loss(forward(m, x), y)
        loss.backward()
        if ov is not None:
            ov.step()
        else:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
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

    def test_no_clipping_is_bit_identical(self):
        plain = train(6, "plain")
        for bucket_mb in (0, 256):  # one parameter per bucket; one bucket
            got = train(6, "overlap", bucket_mb=bucket_mb)
            self.same(plain, got)
            self.assertGreater(got[3]["buckets"], 0)
            self.assertEqual(got[3]["redos"], 0)

    def test_clipping_speculative_steps_and_redos_are_bit_identical(self):
        # The inputs grow with t: the first steps' norms are below max_norm, later ones above.
        plain = train(6, "plain", max_norm=1.0)
        reads = []
        real_read = optim.StreamedAdamW._read
        optim.StreamedAdamW._read = lambda self, *a: reads.append(a[0]) or real_read(self, *a)
        try:
            got = train(6, "overlap", max_norm=1.0, bucket_mb=0)  # the engine keeps the state
            engine_reads, reads[:] = len(reads), []
            old = train(6, "overlap", max_norm=1.0, bucket_mb=0, ov_kw=dict(engine_speculation=False))
            copy_reads = len(reads)
        finally:
            optim.StreamedAdamW._read = real_read
        for ov in (got, old):
            self.same(plain, ov)
            self.assertGreater(ov[3]["redos"], 0, "no step needed clipping: the test does not test the redo")
            self.assertLess(ov[3]["redos"], 6, "every step needed clipping: the test does not test a kept step")
            self.assertEqual(ov[3]["speculative_steps"], got[3]["speculative_steps"])
        n = len(list(got[0].parameters()))
        self.assertEqual(got[3]["kept_copies"], 0)
        self.assertEqual(engine_reads, 0, "the engine's speculation copies no state out")
        self.assertEqual(old[3]["kept_copies"], 6 * n)
        self.assertEqual(copy_reads, 3 * 6 * n, "the fallback copies 3 arrays per parameter and step")

    def test_clipping_with_compressed_moments_and_resident_shards(self):
        for kw in (dict(moment_dtype="int8"), dict(resident_mb=1)):
            plain = train(5, "plain", max_norm=1.0, **kw)
            got = train(5, "overlap", max_norm=1.0, bucket_mb=0, **kw)
            self.same(plain, got)
            self.assertGreater(got[3]["redos"], 0, kw)
            n = len(list(got[0].parameters()))
            resident = sum(not got[1]._can_speculate(i) for i in range(n))
            self.assertEqual(got[3]["kept_copies"], 5 * resident, kw)  # resident shards: copied out
            if "resident_mb" in kw:
                self.assertTrue(0 < resident < n, "resident_mb=1 should make some parameters resident")

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

    def test_moment_dtype_and_resident_from_python(self):
        for dt in ("bf16", "int8"):
            a = train(4, "plain", moment_dtype=dt)
            b = train(4, "overlap", moment_dtype=dt)
            self.same(a, b)
            st = a[1].stats()
            self.assertLess(st["bytes_to_device"], 12 * sum(p.numel() for p in a[0].parameters()))
        self.same(train(4, "plain"), train(4, "plain", resident_mb=1))
        self.same(train(4, "plain"), train(4, "overlap", bucket_mb=0, settings="keep_window:1"))
        with self.assertRaises(optim.InvalidArgumentError):
            train(1, "plain", moment_dtype="int4")


if __name__ == "__main__":
    unittest.main()
