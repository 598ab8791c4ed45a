"""A small real training loop, printed loss by loss in hex, under one allocator mode.

    python train.py MODE [STEPS]     MODE: native | mempool | replace | preload

native: PyTorch's own caching allocator.  mempool: the loop runs inside
torch.cuda.use_mem_pool(deferalloc.mem_pool()) (PyTorch's allocator on top, segments from
deferalloc).  replace: deferalloc.install() (full replacement).  preload: native code, run
under LD_PRELOAD=libdeferalloc_preload.so (the caller sets it).  The loop is the one in
trainer.cpp, op for op: an MLP with weights drawn on the CPU from seed 0, AdamW written
out as tensor ops (so C++ and Python run the same kernels), deterministic algorithms.
Exit 77 without a GPU.
"""
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

D_IN, D_HID, D_OUT, BATCH = 256, 512, 64, 128
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 1e-2


def train(steps: int):
    g = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    w1 = (torch.randn(D_HID, D_IN, generator=g) * 0.05).to(dev).requires_grad_()
    b1 = torch.zeros(D_HID).to(dev).requires_grad_()
    w2 = (torch.randn(D_OUT, D_HID, generator=g) * 0.05).to(dev).requires_grad_()
    b2 = torch.zeros(D_OUT).to(dev).requires_grad_()
    params = [w1, b1, w2, b2]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    x = torch.randn(steps, BATCH, D_IN, generator=g).to(dev)
    y = torch.randn(steps, BATCH, D_OUT, generator=g).to(dev)
    losses = []
    for step in range(1, steps + 1):
        h = torch.relu(torch.nn.functional.linear(x[step - 1], w1, b1))
        out = torch.nn.functional.linear(h, w2, b2)
        loss = torch.nn.functional.mse_loss(out, y[step - 1])
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            c1 = 1.0 - B1 ** step
            c2 = 1.0 - B2 ** step
            for p, mi, vi in zip(params, m, v):
                mi.mul_(B1).add_(p.grad, alpha=1.0 - B1)
                vi.mul_(B2).addcmul_(p.grad, p.grad, value=1.0 - B2)
                p.mul_(1.0 - LR * WD)
                denom = (vi / c2).sqrt_().add_(EPS)
                p.addcdiv_(mi / c1, denom, value=-LR)
        losses.append(loss.item())
    return losses, w1


def main():
    mode = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    if not torch.cuda.is_available():
        print("SKIPPED: no GPU")
        sys.exit(77)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import deferalloc as dfa
    if mode == "replace":
        dfa.install()
    if mode == "mempool":
        pool = dfa.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            losses, w = train(steps)
    else:
        losses, w = train(steps)
    # Prove the memory came from where the mode says.
    # dfa_find names only reservations of dfa_reserve; a block of deferalloc's caching
    # allocator (MemPool, full replacement) is refused with a message that says so.
    ours = True
    try:
        dfa._reservation(w)
    except dfa.DeferallocError as e:
        ours = "caching allocator" in str(e)
    if (mode != "native") != ours:
        print(f"FAIL: mode {mode}: the weights' memory {'is' if ours else 'is not'} a deferalloc reservation")
        sys.exit(1)
    for loss in losses:
        print(float(loss).hex())


if __name__ == "__main__":
    main()
