"""The streamed step against the resident one, on one GPU: one table.

Parts (--parts, comma-separated; each can run alone, and a run with --json merges its
rows into an existing bench_overlap.json, so the lead can call the parts one by one):

  bound:  the duplex transfer bound (pinned H2D and D2H at once, each way) measured now;
  split:  a GQA transformers LlamaForCausalLM (hidden 2048, 16 layers, 32 heads, 4 KV
          heads: 0.84 B params; config only, random init, BF16, SDPA flash attention or
          eager, deterministic: Note [Attention of the benchmark]) at --batch x --seq
          (forward+backward longer than the state transfer): resident FP32 state (device
          tier), the host tier plain, host + overlap_with_backward, host int8 moments + overlap,
          host + overlap with the embedding's state resident (resident_mb);
  small:  the same at --small-batch (forward+backward shorter than the state transfer):
          iteration against max(forward+backward, transfer at the duplex bound); also the
          overlap with coalesced passes (coalesce=2 and all);
  clip:   clipping that never / always / every other iteration fires (max_grad_norm set
          per iteration around the first gradient norm), clip_grad_norm_ + step against
          the overlap (clip_policy auto), losses bit-identical;
  accum:  4 micro-batches of --small-batch per step, accumulate-then-step against the
          overlap with accumulating(), losses bit-identical;
  twin, curves: the compressed-moment kernels against their CPU twin; loss curves of a
          small Llama with fp32 / bf16 / int8 moments (not in the default parts).

The file tier against the disk (dd, compressed moments, the overlap, the O_DIRECT baseline) is
benchmarks/optimizer/bench_file_tier.py's.

Each mode: --warm + --iters iterations back to back, then one traced iteration (timeline
PNG); its optimizer and hooks are released after it (also when it fails) and the GPU memory
is checked back at what it was (a failed check otherwise).  Prints a table last; exit
status 1 when a check fails.  --budget-s S: a mode that would end past S seconds is not run
(a failed check says so), so a run under a time limit still ends with its table and JSON.  --merge A.json (with
--parts '': no GPU needed) merges runs made separately.  --json PATH writes {"benchmark": "bench_overlap", "schema": 1, "device",
"command", "results": [{"name", "value", "unit", "baseline"}], "extra": {...}}; PNGs go
to --out.  --smoke: a tiny configuration on the CPU (host driver) that runs every part
but twin, asserting only the exactness checks (ctest).

    DEFERALLOC_LIB=build-gpu/allocator/libdeferalloc.so \\
    DEFERALLOC_OPTIMIZER_LIB=build-gpu/optimizer/libdeferalloc_optimizer.so PYTHONPATH=python \\
      python3 benchmarks/optimizer/bench_overlap.py --out $OUT --json $OUT/bench_overlap.json \\
      --parts bound,split,small

On the H200 the whole table is one call of under 4.5 minutes (docs/OVERLAP.md):
  --parts bound,split,small,clip,accum --budget-s 255     (about 3 minutes)
"""
import argparse
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_harness import BudgetSpent, Harness  # noqa: E402

PCIE_BPS = 51e9  # duplex pinned copy each way on the H200 machine, when not measured
# The acceptance marks: iteration / resident (clipping never and always fires), iteration
# / max(fwd+bwd, transfer) where fwd+bwd is the shorter; the largest loss gap (%) of compressed
# moments to FP32 ones.  (The file tier's marks are bench_file_tier.py's.)
TARGETS = dict(overlap_vs_resident=1.10, clip_always_vs_resident=1.30, small_vs_bound=1.10, bf16_loss=0.5,
               int8_loss=1.0)


