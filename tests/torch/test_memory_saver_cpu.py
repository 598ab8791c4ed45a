"""deferalloc.memory_saver (torch_memory_saver's API) without a GPU (ctest label torch, the
host driver): the API surface against torch_memory_saver 0.0.10's, argument checks and
refusals with their messages, the TMS_* variables, hook modes, pause/resume bookkeeping of
the torch hook mode on the host driver, disk backup in the torch hook mode (dfa_malloc blocks
of the host driver: round trips, directories, corrupt / truncated / missing files, a killed
writer) and the preload hook mode's disk path on reservations, the preload hook mode's pause
and resume of a tag's arenas, a disk arena's file included (a process with the preload library
in LD_PRELOAD and segments cudaMalloc'ed through it; regions themselves need CUDA),
configure_subprocess and the two opt-ins (install_as_torch_memory_saver, the shim on
PYTHONPATH).  The memory itself: test_memory_saver_gpu."""
import contextlib
import ctypes
import inspect
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import types
import unittest
from unittest import mock

import torch

import deferalloc as dfa
from deferalloc import memory_saver as ms
from test_python_cpu import _malloc_api  # beside this file (sys.path[0])

# torch_memory_saver 0.0.10's public methods: name -> (parameter, default) after self.
TMS_API = {
    "region": [("tag", "default"), ("enable_cpu_backup", False), ("enable_disk_backup", False),
               ("cpu_backup_backend", None)],
    "cuda_graph": [("cuda_graph", inspect.Parameter.empty), ("pool", None), ("stream", None),
                   ("capture_error_mode", "global"), ("tag", "default"), ("enable_cpu_backup", False),
                   ("cpu_backup_backend", None)],
    "disable": [],
    "pause": [("tag", None)],
    "resume": [("tag", None)],
    "get_cpu_backup": [("x", inspect.Parameter.empty), ("zero_copy", False)],
    "set_disk_backup_dir": [("path", inspect.Parameter.empty)],
}
TMS_ENV = ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP", "TMS_INIT_CPU_BACKUP_BACKEND",
           "TMS_RETAIN_CPU_BACKUP", "TMS_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_CHUNK_MB")


def clean_env(**kv):
    """os.environ without the TMS_* variables and LD_PRELOAD, plus `kv`."""
    env = {k: v for k, v in os.environ.items() if k not in TMS_ENV and k != "LD_PRELOAD"}
    env.update(kv)
    return mock.patch.dict(os.environ, env, clear=True)


def torch_saver():
    s = ms.TorchMemorySaver()
    s.hook_mode = "torch"
    return s


class Surface(unittest.TestCase):
    def test_public_names(self):
        self.assertIsInstance(ms.torch_memory_saver, ms.TorchMemorySaver)
        for name in ("TorchMemorySaver", "torch_memory_saver", "configure_subprocess"):
            self.assertTrue(hasattr(ms, name), name)
        for name, params in TMS_API.items():
            sig = inspect.signature(getattr(ms.TorchMemorySaver, name))
            got = [(p.name, p.default) for p in list(sig.parameters.values())[1:]]
            self.assertEqual(got, params, name)
        for prop in ("enabled", "hook_mode", "memory_margin_bytes", "retain_cpu_backup"):
            self.assertIsInstance(inspect.getattr_static(ms.TorchMemorySaver, prop), property, prop)
        self.assertTrue(ms.TorchMemorySaver().enabled)

    def test_hook_mode_before_first_use_only(self):
        s = ms.TorchMemorySaver()
        self.assertEqual(s.hook_mode, "preload")  # TMS's default
        with self.assertRaisesRegex(ValueError, r"hook_mode must be one of \['preload', 'torch'\], not 'cuda'"):
            s.hook_mode = "cuda"
        s.hook_mode = "torch"
        with clean_env():
            s.pause()  # first use
        with self.assertRaisesRegex(RuntimeError, "cannot configure after initialization"):
            s.hook_mode = "preload"

    def test_preload_mode_needs_the_preload_library(self):
        with clean_env():
            with self.assertRaisesRegex(RuntimeError, r"needs libdeferalloc_preload\.so in LD_PRELOAD exactly once "
                                                      r"\(found \[\].*configure_subprocess\(\).*hook_mode='torch'"):
                ms.TorchMemorySaver().pause()
        with clean_env(LD_PRELOAD="/x/libdeferalloc_preload.so:/y/libdeferalloc_preload.so"):
            with self.assertRaisesRegex(RuntimeError, "exactly once"):
                ms.TorchMemorySaver().pause()
        with clean_env(LD_PRELOAD="/x/libfoo.so /x/libdeferalloc_preload.so"):
            s = ms.TorchMemorySaver()
            s.pause()   # nothing to pause
            s.resume()
            if not torch.cuda.is_available():
                with self.assertRaisesRegex(RuntimeError, "hook_mode='preload' needs CUDA"):
                    with s.region("w"):
                        pass

    def test_margin_and_retain(self):
        with clean_env():
            s = torch_saver()
            with self.assertRaisesRegex(NotImplementedError, "Only setter is supported"):
                s.memory_margin_bytes
            s.memory_margin_bytes = 1 << 30
            for bad, exc in ((1.5, TypeError), (True, TypeError), (-1, ValueError)):
                with self.assertRaises(exc):
                    s.memory_margin_bytes = bad
            self.assertTrue(s.retain_cpu_backup)  # deferalloc keeps pinned backups (pinned_cache_mb)
            s.retain_cpu_backup = False
            self.assertFalse(s.retain_cpu_backup)
            with self.assertRaisesRegex(TypeError, "retain_cpu_backup must be a bool"):
                s.retain_cpu_backup = "no"
        with clean_env(TMS_RETAIN_CPU_BACKUP="0"):
            self.assertFalse(torch_saver().retain_cpu_backup)
        with clean_env(TMS_RETAIN_CPU_BACKUP="true"):
            self.assertTrue(torch_saver().retain_cpu_backup)


class SaverCase(unittest.TestCase):
    """A fresh saver in hook mode "torch", the TMS_* variables and LD_PRELOAD unset."""

    def setUp(self):
        self.env = clean_env()
        self.env.start()
        self.s = torch_saver()

    def tearDown(self):
        self.env.stop()


class Refusals(SaverCase):

    def region(self, *a, **k):
        with self.s.region(*a, **k):
            pass

    def test_region_arguments(self):
        with self.assertRaisesRegex(TypeError, "tag must be a string, not int"):
            self.region(3)
        with self.assertRaisesRegex(ValueError, "tag must not be empty"):
            self.region("")
        with self.assertRaisesRegex(TypeError, "enable_cpu_backup must be a bool, not int"):
            self.region("w", enable_cpu_backup=2)
        with self.assertRaisesRegex(TypeError, "enable_cpu_backup must be a bool, not str"):
            self.region("w", enable_cpu_backup="yes")
        self.region("w1", enable_cpu_backup=1)  # 0 / 1 as a C bool, as torch_memory_saver takes them
        self.assertEqual(self.s._impl.keeps["w1"], {"host"})
        with self.assertRaisesRegex(TypeError, "tag must be a string, not int"):
            self.s.pause(3)
        with self.assertRaisesRegex(TypeError, "tag must be a string, not bytes"):
            self.s.resume(b"w")
        with self.assertRaisesRegex(ValueError, "cpu_backup_backend requires enable_cpu_backup=True"):
            self.region("w", cpu_backup_backend="pinned")
        with self.assertRaisesRegex(ValueError, r"cpu_backup_backend must be one of \['pinned', 'mmap'\], not 'x'"):
            self.region("w", enable_cpu_backup=True, cpu_backup_backend="x")
        with self.assertRaisesRegex(NotImplementedError, "cpu_backup_backend='mmap': deferalloc keeps host backups "
                                                         "in pinned memory only"):
            self.region("w", enable_cpu_backup=True, cpu_backup_backend="mmap")
        with self.assertRaisesRegex(ValueError, "mutually exclusive"):
            self.region("w", enable_cpu_backup=True, enable_disk_backup=True)
        with self.assertRaisesRegex(TypeError, "enable_disk_backup must be a bool, not str"):
            self.region("w", enable_disk_backup="yes")
        self.region("w2", enable_disk_backup=True)
        self.assertEqual(self.s._impl.keeps["w2"], {"disk"})
        self.region("w", enable_cpu_backup=True, cpu_backup_backend="pinned")

    def test_unsupported_calls_name_why(self):
        with self.assertRaisesRegex(NotImplementedError, "get_cpu_backup: deferalloc's C ABI gives no access"):
            self.s.get_cpu_backup(torch.zeros(4))
        with self.assertRaisesRegex(TypeError, "x must be a torch.Tensor"):
            self.s.get_cpu_backup([1])
        with self.assertRaisesRegex(TypeError, "set_disk_backup_dir: path must be a string, not int"):
            self.s.set_disk_backup_dir(3)
        with self.assertRaisesRegex(RuntimeError, r"disable\(\) should be called only when the memory saver is active"):
            with self.s.disable():
                pass

    def test_cuda_graph_arguments(self):
        with self.assertRaisesRegex(TypeError, "cuda_graph must be a torch.cuda.CUDAGraph, not object"):
            with self.s.cuda_graph(object()):
                pass
        with self.assertRaisesRegex(NotImplementedError, "enable_disk_backup|mmap"):
            with self.s.cuda_graph(object(), enable_cpu_backup=True, cpu_backup_backend="mmap"):
                pass


