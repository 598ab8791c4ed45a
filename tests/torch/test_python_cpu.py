"""The pure-Python face on the host driver (no GPU): deferred CPU tensors through DLPack.

Run by ctest (label torch) with DEFERALLOC_CONF=driver:host and DEFERALLOC_LIB set.
"""
import ctypes
import gc
import signal
import subprocess
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


def _malloc_api():
    lib = dfa._load()
    lib.dfa_malloc.restype = ctypes.c_void_p
    lib.dfa_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.dfa_free.restype = None
    lib.dfa_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


class Errors(unittest.TestCase):
    def test_one_class_per_status_with_the_c_message(self):
        from deferalloc import errors
        self.assertTrue(issubclass(dfa.OutOfMemory, torch.OutOfMemoryError))
        self.assertTrue(issubclass(dfa.InvalidArgument, ValueError))
        self.assertEqual({c.status for c in errors.BY_STATUS.values()}, set(range(1, 9)))
        for status, cls in errors.BY_STATUS.items():
            self.assertTrue(issubclass(cls, dfa.DeferallocError))
            self.assertEqual(errors.from_status(status, "m").status, status)
        with self.assertRaises(dfa.InvalidState) as e:
            dfa.materialize(dfa.deferred_empty((4,), torch.float32, "cpu"), "restore")
        self.assertTrue(str(e.exception).startswith("dfa_materialize: "), str(e.exception))
        self.assertEqual(e.exception.status, 2)

    def test_65_dimensions_keep_the_message_of_c(self):
        with self.assertRaises(dfa.InvalidArgument) as e:
            dfa.deferred_empty((1,) * 65, torch.float32, "cpu")
        self.assertIn("ndim 65 is outside [0, 64]", str(e.exception))

    def test_sizes_and_types_are_checked_before_c(self):
        bad = [
            (TypeError, lambda: dfa.deferred_empty((4.0, 2), torch.float32, "cpu")),
            (TypeError, lambda: dfa.deferred_empty((True,), torch.float32, "cpu")),
            (TypeError, lambda: dfa.deferred_empty((4,), "float32", "cpu")),
            (ValueError, lambda: dfa.deferred_empty((4, -1), torch.float32, "cpu")),
            (ValueError, lambda: dfa.deferred_empty((2 ** 62,), torch.float32, "cpu")),
            (ValueError, lambda: dfa.deferred_empty((2 ** 31, 2 ** 31, 4), torch.float64, "cpu")),
            (ValueError, lambda: dfa.trim(-1)),
            (ValueError, lambda: dfa.trim(2 ** 64)),
            (TypeError, lambda: dfa.trim(1.5)),
            (ValueError, lambda: dfa.memory_stats(-2)),
            (ValueError, lambda: dfa.pause("py", keep="disk")),
            (TypeError, lambda: dfa.pause("py", keep=1)),
            (ValueError, lambda: dfa.pause("")),
            (TypeError, lambda: dfa.pause(b"py")),
            (ValueError, lambda: dfa.region("r", keep="bogus").__enter__()),
        ]
        t = dfa.deferred_empty((4,), torch.float32, "cpu")
        bad += [(ValueError, lambda: dfa.materialize(t, "bogus")), (TypeError, lambda: dfa.materialize(t, 2)),
                (ValueError, lambda: dfa.release(t, "nvme")), (TypeError, lambda: dfa.is_backed(t.data_ptr()))]
        for i, (exc, f) in enumerate(bad):
            with self.assertRaises(exc, msg=f"case {i}"):
                f()
        self.assertEqual(dfa.deferred_empty(torch.Size([3, 2]), torch.float32, "cpu").shape, (3, 2))
        self.assertEqual(dfa.deferred_empty(5, torch.int8, "cpu").shape, (5,))

    def test_out_of_range_modes_reach_c_as_integers(self):
        lib = dfa._load()
        t = dfa.materialize(dfa.deferred_empty((1024,), torch.float32, "cpu"))
        rid = dfa._reservation(t)
        for v in (3, 7, -1, 2 ** 31 - 1):
            self.assertEqual(lib.dfa_materialize(rid, 0, 2 ** 64 - 1, v, None), 1)
            self.assertIn(f"fill {v} is not", lib.dfa_last_error().decode())
        for v in (2, -1, 255):
            self.assertEqual(lib.dfa_release(rid, 0, 2 ** 64 - 1, v, None), 1)
            self.assertIn(f"keep {v} is not", lib.dfa_last_error().decode())
        self.assertTrue(dfa.is_backed(t))

    def test_a_dfa_malloc_block_is_not_a_reservation(self):
        lib = _malloc_api()
        p = lib.dfa_malloc(1 << 20, 0, None)
        self.assertTrue(p)
        rid = ctypes.c_uint64()
        self.assertEqual(lib.dfa_find(ctypes.c_void_p(p), ctypes.byref(rid)), 1)
        self.assertIn("caching allocator", lib.dfa_last_error().decode())
        lib.dfa_free(p, 1 << 20, 0, None)

    def test_touching_a_released_tensor_names_the_reservation(self):
        code = ("import torch, deferalloc as dfa\n"
                "t = dfa.materialize(dfa.deferred_empty((1 << 16,), torch.float32, 'cpu'))\n"
                "print('reservation', dfa._reservation(t), flush=True)\n"
                "dfa.release(t)\n"
                "t.fill_(1)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, -signal.SIGSEGV, r.stderr[-2000:])
        rid = r.stdout.split()[-1]
        self.assertRegex(r.stderr, rf"\[deferalloc\] SIGSEGV at 0x[0-9a-f]+: reservation {rid} \(address 0x[0-9a-f]+, "
                                   rf"\d+ bytes\), offset \d+, touched while released")


def _replay_like_memory_viz(snap, device=0):
    """Replays the trace backwards from the snapshot as MemoryViz.js's segment view does
    (simulate_memory) and returns the first event index at which an active block lies in
    no mapped segment (where the viewer's find_segment fails), or None."""
    segs = sorted([s["address"], s["total_size"]] for s in snap["segments"] if s["device"] == device)
    blocks = {}
    for s in snap["segments"]:
        if s["device"] == device:
            for b in s["blocks"]:
                if b["state"] in ("active_allocated", "active_pending_free"):
                    blocks[b["address"]] = b["size"]

    def inside(a, n):
        return any(sa <= a and a + n <= sa + sn for sa, sn in segs)

    events = snap["device_traces"][device]
    for i in range(len(events) - 1, -1, -1):
        if any(not inside(a, n) for a, n in blocks.items()):
            return i + 1
        e = events[i]
        act = e["action"]
        if act in ("free_completed", "free"):
            blocks[e["addr"]] = e["size"]
        elif act == "alloc":
            blocks.pop(e["addr"], None)
        elif act == "segment_unmap":  # backwards: mapped again
            segs.append([e["addr"], e["size"]])
            segs.sort()
        elif act == "segment_map":  # backwards: cut out of the segment holding it
            for k, (sa, sn) in enumerate(segs):
                if sa <= e["addr"] and e["addr"] + e["size"] <= sa + sn:
                    del segs[k]
                    if e["addr"] > sa:
                        segs.append([sa, e["addr"] - sa])
                    if e["addr"] + e["size"] < sa + sn:
                        segs.append([e["addr"] + e["size"], sa + sn - e["addr"] - e["size"]])
                    segs.sort()
                    break
            else:
                return i
    return None


class MemoryYouCanSee(unittest.TestCase):
    """Refusals, snapshots and tag names on the host driver."""

    def test_tag_names_with_control_characters_are_refused(self):
        for bad, code in (("a\nb", "U+000A"), ("x\0y", "U+0000"), ("t\tab", "U+0009"), ("l\u2028s", "U+2028"),
                          ("p\u2029s", "U+2029"), ("n\x85l", "U+0085")):
            for enter in (lambda: dfa.region(bad).__enter__(), lambda: dfa.tag(bad).__enter__(),
                          lambda: dfa.pause(bad), lambda: dfa.resume(bad), lambda: dfa.is_paused(bad)):
                with self.assertRaises(dfa.InvalidArgument) as e:
                    enter()
                self.assertEqual(str(e.exception),
                                 f"the tag {bad!r} contains the control character {code} at offset 1; a tag name is "
                                 "printable text (a line break would split the list of tags and the memory "
                                 "snapshot, a NUL cut the name)")
        self.assertNotIn("x", dfa.tags(), "a NUL must not alias the tag before it")
        for t in dfa.tags():
            self.assertTrue(t.isprintable(), t)
        with dfa.region("ok tag"):
            pass
        dfa.pause()  # every tag: no name in the list is broken
        dfa.resume()

    def test_an_allocation_in_a_paused_region_is_refused_with_the_reason(self):
        lib = _malloc_api()
        with dfa.region("paused-r", keep="host"):
            p = lib.dfa_malloc(1 << 20, 0, None)
            self.assertTrue(p)
        ctypes.memset(p, 0x7E, 1 << 20)
        dfa.pause("paused-r")
        want = ("deferalloc refused 4096 bytes (4.00 KiB) in tag 'paused-r': the tag 'paused-r' is paused (pause gave "
                "its memory back). Fix: resume('paused-r') before allocating in it, or allocate outside its region.")
        with self.assertLogs("deferalloc", level="WARNING") as logs:
            with self.assertRaises(torch.cuda.OutOfMemoryError) as e:
                with dfa.region("paused-r"):
                    self.assertEqual(dfa.last_error(), "", "entering a region clears the last refusal")
                    self.assertFalse(lib.dfa_malloc(4096, 0, None))
                    # what PyTorch's caching allocator raises for the NULL it got
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB.")
        self.assertEqual(logs.output, [f"WARNING:deferalloc:{want}"], "one warn line, the reason and the fix")
        self.assertEqual(dfa.last_error(), want)
        self.assertEqual(e.exception.__notes__, [want], "the exception carries deferalloc's reason")
        self.assertTrue(dfa.is_paused("paused-r"), "the refusal leaves the tag paused")
        dfa.resume("paused-r")
        self.assertEqual(ctypes.string_at(p, 1 << 20), b"\x7e" * (1 << 20))
        with dfa.region("paused-r"):
            q = lib.dfa_malloc(4096, 0, None)
            self.assertTrue(q, "resumed: allocations are served again")
        lib.dfa_free(q, 0, 0, None)
        lib.dfa_free(p, 0, 0, None)

    def test_empty_cache_drops_the_regions_mempools_first(self):
        """The wiring of Note [Regions give freed memory back], with PyTorch's CUDA calls
        stood in for (the host has no MemPool; test_memory_gpu measures the real thing)."""
        from unittest import mock
        calls = []
        saved_pools, saved_hook = dict(dfa._pools), dfa._torch_empty_cache
        saved_torch = (torch.cuda.empty_cache, torch.cuda.memory.empty_cache)
        try:
            with mock.patch.object(torch.cuda, "is_available", return_value=True), \
                 mock.patch.object(torch.cuda, "is_initialized", return_value=True), \
                 mock.patch.object(torch.cuda.memory, "empty_cache", lambda: calls.append(len(dfa._pools))):
                dfa._torch_empty_cache = None
                dfa._pools[("some-region", 0)] = object()  # a region's live MemPool
                dfa.empty_cache()
                self.assertEqual(calls, [0], "PyTorch's empty_cache ran once, after the pools were dropped")
                dfa._hook_torch_empty_cache()  # what region() does on CUDA
                dfa._pools[("some-region", 0)] = object()
                torch.cuda.empty_cache()
                self.assertEqual(calls, [0, 0], "torch.cuda.empty_cache() drops them too")
                self.assertEqual(dfa._pools, {})
        finally:
            torch.cuda.empty_cache, torch.cuda.memory.empty_cache = saved_torch
            dfa._pools.clear()
            dfa._pools.update(saved_pools)
            dfa._torch_empty_cache = saved_hook

    def test_snapshot_renders_with_memory_viz(self):
        import os
        import pickle
        import tempfile
        from torch.cuda import _memory_viz
        lib = _malloc_api()
        dfa.record_memory_history(max_entries=10_000)
        try:
            untagged = [lib.dfa_malloc((1 << 20) + 512 * i, 0, None) for i in range(6)]
            with dfa.region("snap-a"):
                a = [lib.dfa_malloc(3 << 20, 0, None) for _ in range(3)]
            with dfa.region("snap-b", keep="host"):
                b = [lib.dfa_malloc(2 << 20, 0, None) for _ in range(2)]
            lib.dfa_free(untagged[2], 0, 0, None)
            lib.dfa_free(a[1], 0, 0, None)
            dfa.empty_cache()
            dfa.pause("snap-b")
            deferred = dfa.deferred_empty((1 << 20,), torch.float32, "cpu")
            dfa.materialize(deferred)
            snap = dfa.memory_snapshot()
        finally:
            dfa.record_memory_history(enabled=False)
        self.assertIn("segments", snap)
        tags = {s["deferalloc_tag"] for s in snap["segments"]}
        self.assertIn("snap-a", tags)
        self.assertNotIn("snap-b", tags, "a paused tag holds no memory to draw")
        ann = snap["deferalloc"]
        self.assertTrue(ann["tags"]["snap-b"]["paused"])
        self.assertEqual(ann["tags"]["snap-b"]["keep"], "host")
        self.assertGreaterEqual(sum(n for _, _, n in ann["tags"]["snap-b"]["paused_ranges"]), 4 << 20)
        self.assertEqual(ann["tags"]["snap-a"]["allocated_blocks"], 2)
        rid = dfa._reservation(deferred)
        (d,) = [r for r in ann["deferred"] if r["id"] == rid]
        self.assertEqual(d["backed_bytes"], 4 << 20)
        self.assertTrue(any(s["segment_type"] == "deferred" and s["address"] == deferred.data_ptr()
                            for s in snap["segments"]))
        for s in snap["segments"]:
            self.assertEqual(sum(b["size"] for b in s["blocks"]), s["total_size"])
        states = {b["state"] for s in snap["segments"] for b in s["blocks"]}
        self.assertEqual(states, {"active_allocated", "inactive"})
        actions = {e["action"] for e in snap["device_traces"][0]}
        self.assertTrue({"alloc", "free_requested", "free_completed", "segment_map", "segment_unmap"} <= actions, actions)
        self.assertIsNone(_replay_like_memory_viz(snap), "every block lies in a mapped segment at every event")
        # PyTorch's renderers: the text summary checks each segment's sums; the plots are HTML
        summary = _memory_viz.segsum(snap)
        self.assertIn("segments:", summary)
        with tempfile.TemporaryDirectory() as out:
            for name, html in (("segments.html", _memory_viz.segment_plot(snap)),
                               ("trace.html", _memory_viz.trace_plot(snap))):
                with open(os.path.join(out, name), "w") as f:
                    f.write(html)
                self.assertIn("MemoryViz.js", html)
                self.assertGreater(os.path.getsize(os.path.join(out, name)), 1000)
            dfa.dump_snapshot(os.path.join(out, "snapshot.pickle"))
            with open(os.path.join(out, "snapshot.pickle"), "rb") as f:
                self.assertEqual(len(pickle.load(f)["segments"]), len(snap["segments"]))
        for p in untagged[:2] + untagged[3:] + a[:1] + a[2:]:
            lib.dfa_free(p, 0, 0, None)
        dfa.resume("snap-b")
        for p in b:
            lib.dfa_free(p, 0, 0, None)


class Regions(unittest.TestCase):
    def test_pause_and_resume_every_tag_with_the_regions_keep(self):
        lib = _malloc_api()
        blocks = []
        for name, keep, v in (("ra", "host", 0x5A), ("rb", "host", 0x3C), ("rc", "discard", 0x11)):
            with dfa.region(name, keep=keep):
                p = lib.dfa_malloc(3 << 20, 0, None)
                self.assertTrue(p, lib.dfa_last_error())
            ctypes.memset(p, v, 3 << 20)
            blocks.append((name, keep, p, v))
        dfa.pause()
        for name, _, _, _ in blocks:
            self.assertTrue(dfa.is_paused(name), name)
        self.assertGreaterEqual(dfa.memory_stats()["deferalloc.manager.backup_bytes"], 2 * (3 << 20))
        with self.assertRaises(dfa.InvalidState):
            dfa.pause("ra")
        dfa.resume()
        for name, keep, p, v in blocks:
            self.assertFalse(dfa.is_paused(name), name)
            if keep == "host":
                got = ctypes.string_at(p, 3 << 20)
                self.assertEqual(got, bytes([v]) * (3 << 20), name)
        # keep given to pause overrides the region's
        dfa.pause("ra", keep="discard")
        self.assertEqual(dfa.memory_stats()["deferalloc.manager.backup_bytes"], 0)
        dfa.resume("ra")
        for _, _, p, _ in blocks:
            lib.dfa_free(p, 3 << 20, 0, None)
        self.assertIn("ra", dfa.tags())
        with self.assertRaises(dfa.InvalidArgument):
            dfa.pause("never-made")


if __name__ == "__main__":
    from unittest_main import run_tests
    run_tests()
