"""Diagnosis on a GPU: StreamedAdamW (device tier) against torch's fused AdamW, one tensor,
identical inputs, element by element, for a few steps; with and without weight decay, FP32
and BF16 parameters.  Prints the count of differing elements per step and the largest
difference in float ulps, so that a difference of formula (many elements, many ulps) is
told from a difference of rounding (few elements, 1 ulp).

    DEFERALLOC_CONF=driver:cuda PYTHONPATH=python python3 tests/torch/diag_fused_adamw.py
Exit 77 without a GPU.
"""
import sys

import torch


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.float().view(torch.int32).long()
    ib = b.float().view(torch.int32).long()
    return int((ia - ib).abs().max().item()) if a.numel() else 0


def run(dtype, wd: float, steps: int = 8, n: int = 1 << 20, betas=(0.9, 0.999)) -> None:
    from deferalloc.optim import StreamedAdamW
    g = torch.Generator(device="cuda").manual_seed(1)
    init = torch.randn(n, device="cuda", generator=g).to(dtype)
    grads = [torch.randn(n, device="cuda", generator=g).to(dtype) for _ in range(steps)]
    ours = torch.nn.Parameter(init.clone())
    opt = StreamedAdamW([ours], lr=1e-3, betas=betas, eps=1e-8, weight_decay=wd, tier="device")
    # The reference: FP32 main param and moments, torch's fused kernel, then the cast.
    ref = torch.nn.Parameter(init.float().clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, betas=betas, eps=1e-8, weight_decay=wd, fused=True)
    for t in range(steps):
        ours.grad = grads[t].clone()
        ref.grad = grads[t].float().clone()
        opt.step()
        ref_opt.step()
        torch.cuda.synchronize()
        sd = opt.state_dict()["state"][0]
        main = sd.get("main_param", sd.get("main"))
        rs = ref_opt.state[ref]
        row = [f"{str(dtype):15s} wd={wd:<5} b2={betas[1]:<5} step {t + 1}:"]
        for name, a, b in (("exp_avg", sd["exp_avg"], rs["exp_avg"]), ("exp_avg_sq", sd["exp_avg_sq"], rs["exp_avg_sq"]),
                           ("main", main, ref.detach())):
            a = a.to("cuda").float().flatten()
            b = b.float().flatten()
            row.append(f"{name} {int((a != b).sum())} differ (max {ulps(a, b)} ulp)")
        row.append(f"param {int((ours.detach().float() != ref.detach().to(dtype).float()).sum())} differ")
        print("  ".join(row), flush=True)


def powf_check(steps: int = 40) -> None:
    """Device powf (torch's float pow kernel, as the fused AdamW's bias corrections) against
    the host's (glibc powf, what make_scalars uses) for the betas of the tests."""
    import ctypes
    libm = ctypes.CDLL("libm.so.6")
    libm.powf.restype, libm.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    for beta in (0.9, 0.95, 0.999):
        b = torch.tensor(beta, dtype=torch.float32)
        ts = torch.arange(1, steps + 1, dtype=torch.float32)
        dev = (b.cuda() ** ts.cuda()).cpu()
        host = torch.tensor([libm.powf(float(b), float(t)) for t in ts], dtype=torch.float32)
        bad = [int(t) for t, x, y in zip(ts, dev, host) if x != y]
        print(f"powf({beta}f, t), t = 1..{steps}: device != host at t = {bad or 'none'}", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIPPED: needs a GPU")
        return 77
    powf_check()
    for dtype in (torch.float32, torch.bfloat16):
        for wd in (0.0, 0.1):
            for betas in ((0.9, 0.999), (0.9, 0.95)):  # 0.95: the device powf differs at t = 6
                try:
                    run(dtype, wd, betas=betas)
                except Exception as e:  # a diagnosis: report and go on
                    print(f"{dtype} wd={wd} betas={betas}: {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
