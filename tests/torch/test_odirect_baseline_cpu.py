"""The synchronous O_DIRECT baseline of benchmarks/optimizer/bench_file_tier.py
(benchmarks/optimizer/odirect_baseline.py, Note [The synchronous O_DIRECT baseline]) equals
torch's AdamW on the CPU: FP32 parameters against torch.optim.AdamW(fused=True) bit for bit
(the same kernel) and against the default AdamW within rounding; BF16 parameters against
fused AdamW on FP32 copies, rounded.  Parameters span buckets (a tiny staging buffer), one is
left without a gradient.  The file lives in a real directory (the build tree's) where one is
writable, so that O_DIRECT is used where the file system has it; on tmpfs (/dev/shm) it falls
back to buffered I/O with a reason, and gives the same results.  Megatron's way too: BF16
parameters whose FP32 gradient is their ``main_grad``.  No GPU, no deferalloc build.
With --device cuda (ctest test_odirect_baseline_gpu, label gpu; exit status 77 without a GPU)
the same tests run on CUDA tensors: pinned staging, the fused CUDA kernel on both sides.
"""
import argparse
import errno
import os
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "optimizer"))
from odirect_baseline import ALIGN, ODirectAdamW  # noqa: E402

DEVICE = torch.device("cpu")  # --device
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(3000,), (37, 111), (5,), (2048, 3)]  # spans buckets of 5120 elements
STEPS = 4


def params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(DEVICE, dtype)) for s in SHAPES]


def grads(step, skip=None):
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(s, generator=g) * 10 ** torch.empty(s).uniform_(-4, 0, generator=g) for s in SHAPES]
    if skip is not None:
        out[skip] = None
    return out


def run_baseline(directory, dtype, staging=64 << 10, skip_at=None, megatron=False):
    ps = params(dtype)
    if megatron:  # Megatron's DDP gives every parameter its main_grad before the optimizer is built
        for p in ps:
            p.main_grad = None
    opt = ODirectAdamW(ps, os.path.join(directory, "state.bin"), staging_bytes=staging,
                       grad_attr="main_grad" if megatron else "grad", **HP)
    for t in range(STEPS):
        for p, gr in zip(ps, grads(t, 1 if t == skip_at else None)):
            if megatron:
                p.main_grad = None if gr is None else gr.to(DEVICE)  # FP32, as Megatron's grad buffer
            else:
                p.grad = None if gr is None else gr.to(DEVICE, dtype)
        opt.step()
    state = opt.read_state()
    info = dict(direct=opt.direct, reason=opt.reason, buckets=len(opt.buckets), file_bytes=opt.file_bytes)
    opt.close()
    return ps, state, info


def run_torch(dtype, skip_at=None, fused=True, megatron=False):
    """torch's AdamW on FP32 copies of the parameters (the main params), the gradients in FP32
    (``megatron``: FP32 from the start, not rounded to the parameters' dtype)."""
    mains = [torch.nn.Parameter(p.detach().float()) for p in params(dtype)]
    opt = torch.optim.AdamW(mains, fused=fused, **HP)
    for t in range(STEPS):
        for p, gr in zip(mains, grads(t, 1 if t == skip_at else None)):
            p.grad = None if gr is None else gr.to(DEVICE, torch.float32 if megatron else dtype).float()
        opt.step()
    return mains, opt


def real_directory():
    """A writable directory on a disk file system (the build tree, else the temp directory)."""
    for d in (os.environ.get("DFA_TEST_DIR"), os.getcwd(), tempfile.gettempdir()):
        if d and os.access(d, os.W_OK):
            return d
    return None


class ODirectBaseline(unittest.TestCase):
    def check(self, directory, dtype, skip_at=None, megatron=False):
        with tempfile.TemporaryDirectory(dir=directory, prefix="dfa-odirect-") as d:
            ps, state, info = run_baseline(d, dtype, skip_at=skip_at, megatron=megatron)
        print(f"  {dtype} in {directory}: direct I/O {info['direct']}"
              f"{'' if info['reason'] is None else ' (' + info['reason'] + ')'}, {info['buckets']} buckets, "
              f"{info['file_bytes']} bytes", flush=True)
        self.assertGreater(info["buckets"], 2, "the parameters span several buckets")
        self.assertEqual(info["file_bytes"] % ALIGN, 0)
        mains, ref = run_torch(dtype, skip_at=skip_at, megatron=megatron)
        for p, s, m in zip(ps, state, mains):
            rs = ref.state[m]
            self.assertTrue(torch.equal(s["main_param"], m.detach().cpu()), "main params == torch fused AdamW")
            self.assertTrue(torch.equal(s["exp_avg"], rs["exp_avg"].cpu()), "exp_avg == torch fused AdamW")
            self.assertTrue(torch.equal(s["exp_avg_sq"], rs["exp_avg_sq"].cpu()), "exp_avg_sq == torch fused AdamW")
            self.assertTrue(torch.equal(p.detach(), m.detach().to(dtype)), "the parameter is its main, rounded")
        plain, _ = run_torch(dtype, skip_at=skip_at, fused=False, megatron=megatron)
        for s, m in zip(state, plain):
            torch.testing.assert_close(s["main_param"], m.detach().cpu(), rtol=1e-6, atol=1e-7)
        return info

    def test_fp32_params(self):
        self.check(real_directory(), torch.float32)

    def test_bf16_params(self):
        self.check(real_directory(), torch.bfloat16)

    def test_param_without_grad(self):
        # A parameter without a gradient keeps its state that step (torch skips it too).
        self.check(real_directory(), torch.float32, skip_at=2)

    def test_megatron_main_grad(self):
        # BF16 parameters, FP32 gradients in main_grad (train_gpt.py --odirect-baseline).
        self.check(real_directory(), torch.bfloat16, skip_at=2, megatron=True)

    def test_missing_grad_attr_is_refused(self):
        # A parameter without the attribute is a wiring mistake (the optimizer built before DDP),
        # not a parameter without a gradient: refused at construction, naming the fix.
        with tempfile.TemporaryDirectory() as d, self.assertRaisesRegex(ValueError, "after Megatron's DDP"):
            ODirectAdamW(params(torch.float32), os.path.join(d, "state.bin"), grad_attr="main_grad", **HP)

    def test_tmpfs(self):
        # tmpfs takes O_DIRECT on newer kernels, refuses it on older ones: either way the same results.
        if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
            self.skipTest("no writable /dev/shm (tmpfs) here")
        info = self.check("/dev/shm", torch.float32)
        if not info["direct"]:
            self.assertIn("buffered I/O instead", info["reason"])

    def test_buffered_fallback(self):
        # A file system that refuses O_DIRECT at open (EINVAL, as tmpfs before Linux 6.6).
        real_open = os.open

        def no_direct(path, flags, *a, **kw):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *a, **kw)
        os.open = no_direct
        try:
            info = self.check(real_directory(), torch.float32)
        finally:
            os.open = real_open
        self.assertFalse(info["direct"])
        self.assertIn("O_DIRECT refused", info["reason"])

    def test_staging_holds_a_bucket(self):
        with tempfile.TemporaryDirectory() as d, self.assertRaises(ValueError):
            ODirectAdamW(params(torch.float32), os.path.join(d, "s"), staging_bytes=4096)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args, rest = ap.parse_known_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: --device cuda without a GPU")
        sys.exit(77)
    DEVICE = torch.device(args.device)
    unittest.main(verbosity=2, argv=sys.argv[:1] + rest)
