"""Around the PCIe wall (issue 16), on one GPU, in one command (about 4 minutes on an H200):

  twin:   the compressed-moment kernels equal their CPU twin bit for bit (GPU vs host driver);
  llama:  a transformers LlamaForCausalLM of >= 1 B parameters (config only, random init,
          BF16, eager attention: deterministic under torch.use_deterministic_algorithms),
          batch sized so that forward+backward >= the state transfer at the PCIe bound
          (--batch 0: doubled from 16 until it is); iteration time split (forward, backward,
          visible optimizer time) for resident FP32 state (device tier), the host tier, the
          host tier + overlap with backward, BF16 and int8 moments (also with overlap), and a
          resident budget covering half the state; losses of the overlapped runs bit-identical
          to the plain ones; one traced iteration per mode (timeline PNG);
  clip:   the same model with gradient clipping: overlap (speculative step + redo) against
          clip_grad_norm_ + step, losses bit-identical, redos counted (the threshold is the
          first iteration's gradient norm, so at least that iteration redoes);
  curves: --curve-steps steps of a small Llama (5 M params) on the same non-repeating data
          (warmup to 2e-3, cosine decay: lr_factor) with fp32 / bf16 / int8 moments, and fp32 from one parameter moved by one ulp (fp32':
          the noise floor of one seed) (loss curves PNG; the CPU memorization stress test is
          benchmarks/optimizer/moment_convergence.py).

Prints a table last; exit status 1 when a check fails.  --json PATH writes
{"benchmark": "bench_overlap", "schema": 1, "device", "command", "results": [{"name", "value",
"unit", "baseline"}], "extra": {...}}; PNGs go to --out.  --smoke: a tiny configuration on the
CPU (host driver) that runs every part but twin, asserting only the exactness checks (ctest).

    DEFERALLOC_LIB=build-gpu/allocator/libdeferalloc.so \\
    DEFERALLOC_OPTIMIZER_LIB=build-gpu/optimizer/libdeferalloc_optimizer.so PYTHONPATH=python \\
      python3 benchmarks/optimizer/bench_overlap.py --out $OUT --json $OUT/bench_overlap.json
"""
import argparse
import gc
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

from deferalloc import optim  # noqa: E402
from deferalloc.overlap import overlap_with_backward  # noqa: E402

PCIE_BPS = 51e9  # duplex pinned copy each way on the H200 machine (issue 16)
TARGETS = dict(overlap_vs_resident=1.15, bf16_speedup=1.4, int8_speedup=1.8, half_resident=0.55, bf16_loss=0.5,
               int8_loss=1.0)


class Bench:
    def __init__(self, a):
        self.a = a
        self.dev = torch.device("cpu" if a.smoke else "cuda")
        self.cuda = self.dev.type == "cuda"
        self.results, self.checks, self.extra = [], [], {"smoke": a.smoke, "targets": TARGETS}

    # ---- reporting ------------------------------------------------------------------------
    def result(self, name, value, unit, baseline=None):
        self.results.append(dict(name=name, value=float(value), unit=unit, baseline=baseline))

    def check(self, what, value, target="", ok=None, perf=False):
        """A row of the table; a performance target is not asserted in --smoke."""
        if perf and self.a.smoke:
            ok = None
        self.checks.append(dict(check=what, value=value, target=target, ok=ok))
        print(f"  {what}: {value} {target} {'' if ok is None else ('pass' if ok else 'FAIL')}", flush=True)

    # ---- clocks ---------------------------------------------------------------------------
    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def between(self, a, b):
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def stamp(self):
        """Host time once the current stream is idle (the traced iteration)."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def opt_kw(self, tier="host"):
        """Engine settings: the window, and the host driver's small pages in --smoke."""
        s = ["keep_window:1"] if tier == "host" else []
        if self.a.engine_settings:  # e.g. "depth:6" (docs/SETTINGS.md's table)
            s.append(self.a.engine_settings)
        if self.a.smoke:
            s.append("host_granularity_kb:64")
        return dict(tier=tier, window_mb=4 if self.a.smoke else 1024, settings=",".join(s) or None)


# ---- twin: the kernels against their CPU twin ---------------------------------------------------

