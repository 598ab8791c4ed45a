"""The Python face on the GPU (ctest labels torch, gpu; exit 77 = Skipped without one).

Deferred tensors (data_ptr and id stable over 100 cycles, zero HBM while released, a CUDA
graph replaying after release/restore), MemPool mode with a tag paused and resumed, and
regions: pausing one tag never unmaps another tag's tensors after cross-tag free and
re-allocate (MemPool mode here, full replacement in a subprocess), and a pause gives back
the segments PyTorch keeps cached-but-free in the tag's pool.
"""
import os
import subprocess
import sys
import unittest

import torch

import deferalloc as dfa


def free_hbm():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class GpuDeferred(unittest.TestCase):
    def test_100_cycles_stable_zero_hbm(self):
        w = dfa.materialize(dfa.deferred_empty((1 << 20,), torch.float32, "cuda"))
        w.fill_(1)
        float(w.sum())
        del w
        torch.cuda.synchronize()
        dfa.trim()
        free0 = free_hbm()
        t = dfa.deferred_empty((256 << 20,), torch.float32, "cuda")
        ptr, ident = t.data_ptr(), id(t)
        self.assertEqual(free_hbm(), free0)
        for i in range(100):
            dfa.materialize(t, "zero" if i == 0 else "restore")
            if i:
                self.assertEqual(float(t[-1]), float(i - 1))
            t.fill_(i)
            dfa.release(t, keep="host")
            dfa.trim()
            if i == 0:
                # The pinned 1 GiB backup is mapped into the GPU's address space once: its page
                # tables take HBM (2 MiB per GiB on the H200); the tensor's bytes take none.
                free_released = free_hbm()
                self.assertLessEqual(free0 - free_released, (256 << 20) * 4 // 256)
            self.assertEqual(free_hbm(), free_released, f"HBM used while released, cycle {i}")
            self.assertEqual((t.data_ptr(), id(t)), (ptr, ident))

    def test_cuda_graph_after_release_restore(self):
        x = dfa.materialize(dfa.deferred_empty((1 << 22,), torch.float32, "cuda"))
        x.copy_(torch.randn(1 << 22, device="cuda"))
        out = torch.empty_like(x)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g.capture_begin()
            out.copy_(x * 2 + 1)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        ref = x.clone()
        dfa.release(x, keep="host")
        dfa.materialize(x, "restore")
        self.assertTrue(torch.equal(x, ref))
        x.add_(1)
        g.replay()
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(out, (ref + 1) * 2 + 1))

    def test_mempool_tag_pause_resume(self):
        pool = dfa.mem_pool()
        with dfa.tag("rollout"), torch.cuda.use_mem_pool(pool):
            a = torch.randn(64 << 20, device="cuda")  # 256 MiB
        ref = a.clone()
        # PyTorch's segment is a deferalloc block (not a reservation of the ABI: dfa_find refuses it)
        self.assertGreaterEqual(dfa.memory_stats()["allocated_bytes.all.current"], 256 << 20)
        with self.assertRaises(dfa.InvalidArgument):
            dfa._reservation(a)
        before = free_hbm()
        dfa.pause("rollout", keep="host")
        self.assertTrue(dfa.is_paused("rollout"))
        dfa.trim()
        self.assertGreaterEqual(free_hbm() - before, 256 << 20)
        dfa.resume("rollout")
        self.assertTrue(torch.equal(a, ref))
        with self.assertRaises(dfa.DeferallocError):
            dfa.resume("rollout")  # not paused
        stats = torch.cuda.memory_stats()
        self.assertGreater(stats["allocated_bytes.all.current"], 0, "PyTorch's stats keep working in MemPool mode")


N = 64 << 20  # floats: 256 MiB per tensor

_ISOLATION = """
import torch, deferalloc as dfa
{setup}
with dfa.region("iso-a"):
    a = torch.full(({n},), 1.0, device="cuda")
a_ptr = a.data_ptr()
del a                                   # back to a's cache (MemPool) or a's segments (replacement)
with dfa.region("iso-b"):
    b = torch.full(({n},), 2.0, device="cuda")
with dfa.region("iso-a"):
    a2 = torch.full(({n},), 3.0, device="cuda")
torch.cuda.synchronize()
for cycle in range(3):
    dfa.pause("iso-a", keep="host")
    assert float(b.sum()) == 2.0 * {n}, "pausing iso-a changed iso-b's tensor"   # faults if unmapped
    dfa.resume("iso-a")
    assert float(a2.sum()) == 3.0 * {n}, "iso-a lost its contents"
    dfa.pause("iso-b")
    assert float(a2.sum()) == 3.0 * {n}, "pausing iso-b changed iso-a's tensor"
    dfa.resume("iso-b")
    b.fill_(2.0)
print("isolated", b.data_ptr() != a_ptr)
"""


class GpuRegions(unittest.TestCase):
    def test_one_shared_mempool_hands_a_segment_across_tags(self):
        # The hazard region() removes: without it the isolation test below would prove nothing.
        pool = dfa.mem_pool()
        with dfa.tag("shared-a"), torch.cuda.use_mem_pool(pool):
            x = torch.empty(N, device="cuda")
        px = x.data_ptr()
        del x
        with dfa.tag("shared-b"), torch.cuda.use_mem_pool(pool):
            y = torch.empty(N, device="cuda")
        self.assertEqual(y.data_ptr(), px, "one MemPool gives tag a's freed segment to tag b")
        del y

    def test_pausing_one_tag_never_unmaps_another_mempool(self):
        code = _ISOLATION.format(setup="", n=N)
        exec(compile(code, "isolation", "exec"), {})

    def test_pausing_one_tag_never_unmaps_another_full_replacement(self):
        code = _ISOLATION.format(setup="dfa.install()", n=N)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr[-3000:])
        self.assertIn("isolated", r.stdout)

    def test_pause_gives_back_the_pools_cached_segments(self):
        with dfa.region("cached", keep="host"):
            ts = [torch.full((N // 4,), float(i), device="cuda") for i in range(8)]  # 8 x 64 MiB
        keep = ts[::2]
        del ts  # four segments now cached-but-free in the tag's MemPool
        torch.cuda.synchronize()
        held = dfa.memory_stats()["allocated_bytes.all.current"]
        dfa.pause("cached")
        after = dfa.memory_stats()["allocated_bytes.all.current"]
        self.assertGreaterEqual(held - after, 4 * (N // 4) * 4, "PyTorch's cached segments of the tag were returned")
        dfa.resume("cached")
        for i, t in enumerate(keep):
            self.assertEqual(float(t[-1]), float(2 * i))
        with dfa.region("cached"):  # a fresh pool after the pause
            extra = torch.ones(1024, device="cuda")
        self.assertEqual(float(extra.sum()), 1024.0)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("SKIPPED: needs a GPU")
        sys.exit(77)
    from unittest_main import run_tests
    run_tests()
