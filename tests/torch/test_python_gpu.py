"""The Python face on the GPU (ctest labels torch, gpu; exit 77 = Skipped without one).

Deferred tensors (data_ptr and id stable over 100 cycles, zero HBM while released, a CUDA
graph replaying after release/restore) and MemPool mode with a tag paused and resumed.
"""
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
        dfa._reservation(a)  # PyTorch's block lies in a deferalloc segment
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


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("SKIPPED: needs a GPU")
        sys.exit(77)
    result = unittest.main(exit=False, verbosity=2).result
    n_bad = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - n_bad} passed, {n_bad} failed")
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)
