"""Do compressed Adam moments train like FP32 moments?  (The mark: after 300 steps on the
same data the loss is within 0.5% (BF16) / 1% (int8) of FP32 moments.)  CPU, host driver.

A small transformers Llama (FP32, random init, seeds --seeds) trained by StreamedAdamW on the
host tier with moment_dtype fp32, bf16 and int8, --steps steps on the same batches of a
sparse bigram language for every format: by default one distinct batch per step (one epoch,
as pretraining); --batches 32 cycles 32 batches, a stress test where the model memorizes them
and the loss keeps falling, so that the optimizer's precision shows most.  The loss of a
format is the mean over the last 20 steps, averaged over the seeds (one seed's trajectory is
chaotic: a rounding anywhere moves it by about a percent); the check fails when a format is
further from FP32 than its tolerance.  See Note [Moment formats] (measured figures there).

    DEFERALLOC_OPTIMIZER_LIB=build/optimizer/libdeferalloc_optimizer.so PYTHONPATH=python \\
      python3 benchmarks/optimizer/moment_convergence.py [--ci] [--json PATH] [--out DIR]

--ci: a smaller model and one seed (ctest, label torch); the default (2 seeds, 300 steps)
takes a few minutes on two cores.  --setting bf16-params: BF16 model parameters, lr 1e-3, a
deeper model (the regime of bench_overlap.py's GPU curves, shrunk; seeds 3,5; about 4 minutes
a format on two cores); --noise-floor adds fp32': FP32 moments from a model one ulp away in one
parameter, reported, not checked.  Exit status 1 when a check fails.
"""
import argparse
import json
import os
import sys
import time

import torch

from deferalloc import optim

TOL = {"bf16": 0.005, "int8": 0.01}


def bigram_batches(vocab, batch, seq, n, seed=1):
    """n batches of token streams from a fixed table of 4 successors per token."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    out = []
    for _ in range(n):
        t = torch.empty(batch, seq, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        pick = torch.randint(0, 4, (batch, seq), generator=g)
        for j in range(1, seq):
            t[:, j] = succ[t[:, j - 1], pick[:, j]]
        out.append(t)
    return out


def model_of(a, seed, perturb=False):
    """The Llama of --setting (FP32 or, for bf16-params, BF16 parameters as bench_overlap's
    curves); perturb: one parameter moved by one ulp (the noise floor's run)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads[0], num_key_value_heads=a.heads[1], max_position_embeddings=256,
                      attn_implementation="eager", tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg)
    if a.bf16:
        m = m.to(torch.bfloat16)
    if perturb:
        with torch.no_grad():
            w = next(m.parameters()).view(-1)[:1]
            w.view(torch.int16 if a.bf16 else torch.int32).add_(1)  # the next representable value
    return m