class Environment(unittest.TestCase):
    def test_parsing(self):
        with clean_env():
            e = ms._env_settings()
            self.assertEqual((e["init_enable"], e["init_cpu_backup"], e["retain_cpu_backup"], e["backend"]),
                             (False, False, True, "pinned"))
        with clean_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="TRUE", TMS_DISK_BACKUP_DIR="/d",
                       TMS_DISK_BACKUP_CHUNK_MB="64", TMS_INIT_CPU_BACKUP_BACKEND="pinned"):
            e = ms._env_settings()
            self.assertEqual((e["init_enable"], e["init_cpu_backup"], e["disk_dir"], e["disk_chunk_mb"]),
                             (True, True, "/d", 64))
        for k, v, exc, msg in (
                ("TMS_INIT_ENABLE", "maybe", ValueError, r"TMS_INIT_ENABLE='maybe' is not a boolean"),
                ("TMS_DISK_BACKUP_CHUNK_MB", "x", ValueError, "not a positive whole number"),
                ("TMS_DISK_BACKUP_CHUNK_MB", "0", ValueError, "not a positive whole number"),
                ("TMS_INIT_CPU_BACKUP_BACKEND", "mmap", NotImplementedError, "TMS_INIT_CPU_BACKUP_BACKEND='mmap'"),
                ("TMS_INIT_CPU_BACKUP_BACKEND", "cuda", ValueError, "must be one of"),
                ("TMS_INIT_ENABLE_DISK_BACKUP", "x", ValueError, "TMS_INIT_ENABLE_DISK_BACKUP='x' is not a boolean")):
            with clean_env(**{k: v}), self.subTest(k=k, v=v):
                with self.assertRaisesRegex(exc, msg):
                    ms._env_settings()
                with self.assertRaisesRegex(exc, msg):
                    torch_saver().pause()  # read at first use
        with clean_env(TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_INIT_ENABLE_DISK_BACKUP="1"):
            with self.assertRaisesRegex(ValueError, "mutually exclusive"):
                ms._env_settings()

    def test_init_enable(self):
        with clean_env(TMS_INIT_ENABLE="1"):
            with self.assertRaisesRegex(NotImplementedError, "TMS_INIT_ENABLE=1 makes every allocation.*"
                                                             "hook_mode='preload' serves it"):
                torch_saver().pause()
        with clean_env(TMS_INIT_ENABLE="1", LD_PRELOAD="/b/libdeferalloc_preload.so"):
            s = ms.TorchMemorySaver()
            impl = s._ensure_initialized()
            self.assertEqual(impl.keeps, {"default": {"discard"}})
            self.assertEqual(impl.pool_ids, {("default", "discard"): {(0, 0)}})
        # TMS_INIT_ENABLE_DISK_BACKUP: what TMS_INIT_ENABLE makes pauseable goes to disk (as TMS's
        # thread default); in torch mode regions name their kind, so it changes nothing there.
        with clean_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_DISK_BACKUP="1", LD_PRELOAD="/b/libdeferalloc_preload.so"):
            impl = ms.TorchMemorySaver()._ensure_initialized()
            self.assertEqual(impl.keeps, {"default": {"disk"}})
            self.assertEqual(impl.pool_ids, {("default", "disk"): {(0, 0)}})
        with clean_env(TMS_INIT_ENABLE_DISK_BACKUP="1"):
            torch_saver().pause()

    def test_expandable_segments_refused(self):
        with clean_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"):
            with self.assertRaisesRegex(RuntimeError, "expandable_segments:True"):
                torch_saver().pause()


class TorchModeOnTheHostDriver(SaverCase):
    """The bookkeeping of pause/resume (no device memory: the host driver opens the tags)."""

    def test_pause_resume_every_order(self):
        with self.s.region("w", enable_cpu_backup=True):
            pass
        with self.s.region("w"):
            pass
        with self.s.region("kv"):
            pass
        self.assertTrue({"tms.host/w", "tms.discard/w", "tms.discard/kv"} <= set(dfa.tags()))
        self.s.pause("w")
        self.assertTrue(dfa.is_paused("tms.host/w") and dfa.is_paused("tms.discard/w"))
        self.assertFalse(dfa.is_paused("tms.discard/kv"))
        with self.assertRaisesRegex(dfa.InvalidState, r"pause\('w'\): the tag is paused already"):
            self.s.pause("w")
        dfa.empty_cache()
        self.s.pause()  # the rest: kv
        self.assertTrue(dfa.is_paused("tms.discard/kv"))
        self.s.pause()  # nothing left: no-op
        self.s.resume("kv")
        with self.assertRaisesRegex(dfa.InvalidState, r"resume\('kv'\): the tag is not paused"):
            self.s.resume("kv")
        dfa.empty_cache()
        self.s.resume()
        self.assertFalse(any(dfa.is_paused(t) for t in ("tms.host/w", "tms.discard/w", "tms.discard/kv")))
        self.s.resume()  # nothing paused: no-op
        self.s.pause("never-used")   # a tag with no allocations holds nothing (as torch_memory_saver)
        self.s.resume("never-used")

    def test_pause_and_resume_of_every_tag_stop_at_the_first_failure_and_say_what_was_done(self):
        for t in ("a", "b", "c"):
            with self.s.region(t):
                pass
        real_pause, real_resume = ms._dfa.pause, ms._dfa.resume

        def failing(real, name):
            def call(tag, **kw):
                if tag == name:
                    raise dfa.OutOfMemory("mocked")
                return real(tag, **kw)
            return call
        with mock.patch.object(ms._dfa, "pause", failing(real_pause, "tms.discard/b")), \
                self.assertLogs("deferalloc", "WARNING") as log, self.assertRaisesRegex(dfa.OutOfMemory, "mocked"):
            self.s.pause()
        self.assertIn("pause(): 'b' failed (mocked) after ['a'] were done (they stay so); not tried: ['c']",
                      log.output[0])
        self.assertEqual([dfa.is_paused(f"tms.discard/{t}") for t in "abc"], [True, False, False])
        self.s.pause()  # b and c
        with mock.patch.object(ms._dfa, "resume", failing(real_resume, "tms.discard/b")), \
                self.assertLogs("deferalloc", "WARNING") as log, self.assertRaisesRegex(dfa.OutOfMemory, "mocked"):
            self.s.resume()
        self.assertIn("resume(): 'b' failed (mocked) after ['a'] were done", log.output[0])
        self.assertEqual([dfa.is_paused(f"tms.discard/{t}") for t in "abc"], [False, True, True])
        self.s.resume()
        self.assertFalse(any(dfa.is_paused(f"tms.discard/{t}") for t in "abc"))

    def test_pause_takes_the_backup_kind_first(self):
        """As in preload mode: a failure that rolls the pause back has discarded nothing."""
        with self.s.region("o", enable_cpu_backup=True):
            pass
        with self.s.region("o"):
            pass
        calls = []
        real = ms._dfa.pause

        def pause(name, keep):
            calls.append(name)
            if name.startswith("tms.discard/"):
                raise dfa.OutOfMemory("mocked pause")
            return real(name, keep=keep)

        with mock.patch.object(ms._dfa, "pause", pause):
            with self.assertRaisesRegex(dfa.OutOfMemory, "mocked pause"):
                self.s.pause("o")
        self.assertEqual(calls, ["tms.host/o", "tms.discard/o"])
        self.assertFalse(dfa.is_paused("tms.host/o") or dfa.is_paused("tms.discard/o"))
        self.s.pause("o")
        self.s.resume("o")

    def test_failed_rollback_leaves_the_tag_resumable(self):
        """A pause that fails and whose rollback fails too records the tag as paused, so that
        resume(tag) finishes it (not a tag stuck half-paused that neither call accepts)."""
        with self.s.region("r", enable_cpu_backup=True):
            pass
        with self.s.region("r"):
            pass
        real_pause, real_resume = ms._dfa.pause, ms._dfa.resume

        def pause(name, keep):
            if name.startswith("tms.discard/"):
                raise dfa.OutOfMemory("mocked pause")
            return real_pause(name, keep=keep)

        def resume(name):
            raise dfa.OutOfMemory("mocked resume")

        with mock.patch.object(ms._dfa, "pause", pause), mock.patch.object(ms._dfa, "resume", resume):
            with self.assertRaisesRegex(dfa.OutOfMemory, "mocked pause"):
                self.s.pause("r")
        self.assertTrue(dfa.is_paused("tms.host/r"))
        with self.assertRaisesRegex(dfa.InvalidState, "paused already"):
            self.s.pause("r")
        self.s.resume("r")  # finishes it
        self.assertFalse(dfa.is_paused("tms.host/r") or dfa.is_paused("tms.discard/r"))
        self.s.pause("r")
        self.s.resume("r")

    def test_pause_inside_a_region_refused_and_nothing_paused(self):
        with self.s.region("a"):
            pass
        with self.s.region("b"):
            with self.assertRaises(dfa.InvalidState):
                self.s.pause("a")
        self.assertFalse(dfa.is_paused("tms.discard/a"))
        self.s.pause("a")
        self.s.resume("a")