class Bench(Harness):
    def __init__(self, a):
        dev = torch.device("cpu" if a.smoke or not a.parts else "cuda")
        super().__init__(a, cuda=dev.type == "cuda")
        self.dev = dev
        self.extra = {"smoke": a.smoke, "targets": TARGETS}

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

    def memory(self):
        """(bytes the caching allocator has allocated, bytes in use on the device) once
        freed; None on the CPU."""
        if not self.cuda:
            return None
        self.free()
        free, total = torch.cuda.mem_get_info()
        return torch.cuda.memory_allocated(), total - free

    def release_check(self, what, before, torch_slack=256 << 20, device_slack=1 << 30):
        """Prints the GPU memory after ``what`` against ``before`` (memory()); a failed
        check when more than the slack stayed (the slack: cuBLAS workspaces, which stay
        per stream, and the CUDA libraries' own caches)."""
        if not self.cuda:
            return True
        alloc, used = self.memory()
        da, du = alloc - before[0], used - before[1]
        print(f"    GPU memory after {what}: {alloc / 2**30:.2f} GiB allocated ({da / 2**20:+.0f} MiB), "
              f"{used / 2**30:.2f} GiB in use on the device ({du / 2**20:+.0f} MiB)", flush=True)
        self.extra.setdefault("memory", {})[what] = dict(allocated=alloc, device_used=used, allocated_delta=da,
                                                        device_delta=du)
        ok = da <= torch_slack and du <= device_slack
        if not ok:
            self.check(f"GPU memory released after {what}", f"{da / 2**20:+.0f} MiB allocated, {du / 2**20:+.0f} MiB "
                       "in use", f"<= +{torch_slack >> 20} MiB, +{device_slack >> 20} MiB", False)
        return ok

    def opt_kw(self, tier="host"):
        """Engine settings: the window (kept between the passes of an overlapped step),
        and the host driver's small pages in --smoke."""
        s = ["keep_window:1"] if tier != "device" else []
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
    cfg = LlamaConfig(attn_implementation=B.attn, tie_word_embeddings=False, **cfg_kw)
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

def _slug(name: str) -> str:
    """A mode's name as --profile-mode and file names take it ('host+overlap b4': host_overlap_b4)."""
    return "".join(c if c.isalnum() else "_" for c in name)


def profile_link(B, name, iteration, ov, n=2):
    """``n`` iterations of mode ``name`` under torch.profiler (CUDA activity: the copy
    engines' and kernels' device timestamps), no synchronisation between them; the
    link's analysis (benchmarks/link_profile.py) printed and kept in extra.link_profile,
    the trace gzipped into --out."""
    import link_profile

    def run():
        for k in range(n):
            iteration(k)
        if ov is not None:
            ov.synchronize()
        B.sync()
    res = link_profile.capture(run, B.cuda, os.path.join(B.a.out, f"link_profile_{_slug(name)}.json.gz"))
    bound = (B.extra.get("bound") or {}).get("duplex")  # GB/s each way, when part bound ran
    print(f"[profile] {name}, {n} iterations:\n" + link_profile.report(res, bound), flush=True)
    B.extra.setdefault("link_profile", {})[name] = dict(iterations=n, **res)


