"""Plain PyTorch, no deferalloc import: a few AdamW steps of a small MLP on the GPU.

    LD_PRELOAD=$(python -c 'import deferalloc, os; print(os.path.dirname(deferalloc.__file__))')/lib/libdeferalloc_preload.so python examples/python/preload_train.py

(The library inside the pip-installed package; from a source build,
``build/allocator/libdeferalloc_preload.so``.)

The "no code change" example of docs/PYTORCH.md (LD_PRELOAD): under LD_PRELOAD, PyTorch's native caching allocator
takes its segments (cudaMalloc) from deferalloc.  The script checks that the preload library
is mapped into the process (exit 1 otherwise, so the example cannot pass without it),
trains, frees everything and calls torch.cuda.empty_cache(), which gives the segments back.
"""
import os
import sys

import torch


def main() -> int:
    with open("/proc/self/maps") as f:
        if "libdeferalloc_preload" not in f.read():
            print("preload_train: libdeferalloc_preload.so is not loaded (LD_PRELOAD=...)")
            return 1
    if not torch.cuda.is_available():
        print("preload_train: needs a GPU")
        return 77
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 1024, device="cuda"), torch.randn(256, 1024, device="cuda")
    losses = []
    for _ in range(10):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    reserved = torch.cuda.memory_reserved()
    del model, opt, x, y, loss
    torch.cuda.empty_cache()
    print(f"preload_train: loss {losses[0]:.4f} -> {losses[-1]:.4f}; {reserved >> 20} MiB of segments from "
          f"{os.path.basename(os.environ.get('LD_PRELOAD', '?'))}, {torch.cuda.memory_reserved() >> 20} MiB after empty_cache")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