class DiskBackup(unittest.TestCase):
    """enable_disk_backup in the torch hook mode on the host driver: a region's dfa_malloc
    blocks (what a MemPool's segments are on CUDA) written to a file at pause and read back at
    resume (Note [Disk backup] in python/deferalloc/memory_saver.py)."""

    SIZES = (100, 300 << 10, (1 << 20) + 5, 3 << 20)  # a tiny block, and blocks over one 1 MiB chunk

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="dfa-tms-disk-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.lib = _malloc_api()  # dfa_malloc / dfa_free with their signatures
        self.blocks = []

    def tearDown(self):
        for p, n in self.blocks:
            self.lib.dfa_free(p, n, -1, None)

    def saver(self, **env):
        ctx = clean_env(**env)
        ctx.start()
        self.addCleanup(ctx.stop)
        return torch_saver()

    def fill(self, s, tag, sizes=SIZES):
        """Blocks of `sizes` in a disk region of `tag`, random contents; returns [(ptr, bytes)]."""
        out = []
        with s.region(tag, enable_disk_backup=True):
            for n in sizes:
                p = self.lib.dfa_malloc(n, -1, None)
                self.assertTrue(p, dfa.last_error())
                ctypes.memmove(p, random.Random(p ^ n).randbytes(n), n)
                out.append((p, n))
        self.blocks += out
        return out

    @staticmethod
    def intact(blocks):
        return all(ctypes.string_at(p, n) == random.Random(p ^ n).randbytes(n) for p, n in blocks)

    def spill_files(self, d=None):
        return sorted(f for f in os.listdir(d or self.dir) if f.endswith(".spill"))

    def test_round_trip_bit_identical_with_chunks_smaller_and_larger_than_a_block(self):
        for i, chunk_mb in enumerate(("1", "256")):
            with self.subTest(chunk_mb=chunk_mb):
                s = self.saver(TMS_DISK_BACKUP_DIR=self.dir, TMS_DISK_BACKUP_CHUNK_MB=chunk_mb)
                tag = f"rt{i}"
                blocks = self.fill(s, tag)
                with s.region(tag):  # a discard kind of the same tag beside it
                    pass
                for _ in range(3):
                    s.pause(tag)
                    self.assertTrue(dfa.is_paused(f"tms.disk/{tag}") and dfa.is_paused(f"tms.discard/{tag}"))
                    files = self.spill_files()
                    self.assertEqual(len(files), 1, files)
                    self.assertTrue(files[0].startswith(f"dfa-tms-{os.getpid()}-"), files)
                    self.assertIn(f"-{tag}-d", files[0])
                    st = os.stat(os.path.join(self.dir, files[0]))
                    self.assertEqual(stat.S_IMODE(st.st_mode), 0o600)
                    self.assertGreaterEqual(st.st_size, sum(self.SIZES))
                    self.assertEqual(s._impl.disk.chunk, int(chunk_mb) << 20)
                    dfa.trim(0)  # the released chunks go back to the driver: only the file holds the bytes
                    s.resume(tag)
                    self.assertFalse(dfa.is_paused(f"tms.disk/{tag}"))
                    self.assertTrue(self.intact(blocks), "contents differ after resume")
                    self.assertEqual(self.spill_files(), [], "the file outlived the resume")

    def test_set_disk_backup_dir_and_the_default(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=os.path.join(self.dir, "env"))
        blocks = self.fill(s, "dir0")
        s.pause("dir0")
        self.assertEqual(len(self.spill_files(os.path.join(self.dir, "env"))), 1)  # the variable's, created
        s.resume("dir0")
        nested = os.path.join(self.dir, "a", "b", "c")
        s.set_disk_backup_dir(nested)  # created with its parents, as TMS's os.makedirs
        self.assertEqual(stat.S_IMODE(os.stat(nested).st_mode), 0o700)
        s.pause("dir0")
        self.assertEqual(len(self.spill_files(nested)), 1)
        s.resume("dir0")
        self.assertTrue(self.intact(blocks))
        link = os.path.join(self.dir, "link")
        os.symlink(nested, link)
        with self.assertRaisesRegex(dfa.IoError, f"{link} is a symbolic link"):
            s.set_disk_backup_dir(link)
        open(os.path.join(self.dir, "file"), "w").close()
        with self.assertRaisesRegex(dfa.IoError, "not a directory"):
            s.set_disk_backup_dir(os.path.join(self.dir, "file"))
        # No directory set: this user's 0700 directory under TMS's default /tmp.
        d = self.saver()
        self.assertIsNone(d._ensure_initialized().disk.dir)
        blocks = self.fill(d, "dir1")
        default = f"/tmp/deferalloc-disk-backup-{os.geteuid()}"
        d.pause("dir1")
        try:
            mine = [f for f in self.spill_files(default) if f.startswith(f"dfa-tms-{os.getpid()}-")]
            self.assertEqual(len(mine), 1)
            self.assertEqual(stat.S_IMODE(os.stat(default).st_mode), 0o700)
        finally:
            d.resume("dir1")
        self.assertTrue(self.intact(blocks))

    def test_a_failed_save_pauses_nothing(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=os.path.join(self.dir, "d"))
        blocks = self.fill(s, "fs")
        with s.region("fs", enable_cpu_backup=True):
            pass
        shutil.rmtree(os.path.join(self.dir, "d"))  # checked at the first disk region: replaced by a file since
        open(os.path.join(self.dir, "d"), "w").close()
        with self.assertRaisesRegex(dfa.IoError, os.path.join(self.dir, "d")):
            s.pause("fs")
        self.assertFalse(any(dfa.is_paused(f"tms.{k}/fs") for k in ("disk", "host")))
        self.assertNotIn("fs", s._impl.paused)
        self.assertTrue(self.intact(blocks))
        self.assertEqual(sorted(os.listdir(self.dir)), ["d"])

    def test_the_directory_is_made_with_its_parents_and_checked_at_the_first_disk_region(self):
        env_dir = os.path.join(self.dir, "x", "y", "z")
        s = self.saver(TMS_DISK_BACKUP_DIR=env_dir)
        with s.region("dc"):  # no disk kind: no directory
            pass
        self.assertFalse(os.path.exists(os.path.join(self.dir, "x")))
        with s.region("dc", enable_disk_backup=True):
            self.assertEqual(stat.S_IMODE(os.stat(env_dir).st_mode), 0o700)  # parents made, as TMS
        link = os.path.join(self.dir, "link")
        os.symlink(env_dir, link)
        s = self.saver(TMS_DISK_BACKUP_DIR=link)
        with self.assertRaisesRegex(dfa.IoError, f"{link} is a symbolic link"):
            with s.region("dc2", enable_disk_backup=True):
                self.fail("a disk region opened on a refused directory")
        with self.assertRaisesRegex(ValueError, "must not be empty"):
            s.set_disk_backup_dir("")
        init_dir = os.path.join(self.dir, "init", "d")
        self.saver(TMS_DISK_BACKUP_DIR=init_dir, TMS_INIT_ENABLE_DISK_BACKUP="1")._ensure_initialized()
        self.assertTrue(os.path.isdir(init_dir), "TMS_INIT_ENABLE_DISK_BACKUP: the directory is made at init")
        with self.assertRaisesRegex(dfa.IoError, "symbolic link"):
            self.saver(TMS_DISK_BACKUP_DIR=link, TMS_INIT_ENABLE_DISK_BACKUP="1")._ensure_initialized()

    def paused(self, tag):
        """A saver with `tag`'s disk region paused, its released memory given back (only the
        file holds the bytes): (saver, blocks)."""
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        blocks = self.fill(s, tag)
        s.pause(tag)
        dfa.trim(0)
        return s, blocks

    def trimming_pause(self, fail=None):
        """dfa.pause that gives released memory back to the driver (only the file holds the
        bytes then) and raises InvalidState for the internal tag `fail`."""
        real = dfa.pause

        def pause(name=None, keep=None, stream=None):
            if name == fail:
                raise dfa.InvalidState(f"injected: pause of {name}")
            real(name, keep, stream)
            dfa.trim(0)
        return mock.patch.object(dfa, "pause", pause)

    def test_a_failed_pause_reads_the_disk_kind_back_and_removes_the_file(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        blocks = self.fill(s, "rb")
        with s.region("rb"):
            pass
        with self.trimming_pause(fail="tms.discard/rb"), self.assertRaisesRegex(dfa.InvalidState, "injected"):
            s.pause("rb")
        self.assertFalse(dfa.is_paused("tms.disk/rb") or dfa.is_paused("tms.discard/rb"))
        self.assertNotIn("rb", s._impl.paused)
        self.assertTrue(self.intact(blocks), "the disk kind was not read back")
        self.assertEqual(self.spill_files(), [])

    def test_a_failed_rollback_keeps_the_tag_paused_with_its_file(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        blocks = self.fill(s, "rr")
        with s.region("rr"):
            pass
        impl = s._ensure_initialized()
        real_load = impl.disk.load

        def failing_load(*a):
            raise dfa.IoError("injected: load")
        with self.trimming_pause(fail="tms.discard/rr"), mock.patch.object(impl.disk, "load", failing_load), \
                self.assertLogs("deferalloc", "WARNING"), self.assertRaisesRegex(dfa.InvalidState, "injected"):
            s.pause("rr")
        self.assertIn("rr", impl.paused, "a failed rollback forgot the paused tag")
        self.assertTrue(dfa.is_paused("tms.disk/rr"))
        self.assertEqual(len(self.spill_files()), 1, "a failed rollback forgot the file")
        with self.assertRaisesRegex(dfa.InvalidState, "paused already"):  # never a read of released memory
            s.pause("rr")
        self.assertIs(impl.disk.load.__func__, real_load.__func__)
        s.resume("rr")
        self.assertTrue(self.intact(blocks))
        self.assertEqual(self.spill_files(), [])

    def test_a_resume_of_a_disk_kind_inside_a_region_is_refused(self):
        s, blocks = self.paused("ri")
        with s.region("other"), mock.patch.object(s._impl.disk, "load", side_effect=dfa.IoError("injected")):
            with self.assertRaisesRegex(dfa.InvalidState, r"resume\(\['ri'\]\).*inside the tagged region"):
                s.resume("ri")
        self.assertTrue(dfa.is_paused("tms.disk/ri"), "resumed inside a region")
        self.assertEqual(len(self.spill_files()), 1)
        s.resume("ri")
        self.assertTrue(self.intact(blocks))

    def test_a_pause_inside_a_region_writes_no_file(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        self.fill(s, "pi")
        impl = s._ensure_initialized()
        with s.region("other"), mock.patch.object(impl.disk, "save", wraps=impl.disk.save) as save:
            with self.assertRaisesRegex(dfa.InvalidState, "inside the tagged region"):
                s.pause("pi")
        save.assert_not_called()
        self.assertFalse(dfa.is_paused("tms.disk/pi"))

    def test_deferalloc_resume_without_a_tag_then_the_savers_resume_reads_the_file(self):
        s, blocks = self.paused("dr")
        dfa.resume()  # every paused tag, tms.disk/dr among them: backed, contents undefined
        self.assertFalse(dfa.is_paused("tms.disk/dr"))
        self.assertEqual(len(self.spill_files()), 1)
        s.resume("dr")
        self.assertTrue(self.intact(blocks), "the saver's resume skipped the file")
        self.assertEqual(self.spill_files(), [])

    def test_a_retried_resume_after_a_failed_release_reads_the_file(self):
        s, blocks = self.paused("rt")
        real_pause = dfa.pause

        def pause(name=None, keep=None, stream=None):
            raise dfa.InvalidState("injected: the release after the failed load")
        with mock.patch.object(s._impl.disk, "load", side_effect=dfa.IoError("injected: load")), \
                mock.patch.object(dfa, "pause", pause), self.assertLogs("deferalloc", "WARNING"):
            with self.assertRaisesRegex(dfa.IoError, "injected: load"):
                s.resume("rt")
        self.assertIs(dfa.pause, real_pause)
        self.assertIn("rt", s._impl.paused)
        self.assertEqual(len(self.spill_files()), 1, "the file went with the failed load")
        s.resume("rt")
        self.assertTrue(self.intact(blocks), "the retried resume skipped the file")
        self.assertEqual(self.spill_files(), [])

    def test_a_pause_after_deferalloc_pause_of_the_disk_kind_is_refused(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        self.fill(s, "dp")
        dfa.pause("tms.disk/dp")
        with self.assertRaisesRegex(dfa.InvalidState, r"pause\('dp'\): its kind 'tms.disk/dp' is paused already"):
            s.pause("dp")
        self.assertEqual(self.spill_files(), [])
        self.assertNotIn("dp", s._impl.paused)
        dfa.resume("tms.disk/dp")
        s.pause("dp")
        s.resume("dp")

    def test_a_block_allocated_while_the_pause_runs_rolls_it_back(self):
        import threading
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        blocks = self.fill(s, "race")
        kept = []  # the tag's discard kind: the check runs before it is released
        with s.region("race"):
            for n in self.SIZES:
                p = self.lib.dfa_malloc(n, -1, None)
                ctypes.memmove(p, random.Random(p ^ n).randbytes(n), n)
                kept.append((p, n))
        self.blocks += kept
        real = dfa.pause
        paused = []

        def pause(name=None, keep=None, stream=None):
            paused.append(name)
            if name == "tms.disk/race":  # another thread inside the disk region, after the file was written
                def alloc():
                    with dfa.tag("tms.disk/race"):
                        p = self.lib.dfa_malloc(4096, -1, None)
                        self.blocks.append((p, 4096))
                th = threading.Thread(target=alloc)
                th.start()
                th.join()
            real(name, keep, stream)
        with mock.patch.object(dfa, "pause", pause):
            with self.assertRaisesRegex(dfa.InvalidState, r"pause\('race'\): 1 block\(s\) of 'tms.disk/race' are in "
                                        "no disk backup file"):
                s.pause("race")
        self.assertNotIn("tms.discard/race", paused, "the discard kind was released before the check")
        self.assertFalse(dfa.is_paused("tms.disk/race") or dfa.is_paused("tms.discard/race"))
        self.assertNotIn("race", s._impl.paused)
        self.assertTrue(self.intact(blocks))
        self.assertTrue(self.intact(kept), "the discard kind lost its contents in a rolled-back pause")
        self.assertEqual(self.spill_files(), [])
        s.pause("race")  # the new block is in the file now
        s.resume("race")
        self.assertTrue(self.intact(blocks))

    def test_a_resume_refuses_a_block_in_no_file(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        blocks = self.fill(s, "cov")
        s.pause("cov")
        (path, dev, ranges), = s._impl.spills["cov"]
        s._impl.spills["cov"] = [(path, dev, ranges[1:])]
        with self.assertRaisesRegex(dfa.InvalidState, r"resume\('cov'\): 1 block\(s\) .* in no disk backup file"):
            s.resume("cov")
        self.assertTrue(dfa.is_paused("tms.disk/cov"))
        s._impl.spills["cov"] = [(path, dev, ranges)]
        s.resume("cov")
        self.assertTrue(self.intact(blocks))

    def test_a_file_that_cannot_be_removed_is_a_warning(self):
        path = os.path.join(self.dir, "f.spill")
        open(path, "w").close()
        with mock.patch.object(os, "unlink", side_effect=PermissionError(13, "Permission denied")), \
                self.assertLogs("deferalloc", "WARNING") as logs:
            ms._DiskBackup.remove([(path, 0, [])])
        self.assertIn(path, logs.output[0])

    def damaged(self, tag, damage, exc, pattern):
        """Pauses `tag`, damages its file, checks that resume raises and that the tag stays
        paused with the file kept; repairs the file and resumes."""
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        blocks = self.fill(s, tag)
        s.pause(tag)
        path = os.path.join(self.dir, self.spill_files()[0])
        with open(path, "rb") as f:
            good = f.read()
        damage(path)
        dfa.trim(0)
        with self.assertRaisesRegex(exc, pattern.format(path=path)):
            s.resume(tag)
        self.assertTrue(dfa.is_paused(f"tms.disk/{tag}"), "the memory was handed back with wrong contents")
        self.assertIn(tag, s._impl.paused)
        with self.assertRaisesRegex(exc, pattern.format(path=path)):  # again: still paused, still refused
            s.resume()
        if os.path.exists(path):
            os.unlink(path)
        with open(path, "wb") as f:
            f.write(good)
        s.resume(tag)
        self.assertTrue(self.intact(blocks))
        self.assertEqual(self.spill_files(), [])

    def test_a_corrupted_file_raises_naming_it_and_the_tag_stays_paused(self):
        def flip(path):
            with open(path, "r+b") as f:
                f.seek(4096 + (300 << 10) + 7)  # inside the data (after the 4 KiB header)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))
        self.damaged("cor", flip, dfa.CorruptData, r"{path}: the block at data offset \d+ .* fails its checksum")

    def test_a_truncated_file_is_corrupt(self):
        self.damaged("tru", lambda p: os.truncate(p, os.path.getsize(p) // 2), dfa.CorruptData,
                     r"{path} is truncated")

    def test_a_missing_file_is_an_io_error(self):
        self.damaged("mis", os.unlink, dfa.IoError, r"cannot open {path}")

    def test_a_killed_writers_temporary_file_is_no_backup(self):
        # A writer killed before its rename leaves <name>.tmp-<random>, never the final name.
        def killed(path):
            os.rename(path, path + ".tmp-00112233aabbccdd")
        self.damaged("kil", killed, dfa.IoError, r"cannot open {path}")
        stale = [f for f in os.listdir(self.dir) if ".tmp-" in f]
        self.assertEqual(len(stale), 1, "a temporary file of another writer was removed")

    def test_get_cpu_backup_of_a_disk_region_is_none(self):
        s = self.saver(TMS_DISK_BACKUP_DIR=self.dir)
        (p, n), = self.fill(s, "gcb", sizes=(4096,))
        x = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
        self.assertIsNone(s.get_cpu_backup(x))  # as TMS: no host copy
        with self.assertRaisesRegex(NotImplementedError, "get_cpu_backup"):
            s.get_cpu_backup(torch.zeros(4))


class PreloadDiskOnTheHostDriver(unittest.TestCase):
    """The preload hook mode's disk path (its pause and resume of reservations) on the host
    driver: the tag's segments, which PyTorch's snapshot lists on CUDA, are deferalloc
    reservations made here (deferred_empty), one disk and one host-backup pool."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="dfa-tms-preload-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        env = clean_env(LD_PRELOAD="/b/libdeferalloc_preload.so", TMS_DISK_BACKUP_DIR=self.dir,
                        TMS_DISK_BACKUP_CHUNK_MB="1")
        env.start()
        self.addCleanup(env.stop)
        self.impl = ms.TorchMemorySaver()._ensure_initialized()
        self.ts = {k: dfa.materialize(dfa.deferred_empty(n, dtype=torch.uint8, device="cpu"))
                   for k, n in (("disk", (3 << 20) + 17), ("disk2", 100), ("host", 1 << 20))}
        for k, t in self.ts.items():
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(len(k))))
        self.refs = {k: t.clone() for k, t in self.ts.items()}
        self.impl.keeps["p"] = {"disk", "host"}
        self.assertIsNone(self.impl.arenas)  # no preload library here: every segment a reservation of its own
        pools = {"disk": (1, 1), "host": (1, 2)}
        for keep, pid in pools.items():
            self.impl.pool_ids[("p", keep)] = {pid}
        # PyTorch's snapshot (address, pool, bytes), with a segment of a pool not the tag's
        snap = [(t.data_ptr(), pools[k.rstrip("2")], t.nbytes) for k, t in self.ts.items()] + [(0x1000, (7, 7), 4096)]
        patch = mock.patch.object(self.impl, "_snapshot", lambda: snap)
        patch.start()
        self.addCleanup(patch.stop)

    def backed(self):
        return {k: dfa.is_backed(t) for k, t in self.ts.items()}

    def test_round_trip_and_a_corrupted_file(self):
        for cycle in range(2):
            self.impl.pause("p")
            self.assertEqual(self.backed(), {"disk": False, "disk2": False, "host": False})
            files = [f for f in os.listdir(self.dir) if f.endswith(".spill")]
            self.assertEqual(len(files), 1, files)
            dfa.trim(0)
            if cycle == 1:  # a flipped byte: refused, released again, the file kept
                path = os.path.join(self.dir, files[0])
                with open(path, "r+b") as f:
                    f.seek(4096 + (2 << 20))
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 1]))
                with self.assertRaisesRegex(dfa.CorruptData, path):
                    self.impl.resume("p")
                self.assertEqual(self.backed(), {"disk": False, "disk2": False, "host": False},
                                 "a failed resume handed memory back")
                self.assertIn("p", self.impl.paused)
                with open(path, "r+b") as f:
                    f.seek(4096 + (2 << 20))
                    f.write(b)
            self.impl.resume("p")
            self.assertTrue(all(self.backed().values()))
            for k, t in self.ts.items():
                self.assertTrue(torch.equal(t, self.refs[k]), f"{k} differs after resume (cycle {cycle})")
            self.assertEqual([f for f in os.listdir(self.dir) if f.endswith(".spill")], [])

    def spills(self):
        return [f for f in os.listdir(self.dir) if f.endswith(".spill")]

    def resumed_intact(self):
        self.impl.resume("p")
        self.assertTrue(all(self.backed().values()))
        for k, t in self.ts.items():
            self.assertTrue(torch.equal(t, self.refs[k]), f"{k} differs after resume")
        self.assertEqual(self.spills(), [])

    def test_a_failed_rollback_keeps_the_tag_paused_with_its_file(self):
        real_by_keep = ms._by_keep

        def by_keep(rows, order):  # one more release after host and disk, which fails (no such reservation)
            out = real_by_keep(rows, order)  # (the pause asks for each kind's rows in turn: after the disk kind's)
            disk = order == ms._PAUSE_ORDER and any(k == "disk" for _, k in rows)
            return out + [("discard", (ctypes.c_uint64 * 1)(0xDEAD))] if disk else out
        with mock.patch.object(ms, "_by_keep", by_keep), \
                mock.patch.object(self.impl.disk, "load", side_effect=dfa.IoError("injected: load")), \
                self.assertLogs("deferalloc", "WARNING"), self.assertRaises(dfa.InvalidArgument):
            self.impl.pause("p")
        self.assertIn("p", self.impl.paused, "a failed rollback forgot the paused tag")
        self.assertEqual(self.backed(), {"disk": False, "disk2": False, "host": False})
        self.assertEqual(len(self.spills()), 1, "a failed rollback forgot the file")
        dfa.trim(0)
        self.resumed_intact()

    def test_a_retried_resume_after_a_failed_release_reads_the_file(self):
        self.impl.pause("p")
        dfa.trim(0)
        real_check = ms._native.allocator.check

        def check(status, call):
            if call == "dfa_release_many":  # as if it failed: the disk segments backed, undefined contents
                for k in ("disk", "disk2"):
                    dfa.materialize(self.ts[k]).fill_(0xEE)
                raise dfa.InvalidState("injected: the release after the failed load")
            real_check(status, call)
        with mock.patch.object(self.impl.disk, "load", side_effect=dfa.IoError("injected: load")), \
                mock.patch.object(ms._native.allocator, "check", check), self.assertLogs("deferalloc", "WARNING"):
            with self.assertRaisesRegex(dfa.IoError, "injected: load"):
                self.impl.resume("p")
        self.assertIn("p", self.impl.paused)
        self.assertTrue(self.backed()["disk"])
        self.assertEqual(len(self.spills()), 1, "the file went with the failed load")
        self.resumed_intact()

    def test_a_pool_of_two_kinds_pauses_its_segments_once(self):
        self.impl.pool_ids[("p", "disk")].add((1, 2))  # the host kind's pool is the disk kind's too
        self.impl.pause("p")
        rids = [row[1] for row in self.impl.paused["p"]]
        self.assertEqual(len(rids), len(set(rids)), self.impl.paused["p"])
        self.assertEqual([row[2] for row in self.impl.paused["p"]], ["host", "disk", "disk"])  # host's: host first
        dfa.trim(0)
        self.resumed_intact()

    def test_a_failed_materialize_of_the_disk_kind_releases_it_again(self):
        self.impl.pause("p")
        dfa.trim(0)
        real_check = ms._native.allocator.check
        failed = []

        def check(status, call):
            if call == "dfa_materialize_many" and not failed:  # the disk kind's, backed already: as if it failed
                failed.append(call)
                raise dfa.OutOfMemory("injected: materialize")
            real_check(status, call)
        with mock.patch.object(ms._native.allocator, "check", check), \
                self.assertRaisesRegex(dfa.OutOfMemory, "injected: materialize"):
            self.impl.resume("p")
        self.assertEqual(self.backed(), {"disk": False, "disk2": False, "host": False},
                         "a failed resume left the disk kind backed while the tag is paused")
        self.assertIn("p", self.impl.paused)
        self.assertEqual(len(self.spills()), 1, "the file went with the failed resume")
        self.resumed_intact()


class RoutingOrder(unittest.TestCase):
    """PyTorch aborts the process when a MemPool is deleted (its cache emptied) while any pool
    is routed (captures_underway): disable() inside a region must not delete its pool while the
    region's pool is routed again (Note [A MemPool is deleted with no pool routed]).  PyTorch's
    routing and MemPool are replaced by fakes that keep that rule as an assertion."""

    def test_disable_pool_deleted_only_with_no_pool_routed(self):
        routed = []
        deleted = []

        class FakePool:
            count = 0

            def __init__(self):
                FakePool.count += 1
                self.id = (7, FakePool.count)

            def __del__(self):
                deleted.append((self.id, list(routed)))

        def begin(device, pool_id):
            routed.append(pool_id)

        def end(device, pool_id):
            routed.remove(pool_id)

        impl = ms._Impl("torch")
        impl.local.depth = 1  # inside a region, as region() leaves it
        with mock.patch.object(ms, "_begin_route", begin), mock.patch.object(ms, "_end_route", end), \
                mock.patch.object(torch.cuda, "is_available", lambda: True), \
                mock.patch.object(torch.cuda, "current_device", lambda: 0), \
                mock.patch.object(torch.cuda, "MemPool", FakePool):
            region_pool = FakePool()
            with impl._route(region_pool):
                with impl.disable():
                    self.assertEqual(len(routed), 1)  # only the disable pool routed
                self.assertEqual(routed, [region_pool.id])
                self.assertEqual(deleted, [], "the disable pool was deleted while the region's pool is routed")
            self.assertEqual(routed, [])
            self.assertEqual(len(deleted), 1, "the disable pool outlived the region")
            self.assertEqual(deleted[0][1], [], "the disable pool was deleted while a pool was routed")
            impl.local.depth = 0


# Run by PreloadArenas in a process with the preload library in LD_PRELOAD: a tag's segments
# cudaMalloc'ed with its arenas current, paused and resumed by the saver's preload mode.
ARENA_CHILD = r"""
import ctypes
import torch
from deferalloc import _native, memory_saver as ms

_native.stream_ptr = lambda stream, device: None  # no CUDA: the null stream
ms._Impl._device = staticmethod(lambda: 0)
impl = ms._Impl("preload")
assert impl.arenas is not None, "the preload library has no arenas"
lib = ctypes.CDLL(None)
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
lib.cudaFree.argtypes = [ctypes.c_void_p]
MIB = 1 << 20
segs = {}
for keep in ("host", "discard"):
    impl._note("t", keep)
    with impl._arena(impl._itag("t", keep)):
        for i in range(64):
            p = ctypes.c_void_p()
            assert lib.cudaMalloc(ctypes.byref(p), MIB) == 0
            ctypes.memset(p.value, i + 1, MIB)
            segs.setdefault(keep, []).append(p.value)
        with impl._arena(None):  # disable(): outside every arena
            q = ctypes.c_void_p()
            assert lib.cudaMalloc(ctypes.byref(q), MIB) == 0
            assert not impl.arenas.dfa_preload_arena_owns(q)
            assert lib.cudaFree(q) == 0
    assert all(impl.arenas.dfa_preload_arena_owns(ctypes.c_void_p(a)) for a in segs[keep])
# PyTorch's snapshot, as the saver reads it: the tag's pools hold the segments
POOL = {"host": (1, 1), "discard": (1, 2)}
for keep in ("host", "discard"):
    impl.pool_ids[("t", keep)] = {POOL[keep]}
snapshot = [(a, POOL[k], MIB) for k in ("host", "discard") for a in segs[k]]
impl._snapshot = lambda: snapshot
figs = {k: impl._arena_figures(impl._itag("t", k)) for k in ("host", "discard")}
assert all(f[0] == 8 and f[3] == 64 for f in figs.values()), figs  # slabs of 1, 1, 2, 4, 8, then 16 MiB (the cap)

def pause_refused(text):  # _preload_pause raises InvalidState saying `text`, and pauses nothing
    try:
        impl._preload_pause("t")
        raise AssertionError(f"a pause went through where it should say {text!r}")
    except ms._dfa.InvalidState as e:
        assert text in str(e), e
    assert all(impl._arena_figures(impl._itag("t", k))[4] == 0 for k in ("host", "discard"))


# A segment of another pool in the tag's arena (a use_mem_pool nested with a region)
snapshot[5] = (snapshot[5][0], (9, 9), MIB)
pause_refused("belongs to PyTorch's pool (9, 9)")
snapshot[5] = (snapshot[5][0], POOL["host"], MIB)
# A segment of the tag's pool that is no reservation of the library (another device's)
snapshot.append((0x1000, POOL["discard"], MIB))
pause_refused("is not a deferalloc reservation")
snapshot.pop()

# The kind with a backup is paused first: a discard pause that fails leaves the host arena restored
real_pause = impl.arenas.dfa_preload_arena_pause
calls = []
def failing_pause(name, keep, stream):
    calls.append(name)
    return 2 if name.startswith(b"tms.discard/") else real_pause(name, keep, stream)
def pause_fails_at_discard(pause, tag):  # the discard kind's arena pause fails: the arenas paused, in order
    calls.clear()
    impl.arenas.dfa_preload_arena_pause = failing_pause
    try:
        pause(tag)
        raise AssertionError("the failing pause went through")
    except ms._dfa.InvalidState:
        pass
    finally:
        impl.arenas.dfa_preload_arena_pause = real_pause
    return list(calls)
order = pause_fails_at_discard(impl._preload_pause, "t")
assert order == [b"tms.host/t", b"tms.discard/t"], order
assert all(impl._arena_figures(impl._itag("t", k))[4] == 0 for k in ("host", "discard"))
for i, a in enumerate(segs["host"]):
    assert ctypes.string_at(a, 4) == bytes([i + 1]) * 4, i

for cycle in range(2):
    rows = impl._preload_pause("t")
    assert rows == [(impl._itag("t", k), 0, k, figs[k][1]) for k in ("host", "discard")], rows
    assert all(impl._arena_figures(impl._itag("t", k))[4] == 1 for k in ("host", "discard"))
    impl._preload_resume(rows)
    impl._preload_resume(rows)  # a retried resume: each arena once
    for i, a in enumerate(segs["host"]):
        assert ctypes.string_at(a, 4) == bytes([i + 1]) * 4, (cycle, i)
    for a in segs["discard"]:
        ctypes.memset(a, 0x5A, MIB)  # backed again, writable
# A pause whose rollback fails too: the tag stays recorded as paused, and resume finishes it
real_resume = impl.arenas.dfa_preload_arena_resume
impl.arenas.dfa_preload_arena_pause = failing_pause
impl.arenas.dfa_preload_arena_resume = lambda name, stream: 3
try:
    impl.pause("t")
    raise AssertionError("the failing pause went through")
except ms._dfa.DeferallocError as e:
    assert "dfa_preload_arena_pause" in str(e), e
impl.arenas.dfa_preload_arena_pause = real_pause
impl.arenas.dfa_preload_arena_resume = real_resume
assert "t" in impl.paused and impl._arena_figures(impl._itag("t", "host"))[4] == 1, impl.paused
impl.resume("t")
assert "t" not in impl.paused and all(impl._arena_figures(impl._itag("t", k))[4] == 0 for k in ("host", "discard"))
for i, a in enumerate(segs["host"]):
    assert ctypes.string_at(a, 4) == bytes([i + 1]) * 4, i

# One snapshot per pause() call, none where the tag's arenas gained no segment since the last
# pause checked them, hold no stray, and no pool of the tag can hold segments outside them
taken = []
impl._snapshot = lambda: taken.append(1) or snapshot
impl.verified.clear()
def cycle(tag=None, snapshots=0):
    n = len(taken)
    impl.pause(tag)
    impl.resume(tag)
    assert len(taken) - n == snapshots, (tag, len(taken) - n, snapshots)
cycle("t", 1)
cycle("t", 0)
def malloc_in(keep, tag="t"):
    p = ctypes.c_void_p()
    with impl._arena(impl._itag(tag, keep)):
        assert lib.cudaMalloc(ctypes.byref(p), MIB) == 0
    return p.value
q = malloc_in("host")  # a new segment: checked again, here of another pool (refused, nothing paused)
snapshot.append((q, (9, 9), MIB))
pause_refused("belongs to PyTorch's pool (9, 9)")
snapshot[-1] = (q, POOL["host"], MIB)
cycle("t", 1)
cycle("t", 0)
impl.pause("t")
r = malloc_in("discard")  # the arena paused: a stray, served outside it, found in the snapshot and paused
impl.resume("t")
snapshot.append((r, POOL["discard"], MIB))
assert impl._arena_figures(impl._itag("t", "discard"))[5] == 1
n = len(taken)
rows = impl._preload_pause("t")
assert len(taken) == n + 1 and any(row[0] == r for row in rows), rows
impl._preload_resume(rows)
cycle("t", 1)  # while the stray lives
impl._note("u", "discard")
impl.pool_ids[("u", "discard")] = {(1, 3)}
u = malloc_in("discard", "u")
snapshot.append((u, (1, 3), MIB))
cycle(None, 1)  # two tags, one snapshot
impl.outside.add(("u", "discard"))  # a capture's pool: looked at every time
cycle("u", 1)
cycle("u", 1)
for a in (q, r, u):
    assert lib.cudaFree(ctypes.c_void_p(a)) == 0
    snapshot.pop()
assert impl._arena_figures(impl._itag("t", "discard"))[5] == 0
impl._snapshot = lambda: snapshot

# The disk kind's arena ("tms.disk/<tag>"): its segments written to a file before the arena is
# released (as discard), read back after its slabs are backed again; a segment freed while
# paused is verified and not copied; a corrupted file is refused, the arena released again and
# the tag still paused, and the resume after the file is mended restores every byte
import glob, os
impl._note("d", "disk")
HALF = MIB // 2
dsegs = []
with impl._arena(impl._itag("d", "disk")):
    for i in range(12):
        p = ctypes.c_void_p()
        assert lib.cudaMalloc(ctypes.byref(p), HALF) == 0
        ctypes.memset(p.value, 0x30 + i, HALF)
        dsegs.append(p.value)
assert impl._arena_segments("tms.disk/d") == sorted((a, HALF) for a in dsegs), impl._arena_segments("tms.disk/d")
assert impl._arena_segments("tms.disk/none") == []
impl.pool_ids[("d", "disk")] = {(1, 4)}
snapshot += [(a, (1, 4), HALF) for a in dsegs]
spill_dir = os.environ["TMS_DISK_BACKUP_DIR"]
for cyc in range(2):
    impl.pause("d")
    assert impl._arena_figures("tms.disk/d")[4] == 1
    assert impl.in_disk_region(dsegs[0] + 8, 8) and not impl.in_disk_region(segs["host"][0], 8)
    files = glob.glob(os.path.join(spill_dir, "*.spill"))
    assert len(files) == 1 and "-d-d0.spill" in files[0], files
    if cyc == 0:  # PyTorch frees a segment while paused (its range back to the paused arena)
        gone = dsegs.pop()
        assert lib.cudaFree(ctypes.c_void_p(gone)) == 0
        snapshot.remove((gone, (1, 4), HALF))
    else:  # a flipped byte of the first segment: refused, the arena released again, the file kept
        with open(files[0], "r+b") as f:
            f.seek(4096 + 10)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        try:
            impl.resume("d")
            raise AssertionError("a corrupted file was read back")
        except ms._dfa.CorruptData as e:
            assert files[0] in str(e), e
        assert "d" in impl.paused and impl._arena_figures("tms.disk/d")[4] == 1
        assert glob.glob(os.path.join(spill_dir, "*.spill")) == files
        with open(files[0], "r+b") as f:
            f.seek(4096 + 10)
            f.write(b)
    impl.resume("d")
    assert "d" not in impl.paused and impl._arena_figures("tms.disk/d")[4] == 0
    assert glob.glob(os.path.join(spill_dir, "*.spill")) == [], "the file outlived the resume"
    for i, a in enumerate(dsegs):
        assert ctypes.string_at(a, HALF) == bytes([0x30 + i]) * HALF, (cyc, i)
# Paused and resumed from a thread whose current device is another: the file, the streams and
# the syncs are the preload library's device's (its arenas' device), not the current one
assert impl.arena_device == 0, impl.arena_device
real_stream, real_sync, devices = ms._stream, ms._sync_devices, []
ms._Impl._device = staticmethod(lambda: 1)
ms._stream = lambda device: devices.append(device) or real_stream(device)
ms._sync_devices = lambda devs: devices.append(tuple(sorted(devs)))
try:
    impl.pause("d")
    files = glob.glob(os.path.join(spill_dir, "*.spill"))
    assert len(files) == 1 and files[0].endswith("-d-d0.spill"), files
    impl.resume("d")
finally:
    ms._Impl._device, ms._stream, ms._sync_devices = staticmethod(lambda: 0), real_stream, real_sync
assert devices and all(d in (0, (0, 1)) for d in devices), devices
for i, a in enumerate(dsegs):
    assert ctypes.string_at(a, HALF) == bytes([0x30 + i]) * HALF, ("another device current", i)
# A failure after the file is written (the discard kind's arena) resumes the disk arena from it
impl._note("d", "discard")
with impl._arena(impl._itag("d", "discard")):
    p = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(p), HALF) == 0
impl.pool_ids[("d", "discard")] = {(1, 5)}
snapshot.append((p.value, (1, 5), HALF))
order = pause_fails_at_discard(impl.pause, "d")
assert order == [b"tms.disk/d", b"tms.discard/d"], order  # the disk kind before the discarded one
assert "d" not in impl.paused and impl._arena_figures("tms.disk/d")[4] == 0
assert glob.glob(os.path.join(spill_dir, "*.spill")) == [], "the rolled-back pause left its file"
for i, a in enumerate(dsegs):
    assert ctypes.string_at(a, HALF) == bytes([0x30 + i]) * HALF, ("rollback", i)
# Note [Disk backup]'s refusals and rollbacks with the disk arena (h30's, on the arenas)
def spills():
    return glob.glob(os.path.join(spill_dir, "*.spill"))
def intact(what):
    for i, a in enumerate(dsegs):
        assert ctypes.string_at(a, HALF) == bytes([0x30 + i]) * HALF, (what, i)
def unpaused():
    return "d" not in impl.paused and all(impl._arena_figures(impl._itag("d", k))[4] == 0 for k in ("disk", "discard"))
def raises(call, kind, text):
    try:
        call()
        raise AssertionError(f"went through where it should say {text!r}")
    except kind as e:
        assert text in str(e), e
# A disk arena released already (by another caller): refused up front, no file written
assert impl.arenas.dfa_preload_arena_pause(b"tms.disk/d", ms._KEEPS.index("host"), None) == 0
raises(lambda: impl.pause("d"), ms._dfa.InvalidState, "'tms.disk/d' is paused already")
assert spills() == [] and "d" not in impl.paused and impl._arena_figures("tms.discard/d")[4] == 0
assert impl.arenas.dfa_preload_arena_resume(b"tms.disk/d", None) == 0
intact("refused")
# A segment placed in the disk arena after its file was written (another thread in the region):
# released without being written, so the pause rolls back (every arena backed, no file), the
# discard kind untouched
real_save = impl.disk.save
late = []
def racing_save(t, groups):
    out = real_save(t, groups)
    assert impl.arenas.dfa_preload_arena_push(b"tms.disk/d") == 0
    q = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(q), HALF) == 0
    impl.arenas.dfa_preload_arena_pop()
    late.append(q.value)
    return out
def pause_rolled_back(save, text):  # a pause with `save` as the file's writer raises `text`, rolled back
    paused_names = []                # before the discard kind is released: every arena backed, no file
    impl.disk.save = save
    impl.arenas.dfa_preload_arena_pause = lambda name, keep, stream: paused_names.append(name) or \
        real_pause(name, keep, stream)
    try:
        raises(lambda: impl.pause("d"), ms._dfa.InvalidState, text)
    finally:
        impl.disk.save = real_save
        impl.arenas.dfa_preload_arena_pause = real_pause
    assert paused_names == [b"tms.disk/d"], paused_names
    assert unpaused() and spills() == [] and impl.disk_gens == {}, (impl.paused, spills(), impl.disk_gens)
pause_rolled_back(racing_save, "are in no disk backup file")
assert impl.arenas.dfa_preload_arena_owns(ctypes.c_void_p(late[0]))
intact("racing")
assert lib.cudaFree(ctypes.c_void_p(late[0])) == 0
# A segment freed and one of the same size placed at its address after the file was written (the
# file's ranges still match): the arena's generation shows it, rolled back the same way
def replace(addr):  # frees the disk segment at `addr` and places new ones in the arena until one lands there
    assert lib.cudaFree(ctypes.c_void_p(addr)) == 0
    others = []
    while len(others) < 64:
        p = ctypes.c_void_p()
        with impl._arena("tms.disk/d"):
            assert lib.cudaMalloc(ctypes.byref(p), HALF) == 0
        q = p.value
        if q == addr:
            break
        others.append(q)
    for o in others:
        assert lib.cudaFree(ctypes.c_void_p(o)) == 0
    assert q == addr, "the freed place was never taken again"
def replacing_save(t, groups):
    out = real_save(t, groups)
    replace(dsegs[3])
    ctypes.memset(dsegs[3], 0x30 + 3, HALF)  # its new owner's bytes (the old ones, for intact())
    return out
pause_rolled_back(replacing_save, "1 segment(s) were placed in 'tms.disk/d'")
intact("replaced")
# A pause whose rollback fails too (the discard arena's pause fails, then the file's load):
# the tag stays paused with its file, and resume reads it
import contextlib
real_load = impl.disk.load
def failing_load(*args):
    raise ms._dfa.IoError("injected: load")
@contextlib.contextmanager
def load_fails_and(pause):  # the file's load fails and the arenas' pause is `pause`, both restored after
    impl.disk.load, impl.arenas.dfa_preload_arena_pause = failing_load, pause
    try:
        yield
    finally:
        impl.disk.load, impl.arenas.dfa_preload_arena_pause = real_load, real_pause
with load_fails_and(failing_pause):
    raises(lambda: impl.pause("d"), ms._dfa.InvalidState, "dfa_preload_arena_pause")
assert "d" in impl.paused and impl._arena_figures("tms.disk/d")[4] == 1, impl.paused
assert len(spills()) == 1, "a failed rollback forgot the file"
impl.resume("d")
assert unpaused() and spills() == []
intact("failed rollback")
# A resume whose load fails and whose release after it fails too: the disk arena stays backed
# (undefined contents), the tag paused with its file; a segment placed there meanwhile is in no
# file (refused, nothing resumed); the next resume reads the file again
impl.pause("d")
def failing_release(name, keep, stream):
    for a in dsegs:
        ctypes.memset(a, 0xEE, HALF)  # backed, undefined contents
    return 2
with load_fails_and(failing_release):
    raises(lambda: impl.resume("d"), ms._dfa.IoError, "injected: load")
assert "d" in impl.paused and impl._arena_figures("tms.disk/d")[4] == 0 and len(spills()) == 1
assert impl._arena_figures("tms.discard/d")[4] == 1, "the discard kind resumed after the disk kind failed"
q = malloc_in("disk", "d")
raises(lambda: impl.resume("d"), ms._dfa.InvalidState, "1 segment(s) were placed in 'tms.disk/d'")
assert "d" in impl.paused and impl._arena_figures("tms.discard/d")[4] == 1 and len(spills()) == 1
raises(lambda: impl.resume("d"), ms._dfa.InvalidState, "are in no disk backup file")  # still there
assert lib.cudaFree(ctypes.c_void_p(q)) == 0
impl.resume("d")
assert unpaused() and spills() == []
intact("retried resume")
# The same with a segment freed and one of its size placed at its address (the file's ranges
# still match): refused once by the arena's generation, its new bytes untouched
impl.pause("d")
with load_fails_and(failing_release):
    raises(lambda: impl.resume("d"), ms._dfa.IoError, "injected: load")
replace(dsegs[3])
q = dsegs[3]
ctypes.memset(q, 0x77, HALF)
raises(lambda: impl.resume("d"), ms._dfa.InvalidState, "1 segment(s) were placed in 'tms.disk/d'")
assert "d" in impl.paused and ctypes.string_at(q, HALF) == b"\x77" * HALF, "the refused resume wrote the segment"
impl.resume("d")  # refused once: the caller was told
assert unpaused() and spills() == [] and impl.disk_gens == {}
intact("replaced while paused")
assert lib.cudaFree(p) == 0
snapshot.pop()
for a in dsegs:
    assert lib.cudaFree(ctypes.c_void_p(a)) == 0
    snapshot.remove((a, (1, 4), HALF))
assert impl._arena_segments("tms.disk/d") == []

# deferalloc.release & co. of a tensor in an arena: refused (its reservation is the arena's whole block)
import deferalloc
t = torch.frombuffer((ctypes.c_ubyte * MIB).from_address(segs["host"][3] + 4096), dtype=torch.uint8)
for call in (deferalloc.release, deferalloc.materialize, deferalloc.is_backed):
    try:
        call(t)
        raise AssertionError(f"{call.__name__} of a tensor in an arena went through")
    except deferalloc.InvalidArgument as e:
        assert "lies in a preload arena" in str(e), e
del t
for keep in ("host", "discard"):
    for a in segs[keep]:
        assert lib.cudaFree(ctypes.c_void_p(a)) == 0
    assert impl._arena_figures(impl._itag("t", keep))[:4] == [0, 0, 0, 0]
# An arena the library refuses to make current (it does not serve this device): the region raises
impl.arenas.dfa_preload_arena_push = lambda name: 2 if name else 0
try:
    with impl._arena(impl._itag("t", "host")):
        raise AssertionError("a region whose cudaMallocs nothing could pause started")
except ms._dfa.InvalidState as e:
    assert "does not serve this thread's cudaMalloc" in str(e), e
print("arenas ok")
"""


class PreloadArenas(unittest.TestCase):
    def test_pause_resume_of_a_tags_arenas(self):
        lib = ms.preload_library_path()
        if not os.path.exists(lib):
            self.skipTest(f"{lib} is not built")
        env = {k: v for k, v in os.environ.items() if k not in TMS_ENV}
        spill_dir = tempfile.mkdtemp(prefix="dfa-tms-arena-")
        self.addCleanup(shutil.rmtree, spill_dir, True)
        # pool_cache_mb:0: a released chunk goes back to the host driver, so a skipped load of
        # the disk arena's file shows (a cached chunk would come back with its old bytes)
        env.update(LD_PRELOAD=lib, DEFERALLOC_CONF="driver:host,host_granularity_kb:64,pool_cache_mb:0",
                   TMS_DISK_BACKUP_DIR=spill_dir,
                   TMS_DISK_BACKUP_CHUNK_MB="1")
        r = subprocess.run([sys.executable, "-c", ARENA_CHILD], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("arenas ok", r.stdout)


class PreloadCudaGraph(unittest.TestCase):
    """cuda_graph in hook_mode="preload", PyTorch's capture faked: the capture's pool is the
    tag's before the capture begins (PyTorch 2.11's CUDAGraph.pool() raises until a capture
    succeeded), so a capture that raises leaves its pool the tag's."""

    def test_capture_pool_known_before_the_capture(self):
        with clean_env(LD_PRELOAD="/b/libdeferalloc_preload.so"):
            impl = ms._Impl("preload")
        impl.arenas = None  # no arena entry points here: the bookkeeping only
        seen = []

        class Graph:  # as torch 2.11's CUDAGraph before a successful capture
            def pool(self):
                raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            seen.append((pool, set(impl.pool_ids.get(("g", "discard"), set()))))  # what the tag holds at capture_begin
            yield

        with mock.patch.object(torch.cuda, "is_available", lambda: True), \
                mock.patch.object(torch.cuda, "graph", graph):
            with impl.cuda_graph(Graph(), None, None, "global", "g", "discard"):
                pass
            pool, held = seen[-1]
            self.assertIsNotNone(pool, "the capture got no pool of ours: its id would be known only after it")
            self.assertEqual(held, {tuple(pool)}, "the pool is the tag's before the capture begins")
            with self.assertRaisesRegex(RuntimeError, "the capture fails"):
                with impl.cuda_graph(Graph(), None, None, "global", "g", "discard"):
                    raise RuntimeError("the capture fails")
            second = tuple(seen[-1][0])
            self.assertNotEqual(second, tuple(pool), "each capture without a pool gets a new one")
            self.assertEqual(impl.pool_ids[("g", "discard")], {tuple(pool), second})
            with impl.cuda_graph(Graph(), (5, 0), None, "global", "g", "discard"):  # a pool passed in: as given
                pass
            self.assertEqual(seen[-1][0], (5, 0))
        self.assertIn((5, 0), impl.pool_ids[("g", "discard")])
        self.assertIn(("g", "discard"), impl.outside)


class ConfigureSubprocess(unittest.TestCase):
    def test_ld_preload_set_and_restored(self):
        lib = ms.preload_library_path()
        self.assertEqual(os.path.basename(lib), "libdeferalloc_preload.so")
        with clean_env():
            with ms.configure_subprocess():
                self.assertEqual(os.environ["LD_PRELOAD"], lib)
            self.assertNotIn("LD_PRELOAD", os.environ)
        with clean_env(LD_PRELOAD="/x/libother.so"):
            with ms.configure_subprocess():
                self.assertEqual(os.environ["LD_PRELOAD"], f"{lib}:/x/libother.so")
                out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['LD_PRELOAD'])"],
                                     capture_output=True, text=True, env={**os.environ, "LD_PRELOAD": ""})
                self.assertEqual(out.returncode, 0)
            self.assertEqual(os.environ["LD_PRELOAD"], "/x/libother.so")


class OptIn(unittest.TestCase):
    CODE = ("import deferalloc.memory_saver as m{install}\n"
            "from torch_memory_saver import torch_memory_saver, TorchMemorySaver, configure_subprocess\n"
            "import torch_memory_saver as t\n"
            "assert torch_memory_saver is m.torch_memory_saver and TorchMemorySaver is m.TorchMemorySaver\n"
            "assert configure_subprocess is m.configure_subprocess and t is m\n"
            "torch_memory_saver.hook_mode = 'torch'\n"
            "with torch_memory_saver.region('w', enable_cpu_backup=True):\n"
            "    pass\n"
            "torch_memory_saver.pause('w'); torch_memory_saver.resume('w')\n"
            "print('drop-in ok')\n")

    def run_code(self, code, pythonpath):
        env = {k: v for k, v in os.environ.items() if k not in TMS_ENV}
        env["PYTHONPATH"] = pythonpath
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)

    def test_install_as_torch_memory_saver(self):
        r = self.run_code(self.CODE.format(install="; m.install_as_torch_memory_saver()"), os.environ["PYTHONPATH"])
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn("drop-in ok", r.stdout)

    def test_shim_on_pythonpath(self):
        r = self.run_code(self.CODE.format(install=""), ms.shim_path() + os.pathsep + os.environ["PYTHONPATH"])
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn("drop-in ok", r.stdout)

    def test_install_refused_over_the_real_package(self):
        real = types.ModuleType("torch_memory_saver")
        real.__file__ = "/site/torch_memory_saver/__init__.py"
        with mock.patch.dict(sys.modules, {"torch_memory_saver": real}):
            with self.assertRaisesRegex(RuntimeError, "torch_memory_saver is imported already "
                                                      r"\(/site/torch_memory_saver/__init__\.py\)"):
                ms.install_as_torch_memory_saver()
        with mock.patch.dict(sys.modules):
            sys.modules.pop("torch_memory_saver", None)
            self.assertIs(ms.install_as_torch_memory_saver(), ms)
            self.assertIs(ms.install_as_torch_memory_saver(), ms)  # twice is fine
            import torch_memory_saver
            self.assertIs(torch_memory_saver.torch_memory_saver, ms.torch_memory_saver)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from unittest_main import run_tests
    run_tests()