def run_mode(B, name, batch, overlap=False, clip=None, micro=1, tier="host", ov_kw=None, iters=None, warm=None,
             **kw):
    """warm + iters iterations back to back (an overlapped step may end under the next
    forward), then one traced iteration.  ``clip(it)``: max_grad_norm of iteration it
    (None: no clipping); ``micro``: micro-batches per step (the overlap: all but the last
    inside accumulating()).  Returns losses (every micro-batch), the split (seconds, means
    over the timed iterations, all from the same clock: iteration = from one iteration's
    first forward to the next one's (the last: to the end of the step); forward and
    backward summed over micro-batches, an overlapped forward including its waits; visible
    optimizer = iteration - forward - backward, never negative), the traced iteration's
    spans, and the overlap's stats.  Everything the mode allocated is released before it
    returns, also when it fails (see release_check)."""
    a = B.a
    B.budget(name)
    t_mode = time.perf_counter()
    model, init = B.model()
    data = B.batches(batch)
    iters = iters or a.iters
    warm = a.warm if warm is None else warm
    restore(model, init)
    mem0 = B.memory()
    opt = ov = None
    try:
        opt = optim.StreamedAdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **B.opt_kw(tier), **kw)
        ov = (overlap_with_backward(model, opt, bucket_mb=a.bucket_mb,
                                    max_grad_norm=clip(0) if clip else None, **(ov_kw or {}))
              if overlap else None)
        losses, marks = [], []

        def iteration(it, mark):
            norm = clip(it) if clip else None
            if ov is not None:
                ov.max_grad_norm = norm
            fb = []
            for k in range(micro):
                x = data[(it * micro + k) % len(data)]
                m0 = mark()
                loss = model(input_ids=x, labels=x).loss
                if micro > 1:
                    loss = loss / micro
                m1 = mark()
                if ov is not None and k < micro - 1:
                    with ov.accumulating():
                        loss.backward()
                else:
                    loss.backward()
                fb.append((m0, m1, mark()))
                losses.append(loss.detach())
            if ov is not None:
                ov.step()
            else:
                if norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
                opt.step()
            opt.zero_grad(set_to_none=True)
            return fb, mark()

        for it in range(warm):
            iteration(it, lambda: None)
        if ov is not None:
            ov.synchronize()
        B.sync()
        t0 = time.perf_counter()
        for it in range(warm, warm + iters):
            marks.append(iteration(it, B.mark))
        if ov is not None:
            ov.synchronize()
        B.sync()
        end = B.mark()  # the step's end: every stream idle (the overlap's last bucket included)
        B.sync()
        wall_s = (time.perf_counter() - t0) / iters
        # The traced iteration: host stamps after the current stream is idle at each phase,
        # the overlap's bucket steps from its worker, and the next forward (no grad) with its waits.
        if ov is not None:
            ov.trace, ov.timeline = True, []
        fb, t3 = iteration(warm + iters, B.stamp)
        o = fb[0][0]
        with torch.no_grad():
            model(input_ids=data[0])
        t4 = B.stamp()
        if ov is not None:
            ov.synchronize()
        spans = [s for f0, f1, b1 in fb for s in (("forward", f0 - o, f1 - o), ("backward", f1 - o, b1 - o))]
        spans += [("optimizer (visible)", fb[-1][2] - o, t3 - o), ("next forward", t3 - o, t4 - o)]
        buckets = [("commit" if i < 0 else f"bucket {i}", s - o, e - o) for i, s, e in (ov.timeline if ov else [])]
        stats = ov.stats() if ov is not None else {}
        if _slug(name) in {_slug(m) for m in a.profile_mode or ()}:
            if ov is not None:
                ov.trace = False
            B.profiled.add(_slug(name))
            t_prof = time.perf_counter()
            try:
                profile_link(B, name, lambda k: iteration(warm + iters + 1 + k, lambda: None), ov)
            except Exception as e:  # (a diagnostic: the mode's figures stand without it)
                print(f"[profile] {name}: failed: {e!r}", flush=True)
                B.extra.setdefault("link_profile", {})[name] = {"error": repr(e)}
            del losses[(warm + iters + 1) * micro:]  # (the profiled iterations' are not the mode's)
            t_mode += time.perf_counter() - t_prof  # (not the next mode's estimate)
    finally:
        try:
            if ov is not None:
                ov.remove()  # the model is shared by every mode: no hook may outlive its mode
        finally:
            # Nor may a failed mode's gradients: the next mode's first backward would add to them.
            model.zero_grad(set_to_none=True)
            opt = ov = None
            B.free()
    # One clock for every part of the split (events on the GPU), so that the parts add up:
    # a median of the forward plus a median of the backward could exceed the mean iteration.
    starts = [fb[0][0] for fb, _ in marks] + [end]
    it_s = sum(B.between(s, e) for s, e in zip(starts, starts[1:])) / iters
    f_s = sum(B.between(m0, m1) for fb, _ in marks for m0, m1, _ in fb) / iters
    b_s = sum(B.between(m1, b1) for fb, _ in marks for _, m1, b1 in fb) / iters
    split = dict(iteration=it_s, forward=f_s, backward=b_s, visible_optimizer=max(0.0, it_s - f_s - b_s))
    print(f"  {name:<34} iter {it_s * 1e3:8.1f} ms  fwd {f_s * 1e3:7.1f}  bwd {b_s * 1e3:7.1f}  "
          f"visible opt {split['visible_optimizer'] * 1e3:7.1f}  (wall clock {wall_s * 1e3:.1f})  {stats or ''}",
          flush=True)
    B.release_check(name, mem0)
    B.estimate_s = time.perf_counter() - t_mode
    out = [float(v) for v in losses]
    B.extra.setdefault("modes", {})[name] = dict(batch=batch, micro=micro, split=split, wall_clock_s=wall_s,
                                                 losses=out, stats=stats, timeline=dict(phases=spans, buckets=buckets))
    for part in ("iteration", "forward", "backward", "visible_optimizer"):
        B.result(f"{name}: {part.replace('_', ' ')}", split[part] * 1e3, "ms")
    return out, split, stats


def same_losses(B, plain, ovl, la, lb, what=""):
    same = la == lb
    B.check(f"losses {ovl} == {plain} ({len(la)} micro-batches{what})",
            "bit-identical" if same else f"DIFFER {la} vs {lb}", "bit-identical", same)
    B.result(f"losses {ovl} == {plain}", same, "bool")
    return same


# ---- the model, its data and the bounds ----------------------------------------------------------

