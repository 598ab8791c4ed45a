"""deferalloc.memory_saver on the GPU (ctest labels torch, gpu; exit 77 = Skipped without one).

Each hook mode runs in a process of its own (the mode is fixed at first use; "preload" runs
with libdeferalloc_preload.so in LD_PRELOAD, beside $DEFERALLOC_LIB):
* regions with CPU backup give back >= 99% of 4 GiB at pause (cuMemGetInfo; every "gives back"
  allows for the chunks deferalloc may keep cached, pool_cache_mb, 64 MiB) and come back
  bit for bit at the same addresses; discard regions give back and are writable after resume;
* a CUDA graph captured under cuda_graph(...) reading region tensors (weights): pause gives
  back the graph's private pool, resume maps it at the same addresses, replay is bit-identical
  before and after (and follows in-place weight changes, without a new capture);
* disable() inside a region and a region inside a region: only the right memory is paused;
* pause / resume / torch.cuda.empty_cache / deferalloc.empty_cache in every order of four:
  a second pause or resume is refused (InvalidState) and changes nothing, contents survive;
* memory_margin_bytes refuses a resume without the margin (nothing resumed);
  retain_cpu_backup=False; get_cpu_backup refused outside disk regions;
* preload mode: 256 segments of 16 MiB in a region take a few slabs of its arena, and a
  discard pause / resume unmaps / maps at most one chunk per slab, with the addresses kept;
  a CPU-backup pause of an arena copies exactly its segments' bytes (not the newest slab's
  free tail) and its resume restores them; KV layers of 260 / 300 MiB take one slab of their
  own bytes each (within 1.1x); a region inside a use_mem_pool, whose allocation lands in the
  arena for the other pool, makes a pause raise InvalidState, nothing paused; a cuda_graph
  capture that raises leaves its pool the tag's (a pause goes through);
* disk backup (test_9f): a region with enable_disk_backup gives back >= 99% of 1 GiB at pause,
  its file in the directory of set_disk_backup_dir, and comes back bit for bit at the same
  addresses with staging chunks smaller and larger than a segment, the file deleted (in preload
  mode its segments lie in the arena "tms.disk/<tag>", paused and backed again by slabs); a CUDA
  graph reading the region's tensors replays bit-identically after pause/resume; a corrupted
  file makes resume raise CorruptData naming it, the memory given back again (the tag stays
  paused), and once repaired the resume restores every byte; get_cpu_backup of its tensors is None.
Then, per mode, two processes on one GPU (a third holds ballast so that only one of them fits):
20 cycles of each pausing while the other works; what one gives back the other maps (>= 95%
each cycle), free memory does not drift over the cycles, and a paused process holds at most
its CUDA context + 256 MiB.
    python3 tests/torch/test_memory_saver_gpu.py            # everything (about 2 minutes on an H200)
    python3 tests/torch/test_memory_saver_gpu.py --mode torch   # one mode's suite
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GIB, MIB = 1 << 30, 1 << 20
MODE = None  # set by --mode


def cache_bound() -> int:
    """pool_cache_mb of DEFERALLOC_CONF, else the library's default (64 MiB): the physical
    chunks a pause may leave cached in the process instead of giving them to the device."""
    for item in os.environ.get("DEFERALLOC_CONF", "").split(","):
        k, _, v = item.partition(":")
        if k.strip() == "pool_cache_mb":
            return int(v) * MIB
    return 64 * MIB


def free_hbm() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def saver():
    from deferalloc.memory_saver import torch_memory_saver
    return torch_memory_saver


def preload_lib():
    """The process's symbols (the preload library and libdeferalloc, both loaded at start),
    with dfa_preload_arena_figures typed."""
    import ctypes
    lib = ctypes.CDLL(None)
    lib.dfa_preload_arena_figures.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    return lib


def dfa_stats(lib) -> dict:
    """dfa_get_stats: backup bytes and the driver calls (reserve, free_reservation, create,
    release, map, unmap, set_access, host_alloc)."""
    import ctypes

    class Stats(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("reservations", "reserved", "backed", "peak", "backup", "alive",
                                                   "cached", "pinned")] + \
                   [("created", ctypes.c_uint64), ("reused", ctypes.c_uint64), ("calls", ctypes.c_uint64 * 8)]
    st = Stats()
    if lib.dfa_get_stats(ctypes.byref(st)) != 0:
        raise RuntimeError("dfa_get_stats failed")
    return {"backup": st.backup, "calls": list(st.calls)}


def filled(n_tensors: int, numel: int, base: float = 0.0):
    return [torch.full((numel,), base + i, dtype=torch.float32, device="cuda") for i in range(n_tensors)]


def intact(ts, base: float = 0.0) -> bool:
    lo = torch.stack([t.min() for t in ts]).cpu()
    hi = torch.stack([t.max() for t in ts]).cpu()
    want = torch.arange(len(ts), dtype=torch.float32) + base
    return bool(torch.equal(lo, want) and torch.equal(hi, want))


def captured(s, f, tag: str, warmups: int):
    """f warmed up on a side stream (as torch.cuda.graphs asks), then captured under
    ``s.cuda_graph`` into ``tag`` and replayed once: (the graph, its output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with s.cuda_graph(g, tag=tag):
        y = f()
    g.replay()
    torch.cuda.synchronize()
    return g, y


class ModeSuite(unittest.TestCase):
    """One hook mode (MODE), in this process."""

    def assertGaveBack(self, given: int, size: int, what: str = "") -> None:
        """At least 99% of `size` back on the device, less what the chunk cache may keep."""
        self.assertGreaterEqual(given, 0.99 * size - cache_bound(), what)

    def test_1_cpu_backup_round_trip(self):
        s = saver()
        with s.region("w", enable_cpu_backup=True):
            ts = filled(64, 16 * MIB)  # 64 x 64 MiB = 4 GiB
        ptrs = [t.data_ptr() for t in ts]
        live = sum(t.nbytes for t in ts)
        f1 = free_hbm()
        s.pause("w")
        given = free_hbm() - f1
        print(f"[{MODE}] cpu backup: pause gave back {given / GIB:.3f} GiB of {live / GIB:.3f}", flush=True)
        self.assertGaveBack(given, live)
        s.resume("w")
        self.assertEqual([t.data_ptr() for t in ts], ptrs)
        self.assertTrue(intact(ts))
        # the chunk cache, and the pinned backup's page tables in the GPU's address space (2 MiB per GiB)
        self.assertLessEqual(abs(free_hbm() - f1), cache_bound() + 16 * MIB)

    def test_2_discard(self):
        s = saver()
        with s.region("kv"):
            ts = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(2)]
        f1 = free_hbm()
        s.pause("kv")
        given = free_hbm() - f1
        print(f"[{MODE}] discard: pause gave back {given / GIB:.3f} GiB of 2", flush=True)
        self.assertGaveBack(given, 2 * GIB)
        s.resume("kv")
        for i, t in enumerate(ts):
            t.fill_(i + 1)
        self.assertEqual([int(t.max()) for t in ts], [1, 2])

    def test_3_cuda_graph_replays_after_pause_resume(self):
        s = saver()
        n = 64 * MIB  # 256 MiB per tensor
        with s.region("gw", enable_cpu_backup=True):
            x = torch.randn(n, device="cuda")
            w = torch.randn(n, device="cuda")
            b = torch.randn(n, device="cuda")

        def f():
            tmp = x * w          # an intermediate freed inside the capture
            return tmp.sin() + b

        g, y = captured(s, f, "graph", 2)
        ref = y.clone()
        self.assertTrue(torch.equal(ref, f()), "graph and eager differ before any pause")
        graph_bytes = sum(seg["total_size"] for seg in torch.cuda.memory.memory_snapshot(g.pool(), include_traces=False))
        print(f"[{MODE}] graph pool {graph_bytes / MIB:.0f} MiB", flush=True)
        self.assertGreaterEqual(graph_bytes, 2 * n * 4)
        y_ptr = y.data_ptr()
        for cycle in range(3):
            f0 = free_hbm()
            s.pause("graph")
            given_graph = free_hbm() - f0
            s.pause("gw")
            given_all = free_hbm() - f0
            print(f"[{MODE}] cycle {cycle}: graph gave back {given_graph / MIB:.0f} MiB of {graph_bytes / MIB:.0f}, "
                  f"graph + weights {given_all / MIB:.0f} MiB", flush=True)
            self.assertGaveBack(given_graph, graph_bytes, "the graph's pool")
            self.assertGaveBack(given_all, graph_bytes + 3 * n * 4, "the graph's pool and the weights")
            s.resume("gw")
            s.resume("graph")
            self.assertEqual(y.data_ptr(), y_ptr)
            y.zero_()
            g.replay()
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(y, ref), f"replay after pause/resume differs (cycle {cycle})")
        w.mul_(2)  # the graph reads the weights where they are: no new capture
        g.replay()
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(y, f()))
        w.div_(2)

    def pause_gives_back_only(self, tag: str, paused: int, kept: int, what: str) -> None:
        """pause(tag) gives back `paused` bytes and not the `kept` ones."""
        f0 = free_hbm()
        saver().pause(tag)
        given = free_hbm() - f0
        print(f"[{MODE}] {what}: pause({tag!r}) gave back {given / MIB:.0f} MiB", flush=True)
        self.assertGaveBack(given, paused)
        self.assertLess(given, paused + kept // 2)

    def test_4_disable_inside_a_region(self):
        s = saver()
        with s.region("d"):
            a = torch.ones(64 * MIB, device="cuda")
            with s.disable():
                keep = torch.full((64 * MIB,), 3.0, device="cuda")
        self.pause_gives_back_only("d", a.nbytes, keep.nbytes, "disable: region 256 MiB, disabled 256 MiB")
        self.assertEqual(float(keep.sum()), 3.0 * keep.numel())
        s.resume("d")

    def test_5_region_inside_a_region(self):
        s = saver()
        with s.region("outer", enable_cpu_backup=True):
            a = torch.full((64 * MIB,), 5.0, device="cuda")
            with s.region("inner"):
                bb = torch.ones(64 * MIB, device="cuda")
            a2 = torch.full((64 * MIB,), 6.0, device="cuda")  # the outer pool again
        self.pause_gives_back_only("inner", bb.nbytes, a.nbytes, "nested: inner 256 MiB, outer 512 MiB")
        self.assertEqual((float(a.min()), float(a2.max())), (5.0, 6.0))
        s.resume("inner")
        s.pause("outer")
        s.resume("outer")
        self.assertEqual((float(a.min()), float(a.max()), float(a2.min())), (5.0, 5.0, 6.0))

    def test_6_pause_resume_empty_cache_in_every_order(self):
        import deferalloc as dfa
        s = saver()
        with s.region("il", enable_cpu_backup=True):
            t = torch.arange(128 * MIB, dtype=torch.float32, device="cuda")  # 512 MiB
        ref = t.clone()
        ops = {
            "pause": lambda: s.pause("il"),
            "resume": lambda: s.resume("il"),
            "torch.cuda.empty_cache": torch.cuda.empty_cache,
            "deferalloc.empty_cache": dfa.empty_cache,
        }
        n = 0
        for seq in itertools.product(ops, repeat=4):
            paused = False
            for op in seq:
                f0 = free_hbm()
                if op in ("pause", "resume") and paused == (op == "pause"):
                    with self.assertRaises(dfa.InvalidState, msg=str(seq)):
                        ops[op]()
                    self.assertLessEqual(abs(free_hbm() - f0), 2 * MIB, f"a refused {op} changed memory in {seq}")
                    continue
                ops[op]()
                if op == "pause":
                    paused = True
                    self.assertGaveBack(free_hbm() - f0, t.nbytes, str(seq))
                elif op == "resume":
                    paused = False
            if paused:
                s.resume("il")
            self.assertTrue(torch.equal(t, ref), f"contents changed by {seq}")
            n += 1
        print(f"[{MODE}] {n} orders of pause/resume/empty_cache: contents intact, refusals changed nothing", flush=True)

    def test_7_margin_and_retain(self):
        import deferalloc as dfa
        s = saver()
        with s.region("m", enable_cpu_backup=True):
            t = torch.full((64 * MIB,), 7.0, device="cuda")
        s.pause("m")
        s.memory_margin_bytes = torch.cuda.mem_get_info()[1]
        with self.assertRaises(dfa.OutOfMemory):
            s.resume("m")
        with self.assertRaises(dfa.InvalidState):  # still paused
            s.pause("m")
        s.memory_margin_bytes = 0
        s.resume("m")
        self.assertEqual(float(t.min()), 7.0)
        s.retain_cpu_backup = False
        try:
            for _ in range(2):
                s.pause("m")
                s.resume("m")
                self.assertEqual(float(t.max()), 7.0)
        finally:
            s.retain_cpu_backup = True

    def test_8_refusals(self):
        s = saver()
        with s.region("r"):
            t = torch.ones(4, device="cuda")
        self.assertTrue(s.enabled)
        self.assertEqual(s.hook_mode, MODE)
        with self.assertRaises(NotImplementedError):
            s.get_cpu_backup(t)
        with self.assertRaisesRegex(ValueError, "mutually exclusive"):
            with s.region("r2", enable_cpu_backup=True, enable_disk_backup=True):
                pass
        s.pause()     # every tag
        s.resume()

    def test_9_preload_discard_in_few_mappings(self):
        """hook_mode="preload": 4 GiB in 256 segments of 16 MiB lie in a few slabs of the
        region's arena (Note [Preload arenas]): pause and resume unmap and map O(slabs), not
        256, give the memory back, and keep the addresses."""
        if MODE != "preload":
            self.skipTest("the arenas are hook_mode='preload''s")
        import ctypes
        lib = preload_lib()
        figures = (ctypes.c_size_t * 7)()

        def calls():
            return dfa_stats(lib)["calls"]

        s = saver()
        with s.region("mappings"):
            ts = [torch.empty(16 * MIB, dtype=torch.uint8, device="cuda") for _ in range(256)]
        ptrs = [t.data_ptr() for t in ts]
        self.assertEqual(lib.dfa_preload_arena_figures(b"tms.discard/mappings", figures), 0)
        slabs, slab_bytes = figures[0], figures[1]
        print(f"[{MODE}] 256 x 16 MiB in {slabs} slabs of {slab_bytes / GIB:.3f} GiB", flush=True)
        self.assertLessEqual(slabs, 16)  # 16, 16, 32, ..., 512 MiB: 7 slabs for the first GiB, then 6 of 512
        self.assertLessEqual(slab_bytes, 4 * GIB + 512 * MIB)
        for _ in range(3):
            c0, f0 = calls(), free_hbm()
            t0 = time.perf_counter()
            s.pause("mappings")
            t1 = time.perf_counter()
            given = free_hbm() - f0
            c1 = calls()
            t2 = time.perf_counter()
            s.resume("mappings")
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            c2 = calls()
            print(f"[{MODE}] discard of 4 GiB in 256 segments: pause {1e3 * (t1 - t0):.2f} ms "
                  f"({c1[5] - c0[5]} unmaps), resume {1e3 * (t3 - t2):.2f} ms ({c2[4] - c1[4]} maps), "
                  f"gave back {given / GIB:.3f} GiB", flush=True)
            self.assertGaveBack(given, 4 * GIB)
            self.assertLessEqual(c1[5] - c0[5], slabs)
            self.assertLessEqual(c2[4] - c1[4], slabs)  # one chunk a slab, even where smaller ones are cached
            self.assertEqual([t.data_ptr() for t in ts], ptrs)
        for i, t in enumerate(ts):
            t.fill_(i % 251)
        self.assertEqual([int(t[-1]) for t in ts[:3]], [0, 1, 2])

    def test_9b_preload_backup_copies_the_segments_only(self):
        """hook_mode="preload", CPU backup: 40 segments of 16 MiB (640 MiB) lie in slabs of 16,
        16, 32, ..., 512 MiB (1 GiB, the last 384 MiB a free tail); a pause copies the 640 MiB
        only, a resume restores them bit for bit, one map a slab."""
        if MODE != "preload":
            self.skipTest("the arenas are hook_mode='preload''s")
        import ctypes
        lib = preload_lib()
        figures = (ctypes.c_size_t * 7)()
        s = saver()
        with s.region("live", enable_cpu_backup=True):
            ts = [torch.full((16 * MIB,), i % 251, dtype=torch.uint8, device="cuda") for i in range(40)]
        ptrs = [t.data_ptr() for t in ts]
        self.assertEqual(lib.dfa_preload_arena_figures(b"tms.host/live", figures), 0)
        slabs, slab_bytes, live = figures[0], figures[1], figures[2]
        print(f"[{MODE}] 40 x 16 MiB: {live / MIB:.0f} MiB of segments in {slabs} slabs of {slab_bytes / MIB:.0f} MiB",
              flush=True)
        self.assertEqual(live, 40 * 16 * MIB)
        self.assertGreater(slab_bytes, live)  # a free tail that a backup must not copy
        for _ in range(2):
            b0 = dfa_stats(lib)
            s.pause("live")
            b1 = dfa_stats(lib)
            s.resume("live")
            torch.cuda.synchronize()
            b2 = dfa_stats(lib)
            print(f"[{MODE}] backup pause copied {(b1['backup'] - b0['backup']) / MIB:.0f} MiB, "
                  f"resume {b2['calls'][4] - b1['calls'][4]} maps", flush=True)
            self.assertEqual(b1["backup"] - b0["backup"], live)
            self.assertEqual(b2["backup"], b0["backup"])
            self.assertLessEqual(b2["calls"][4] - b1["calls"][4], slabs)
            self.assertEqual([t.data_ptr() for t in ts], ptrs)
            self.assertEqual([int(t[0]) for t in ts], [i % 251 for i in range(40)])
            self.assertEqual([int(t[-1]) for t in ts], [i % 251 for i in range(40)])
        del ts

    def test_9c_preload_large_tensors_take_their_own_bytes(self):
        """hook_mode="preload": a KV cache of one tensor per layer, 260 and 300 MiB each (above
        an eighth of the 512 MiB slab cap), takes one slab per tensor of exactly its bytes
        (within 1.1x, not a power of two each), paused and resumed in one mapping a slab."""
        if MODE != "preload":
            self.skipTest("the arenas are hook_mode='preload''s")
        import ctypes
        lib = preload_lib()
        figures = (ctypes.c_size_t * 7)()
        s = saver()
        # A tag of its own: the region's MemPool is kept for the process (as TMS keeps its
        # pools), so under test_2's tag "kv" it still caches test_2's two free 1 GiB segments,
        # and PyTorch's allocator splits those for the first six layers (300 + 260 + 300 and
        # 260 + 300 + 260 MiB, best fit) before it cudaMallocs a segment per layer: on the H100
        # that gave 12 slabs (2 of 1 GiB + 10 layers, 4848 MiB of segments) for 16 layers.
        with s.region("kv_layers"):
            ts = [torch.empty((260 if i % 2 else 300) * MIB, dtype=torch.uint8, device="cuda") for i in range(16)]
        self.assertEqual(lib.dfa_preload_arena_figures(b"tms.discard/kv_layers", figures), 0)
        slabs, slab_bytes, live = figures[0], figures[1], figures[2]
        print(f"[{MODE}] 16 KV layers of 260 / 300 MiB: {live / MIB:.0f} MiB of segments in {slabs} slabs of "
              f"{slab_bytes / MIB:.0f} MiB", flush=True)
        self.assertEqual(figures[3], 16)  # one segment per layer
        self.assertEqual(live, 8 * (260 + 300) * MIB)
        self.assertEqual(slabs, 16)
        self.assertLessEqual(slab_bytes, live * 11 // 10)
        c0, f0 = dfa_stats(lib)["calls"], free_hbm()
        s.pause("kv_layers")
        given = free_hbm() - f0
        c1 = dfa_stats(lib)["calls"]
        s.resume("kv_layers")
        torch.cuda.synchronize()
        c2 = dfa_stats(lib)["calls"]
        self.assertGaveBack(given, 16 * 280 * MIB)
        self.assertLessEqual(c1[5] - c0[5], slabs)
        self.assertLessEqual(c2[4] - c1[4], slabs)
        for t in ts:
            t.fill_(7)
        del ts

    def test_9d_preload_another_pools_segment_in_the_arena_is_refused(self):
        """hook_mode="preload": a torch.cuda.use_mem_pool nested with a region: PyTorch routes the
        allocation to one of the two pools begun on the thread, the first begun in older
        versions, the last in newer ones (2.11 searches its captures_underway in LIFO order).
        So one nesting or the other puts a segment of that pool in the tag's arena (the arena
        is current all the while), and a pause raises InvalidState, nothing paused.  Once that
        pool is gone, the pause goes through."""
        if MODE != "preload":
            self.skipTest("the arenas are hook_mode='preload''s")
        import ctypes
        import deferalloc as dfa
        lib = preload_lib()
        lib.dfa_preload_arena_owns.argtypes = [ctypes.c_void_p]
        s = saver()
        other = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(other), s.region("hazard"):
            x = torch.full((64 * MIB,), 5, dtype=torch.uint8, device="cuda")  # other's: PyTorch routing FIFO
        with s.region("hazard"), torch.cuda.use_mem_pool(other):
            z = torch.full((64 * MIB,), 6, dtype=torch.uint8, device="cuda")  # other's: PyTorch routing LIFO
        theirs = [seg["address"] for seg in torch.cuda.memory.memory_snapshot(other.id, include_traces=False)]
        print(f"[{MODE}] use_mem_pool and a region nested: {len(theirs)} segment(s) of the other pool, "
              f"{sum(lib.dfa_preload_arena_owns(a) for a in theirs)} in the tag's arena", flush=True)
        self.assertTrue(any(lib.dfa_preload_arena_owns(a) for a in theirs),
                        "no segment of the other pool lies in the tag's arena: the test sets up nothing to refuse")
        with self.assertRaisesRegex(dfa.InvalidState, "belongs to PyTorch's pool"):
            s.pause("hazard")
        self.assertEqual((int(x[-1]), int(z[-1])), (5, 6))  # nothing paused
        del x, z
        torch.cuda.synchronize()
        del other  # its cached segment freed (no pool routed): out of the arena
        torch.cuda.empty_cache()
        s.pause("hazard")
        s.resume("hazard")

    def test_9e_preload_capture_that_raises_keeps_its_pool_the_tags(self):
        """hook_mode="preload": a cuda_graph capture that raises after allocating leaves its
        segment in the tag's arena, and its pool is the tag's already: a pause goes through."""
        if MODE != "preload":
            self.skipTest("the arenas are hook_mode='preload''s")
        s = saver()
        g = torch.cuda.CUDAGraph()
        src = torch.ones((16 * MIB,), dtype=torch.uint8, device="cuda")
        with self.assertRaisesRegex(RuntimeError, "the capture fails"):
            with s.cuda_graph(g, tag="graph_raises"):
                y = src * 2  # in the capture's pool, in the arena
                raise RuntimeError("the capture fails")
        del y
        s.pause("graph_raises")  # before the fix: InvalidState, the pool unknown to the tag
        s.resume("graph_raises")
        del g, src

    def test_9f_disk_backup(self):
        import tempfile
        import deferalloc as dfa
        s = saver()
        d = tempfile.mkdtemp(prefix="dfa-tms-disk-gpu-")
        s.set_disk_backup_dir(d)
        n = 64 * MIB  # 256 MiB per tensor
        with s.region("dw", enable_disk_backup=True):
            ws = [torch.randn(n, device="cuda") for _ in range(4)]  # 1 GiB
            odd = torch.randint(0, 255, (12345,), dtype=torch.uint8, device="cuda")  # a small segment
        refs = [t.clone() for t in ws + [odd]]  # outside every region
        live = sum(t.nbytes for t in ws)
        self.assertIsNone(s.get_cpu_backup(ws[0]))  # as TMS: a disk region has no host copy
        arena = None
        if MODE == "preload":  # the segments lie in the arena "tms.disk/dw" (Note [Preload arenas])
            import ctypes
            lib = preload_lib()
            arena = (ctypes.c_size_t * 7)()
            self.assertEqual(lib.dfa_preload_arena_figures(b"tms.disk/dw", arena), 0)
            print(f"[{MODE}] disk region: {arena[3]} segments in {arena[0]} slabs of the arena", flush=True)
            self.assertGreaterEqual(arena[2], live)  # every large tensor's segment placed in it
            self.assertGreaterEqual(arena[3], 5)

        def f():
            return (ws[0] * ws[1]).sin() + ws[2]
        g, y = captured(s, f, "dgraph", 1)
        yref = y.clone()

        def same() -> bool:
            return all(torch.equal(t, r) for t, r in zip(ws + [odd], refs))

        def ballast(nbytes: int) -> None:
            """Overwrites the memory the pause freed (a tensor outside every region, filled and
            freed again, deferalloc's cached chunks given back first and after), so that a resume
            whose file is not read back cannot find the old bytes on the same physical pages."""
            dfa.trim(0)
            nbytes = min(nbytes, free_hbm() - 256 * MIB)
            if nbytes > 0:
                b = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
                torch.cuda.synchronize()
                del b
            torch.cuda.empty_cache()
            dfa.trim(0)

        for chunk in (1 * MIB, 16 * MIB, 512 * MIB):  # smaller than a segment, and larger than all
            s._impl.disk.chunk = chunk
            f0 = free_hbm()
            s.pause("dw")
            given = free_hbm() - f0
            files = [x for x in os.listdir(d) if x.endswith(".spill")]
            print(f"[{MODE}] disk backup (chunk {chunk // MIB} MiB): pause gave back {given / GIB:.3f} GiB of "
                  f"{live / GIB:.3f}; files {files}", flush=True)
            self.assertGaveBack(given, live, "a disk-backup pause")
            if arena is not None:
                self.assertEqual(lib.dfa_preload_arena_figures(b"tms.disk/dw", arena), 0)
                self.assertEqual(arena[4], 1, "the disk arena is not paused")
            self.assertEqual(len(files), 1, files)
            self.assertGreaterEqual(os.path.getsize(os.path.join(d, files[0])), live)
            s.pause("dgraph")
            s.resume("dgraph")
            ballast(given)
            s.resume("dw")
            self.assertTrue(same(), f"contents differ after a disk-backup resume (chunk {chunk})")
            self.assertEqual([x for x in os.listdir(d) if x.endswith(".spill")], [], "the file outlived the resume")
            y.zero_()
            g.replay()
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(y, yref), "graph replay over a disk region differs after pause/resume")

        # A corrupted file: resume raises naming it, and the memory is given back again.
        f0 = free_hbm()
        s.pause("dw")
        paused_free = free_hbm()
        path = os.path.join(d, [x for x in os.listdir(d) if x.endswith(".spill")][0])
        with open(path, "r+b") as fh:
            fh.seek(4096 + 12345)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
        with self.assertRaisesRegex(dfa.CorruptData, path):
            s.resume("dw")
        self.assertGreaterEqual(free_hbm(), paused_free - cache_bound(), "a failed resume kept the memory")
        with self.assertRaises(dfa.InvalidState):
            s.pause("dw")  # still paused
        with open(path, "r+b") as fh:
            fh.seek(4096 + 12345)
            fh.write(byte)
        ballast(paused_free - f0)
        s.resume("dw")
        self.assertTrue(same(), "contents differ after the repaired file's resume")
        self.assertLessEqual(abs(free_hbm() - f0), cache_bound() + 16 * MIB)
        os.rmdir(d)


# ---- two processes on one GPU ---------------------------------------------------------------------

def child(mode: str, name: str) -> int:
    """A process of the two: commands on stdin, one JSON line per command on stdout."""
    s = saver()
    s.hook_mode = mode
    state = {}
    base = 100.0 if name == "A" else 200.0

    def reply(**kv):
        kv["free"] = free_hbm()
        print("REPLY " + json.dumps(kv), flush=True)

    torch.empty(1, device="cuda")
    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd[0] == "setup":
                size = int(cmd[1])
                with s.region("w", enable_cpu_backup=True):
                    state["w"] = filled(4, 16 * MIB, base)  # 256 MiB with contents
                with s.region("kv"):
                    chunk = GIB
                    state["kv"] = [torch.empty(min(chunk, size - o), dtype=torch.uint8, device="cuda")
                                   for o in range(0, size, chunk)]
                reply(ok=True)
            elif cmd[0] == "pause":
                s.pause()
                reply(ok=True)
            elif cmd[0] == "resume":
                s.resume()
                reply(ok=True)
            elif cmd[0] == "work":
                for t in state["kv"]:
                    t.fill_(int(cmd[1]) % 256)
                ok = intact(state["w"], base) and all(int(t[-1]) == int(cmd[1]) % 256 for t in state["kv"][:2])
                reply(ok=ok)
            elif cmd[0] == "free":
                reply(ok=True)
            elif cmd[0] == "quit":
                return 0
        except Exception as e:  # reported to the parent, which fails the test
            print("REPLY " + json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


class Proc:
    def __init__(self, args, env):
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited ({self.p.wait()}) on {cmd!r}")
            if line.startswith("REPLY "):
                r = json.loads(line[6:])
                if not r.get("ok"):
                    raise AssertionError(f"{cmd!r}: {r}")
                return r

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.p.stdout.close()


def mode_env(mode: str) -> dict:
    from deferalloc.memory_saver import configure_subprocess
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if mode == "preload":
        saved = os.environ.pop("LD_PRELOAD", None)
        try:
            with configure_subprocess():  # the public way: LD_PRELOAD for the processes started inside
                env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
        finally:
            if saved is not None:
                os.environ["LD_PRELOAD"] = saved
    return env


def two_processes(mode: str, cycles: int = 20, size: int = 16 * GIB) -> list:
    """Returns the failed checks (empty: passed)."""
    env = mode_env(mode)
    me = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--child"]
    a = Proc(me + ["A"], env)
    b = Proc(me + ["B"], env)
    ballast = None
    bad = []
    try:
        a.ask("free")
        free_ctx = b.ask("free")["free"]  # both contexts
        # A third process (PyTorch alone) holds what the GPU has beyond one worker's size + 4 GiB,
        # so that a process can resume only if the other really gave its memory back.
        hold = max(0, free_ctx - size - 4 * GIB - 1 * GIB)  # 1 GiB: the ballast process's own context
        plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        ballast = subprocess.Popen([sys.executable, "-c",
                                    "import sys, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, "
                                    "device='cuda'); print('held', flush=True); sys.stdin.read()", str(hold)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=plain)
        assert ballast.stdout.readline().startswith("held")
        base = a.ask("free")["free"]
        a.ask(f"setup {size}")
        held_a = base - a.ask("pause")["free"]
        b.ask(f"setup {size}")
        held_both = base - b.ask("pause")["free"]
        print(f"[{mode}] two processes: {size / GIB:.0f} GiB each, {base / GIB:.2f} GiB free with the ballast; paused A "
              f"holds {held_a / MIB:.0f} MiB, both paused {held_both / MIB:.0f} MiB beyond their contexts", flush=True)
        if held_a > 256 * MIB:
            bad.append(f"paused A holds {held_a / MIB:.0f} MiB > 256 MiB beyond its context")
        if held_both - held_a > 256 * MIB:
            bad.append(f"paused B holds {(held_both - held_a) / MIB:.0f} MiB > 256 MiB beyond its context")
        both_paused, active, b_paused = [], [], []
        given_b = 0
        for i in range(cycles):
            f_resume = a.ask("resume")["free"]
            active.append(f_resume)
            if i > 0:  # A maps what B gave back at the end of the cycle before
                took_a = b_paused[-1] - f_resume
                if took_a < 0.95 * given_b:
                    bad.append(f"cycle {i}: A mapped {took_a / GIB:.3f} GiB of the {given_b / GIB:.3f} B gave back")
            a.ask(f"work {i}")
            f_a_paused = a.ask("pause")["free"]
            given_a = f_a_paused - f_resume
            both_paused.append(f_a_paused)
            f_b = b.ask("resume")["free"]
            took_b = f_a_paused - f_b
            b.ask(f"work {i + 1}")
            f_b_paused = b.ask("pause")["free"]
            b_paused.append(f_b_paused)
            given_b = f_b_paused - f_b
            line = (f"cycle {i:2d}: A gave back {given_a / GIB:.3f} GiB, B mapped {took_b / GIB:.3f} "
                    f"({took_b / max(1, given_a):.3f}); B gave back {given_b / GIB:.3f}; both paused: "
                    f"{(base - f_a_paused) / MIB:.0f} MiB held")
            print(f"[{mode}] {line}", flush=True)
            if took_b < 0.95 * given_a or given_a < 0.95 * size:
                bad.append(line)
        drift = max(both_paused) - min(both_paused)
        print(f"[{mode}] free memory with both paused over {cycles} cycles: spread {drift / MIB:.1f} MiB, "
              f"max held {(base - min(both_paused)) / MIB:.0f} MiB", flush=True)
        if drift > 64 * MIB:
            bad.append(f"free memory with both paused drifts by {drift / MIB:.0f} MiB over the cycles")
        if base - min(both_paused) > 512 * MIB:
            bad.append(f"both paused hold {(base - min(both_paused)) / MIB:.0f} MiB > 2 x 256 MiB beyond their contexts")
    finally:
        a.close()
        b.close()
        if ballast is not None:
            ballast.stdin.close()
            ballast.wait(timeout=60)
            ballast.stdout.close()
    return bad


class TwoProcessesOnOneGpu(unittest.TestCase):
    def run_mode(self, mode):
        bad = two_processes(mode)
        self.assertEqual(bad, [])

    def test_torch_mode(self):
        self.run_mode("torch")

    def test_preload_mode(self):
        self.run_mode("preload")


def main() -> int:
    global MODE
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["torch", "preload"])
    ap.add_argument("--child", choices=["A", "B"])
    args, rest = ap.parse_known_args()
    if not torch.cuda.is_available():
        print("SKIPPED: needs a GPU")
        return 77
    if args.child:
        return child(args.mode, args.child)
    sys.path.insert(0, HERE)
    from unittest_main import run_tests
    if args.mode:
        MODE = args.mode
        saver().hook_mode = args.mode
        sys.argv = [sys.argv[0]] + rest + ["ModeSuite"]
        run_tests()  # exits
    # Everything: each mode's suite in a process of its own, then the two-process test.
    failed = []
    for mode in ("torch", "preload"):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode], env=mode_env(mode))
        print(f"== hook mode {mode}: exit {r.returncode} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if r.returncode != 0:
            failed.append(mode)
    sys.argv = [sys.argv[0]] + rest + ["TwoProcessesOnOneGpu"]
    try:
        run_tests()
    except SystemExit as e:
        if e.code != 0:
            failed.append("two processes")
    print(f"memory_saver GPU: {'failed: ' + ', '.join(failed) if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
