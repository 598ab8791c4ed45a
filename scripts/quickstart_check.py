"""The README's quick start as a user runs it, with the deferalloc the interpreter imports
(scripts/no_toolkit_check.sh, scripts/wheel_check.sh):
  python quickstart_check.py [--no-kernels]
a deferred tensor released to the host and restored; a StreamedAdamW step (on a GPU: the CUDA
kernels; with --no-kernels, a build without the CUDA toolkit: the optimizer must refuse the
GPU naming the cause); on a GPU also a region paused and resumed with its contents.  Prints
one line saying what ran, where.
"""
import sys

import torch

import deferalloc
from deferalloc.optim import StreamedAdamW

no_kernels = "--no-kernels" in sys.argv[1:]
gpu = torch.cuda.is_available()
dev = "cuda" if deferalloc.driver_name() == "cuda" else "cpu"
if gpu and dev != "cuda":
    raise SystemExit(f"quickstart_check: a GPU is present but the library chose the {dev} driver")
t = deferalloc.deferred_empty((1 << 20,), torch.float32, dev)
deferalloc.materialize(t, "zero")
t += 1
deferalloc.release(t, keep="host")
deferalloc.materialize(t, "restore")
assert t.sum().item() == t.numel()
ran = ["deferred tensor"]

m = torch.nn.Linear(256, 256).to(dev, torch.bfloat16)
if dev == "cuda" and no_kernels:
    try:
        StreamedAdamW(m.parameters(), lr=1e-3, window_mb=16)
        raise SystemExit("quickstart_check: a CUDA optimizer without kernels did not fail")
    except deferalloc.NoDevice as e:
        assert "without its CUDA kernels" in str(e), e
    ran.append("StreamedAdamW refused the GPU (no kernels)")
else:
    opt = StreamedAdamW(m.parameters(), lr=1e-3, tier="host", window_mb=16)
    m(torch.randn(8, 256, device=dev, dtype=torch.bfloat16)).float().square().mean().backward()
    before = m.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, m.weight), "the step changed nothing"
    ran.append("StreamedAdamW step")
if dev == "cuda":
    with deferalloc.region("rollout", keep="host"):
        kv = torch.full((1 << 24,), 7.0, device="cuda")
    deferalloc.pause("rollout")
    deferalloc.resume("rollout")
    assert kv.eq(7.0).all()
    ran.append("region pause/resume")
where = torch.cuda.get_device_name(0) if dev == "cuda" else "the CPU (host driver)"
print(f"quickstart_check: ok on {where}: {', '.join(ran)} (library {deferalloc.library_path()})")