def kernels_vs_cpu_twin(B):
    print("[twin] compressed-moment kernels vs CPU twin", flush=True)
    if not B.cuda:
        print("  skipped: --smoke has no GPU to compare the CPU twin with")
        return
    g = torch.Generator().manual_seed(0)
    shapes = [(1000, 1003), (4099,)]  # several pieces, partial int8 blocks
    init = [torch.randn(s, generator=g) * 0.05 for s in shapes]
    grads = [[torch.randn(s, generator=g) * 10 ** torch.empty(s).uniform_(-5, 0, generator=g) for s in shapes]
             for _ in range(3)]

    def run(dev, **kw):
        ps = [torch.nn.Parameter(t.to(dev, torch.bfloat16)) for t in init]
        o = optim.StreamedAdamW(ps, lr=1e-3, window_mb=32 if dev == "cuda" else 8,
                                settings="host_granularity_kb:64" if dev == "cpu" else None, **kw)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.to(dev, torch.bfloat16)
            o.step()
        B.sync()
        sd = o.state_dict()["state"]
        out = [sd[i][k] for i in sd for k in ("main_param", "exp_avg", "exp_avg_sq")] + [p.detach().cpu() for p in ps]
        del o
        return out

    for fmt in ("bf16", "int8"):
        same = all(torch.equal(x, y) for x, y in zip(run("cuda", moment_dtype=fmt), run("cpu", moment_dtype=fmt)))
        B.check(f"{fmt} moments: GPU state and params == CPU twin after 3 steps", "bit-identical" if same else "DIFFER",
                "bit-identical", same)
        B.result(f"twin {fmt} bit-identical", same, "bool")
    same = all(torch.equal(x, y) for x, y in zip(run("cuda"), run("cuda", resident_mb=8)))
    B.check("resident split (8 MiB resident) == all streamed, GPU, 3 steps", "bit-identical" if same else "DIFFER",
            "bit-identical", same)
    B.result("twin resident split bit-identical", same, "bool")


# ---- the model and its data --------------------------------------------------------------------

def llama(B, cfg_kw, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(attn_implementation="eager", tie_word_embeddings=False, **cfg_kw)
    with torch.device(B.dev):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.config.use_cache = False
    return m


def bigram_batches(B, vocab, batch, seq, n, seed=1):
    """n batches of token streams from a fixed table of 4 successors per token."""
    g = torch.Generator(device=B.dev).manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g, device=B.dev)
    t = torch.empty(n * batch, seq, dtype=torch.long, device=B.dev)
    t[:, 0] = torch.randint(0, vocab, (n * batch,), generator=g, device=B.dev)
    pick = torch.randint(0, 4, (n * batch, seq), generator=g, device=B.dev)
    for j in range(1, seq):
        t[:, j] = succ[t[:, j - 1], pick[:, j]]
    return list(t.view(n, batch, seq).unbind(0))


def restore(model, init):
    with torch.no_grad():
        for p, s in zip(model.parameters(), init):
            p.copy_(s)


# ---- one mode -----------------------------------------------------------------------------------

def run_mode(B, model, init, data, name, overlap=False, max_grad_norm=None, tier="host", **kw):
    """warm + iters iterations back to back (an overlapped step may end under the next
    forward), then one traced iteration.  Returns losses (every iteration), the split
    (seconds: iteration by wall clock over the timed iterations; forward and backward by
    events, an overlapped forward including its waits; visible optimizer = the rest) and
    the traced iteration's spans."""
    a = B.a
    restore(model, init)
    opt = optim.StreamedAdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **B.opt_kw(tier), **kw)
    ov = (overlap_with_backward(model, opt, bucket_mb=a.bucket_mb, max_grad_norm=max_grad_norm)
          if overlap else None)
    losses, marks = [], []

    def iteration(it, mark):
        x = data[it % len(data)]
        m0 = mark()
        loss = model(input_ids=x, labels=x).loss
        m1 = mark()
        loss.backward()
        m2 = mark()
        if ov is not None:
            ov.step()
        else:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
        opt.zero_grad(set_to_none=True)
        m3 = mark()
        losses.append(loss.detach())
        return m0, m1, m2, m3

    for it in range(a.warm):
        iteration(it, lambda: None)
    if ov is not None:
        ov.synchronize()
    B.sync()
    t0 = time.perf_counter()
    for it in range(a.warm, a.warm + a.iters):
        marks.append(iteration(it, B.mark))
    if ov is not None:
        ov.synchronize()
    B.sync()
    it_s = (time.perf_counter() - t0) / a.iters
    # The traced iteration: host stamps after the current stream is idle at each phase, the
    # overlap's bucket steps from its worker, and the next forward (no grad) with its waits.
    if ov is not None:
        ov.trace, ov.timeline = True, []
    o, t1, t2, t3 = iteration(a.warm + a.iters, B.stamp)
    with torch.no_grad():
        model(input_ids=data[(a.warm + a.iters + 1) % len(data)])
    t4 = B.stamp()
    if ov is not None:
        ov.synchronize()
    spans = [("forward", 0.0, t1 - o), ("backward", t1 - o, t2 - o), ("optimizer (visible)", t2 - o, t3 - o),
             ("next forward", t3 - o, t4 - o)]
    buckets = [(f"bucket {i}", s - o, e - o) for i, s, e in (ov.timeline if ov is not None else [])]
    stats = ov.stats() if ov is not None else {}
    if ov is not None:
        ov.remove()
    del opt, ov
    B.free()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    f_s = med([B.between(m[0], m[1]) for m in marks])
    b_s = med([B.between(m[1], m[2]) for m in marks])
    split = dict(iteration=it_s, forward=f_s, backward=b_s, visible_optimizer=it_s - f_s - b_s)
    print(f"  {name:<22} iter {it_s * 1e3:8.1f} ms  fwd {f_s * 1e3:7.1f}  bwd {b_s * 1e3:7.1f}  "
          f"visible opt {split['visible_optimizer'] * 1e3:7.1f}  {stats or ''}", flush=True)
    return [float(v) for v in losses], split, dict(phases=spans, buckets=buckets), stats


