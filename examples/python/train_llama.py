"""Train a small Llama with deferalloc.optim.StreamedAdamW: its FP32 main params and Adam
moments live in pinned host memory (--tier host), a file (--tier file) or HBM (--tier
device), streamed through a fixed window each step.

The model is built from a config (random init, BF16, nothing downloaded): transformers'
LlamaForCausalLM when transformers is installed, else a compact Llama written here (RMSNorm,
rotary attention, SwiGLU MLP; same structure, fewer options).  Two parameter groups (weight
decay on matrices only) and a warm-up + cosine LR schedule, as a real recipe.

    # GPU
    python examples/python/train_llama.py --tier host --steps 50
    # CPU, host driver (no GPU needed), a tiny model
    DEFERALLOC_CONF=driver:host python examples/python/train_llama.py --cpu --tiny --steps 5

(With ``pip install .``; from a source build, prefix ``PYTHONPATH=python
DEFERALLOC_LIB=build/allocator/libdeferalloc.so``.)

--tier reference steps FP32 main params and moments kept resident with torch._fused_adamw_
(the baseline StreamedAdamW matches bit for bit on the GPU).
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {  # hidden, intermediate, layers, heads, vocab, sequence
    "tiny": (64, 172, 2, 4, 256, 32),
    "small": (512, 1376, 4, 8, 4096, 256),
}


# ---- the model -------------------------------------------------------------------------------

class _RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotary(x, cos, sin):
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class _Block(nn.Module):
    def __init__(self, d, ff, heads):
        super().__init__()
        self.heads = heads
        self.input_layernorm = _RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.post_attention_layernorm = _RMSNorm(d)
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
        o = (att.float().softmax(-1).to(q.dtype) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.o_proj(o)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class MiniLlama(nn.Module):
    """A Llama in plain PyTorch, for machines without transformers."""

    def __init__(self, d, ff, layers, heads, vocab, seq):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d, ff, heads) for _ in range(layers))
        self.norm = _RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids, labels):
        s = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1).to(x.dtype)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_model(size: str, device: torch.device, seed: int = 0) -> tuple[nn.Module, str]:
    """(model in BF16 on device, "transformers" or "mini")."""
    d, ff, layers, heads, vocab, seq = SIZES[size]
    torch.manual_seed(seed)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return MiniLlama(d, ff, layers, heads, vocab, seq).to(device, torch.bfloat16), "mini"
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg).to(device, torch.bfloat16), "transformers"


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, MiniLlama):
        return model(ids, ids)
    return model(input_ids=ids, labels=ids).loss


def batches(size: str, steps: int, batch: int, device: torch.device, seed: int = 1) -> list[torch.Tensor]:
    vocab, seq = SIZES[size][4], SIZES[size][5]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(steps)]


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def schedule(warmup: int, total: int):
    return lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))


# ---- the reference: resident FP32 state stepped by torch._fused_adamw_ ---------------------------

class ResidentFusedAdamW(torch.optim.Optimizer):
    """FP32 main params and moments in memory beside the model, stepped by torch._fused_adamw_
    per group; the BF16 params are written from the main params (round to nearest even)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p] = {"main": p.detach().float().clone(), "exp_avg": torch.zeros(p.shape, device=p.device),
                                 "exp_avg_sq": torch.zeros(p.shape, device=p.device),
                                 "step": torch.zeros((), device=p.device)}

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            if not ps:
                continue
            st = [self.state[p] for p in ps]
            for s in st:
                s["step"] += 1
            torch._fused_adamw_([s["main"] for s in st], [p.grad.float() for p in ps], [s["exp_avg"] for s in st],
                                [s["exp_avg_sq"] for s in st], [], [s["step"] for s in st], lr=float(g["lr"]),
                                beta1=g["betas"][0], beta2=g["betas"][1], weight_decay=g["weight_decay"],
                                eps=g["eps"], amsgrad=False, maximize=False)
            for p, s in zip(ps, st):
                p.copy_(s["main"])


def make_optimizer(kind: str, model: nn.Module, lr: float, window_mb: int = 512, directory: str | None = None):
    groups = param_groups(model)
    if kind == "reference":
        return ResidentFusedAdamW(groups, lr=lr, betas=(0.9, 0.95))
    from deferalloc.optim import StreamedAdamW
    return StreamedAdamW(groups, lr=lr, betas=(0.9, 0.95), tier=kind, directory=directory, window_mb=window_mb)


def train(kind: str, size: str, steps: int, device: torch.device, lr: float = 1e-3, batch: int = 4,
          window_mb: int = 512, directory: str | None = None, log=None) -> tuple[list[float], torch.optim.Optimizer]:
    model, _ = build_model(size, device)
    opt = make_optimizer(kind, model, lr, window_mb, directory)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(max(1, steps // 10), steps))
    losses = []
    for t, ids in enumerate(batches(size, steps, batch, device)):
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log:
            log(t, losses[-1], opt)
    return losses, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", default="host", choices=["device", "host", "file", "reference"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a 0.1 M-parameter model (CPU runs)")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors (set DEFERALLOC_CONF=driver:host)")
    ap.add_argument("--window-mb", type=int, default=512)
    ap.add_argument("--directory", default=None, help="file tier: where the state file goes (default: a temp dir)")
    ap.add_argument("--lr", type=float, default=1e-3)
    a = ap.parse_args()
    device = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")
    size = "tiny" if a.tiny else "small"
    _, flavour = build_model(size, torch.device("cpu"))
    print(f"model: {flavour} Llama ({size}), BF16 on {device}; optimizer tier: {a.tier}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        def log(t, loss, opt):
            extra = ""
            if hasattr(opt, "stats"):
                s = opt.stats()
                extra = f"  step {s['seconds'] * 1e3:7.2f} ms  state HBM peak {s['peak_backed_bytes'] >> 20} MiB"
            print(f"step {t:4d}  loss {loss:.6f}{extra}")
        train(a.tier, size, a.steps, device, a.lr, window_mb=a.window_mb,
              directory=a.directory or (tmp if a.tier == "file" else None), log=log)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