def model_config(B):
    if B.a.smoke:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=B.a.layers,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def determinism_probe(B, m, cfg):
    """Why ``m``'s attention cannot serve (None: it can): two forward+backward passes of
    one batch must run and give bit-identical gradients."""
    g = torch.Generator(device=B.dev).manual_seed(7)
    x = torch.randint(0, cfg["vocab_size"], (2, min(B.a.seq, 1024)), generator=g, device=B.dev)
    runs = []
    try:
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            m(input_ids=x, labels=x).loss.backward()
            runs.append([p.grad.clone() for p in m.parameters()])
    except RuntimeError as e:
        return f"does not run ({str(e)[:120]})"
    finally:
        m.zero_grad(set_to_none=True)
    same = all(torch.equal(u, v) for u, v in zip(*runs))
    return None if same else "gives different gradients for the same batch"


def _model(B):
    """The shared model.  Attention (see Note [Attention of the benchmark] at main): SDPA
    restricted to flash attention, whose backward is deterministic under
    torch.use_deterministic_algorithms(True); where it does not run or a probe finds it
    not deterministic, eager attention (and the smaller default batches)."""
    if "model" not in B.cache:
        cfg = model_config(B)
        m = llama(B, cfg)
        if B.attn == "sdpa" and B.cuda:
            why = determinism_probe(B, m, cfg)
            if why:
                print(f"[model] SDPA flash attention {why}: eager attention instead", flush=True)
                B.extra["attention_fallback"] = why
                del m
                B.free()
                B.attn = "eager"
                m = llama(B, cfg)
        B.shapes()
        n = sum(p.numel() for p in m.parameters())
        print(f"[model] GQA Llama, {n / 1e9:.3f} G params ({cfg['num_hidden_layers']} layers, hidden "
              f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads, {cfg['num_key_value_heads']} KV heads), "
              f"{B.attn} attention; batch {B.a.batch} (split, clip), {B.a.small_batch} (small, accum)",
              flush=True)
        B.extra["model"] = dict(params=n, **cfg, seq=B.a.seq, attention=B.attn, batch=B.a.batch,
                                small_batch=B.a.small_batch)
        B.cache["model"] = (m, [p.detach().clone() for p in m.parameters()])
        B.cache["params"] = n
    return B.cache["model"]


def _batches(B, batch):
    key = ("data", batch)
    if key not in B.cache:
        B.cache[key] = bigram_batches(B, model_config(B)["vocab_size"], batch, B.a.seq, 4 * 2)
    return B.cache[key]


def duplex_bound(B):
    """Bytes per second each way with pinned H2D and D2H running at once (1 GiB each)."""
    if "bound" in B.cache:
        return B.cache["bound"]
    if not B.cuda:
        B.cache["bound"] = PCIE_BPS
        return PCIE_BPS
    n = 1 << 30
    h = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    d = [torch.empty(n, dtype=torch.uint8, device=B.dev) for _ in range(2)]
    s = [torch.cuda.Stream() for _ in range(2)]
    best = {}
    for what in ("h2d", "d2h", "duplex"):
        t = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if what in ("h2d", "duplex"):
                with torch.cuda.stream(s[0]):
                    d[0].copy_(h[0], non_blocking=True)
            if what in ("d2h", "duplex"):
                with torch.cuda.stream(s[1]):
                    h[1].copy_(d[1], non_blocking=True)
            torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        best[what] = n / min(t)
    del h, d
    B.free()
    for k, v in best.items():
        B.result(f"pinned copy {k} (each way)", v / 1e9, "GB/s")
    print(f"[bound] pinned copies: H2D {best['h2d'] / 1e9:.1f} GB/s, D2H {best['d2h'] / 1e9:.1f} GB/s, "
          f"both at once {best['duplex'] / 1e9:.1f} GB/s each way", flush=True)
    B.extra["bound"] = {k: v / 1e9 for k, v in best.items()}
    B.cache["bound"] = best["duplex"]
    return best["duplex"]


def part_bound(B):
    duplex_bound(B)


# ---- split / small: the iteration split -----------------------------------------------------------

def _split_modes(B, batch, tag):
    r = run_mode(B, f"resident{tag}", batch, tier="device")
    h = run_mode(B, f"host{tag}", batch)
    o = run_mode(B, f"host+overlap{tag}", batch, overlap=True)
    i8 = run_mode(B, f"host int8+overlap{tag}", batch, overlap=True, moment_dtype="int8")
    same_losses(B, f"resident{tag}", f"host{tag}", r[0], h[0])
    same_losses(B, f"host{tag}", f"host+overlap{tag}", h[0], o[0])
    B.check(f"gain of overlap{tag}: host / host+overlap iteration", f"{h[1]['iteration'] / o[1]['iteration']:.2f}x")
    B.result(f"host / host+overlap iteration{tag}", h[1]["iteration"] / o[1]["iteration"], "x")
    for name, m in ((f"host{tag}", h), (f"host+overlap{tag}", o), (f"host int8+overlap{tag}", i8)):
        q = m[1]["iteration"] / r[1]["iteration"]
        B.result(f"{name} / resident iteration", q, "x")
    B.cache[f"resident{tag}"] = r[1]
    return r, h, o, i8


