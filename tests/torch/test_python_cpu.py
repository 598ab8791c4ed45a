"""The pure-Python face on the host driver (no GPU): deferred CPU tensors through DLPack.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host and DEFERALLOC_LIB set.
"""
import gc
import sys
import unittest

import torch

import deferalloc as dfa


class DeferredTensors(unittest.TestCase):
    def test_driver_is_host(self):
        self.assertEqual(dfa.driver_name(), "host")

    def test_cycles_keep_address_object_and_contents(self):
        t = dfa.deferred_empty((256, 1024), torch.float32, "cpu")
        ptr, ident = t.data_ptr(), id(t)
        self.assertFalse(dfa.is_backed(t))
        dfa.materialize(t, "zero")
        self.assertTrue(dfa.is_backed(t))
        self.assertEqual(float(t.abs().sum()), 0.0)
        ref = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
        for _ in range(20):
            t.copy_(ref)
            dfa.release(t, keep="host")
            self.assertFalse(dfa.is_backed(t))
            dfa.materialize(t, "restore")
            self.assertTrue(torch.equal(t, ref))
            dfa.release(t)
            dfa.materialize(t, "undefined")
        self.assertEqual((t.data_ptr(), id(t)), (ptr, ident))

    def test_last_reference_frees_the_reservation(self):
        before = dfa.memory_stats()
        del before
        t = dfa.deferred_empty((1000,), torch.int64, "cpu")
        dfa.materialize(t)
        ptr = t.data_ptr()
        del t
        gc.collect()
        with self.assertRaises(dfa.DeferallocError):
            dfa._load()
            import ctypes
            rid = ctypes.c_uint64()
            dfa._check(dfa._load().dfa_find(ctypes.c_void_p(ptr), ctypes.byref(rid)), "dfa_find")

    def test_bad_input(self):
        with self.assertRaises(dfa.DeferallocError):
            dfa.deferred_empty((4, -1), torch.float32, "cpu")
        with self.assertRaises(dfa.DeferallocError):
            dfa.deferred_empty((4,), torch.complex64, "cpu")
        t = dfa.deferred_empty((4,), torch.float32, "cpu")
        with self.assertRaises(dfa.DeferallocError):
            dfa.materialize(t, "bogus")
        with self.assertRaises(dfa.DeferallocError):
            dfa.materialize(t, "restore")  # never released with keep=host
        with self.assertRaises(dfa.DeferallocError):
            dfa.is_backed(torch.zeros(3))  # not ours


class Tags(unittest.TestCase):
    def test_misuse(self):
        with self.assertRaises(dfa.DeferallocError) as e:
            dfa.resume("no-such-tag")
        self.assertEqual(e.exception.status, 1)
        with dfa.tag("py"):
            with self.assertRaises(dfa.DeferallocError) as e:
                dfa.pause("py")
            self.assertEqual(e.exception.status, 2)
        dfa.pause("py")
        self.assertTrue(dfa.is_paused("py"))
        with self.assertRaises(dfa.DeferallocError):
            dfa.pause("py")
        dfa.resume("py")
        stats = dfa.memory_stats()
        for k in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_alloc_retries", "num_ooms"):
            self.assertIn(k, stats)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    ok = result.wasSuccessful() and result.testsRun > 0
    print(f"{result.testsRun - len(result.failures) - len(result.errors)} passed, "
          f"{len(result.failures) + len(result.errors)} failed")
    sys.exit(0 if ok else 1)
