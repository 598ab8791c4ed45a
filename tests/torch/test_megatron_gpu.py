"""GPU acceptance of deferalloc.megatron (issue 14), one H200, a few minutes.

Runs examples/megatron/train_gpt.py under torchrun (1 GPU, a megatron-core GPTModel of the
local layer spec, BF16 params, DistributedOptimizer) five times and checks:
  (a) 20 steps: losses bit-identical with deferalloc (host and file tiers) to Megatron's own
      DistributedOptimizer with FP32 main params (its inner AdamW fused=True; deterministic);
  (b) peak HBM (cuMemGetInfo sampled through the steps) lower by at least
      12 B/param x params - window, and the same bound for HBM in use between steps;
  (c) optimizer-phase time (optimizer.step(), Megatron's whole step) >= 5x faster than
      megatron-core's HybridDeviceOptimizer(offload_fraction=1.0) in the same run;
  (d) Megatron dist-checkpointing save at step 10 (host tier), load in a new process,
      steps 11-20 identical and the loaded optimizer state equal to the saved one.

    DEFERALLOC_LIB=build/allocator/libdeferalloc.so PYTHONPATH=python:/tmp/site \\
      python tests/torch/test_megatron_gpu.py [--megatron-wheel megatron_core-0.16.1-*.whl]

(--megatron-wheel installs the wheel with --no-deps into a temporary directory; without
it megatron-core must be importable.)  Exit 0 when every check passes, 1 when one fails,
77 without a GPU or megatron-core.  Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.normpath(os.path.join(HERE, "..", "..", "examples", "megatron", "train_gpt.py"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-wheel")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-at", type=int, default=10)
    ap.add_argument("--hdo-steps", type=int, default=5)
    ap.add_argument("--window-mb", type=int, default=512)
    ap.add_argument("--model", default="--layers 8 --hidden 1024 --heads 16 --vocab 32768 --seq 512 --batch 4",
                    help="train_gpt.py's model options, one string")
    args = ap.parse_args()
    args.model = shlex.split(args.model)

    import torch
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    work = tempfile.mkdtemp(prefix="dfa_megatron_")
    env = dict(os.environ)
    env.pop("DEFERALLOC_CONF", None)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.megatron_wheel:
        site = os.path.join(work, "site")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site,
                        args.megatron_wheel], check=True)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), site) if p)
    probe = subprocess.run([sys.executable, "-c", "import megatron.core as m; print(m.__version__)"], env=env,
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != "0.16.1":
        print(f"SKIP: megatron-core 0.16.1 not importable ({probe.stdout.strip() or probe.stderr.strip()[-300:]})")
        return 77

    def run(name: str, extra: list[str]) -> dict | None:
        summary = os.path.join(work, f"{name}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", EXAMPLE,
               *args.model, "--window-mb", str(args.window_mb), "--summary", summary, *extra]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        print(f"--- {name} ({time.perf_counter() - t0:.0f} s, rc {r.returncode})", flush=True)
        print("\n".join(line for line in r.stdout.splitlines() if line.startswith(("step", "params"))), flush=True)
        if r.returncode != 0:
            print(r.stdout[-2000:], r.stderr[-4000:], flush=True)
            return None
        with open(summary) as f:
            return json.load(f)

    steps = ["--steps", str(args.steps)]
    own = run("megatron", steps)
    host = run("deferalloc-host", steps + ["--deferalloc", "host", "--save", f"{work}/ckpt_host",
                                           "--save-at", str(args.save_at)])
    file_ = run("deferalloc-file", steps + ["--deferalloc", "file", "--directory", f"{work}/state"])
    resumed = run("deferalloc-host-resumed", steps + ["--deferalloc", "host", "--load", f"{work}/ckpt_host"])
    hdo = run("megatron-hdo", ["--steps", str(args.hdo_steps), "--hdo"])

    rows: list[tuple[str, str, bool]] = []

    def check(what: str, value: str, ok: bool) -> None:
        rows.append((what, value, ok))

    def same_losses(a, b, first=1):
        if a is None or b is None:
            return False
        return {k: v for k, v in a["losses"].items() if int(k) >= first} == \
               {k: v for k, v in b["losses"].items() if int(k) >= first}

    for name, r in (("host", host), ("file", file_)):
        check(f"losses {name} == Megatron FP32 ({args.steps} steps)",
              "bit-identical" if same_losses(r, own) else "differ / failed", same_losses(r, own))
    if own and host:
        n = own["params"]
        bound = 12 * n - args.window_mb * 2**20
        for name, r in (("host", host), ("file", file_)):
            if r is None:
                continue
            saved = own["peak_hbm"] - r["peak_hbm"]
            check(f"peak HBM saved, {name} (>= {bound / 2**30:.2f} GiB)",
                  f"{saved / 2**30:.2f} GiB ({own['peak_hbm'] / 2**30:.2f} -> {r['peak_hbm'] / 2**30:.2f})",
                  saved >= bound)
            saved_between = own["between_hbm"] - r["between_hbm"]
            check(f"HBM between steps saved, {name} (>= {bound / 2**30:.2f} GiB)",
                  f"{saved_between / 2**30:.2f} GiB", saved_between >= bound)
        check("engine peak state HBM <= window", f"{host.get('engine_peak_backed', 0) / 2**20:.0f} MiB",
              host.get("engine_peak_backed", 1 << 62) <= args.window_mb * 2**20)
    if host and hdo:
        t_host = statistics.median(host["optimizer_seconds"][2:])
        t_hdo = statistics.median(hdo["optimizer_seconds"][1:])
        t_own = statistics.median(own["optimizer_seconds"][2:]) if own else float("nan")
        check("optimizer step: HDO / deferalloc host (>= 5)",
              f"{t_hdo / t_host:.1f}x ({t_hdo * 1e3:.0f} / {t_host * 1e3:.0f} ms; Megatron resident {t_own * 1e3:.0f} ms)",
              t_hdo / t_host >= 5)
    else:
        check("optimizer step: HDO / deferalloc host (>= 5)", "a run failed", False)
    check(f"save at {args.save_at}, load in a new process, continue to {args.steps}",
          "identical" if same_losses(resumed, host, args.save_at + 1) else "differ / failed",
          same_losses(resumed, host, args.save_at + 1) and resumed is not None
          and resumed.get("loaded_digest") == host.get("saved_digest"))

    print(f"\nmegatron-core GPTModel, {own['params'] / 1e6:.0f} M params, window {args.window_mb} MiB"
          if own else "\nmegatron-core GPTModel")
    width = max(len(r[0]) for r in rows)
    for what, value, ok in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {what:<{width}}  {value}")
    failed = sum(not ok for _, _, ok in rows)
    print(f"{len(rows) - failed}/{len(rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