def _which_case(B, r, tag, longer):
    """A check that the shape gives the case the part stands for: forward+backward (the
    resident mode's) longer (split) or shorter (small) than the FP32 state's transfer at
    the duplex bound."""
    fb = r[1]["forward"] + r[1]["backward"]
    transfer = B.cache["params"] * 12 / duplex_bound(B)
    q = fb / transfer
    B.check(f"fwd+bwd{tag} / FP32 state transfer at the duplex bound",
            f"{q:.2f} ({fb * 1e3:.0f} vs {transfer * 1e3:.0f} ms)", "> 1" if longer else "< 1",
            q > 1 if longer else q < 1, perf=True)
    B.result(f"fwd+bwd{tag} / transfer", q, "x")
    return fb, transfer


def part_split(B):
    _model(B)
    print(f"[split] batch {B.a.batch} x {B.a.seq}", flush=True)
    r, h, o, i8 = _split_modes(B, B.a.batch, "")
    _which_case(B, r, "", True)
    # The forward's first bucket (the embedding) gets its gradient last and is needed first:
    # kept resident (registration order), its step runs on the GPU (docs/OVERLAP.md).
    emb = B.model()[0].get_input_embeddings().weight.numel()
    try:
        e = run_mode(B, "host+overlap, embedding resident", B.a.batch, overlap=True,
                     resident_mb=math.ceil(emb * 12 / 2**20) + 1)
        same_losses(B, "host", "host+overlap, embedding resident", h[0], e[0])
        B.result("host+overlap, embedding resident / resident iteration", e[1]["iteration"] / r[1]["iteration"], "x")
    except BudgetSpent as ex:
        B.check("host+overlap, embedding resident", f"cut short: {ex}", "runs", False)
    q = o[1]["iteration"] / r[1]["iteration"]
    B.check("host+overlap iteration / resident", f"{q:.2f}x", f"<= {TARGETS['overlap_vs_resident']}x",
            q <= TARGETS["overlap_vs_resident"], perf=True)


def part_small(B):
    a = B.a
    _model(B)
    print(f"[small] batch {a.small_batch} x {a.seq}", flush=True)
    bps = duplex_bound(B)
    n = B.cache["params"]
    tag = f" b{a.small_batch}"
    r, h, o, i8 = _split_modes(B, a.small_batch, tag)
    fb, _ = _which_case(B, r, tag, False)
    rows = [("host+overlap", o, 12, True), ("host int8+overlap", i8, 6, False)]
    # The host tier's coalesced passes (overlap's coalesce=k: at most k done buckets a
    # pass, the forward's first), the option for this case (docs/OVERLAP.md).
    for k in (2, True):
        name = f"host+overlap, coalesce {'all' if k is True else k}"
        try:
            c = run_mode(B, name + tag, a.small_batch, overlap=True, ov_kw=dict(coalesce=k))
        except BudgetSpent as e:
            B.check(name + tag, f"cut short: {e}", "runs", False)
            break
        same_losses(B, f"host{tag}", name + tag, h[0], c[0])
        rows.append((name, c, 12, False))
    for name, m, bpp, asserted in rows:
        transfer = n * bpp / bps
        ideal = max(fb, transfer)
        q = m[1]["iteration"] / ideal
        B.check(f"{name}{tag} / max(fwd+bwd, transfer at the duplex bound)",
                f"{q:.2f}x ({m[1]['iteration'] * 1e3:.0f} ms vs max({fb * 1e3:.0f}, {transfer * 1e3:.0f}) ms)",
                f"<= {TARGETS['small_vs_bound']}x", q <= TARGETS["small_vs_bound"] if asserted else None, perf=True)
        B.result(f"{name}{tag} / max(fwd+bwd, transfer)", q, "x")


# ---- clip: clipping that never / always / every other iteration fires -----------------------------

