"""Freed regions, refusals and snapshots on the GPU (ctest labels torch, gpu; exit 77 = Skipped without one).

* A region's freed memory goes back: 16 GiB in 1,024 tensors of region "big", freed, then
  torch.cuda.empty_cache() (and, in a second round, deferalloc.empty_cache() alone) returns
  >= 99% of it by cuMemGetInfo, while region "keep"'s tensors stay intact.
* An allocation in a paused region fails with PyTorch's OutOfMemoryError carrying
  deferalloc's reason as a note (printed), and the tag stays paused.
* memory_snapshot() over regions renders with torch.cuda._memory_viz; a Llama training step
  under install() (examples/python/llama_memory_snapshot.py, tiny size, in a subprocess)
  writes the snapshot, the two plots and the PNG.
Prints one line per measurement.  About a minute on an H200.
"""
import os
import subprocess
import sys
import tempfile
import unittest

import torch

import deferalloc as dfa

GIB = 1 << 30
BIG = int(os.environ.get("DFA_REGION_GIB", "16"))


def free_hbm():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class RegionGivesBack(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with dfa.region("keep"):
            cls.keep = [torch.full((64 << 20,), i, dtype=torch.uint8, device="cuda") for i in range(16)]  # 1 GiB

    def check_keep(self):
        for i, t in enumerate(self.keep):
            self.assertEqual(int(t.min()), i)
            self.assertEqual(int(t.max()), i)

    def round(self, how: str, empty):
        torch.cuda.empty_cache()
        before = free_hbm()
        with dfa.region("big"):
            ts = [torch.empty((BIG * GIB) // 1024, dtype=torch.uint8, device="cuda") for _ in range(1024)]
            for t in ts[::64]:
                t.fill_(7)
        held = before - free_hbm()
        self.assertGreaterEqual(held, BIG * GIB)
        del ts, t
        empty()
        back = free_hbm() - (before - held)
        print(f"{how}: {held / GIB:.2f} GiB held by region 'big', {back / GIB:.2f} GiB given back "
              f"({100.0 * back / (BIG * GIB):.2f}% of {BIG} GiB)", flush=True)
        self.assertGreaterEqual(back, 0.99 * BIG * GIB, how)
        self.check_keep()

    def test_1_torch_empty_cache_gives_a_regions_memory_back(self):
        self.round("torch.cuda.empty_cache()", torch.cuda.empty_cache)

    def test_2_deferalloc_empty_cache_gives_a_regions_memory_back(self):
        self.round("deferalloc.empty_cache()", dfa.empty_cache)

    def test_3_an_allocation_in_a_paused_region_says_why(self):
        with dfa.region("paused"):
            x = torch.ones(1 << 20, device="cuda")
        dfa.pause("paused", keep="host")
        with self.assertRaises(torch.cuda.OutOfMemoryError) as e:
            with dfa.region("paused"):
                torch.empty(1 << 20, device="cuda")
        notes = getattr(e.exception, "__notes__", [])
        print(f"paused region: {type(e.exception).__name__}: {str(e.exception).splitlines()[0]}")
        for n in notes:
            print(f"  note: {n}")
        self.assertEqual(len(notes), 1)
        self.assertRegex(notes[0], r"^deferalloc refused \d+ bytes \([^)]+\) in tag 'paused': the tag 'paused' is paused "
                                   r"\(pause gave its memory back\)\. Fix: resume\('paused'\) before allocating in it, "
                                   r"or allocate outside its region\.$")
        self.assertEqual(dfa.last_error(), notes[0])
        self.assertTrue(dfa.is_paused("paused"))
        dfa.resume("paused")
        self.assertEqual(float(x.sum()), float(1 << 20))
        self.check_keep()

    def test_4_snapshot_over_regions_renders(self):
        from torch.cuda import _memory_viz
        snap = dfa.memory_snapshot()
        tags = {s.get("deferalloc_tag") for s in snap["segments"]}
        self.assertIn("keep", tags)
        _memory_viz.segsum(snap)
        self.assertIn("MemoryViz.js", _memory_viz.segment_plot(snap))
        self.assertIn("keep", snap["deferalloc"]["tags"])


class LlamaUnderInstall(unittest.TestCase):
    def test_snapshot_of_a_training_step(self):
        script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", "llama_memory_snapshot.py")
        with tempfile.TemporaryDirectory() as out:
            r = subprocess.run([sys.executable, script, "--out", out, "--size", "tiny"], capture_output=True,
                               text=True, timeout=600)
            print(r.stdout[-3000:])
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            for name in ("snapshot.pickle", "segment_plot.html", "trace_plot.html", "memory.png"):
                self.assertGreater(os.path.getsize(os.path.join(out, name)), 1000, name)
            self.assertIn("installed True", r.stdout)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("SKIPPED: needs a GPU")
        sys.exit(77)
    from unittest_main import run_tests
    run_tests()
