"""GPU acceptance of StreamedAdamW as a torch optimizer, on a transformers Llama.

  (1) DCP round trip: get_state_dict + dcp.save after 4 steps, 3 more steps; a fresh model
      and optimizer dcp.load + set_state_dict and take the same 3 steps: weights and state
      bit-identical, on the host, file and device tiers (BF16 model).
  (2) FSDP2 (fully_shard, NCCL, world size 1): 4 steps with clip_grad_norm_ against
      torch.optim.AdamW(fused=True) on FP32 master copies of the local shards given the same
      gradients: main params, moments and BF16 weights bit-identical; then a DCP round trip
      of the FSDP2 model (as in (1)).
  (3) GradScaler with FP16 parameters: StreamedAdamW under torch.amp.GradScaler against
      torch.optim.AdamW(fused=True) on FP32 master copies under a second GradScaler of the
      same settings, given the same scaled FP16 gradients (one step with an inf): bit-identical.
  (4) Frozen parameters (the embeddings): stats() counts state for the trainable
      parameters only, and no state entry exists for the frozen ones.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 DEFERALLOC_LIB=build/allocator/libdeferalloc.so \\
    DEFERALLOC_OPTIMIZER_LIB=build/optimizer/libdeferalloc_optimizer.so PYTHONPATH=python \\
      python tests/torch/test_optim_torch_api_gpu.py

Exit 0 when every check passes, 1 when one fails, 77 without a GPU or transformers (the
reason printed).  Under a minute on an H200.  --device cpu runs the same on the host driver
as a smoke test; there the torch references round otherwise (CPU kernels), so their rows
are informational.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
DEV = torch.device("cuda")
FAILED: list[str] = []
STRICT_REFERENCE = True  # False on the CPU: torch's CPU AdamW rounds otherwise than the engine
VOCAB, SEQ = 1024, 64


def check(what: str, ok: bool, reference: bool = False) -> None:
    informational = reference and not STRICT_REFERENCE
    print(f"  {what}: {'PASS' if ok else 'FAIL'}{' (informational on the CPU)' if informational else ''}", flush=True)
    if not ok and not informational:
        FAILED.append(what)


def llama(dtype: torch.dtype, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).to(DEV, dtype)


def loss_of(model, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + t)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g).to(DEV)
    return model(ids, labels=ids).loss


def streamed(model, tier: str = "host", directory: str | None = None, **kw):
    from deferalloc.optim import StreamedAdamW
    return StreamedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, window_mb=16, tier=tier,
                         directory=directory, **kw)


def train(model, opt, first: int, steps: int, clip: float | None = None) -> None:
    for t in range(first, first + steps):
        loss_of(model, t).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def same_state(a, b, pa, pb) -> bool:
    return all(torch.equal(local(a.state[p][k]).cpu(), local(b.state[q][k]).cpu())
               for p, q in zip(pa, pb) for k in ("step", "exp_avg", "exp_avg_sq", "main_param"))


def dcp_resume(build, tier: str, tmp: str, label: str) -> None:
    """(1): build(seed, directory) -> (model, opt)."""
    a_dir, b_dir = os.path.join(tmp, f"{label}-a"), os.path.join(tmp, f"{label}-b")
    os.makedirs(a_dir)
    os.makedirs(b_dir)
    model, opt = build(0, a_dir)
    train(model, opt, 0, 4)
    msd, osd = get_state_dict(model, opt)
    ck = os.path.join(tmp, f"{label}-ck")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
    train(model, opt, 4, 3)
    fresh, fopt = build(1, b_dir)
    msd, osd = get_state_dict(fresh, fopt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ck)
    set_state_dict(fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    train(fresh, fopt, 4, 3)
    pa, pb = list(model.parameters()), list(fresh.parameters())
    check(f"{label}: weights after a DCP resume", all(torch.equal(local(p), local(q)) for p, q in zip(pa, pb)))
    check(f"{label}: optimizer state after a DCP resume", same_state(opt, fopt, pa, pb))


def master_reference(params):
    """torch.optim.AdamW(fused=True) on FP32 master copies of ``params`` (local shards)."""
    masters = [torch.nn.Parameter(local(p).detach().float().clone()) for p in params]
    fused = DEV.type == "cuda"
    return masters, torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, fused=fused)


def compare_to_masters(what: str, opt, params, masters, ref) -> None:
    main = all(torch.equal(local(opt.state[p]["main_param"]).cpu(), m.detach().cpu()) for p, m in zip(params, masters))
    moments = all(torch.equal(local(opt.state[p][k]).cpu(), ref_state.cpu())
                  for p, m in zip(params, masters) for k, ref_state in
                  (("exp_avg", ref.state[m]["exp_avg"]), ("exp_avg_sq", ref.state[m]["exp_avg_sq"])))
    weights = all(torch.equal(local(p).detach(), m.detach().to(p.dtype)) for p, m in zip(params, masters))
    check(f"{what}: main params = the fused reference's FP32 masters", main, reference=True)
    check(f"{what}: moments = the reference's", moments, reference=True)
    check(f"{what}: weights = dtype(master)", weights, reference=True)


def fsdp2_world_size_1(tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if DEV.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        def build(seed, directory=None):
            model = llama(torch.bfloat16, seed)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            return model, streamed(model)

        model, opt = build(0)
        params = list(model.parameters())
        masters, ref = master_reference(params)
        for t in range(4):
            loss_of(model, t).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for p, m in zip(params, masters):
                m.grad = local(p.grad).float()
            ref.step()
            opt.step()
            opt.zero_grad()
        check("FSDP2 ws1: state is DTensor with the params' placements",
              all(type(opt.state[p]["exp_avg"]).__name__ == "DTensor" and
                  opt.state[p]["exp_avg"].placements == p.placements for p in params))
        compare_to_masters("FSDP2 ws1", opt, params, masters, ref)
        dcp_resume(build, "host", tmp, "FSDP2 ws1")
    finally:
        dist.destroy_process_group()


def grad_scaler_fp16() -> None:
    model = llama(torch.float16, 0)
    opt = streamed(model)
    params = list(model.parameters())
    masters, ref = master_reference(params)
    dev = DEV.type
    sa, sb = torch.amp.GradScaler(dev, init_scale=2.0 ** 12), torch.amp.GradScaler(dev, init_scale=2.0 ** 12)
    sb.scale(torch.ones((), device=DEV))  # creates sb's scale tensor, as scale(loss) would
    for t in range(5):
        sa.scale(loss_of(model, t)).backward()
        if t == 2:
            params[0].grad.view(-1)[0] = float("inf")  # this step is skipped by both
        for p, m in zip(params, masters):
            m.grad = p.grad.float()  # the same scaled gradients
        sb.step(ref)
        sb.update()
        sa.step(opt)
        sa.update()
        opt.zero_grad()
    check("GradScaler FP16: the scales agree", sa.get_scale() == sb.get_scale())
    check("GradScaler FP16: the skipped step left step counts at 4",
          all(float(opt.state[p]["step"]) == 4.0 for p in params))
    compare_to_masters("GradScaler FP16", opt, params, masters, ref)


def frozen_stats() -> None:
    model = llama(torch.bfloat16, 0)
    model.model.embed_tokens.weight.requires_grad_(False)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight.requires_grad_(False)
    opt = streamed(model)
    train(model, opt, 0, 2)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    s = opt.stats()
    print(f"  frozen: {frozen} frozen and {trainable} trainable elements; stats state_params {s['state_params']}, "
          f"state_bytes {s['state_bytes']}, params stepped {s['params']}")
    check("frozen: state for the trainable parameters only (stats)",
          s["state_params"] == trainable and s["state_bytes"] == 12 * trainable and s["params"] == trainable)
    check("frozen: no state entry for a frozen parameter",
          all(p not in opt.state for p in model.parameters() if not p.requires_grad))


def main() -> int:
    global DEV, STRICT_REFERENCE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    DEV = torch.device(args.device)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("test_optim_torch_api_gpu: skipped: no CUDA device")
        return 77
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("test_optim_torch_api_gpu: skipped: transformers is not installed")
        return 77
    if DEV.type == "cpu":
        STRICT_REFERENCE = False
        os.environ.setdefault("DEFERALLOC_CONF", "driver:host")
    else:
        torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        for tier in ("host", "file", "device"):
            print(f"(1) DCP round trip, {tier} tier", flush=True)
            dcp_resume(lambda seed, d, tier=tier: (lambda m: (m, streamed(m, tier, d)))(llama(torch.bfloat16, seed)),
                       tier, tmp, f"DCP {tier}")
        print("(2) FSDP2 at world size 1", flush=True)
        fsdp2_world_size_1(tmp)
    print("(3) GradScaler, FP16 parameters", flush=True)
    grad_scaler_fp16()
    print("(4) frozen parameters", flush=True)
    frozen_stats()
    print(f"test_optim_torch_api_gpu: {'FAILED: ' + '; '.join(FAILED) if FAILED else 'every check passed'}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
