"""Acceptance: bit-identical losses under native PyTorch, MemPool mode, full replacement,
LD_PRELOAD mode, and the C++ LibTorch trainer (native and with install()).

    python check_losses.py --trainer PATH --preload PATH [--steps N]

Each mode runs in its own process (an allocator is chosen once per process).  Exit 77
without a GPU (ctest: Skipped), 1 on any difference or failure.
"""
import argparse
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if p.returncode == 77:
        print("SKIPPED: no GPU")
        sys.exit(77)
    if p.returncode != 0:
        print(f"FAIL: {' '.join(cmd)} exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        sys.exit(1)
    return [float.fromhex(line) for line in p.stdout.split() if line.startswith(("0x", "-0x"))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--preload", required=True)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    py = [sys.executable, os.path.join(here, "train.py")]
    steps = str(a.steps)
    results = {
        "python native": run(py + ["native", steps]),
        "python MemPool": run(py + ["mempool", steps]),
        "python replacement": run(py + ["replace", steps]),
        "python LD_PRELOAD": run(py + ["preload", steps], {"LD_PRELOAD": a.preload}),
        "C++ native": run([a.trainer, "native", steps]),
        "C++ install()": run([a.trainer, "install", steps]),
    }
    ref = results["python native"]
    ok = len(ref) == a.steps and ref[-1] < ref[0]
    print(f"{'mode':<20} {'steps':>5} {'first loss':>22} {'last loss':>22}  identical")
    for name, losses in results.items():
        same = losses == ref
        ok &= same
        print(f"{name:<20} {len(losses):>5} {losses[0]:>22.17g} {losses[-1]:>22.17g}  {'yes' if same else 'NO'}")
    print("losses bit-identical across modes: " + ("PASS" if ok else "FAIL"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
