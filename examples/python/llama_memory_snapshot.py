"""A memory snapshot of a Llama training step under deferalloc.install(), for PyTorch's viewer.

    python examples/python/llama_memory_snapshot.py --out /tmp/deferalloc-memory --size small --steps 2

Replaces PyTorch's CUDA allocator by deferalloc's (install), records the allocator's events
(deferalloc.record_memory_history), trains a transformers Llama (BF16 weights, the
StreamedAdamW optimizer with its state on the host tier) for a few steps, and writes into
--out: snapshot.pickle (for https://pytorch.org/memory_viz), segment_plot.html and
trace_plot.html (torch.cuda._memory_viz), and memory.png (a picture of the same data drawn
with matplotlib: memory over the trace and the segments with their blocks).  Prints one line
per file and a summary.  Needs a GPU (exit 77 without one); --device cpu --size tiny runs the
same on the host driver (DEFERALLOC_CONF=driver:host) for a smoke test.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys

import torch

import deferalloc as dfa

SIZES = {  # hidden, ffn, layers, heads, vocab, seq, batch
    "tiny": (128, 344, 2, 4, 1024, 64, 2),
    "small": (1024, 2816, 8, 16, 32000, 1024, 4),
}


def build(size: str, device: torch.device):
    d, ff, layers, heads, vocab, seq, batch = SIZES[size]
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                      tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).to(device, torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def draw_png(snap: dict, path: str) -> None:
    """Allocated and backed bytes over the recorded events, and the segments with their blocks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trace = snap["device_traces"][0] if snap["device_traces"] else []
    own = [s for s in snap["segments"] if s["segment_type"] != "deferred"]
    alloc_now = sum(b["size"] for s in own for b in s["blocks"] if b["state"] != "inactive")
    backed_now = sum(s["total_size"] for s in own)
    d_alloc = {"alloc": 1, "free_completed": -1}
    d_backed = {"segment_map": 1, "segment_unmap": -1}
    alloc, backed = [alloc_now], [backed_now]
    for e in reversed(trace):  # backwards from the snapshot's totals
        alloc.append(alloc[-1] - d_alloc.get(e["action"], 0) * e["size"])
        backed.append(backed[-1] - d_backed.get(e["action"], 0) * e["size"])
    alloc.reverse()
    backed.reverse()
    gib = float(1 << 30)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 8), gridspec_kw={"height_ratios": [1, 1.3]})
    top.plot([a / gib for a in alloc], label="allocated (blocks)")
    top.plot([b / gib for b in backed], label="backed (physical memory of deferalloc's segments)")
    top.set_xlabel("recorded allocator event")
    top.set_ylabel("GiB")
    top.set_title("deferalloc under install(): a Llama training step")
    top.legend(loc="upper left")
    rows = sorted(snap["segments"], key=lambda s: -s["total_size"])[:40]
    colors = {"active_allocated": "#4e79a7", "active_pending_free": "#e15759", "inactive": "#dddddd"}
    for y, s in enumerate(rows):
        x = 0
        for b in s["blocks"]:
            bottom.barh(y, b["size"] / gib, left=x / gib, color=colors[b["state"]], edgecolor="none", height=0.8)
            x += b["size"]
        label = s["segment_type"] + (f" [{s['deferalloc_tag']}]" if s.get("deferalloc_tag") else "")
        bottom.text(x / gib, y, " " + label, va="center", fontsize=6)
    bottom.invert_yaxis()
    bottom.set_xlabel("GiB (each row one segment: a backed run; blue allocated, grey free, red pending free)")
    bottom.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("SKIPPED: needs a GPU")
            return 77
        dfa.install()  # before any CUDA allocation
    from deferalloc.optim import StreamedAdamW
    dfa.record_memory_history(max_entries=1_000_000)
    model, ids = build(args.size, device)
    opt = StreamedAdamW(model.parameters(), lr=1e-4, tier="host", window_mb=256)
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {float(loss.detach()):.4f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    snap = dfa.memory_snapshot()
    if device.type == "cuda":  # under install(), PyTorch's own entry point gives the same
        assert "deferalloc" in torch.cuda.memory._snapshot(), "torch.cuda.memory._snapshot is not deferalloc's"
    os.makedirs(args.out, exist_ok=True)
    from torch.cuda import _memory_viz
    with open(os.path.join(args.out, "snapshot.pickle"), "wb") as f:
        pickle.dump(snap, f)
    for name, html in (("segment_plot.html", _memory_viz.segment_plot(snap)),
                       ("trace_plot.html", _memory_viz.trace_plot(snap))):
        with open(os.path.join(args.out, name), "w") as f:
            f.write(html)
    draw_png(snap, os.path.join(args.out, "memory.png"))
    for name in ("snapshot.pickle", "segment_plot.html", "trace_plot.html", "memory.png"):
        print(f"wrote {os.path.join(args.out, name)} ({os.path.getsize(os.path.join(args.out, name))} bytes)")
    ann = snap["deferalloc"]
    print(f"segments {len(snap['segments'])}, events {len(snap['device_traces'][0])}, "
          f"optimizers {len(ann['optimizers'])}, installed {ann['installed']}")
    for o in ann["optimizers"]:
        st = o.get("stats", {})
        print(f"optimizer: peak state HBM {st.get('peak_backed_bytes', 0) / 2**20:.1f} MiB, "
              f"to device {st.get('bytes_to_device', 0) / 2**20:.1f} MiB per step")
    print(_memory_viz.segsum(snap).splitlines()[0:4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