def part_clip(B):
    a = B.a
    model, init = _model(B)
    x = _batches(B, a.batch)[0]
    restore(model, init)
    model(input_ids=x, labels=x).loss.backward()
    g0 = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    B.free()
    lo, hi = g0 * 1e-3, g0 * 1e6  # always fires / never fires (the norm stays within these)
    patterns = dict(never=lambda it: hi, always=lambda it: lo, every_other=lambda it: lo if it % 2 else hi)
    print(f"[clip] batch {a.batch}; first gradient norm {g0:.4g}; max_grad_norm {lo:.3g} (fires) or {hi:.3g}",
          flush=True)
    B.extra["clip"] = dict(first_norm=g0, fires=lo, never=hi)
    res = B.cache.get("resident")
    if res is None:
        res = run_mode(B, "resident", a.batch, tier="device")[1]
        B.cache["resident"] = res
    out = {}
    for name, clip in patterns.items():
        try:
            lp, sp, _ = run_mode(B, f"host, clip {name}", a.batch, clip=clip, iters=a.clip_iters)
            lo_, so, st = run_mode(B, f"host+overlap, clip {name}", a.batch, overlap=True, clip=clip,
                                   iters=a.clip_iters)
        except BudgetSpent as e:
            B.check(f"clip {name}", f"cut short: {e}", "runs", False)
            return
        same_losses(B, f"host, clip {name}", f"host+overlap, clip {name}", lp, lo_,
                    f"; {st.get('speculations')} speculations, {st.get('redos')} redos, {st.get('switches')} switches")
        out[name] = (sp, so, st)
        q, qp = so["iteration"] / res["iteration"], so["iteration"] / sp["iteration"]
        B.result(f"host+overlap, clip {name} / resident iteration", q, "x")
        B.result(f"host+overlap, clip {name} / host, clip {name} iteration", qp, "x")
        for k in ("speculations", "redos", "switches"):
            B.result(f"host+overlap, clip {name}: {k}", st.get(k, 0), "count")
        B.check(f"clip {name}: overlap / plain iteration", f"{qp:.2f}x", "<= 1x", qp <= 1.0, perf=True)
        target = dict(never=TARGETS["overlap_vs_resident"], always=TARGETS["clip_always_vs_resident"]).get(name)
        if target:
            B.check(f"clip {name}: overlap / resident iteration", f"{q:.2f}x", f"<= {target}x", q <= target, perf=True)
    lo_it, hi_it = out["never"][1]["iteration"], out["always"][1]["iteration"]
    mid = out["every_other"][1]["iteration"]
    B.check("clip every other: overlap iteration between never and always", f"{mid * 1e3:.0f} ms "
            f"({lo_it * 1e3:.0f} .. {hi_it * 1e3:.0f})", "between", lo_it * 0.98 <= mid <= hi_it * 1.02, perf=True)


# ---- accum: gradient accumulation --------------------------------------------------------------------