# ---- llama: the iteration split ------------------------------------------------------------------

def model_config(B):
    if B.a.smoke:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=B.a.layers,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def fwd_bwd_seconds(B, model, x, reps=2):
    model(input_ids=x, labels=x).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    B.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)
    B.sync()
    return (time.perf_counter() - t0) / reps


def big_llama(B):
    a = B.a
    cfg = model_config(B)
    model = llama(B, cfg)
    n = sum(p.numel() for p in model.parameters())
    bound_s = n * 12 / PCIE_BPS
    print(f"[llama] {n / 1e9:.3f} G params; state transfer at the bound {bound_s * 1e3:.0f} ms "
          f"(12 B/param each way, {PCIE_BPS / 1e9:.0f} GB/s)", flush=True)
    batch = a.batch or (2 if a.smoke else 16)
    while True:
        try:
            x = bigram_batches(B, cfg["vocab_size"], batch, a.seq, 1)[0]
            fb = fwd_bwd_seconds(B, model, x)
        except torch.OutOfMemoryError:
            if a.batch or batch <= 16:
                raise
            model.zero_grad(set_to_none=True)
            batch //= 2  # the last size that fitted (the modes need room for their state too)
            print(f"  out of memory: batch {batch}", flush=True)
            break
        print(f"  batch {batch} x {a.seq}: forward+backward {fb * 1e3:.0f} ms", flush=True)
        if a.batch or a.smoke or fb >= 1.1 * bound_s or batch >= 64:
            break
        batch *= 2
    x = None
    B.free()
    init = [p.detach().clone() for p in model.parameters()]
    data = bigram_batches(B, cfg["vocab_size"], batch, a.seq, 4)
    half_mb = max(1, (n * 12 // 2) >> 20)
    modes = [("resident", dict(tier="device")),
             ("host", dict()),
             ("host+overlap", dict(overlap=True)),
             ("host bf16", dict(moment_dtype="bf16")),
             ("host int8", dict(moment_dtype="int8")),
             ("host int8+overlap", dict(moment_dtype="int8", overlap=True)),
             ("host half resident", dict(resident_mb=half_mb))]
    out, losses, timeline = {}, {}, {}
    for name, kw in modes:
        losses[name], out[name], timeline[name], _ = run_mode(B, model, init, data, name, **kw)
        for part in ("iteration", "forward", "backward", "visible_optimizer"):
            B.result(f"{name}: {part.replace('_', ' ')}", out[name][part] * 1e3, "ms",
                     None if name == "resident" else f"resident: {part.replace('_', ' ')}")
    B.extra["llama"] = dict(params=n, batch=batch, seq=a.seq, layers=cfg["num_hidden_layers"], split=out,
                            losses=losses, timeline=timeline, half_resident_mb=half_mb, bound_ms=bound_s * 1e3)
    r, h, o = out["resident"], out["host"], out["host+overlap"]
    fb = r["forward"] + r["backward"]
    B.check("fwd+bwd (resident) / state transfer at the bound", f"{fb / bound_s:.2f}x ({fb * 1e3:.0f} ms vs "
            f"{bound_s * 1e3:.0f} ms)", ">= 1x", fb >= bound_s, perf=True)
    B.result("fwd+bwd / state transfer at the bound", fb / bound_s, "x")
    q = o["iteration"] / r["iteration"]
    B.check("host+overlap iteration / resident iteration", f"{q:.2f}x", f"<= {TARGETS['overlap_vs_resident']}x",
            q <= TARGETS["overlap_vs_resident"], perf=True)
    B.result("host+overlap / resident iteration", q, "x", "resident: iteration")
    B.check("gain of overlap: host iteration / host+overlap iteration", f"{h['iteration'] / o['iteration']:.2f}x")
    B.result("host / host+overlap iteration", h["iteration"] / o["iteration"], "x", "host: iteration")
    for f in ("bf16", "int8"):
        s = h["visible_optimizer"] / out[f"host {f}"]["visible_optimizer"]
        B.check(f"host step, {f} moments vs fp32 moments (visible optimizer time)", f"{s:.2f}x",
                f">= {TARGETS[f + '_speedup']}x", s >= TARGETS[f + "_speedup"], perf=True)
        B.result(f"host step speedup, {f} moments", s, "x", "host: visible optimizer")
    s = out["host int8"]["iteration"] / out["host int8+overlap"]["iteration"]
    B.check("gain of overlap with int8 moments", f"{s:.2f}x")
    q = out["host half resident"]["visible_optimizer"] / h["visible_optimizer"]
    B.check("step time, half the state resident / fully streamed", f"{q:.2f}x", f"<= {TARGETS['half_resident']}x",
            q <= TARGETS["half_resident"], perf=True)
    B.result("half resident / fully streamed step", q, "x", "host: visible optimizer")
    first = {losses[k][0] for k in losses}
    B.check("first loss equal in every mode (deterministic forward)", f"{len(first)} distinct", "1", len(first) == 1)
    for plain, ovl in (("host", "host+overlap"), ("host int8", "host int8+overlap"), ("resident", "host")):
        same = losses[plain] == losses[ovl]
        B.check(f"losses {ovl} == {plain} ({len(losses[plain])} iterations, no clipping)",
                "bit-identical" if same else f"DIFFER {losses[plain]} vs {losses[ovl]}", "bit-identical", same)
        B.result(f"losses {ovl} == {plain}", same, "bool")
    # Clipping: the threshold is the first iteration's gradient norm (the forward is
    # deterministic), so the first iteration clips and its speculative step is redone.
    x = data[0]
    restore(model, init)
    model(input_ids=x, labels=x).loss.backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    print(f"[clip] max_grad_norm {norm:.4g} (the first iteration's gradient norm)", flush=True)
    lp, split_p, _, _ = run_mode(B, model, init, data, "host, clipped", max_grad_norm=norm)
    lo, split, tl, stats = run_mode(B, model, init, data, "host+overlap, clipped", overlap=True, max_grad_norm=norm)
    B.extra["clip"] = dict(max_grad_norm=norm, losses={"host": lp, "host+overlap": lo}, stats=stats, split=split)
    same = lp == lo
    B.check(f"clipped losses host+overlap == host ({len(lp)} iterations, {stats.get('redos')} redos)",
            "bit-identical" if same else f"DIFFER {lp} vs {lo}", "bit-identical, >= 1 redo",
            same and stats.get("redos", 0) >= 1)
    B.result("clipped losses host+overlap == host", same, "bool")
    B.result("clipping redos", stats.get("redos", 0), "count")
    # Note [Speculative steps]: the engine keeps the previous state, nothing is copied out.
    B.check("clipped overlap: state copied out to keep it", f"{stats.get('kept_copies')} shards", "0",
            stats.get("kept_copies") == 0)
    B.result("host, clipped: visible optimizer", split_p["visible_optimizer"] * 1e3, "ms")
    B.result("host+overlap, clipped: visible optimizer", split["visible_optimizer"] * 1e3, "ms",
             "host, clipped: visible optimizer")
    B.result("host+overlap, clipped / host, clipped iteration", split["iteration"] / split_p["iteration"], "x")
    del model, init, data
    B.free()


# ---- curves ---------------------------------------------------------------------------------------

# The curves' schedule, a pretraining run's: linear warmup over the first 10% of the steps
# to CURVE_LR, cosine decay to 10% of it at the end.  The model: on this bigram data a Llama
# sits on a plateau near ln(vocab) and then falls steeply, and the plateau grows with the
# model (measured on the CPU with torch's AdamW at 2e-3, seq 128: hidden 256 / 4 layers /
# vocab 4096 leaves it by step 60; hidden 384 / 6 layers / vocab 2048 by step 100; on the
# H200 the 63 M model of hidden 768 / 8 layers / vocab 8192 only began to leave it by step
# 300).  While the loss is on or leaving the plateau, the last steps' loss measures when it
# left (one rounding moves that by tens of steps; with the 63 M model the noise floor was
# 5% at step 200 at a constant 1e-3, and every format's gap was the timing of the fall:
# docs/BENCHMARKS.md).  So the curves use the small model, whose last 100 steps improve
# slowly, and compare where training got.
CURVE_LR = 2e-3


def lr_factor(t, steps):
    warm = max(1, steps // 10)
    if t < warm:
        return (t + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (t - warm) / max(1, steps - warm)))


def curves(B):
    a = B.a
    steps = a.curve_steps
    if a.smoke:
        cfg = dict(model_config(B))
        batch, seq = 2, 32
    else:
        # A model that leaves the plateau near ln(vocab) in the first tens of steps (see the
        # note above CURVE_LR): the loss at step 300 then measures how far training got.
        cfg = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024)
        batch, seq = 16, 256
    model = llama(B, cfg, seed=3)
    n = sum(p.numel() for p in model.parameters())
    print(f"[curves] {steps} steps of a {n / 1e6:.1f} M-param Llama, fp32 / bf16 / int8 moments, "
          f"{steps} distinct batches of {batch}x{seq}", flush=True)
    init = [p.detach().clone() for p in model.parameters()]
    data = bigram_batches(B, cfg["vocab_size"], batch, seq, steps, seed=4)
    out = {}
    for fmt in ("fp32", "fp32'", "bf16", "int8"):  # fp32': the noise floor, one parameter one ulp away
        restore(model, init)
        if fmt == "fp32'":
            with torch.no_grad():
                next(model.parameters()).view(-1)[:1].view(torch.int16).add_(1)  # BF16: the next value
        kw = B.opt_kw()
        kw["window_mb"] = 4 if a.smoke else 512
        opt = optim.StreamedAdamW(model.parameters(), lr=CURVE_LR, weight_decay=0.01, moment_dtype=fmt.rstrip("'"), **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(t, steps))
        ls = []
        t0 = time.perf_counter()
        for t in range(steps):
            loss = model(input_ids=data[t], labels=data[t]).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            ls.append(loss.detach())
        out[fmt] = [float(v) for v in ls]
        print(f"  {fmt}: loss {out[fmt][0]:.3f} -> {out[fmt][-1]:.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
        del opt
        B.free()
    B.extra["curves"] = dict(params=n, steps=steps, batch=batch, seq=seq, losses=out)
    k = min(20, steps)
    tail = {f: sum(v[-k:]) / k for f, v in out.items()}
    B.result("curves: loss fp32 (mean of the last steps)", tail["fp32"], "nats")
    B.result("curves: loss fp32' (1 ulp) vs fp32 (noise floor)", (tail["fp32'"] - tail["fp32"]) / tail["fp32"] * 100, "%",
             "curves: loss fp32 (mean of the last steps)")
    for f in ("bf16", "int8"):
        d = (tail[f] - tail["fp32"]) / tail["fp32"] * 100
        tol = TARGETS[f + "_loss"]
        B.check(f"loss after {steps} steps, {f} vs fp32 moments (mean of last {k})",
                f"{tail[f]:.4f} vs {tail['fp32']:.4f} ({d:+.2f}%)", f"within {tol:g}%", abs(d) <= tol, perf=True)
        B.result(f"curves: loss {f} vs fp32", d, "%", "curves: loss fp32 (mean of the last steps)")
    del model, init, data
    B.free()


# ---- plots ----------------------------------------------------------------------------------------

def plots(B, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no PNG)")
        return []
    files = []
    if "llama" in B.extra:
        L = B.extra["llama"]
        split, names = L["split"], list(L["split"])
        fig, ax = plt.subplots(figsize=(8, 4.5))
        left = [0.0] * len(names)
        for part in ("forward", "backward", "visible_optimizer"):
            vals = [max(0.0, split[k][part]) * 1e3 for k in names]
            ax.barh(names, vals, left=left, label=part.replace("_", " "))
            left = [x + v for x, v in zip(left, vals)]
        ax.set(xlabel="ms per iteration", title=f"{L['params'] / 1e9:.2f} B-param Llama, batch {L['batch']}x{L['seq']}")
        ax.invert_yaxis()
        ax.legend()
        fig.tight_layout()
        files.append(os.path.join(out_dir, "bench_overlap_split.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
        tl = L["timeline"]
        fig, ax = plt.subplots(figsize=(11, 0.7 * len(tl) + 1.5))
        colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer (visible)": "tab:red",
                  "next forward": "tab:cyan"}
        for y, name in enumerate(tl):
            for what, s, e in tl[name]["phases"]:
                ax.barh(y - 0.15, (e - s) * 1e3, left=s * 1e3, height=0.3, color=colors[what],
                        label=what if y == 0 else None)
            for i, (what, s, e) in enumerate(tl[name]["buckets"]):
                ax.barh(y + 0.2, (e - s) * 1e3, left=s * 1e3, height=0.2, color="tab:green" if i % 2 else "tab:olive",
                        label="bucket steps (side stream)" if i == 0 and "overlap" in name else None)
        ax.set_yticks(range(len(tl)), list(tl))
        ax.invert_yaxis()
        ax.set(xlabel="ms from the iteration's start", title="one traced iteration per mode (and the next forward)")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="lower right")
        fig.tight_layout()
        files.append(os.path.join(out_dir, "bench_overlap_timeline.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    if "curves" in B.extra:
        C = B.extra["curves"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for f, v in C["losses"].items():
            ax.plot(v, label=f"{f} moments", lw=1)
        ax.set(xlabel="step", ylabel="loss", yscale="log", title=f"{C['params'] / 1e6:.0f} M-param Llama, host tier")
        ax.legend()
        fig.tight_layout()
        files.append(os.path.join(out_dir, "bench_overlap_curves.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the PNGs")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny configuration on the CPU (host driver)")
    ap.add_argument("--layers", type=int, default=22)  # 1.1 B parameters (TinyLlama's shape)
    ap.add_argument("--batch", type=int, default=0, help="0: from 16, doubled until fwd+bwd >= the transfer")
    ap.add_argument("--seq", type=int, default=None, help="default 512 (--smoke 32)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--curve-steps", type=int, default=None, help="default 300 (--smoke 20)")
    ap.add_argument("--parts", default="twin,llama,curves")
    ap.add_argument("--engine-settings", default="",
                    help="more engine settings for every StreamedAdamW of the run (e.g. depth:6)")
    a = ap.parse_args()
    a.seq = a.seq or (32 if a.smoke else 512)
    a.curve_steps = a.curve_steps or (20 if a.smoke else 300)
    if not a.smoke and not torch.cuda.is_available():
        print("SKIP: no CUDA device (--smoke runs a tiny configuration on the CPU)")
        return 77
    B = Bench(a)
    # Bit-identical losses between runs need deterministic kernels (cuBLAS workspace; eager
    # attention; strict, so that a non-deterministic kernel fails instead of warning).
    torch.use_deterministic_algorithms(True)
    t0 = time.perf_counter()
    parts = a.parts.split(",")
    for key, fn in (("twin", kernels_vs_cpu_twin), ("llama", big_llama), ("curves", curves)):
        if key in parts:
            try:  # a failing part still leaves the others' rows and the table
                fn(B)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                B.check(f"part {key}", f"{type(e).__name__}: {str(e)[:160]}", "runs", False)
                B.free()
    os.makedirs(a.out, exist_ok=True)
    files = plots(B, a.out)
    device = torch.cuda.get_device_name() if B.cuda else "cpu (host driver)"
    ok = all(c["ok"] is not False for c in B.checks)
    if a.json:
        B.extra.update(checks=B.checks, passed=ok, pngs=files, seconds=time.perf_counter() - t0)
        with open(a.json, "w") as f:
            json.dump(dict(benchmark="bench_overlap", schema=1, device=device, command=" ".join(sys.argv),
                           results=B.results, extra=B.extra), f)
    print(f"\n{device}, {time.perf_counter() - t0:.0f} s; PNGs: {', '.join(files) or 'none'}")
    print("| check | result | target | |\n|---|---|---|---|")
    for c in B.checks:
        print(f"| {c['check']} | {c['value']} | {c['target']} | {'' if c['ok'] is None else ('pass' if c['ok'] else 'FAIL')} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