def train(fmt, seed, a, data):
    perturb = fmt == "fp32'"
    m = model_of(a, seed, perturb)
    fmt = "fp32" if perturb else fmt
    opt = optim.StreamedAdamW(m.parameters(), lr=a.lr, weight_decay=0.01, window_mb=4, moment_dtype=fmt,
                              settings="host_granularity_kb:64")  # the host driver's small pages
    losses = []
    for t in range(a.steps):
        x = data[t % len(data)]
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ci", action="store_true", help="smaller model, one seed")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default=None, help="comma-separated model seeds (default 0,1; --ci: 0)")
    ap.add_argument("--batches", type=int, default=0, help="distinct batches, cycled (0: one per step)")
    ap.add_argument("--lr", type=float, default=None, help="default 3e-3 (fp32 setting), 1e-3 (bf16-params)")
    ap.add_argument("--setting", choices=("fp32", "bf16-params"), default="fp32",
                    help="bf16-params: BF16 model parameters (FP32 main params), lr 1e-3, 6 layers, vocab 4096, "
                         "batches of 8x128, seeds 3,5: the regime of bench_overlap's GPU curves, shrunk")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also train FP32 moments from a model one ulp away in one parameter (fp32')")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="directory for moment_convergence.png")
    a = ap.parse_args()
    a.bf16 = a.setting == "bf16-params"
    if a.bf16:
        a.hidden, a.layers, a.vocab, a.batch, a.seq, a.inter, a.heads, data_seed = (128, 6, 4096, 8, 128, 320, (2, 1), 4)
        if a.ci:
            a.layers, a.vocab, a.seq = 4, 2048, 64
    else:
        a.hidden, a.layers, a.vocab, a.batch, a.seq = (64, 2, 256, 8, 64) if a.ci else (128, 2, 512, 16, 64)
        a.inter, a.heads, data_seed = 2 * a.hidden, (4, 2), 1
    a.lr = a.lr or (1e-3 if a.bf16 else 3e-3)
    seeds = [int(s) for s in (a.seeds or ("0" if a.ci else "3,5" if a.bf16 else "0,1")).split(",")]
    torch.set_num_threads(1)  # the optimizer's CPU twin and torch share the cores; also reproducible
    a.batches = a.batches or a.steps
    data = bigram_batches(a.vocab, a.batch, a.seq, a.batches, seed=data_seed)
    t0 = time.perf_counter()
    curves = {f: {} for f in ("fp32", "fp32'", "bf16", "int8") if f != "fp32'" or a.noise_floor}
    for seed in seeds:
        for f in curves:
            curves[f][seed] = train(f, seed, a, data)
            print(f"seed {seed} {f}: loss {curves[f][seed][0]:.3f} -> tail {sum(curves[f][seed][-20:]) / 20:.4f}",
                  flush=True)
    tail = {f: sum(sum(c[s][-20:]) / 20 for s in seeds) / len(seeds) for f, c in curves.items()}
    rows, ok = [], True
    print(f"\nLlama hidden {a.hidden} x {a.layers} layers, vocab {a.vocab}, {'BF16' if a.bf16 else 'FP32'} params, "
          f"lr {a.lr:g}, {a.steps} steps over {a.batches} batches of {a.batch}x{a.seq}, seeds {seeds}, "
          f"{time.perf_counter() - t0:.0f} s")
    for f in [f for f in curves if f != "fp32"]:
        d = (tail[f] - tail["fp32"]) / tail["fp32"]
        per_seed = [(sum(curves[f][s][-20:]) - sum(curves["fp32"][s][-20:])) / sum(curves["fp32"][s][-20:])
                    for s in seeds]
        good = abs(d) <= TOL.get(f, float("inf"))  # fp32' (the noise floor) is reported, not checked
        ok &= good
        print(f"  {f}: {tail[f]:.4f} vs fp32 {tail['fp32']:.4f}: {d * 100:+.2f}% (per seed "
              f"{', '.join(f'{x * 100:+.2f}%' for x in per_seed)})"
              + (f", tolerance {TOL[f] * 100:g}%: {'pass' if good else 'FAIL'}" if f in TOL else " (noise floor)"))
        rows.append(dict(name=f"loss_diff_{f.replace(chr(39), '_perturbed')}_vs_fp32", value=d * 100, unit="%", baseline="loss_fp32"))
    rows.insert(0, dict(name="loss_fp32", value=tail["fp32"], unit="nats", baseline=None))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(benchmark="moment_convergence", schema=1, device="cpu (host driver)",
                           command=" ".join(sys.argv), results=rows,
                           extra=dict(setting=a.setting, seeds=seeds, steps=a.steps, tolerance_pct={k: v * 100 for k, v in TOL.items()},
                                      tails=tail, curves={f: {str(s): v for s, v in c.items()} for f, c in curves.items()},
                                      passed=ok)), fh)
    if a.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        os.makedirs(a.out, exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for f, c in curves.items():
            for s in seeds:
                ax.plot(c[s], lw=1, label=f"{f} moments, seed {s}")
        ax.set(xlabel="step", ylabel="loss", yscale="log", title="StreamedAdamW, host tier, CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "moment_convergence.png"), dpi=110)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