def part_accum(B):
    a = B.a
    _model(B)
    print(f"[accum] 4 micro-batches of {a.small_batch} x {a.seq} per step", flush=True)
    lp, sp, _ = run_mode(B, "host, 4 micro-batches", a.small_batch, micro=4)
    lo, so, st = run_mode(B, "host+overlap, 4 micro-batches", a.small_batch, micro=4, overlap=True)
    same_losses(B, "host, 4 micro-batches", "host+overlap, 4 micro-batches", lp, lo)
    q = so["iteration"] / sp["iteration"]
    B.check("4 micro-batches: overlap / plain iteration", f"{q:.2f}x", "<= 1x", q <= 1.0, perf=True)
    B.result("4 micro-batches: overlap / plain iteration", q, "x")


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
                f"{tail[f]:.4f} vs {tail['fp32']:.4f} ({d:+.2f}%)", f"within {tol:g}%", abs(d) <= tol, in_smoke=False)
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
    modes = B.extra.get("modes", {})
    if modes:
        names = list(modes)
        fig, ax = plt.subplots(figsize=(9, 0.32 * len(names) + 1.5))
        left = [0.0] * len(names)
        for part in ("forward", "backward", "visible_optimizer"):
            vals = [max(0.0, modes[k]["split"][part]) * 1e3 for k in names]
            ax.barh(names, vals, left=left, label=part.replace("_", " "))
            left = [x + v for x, v in zip(left, vals)]
        M = B.extra.get("model", {})
        ax.set(xlabel="ms per iteration", xscale="log" if max(left) > 20 * min(left) else "linear",
               title=f"{M.get('params', 0) / 1e9:.2f} B-param GQA Llama, seq {M.get('seq')}: iteration split")
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(os.path.join(out_dir, "bench_overlap_split.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(12, 0.45 * len(names) + 1.5))
        colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer (visible)": "tab:red",
                  "next forward": "tab:cyan"}
        for y, name in enumerate(names):
            tl = modes[name]["timeline"]
            for what, s, e in tl["phases"]:
                ax.barh(y - 0.15, (e - s) * 1e3, left=s * 1e3, height=0.3, color=colors[what],
                        label=what if y == 0 else None)
            for i, (what, s, e) in enumerate(tl["buckets"]):
                c = "black" if what == "commit" else ("tab:green" if i % 2 else "tab:olive")
                ax.barh(y + 0.2, (e - s) * 1e3, left=s * 1e3, height=0.2, color=c,
                        label="commit" if what == "commit" else "bucket steps (side stream)")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set(xlabel="ms from the iteration's start", xscale="symlog",
               title="one traced iteration per mode (and the next forward)")
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


def merge_previous(B, path):
    """Rows of an earlier run of other parts in ``path`` (same benchmark): kept where this
    run has none of the same name."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return
    if old.get("benchmark") != "bench_overlap":
        return
    names = {r["name"] for r in B.results}
    B.results[:0] = [r for r in old.get("results", []) if r["name"] not in names]
    ox = old.get("extra", {})
    checks = {c["check"] for c in B.checks}
    B.checks[:0] = [c for c in ox.get("checks", []) if c["check"] not in checks]
    modes = {**ox.get("modes", {}), **B.extra.get("modes", {})}
    for k, v in ox.items():
        if k not in B.extra and k not in ("checks", "passed", "pngs", "seconds"):
            B.extra[k] = v
    if modes:
        B.extra["modes"] = modes
    B.extra.setdefault("merged_from", []).append(old.get("command"))
    B.extra.setdefault("merged_devices", []).append(old.get("device"))


PARTS = ("bound", "split", "small", "clip", "accum")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the PNGs")
    ap.add_argument("--json", default=None, help="write the results here (merged with an earlier run's other parts)")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="also merge this earlier run's JSON (repeatable; with --parts '' only merges: no GPU needed)")
    ap.add_argument("--smoke", action="store_true", help="tiny configuration on the CPU (host driver)")
    ap.add_argument("--layers", type=int, default=16)  # 0.85 B parameters with hidden 2048
    ap.add_argument("--attn", choices=("sdpa", "eager"), default=None,
                    help="attention: sdpa (flash only; the default on the GPU) or eager (--smoke's)")
    ap.add_argument("--batch", type=int, default=None,
                    help="split and clip (default 12 with sdpa, 4 with eager; --smoke 2)")
    ap.add_argument("--small-batch", type=int, default=None,
                    help="small and accum (per micro-batch; default 4 with sdpa, 1 with eager; --smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="default 2048 (--smoke 32)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per mode (default 3; --smoke 2)")
    ap.add_argument("--warm", type=int, default=None, help="default 2 (--smoke 1)")
    ap.add_argument("--clip-iters", type=int, default=None, help="timed iterations of the clipping modes (6; 4)")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--curve-steps", type=int, default=None, help="default 300 (--smoke 20)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}, twin, curves")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run: a mode that would end later is not run (the table and JSON "
                         "still come); give a little less than the caller's time limit")
    ap.add_argument("--profile-mode", action="append", default=None, metavar="MODE",
                    help="profile two more iterations of this mode (e.g. host_overlap_b4 for 'host+overlap b4'; repeatable): where the "
                         "link idles (benchmarks/link_profile.py; extra.link_profile, a trace in --out)")
    ap.add_argument("--engine-settings", default="",
                    help="more engine settings for every StreamedAdamW of the run (e.g. depth:6)")
    a = ap.parse_args()
    a.seq = a.seq or (32 if a.smoke else 2048)
    a.attn = a.attn or ("eager" if a.smoke else "sdpa")
    a.curve_steps = a.curve_steps or (20 if a.smoke else 300)
    for k, full, smoke in (("iters", 3, 2), ("warm", 2, 1), ("clip_iters", 6, 4)):
        if getattr(a, k) is None:
            setattr(a, k, smoke if a.smoke else full)
    parts = [p for p in a.parts.split(",") if p]
    if not a.smoke and parts and not torch.cuda.is_available():
        print("SKIP: no CUDA device (--smoke runs a tiny configuration on the CPU)")
        return 77
    B = Bench(a)
    B.cache = {}
    B.profiled = set()  # the modes --profile-mode profiled (slugs)
    B.model = lambda: _model(B)
    B.batches = lambda batch: _batches(B, batch)
    B.attn = a.attn
    given = a.batch, a.small_batch

    def shapes():  # the default batches once the attention is known (_model)
        eager = B.attn == "eager"
        a.batch = given[0] or (2 if a.smoke else 4 if eager else 12)
        a.small_batch = given[1] or (2 if a.smoke else 1 if eager else 4)
    B.shapes = shapes
    shapes()
    # Note [Attention of the benchmark]
    # Rationale: losses must be bit-identical between modes (one process, same init and
    # batches), so every kernel must be deterministic; and the parts need shapes on both
    # sides of the state transfer: eager attention keeps each layer's attention
    # probabilities (FP32 and BF16: batch x heads x seq^2 x 6 bytes, 3 GiB a layer at batch
    # 4 x 2048 with 32 heads), so batch 12 does not fit in 141 GB, and it is slow (forward+
    # backward 341 ms at batch 4, longer than the transfer).
    # Approach: torch.use_deterministic_algorithms(True) (strict: a kernel with no
    # deterministic variant fails instead of warning), cuBLAS workspace config, and SDPA
    # restricted to flash attention: torch's flash backward runs its deterministic
    # variant when deterministic algorithms are on and warn_only is off (it warns only in
    # warn_only mode); cuDNN and memory-efficient attention are switched off (each has a
    # non-deterministic backward by default).  A probe (determinism_probe) runs one batch
    # twice and compares the gradients bit for bit before the model is used.
    # Limits: the probe cannot prove determinism for every shape; the losses of every
    # mode are compared bit for bit anyway.  Where flash does not run or the probe fails,
    # eager attention with batches 4 and 1 (fwd+bwd about 1.6x and 0.4x the transfer).
    torch.use_deterministic_algorithms(True)
    if B.cuda and a.attn == "sdpa":
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.perf_counter()
    parts = ["split" if p == "llama" else p for p in parts]
    fns = dict(twin=kernels_vs_cpu_twin, bound=part_bound, split=part_split, small=part_small, clip=part_clip,
               accum=part_accum, curves=curves)
    for key in parts:
        if key not in fns:
            moved = " (the file tier's is benchmarks/optimizer/bench_file_tier.py)" if key == "file" else ""
            print(f"unknown part {key!r} (parts: {', '.join(fns)}){moved}")
            return 2
    if any(p in parts for p in ("split", "small", "clip", "accum")):
        try:  # first, so that each part's memory is measured against the shared model's
            _model(B)
        except Exception as e:  # noqa: BLE001 (each part then fails building it, with the table)
            traceback.print_exc()
            B.check("model", f"{type(e).__name__}: {str(e)[:160]}", "built", False)
    for key, fn in fns.items():
        if key in parts:
            t1 = time.perf_counter()
            before = B.memory()
            try:  # a failing part still leaves the others' rows and the table
                fn(B)
            except BudgetSpent as e:
                B.check(f"part {key}", f"cut short: {e}", "runs", False)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                B.check(f"part {key}", f"{type(e).__name__}: {str(e)[:160]}", "runs", False)
            # Outside the except clause: the traceback (and the frames holding a failed
            # mode's tensors) is gone, so the next part starts with the memory released.
            if before is not None:
                B.release_check(f"part {key}", before)
            B.extra.setdefault("part_seconds", {})[key] = time.perf_counter() - t1
            print(f"[{key}] {time.perf_counter() - t1:.0f} s", flush=True)
    B.cache.clear()
    if B.cuda:  # with the model freed, nothing may stay allocated (the device's use is not compared)
        B.release_check("the run (model freed)", (0, B.memory()[1]))
    unknown = {_slug(m) for m in a.profile_mode or ()} - B.profiled
    if unknown:
        print(f"[profile] no mode ran as {', '.join(sorted(unknown))}; the modes that ran: "
              f"{', '.join(_slug(n) for n in B.extra.get('modes', {}))}", flush=True)
    for path in ([a.json] if a.json else []) + a.merge:
        merge_previous(B, path)
    os.makedirs(a.out, exist_ok=True)
    files = plots(B, a.out)
    device = (torch.cuda.get_device_name() if B.cuda else "cpu (host driver)" if parts
              else next((d for d in B.extra.get("merged_devices", []) if d), "none"))
    if a.json:
        B.extra.update(pngs=files, seconds=time.perf_counter() - t0)
        B.write_json(a.json, "bench_overlap", device, B.extra, command=" ".join(sys.argv))
    print(f"\n{device}, {time.perf_counter() - t0:.0f} s; PNGs: {', '.join(files) or 'none'}")
    B.print_checks()
    print("\n| mode | iteration ms | forward | backward | visible optimizer |\n|---|---|---|---|---|")
    for name, m in B.extra.get("modes", {}).items():
        s = m["split"]
        print(f"| {name} | {s['iteration'] * 1e3:.1f} | {s['forward'] * 1e3:.1f} | {s['backward'] * 1e3:.1f} | "
              f"{s['visible_optimizer'] * 1e3:.1f} |")
    return 0 if B.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
