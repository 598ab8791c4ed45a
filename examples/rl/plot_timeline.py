"""One RL step of examples/rl/colocated.py as a timeline (PNG): each side's wake, work and
sleep, from a colocated.py report or check_cycle.py's JSON (its deferalloc run, and its
torch_memory_saver run below it when there is one).

    python examples/rl/plot_timeline.py rl_cycle.json rl_step.png [--step N]

The step shown is the last one (``--step`` picks another).  Needs matplotlib.
"""
from __future__ import annotations

import argparse
import json
import sys

# side -> [(phase, end key, seconds key: the phase starts at end - seconds; None: at the previous phase's end)]
PHASES = {"inference": [("wake", "t_wake_end", "wake_s"), ("load weights", "t_load_end", None),
                        ("generate", "t_generate_end", None), ("sleep", "t_sleep_end", "sleep_s")],
          "trainer": [("wake", "t_wake_end", "wake_s"), ("train", "t_train_end", None),
                      ("publish", "t_publish_end", None), ("sleep", "t_sleep_end", "sleep_s")]}
COLORS = {"wake": "tab:red", "sleep": "tab:orange", "load weights": "tab:gray", "generate": "tab:green",
          "train": "tab:blue", "publish": "tab:purple"}


def segments(row: dict) -> list:
    """(side, phase, start s, length s) of one step row, times from the step's first wake."""
    out = []
    for side, phases in PHASES.items():
        t = row[side]
        prev = t["t_wake_end"] - t["wake_s"]
        for phase, end_key, seconds_key in phases:
            end = t[end_key]
            start = end - t[seconds_key] if seconds_key else prev
            out.append((side, phase, start, max(end - start, 0.0)))
            prev = end
    t0 = min(s for _, _, s, _ in out)
    return [(side, phase, s - t0, n) for side, phase, s, n in out]


def plot(report: dict, png: str, step: int | None = None, others: dict | None = None) -> bool:
    """Writes the timeline of ``step`` (default: the last) of ``report`` and of each report in
    ``others`` (name -> report or None) below it; False (said why) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_timeline: matplotlib is not installed; no plot")
        return False
    runs = [(report.get("args", {}).get("saver", "deferalloc"), report)]
    runs += [(name, r) for name, r in (others or {}).items() if r]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 + 1.3 * len(runs)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs):
        rows = {x["step"]: x for x in r["steps"]}
        row = rows[step] if step in rows else r["steps"][-1]
        seen = set()
        for side, phase, start, length in segments(row):
            y = 1 if side == "inference" else 0
            ax.barh(y, length * 1e3, left=start * 1e3, color=COLORS[phase], edgecolor="black", linewidth=0.3,
                    label=phase if phase not in seen else None)
            seen.add(phase)
        ax.set_yticks([0, 1], ["trainer", "inference"])
        share = 100 * row["share"]
        ax.set_title(f"{name}: step {row['step']}, {row['wall_s'] * 1e3:.0f} ms, sleep + wake "
                     f"{row['sleep_wake_s'] * 1e3:.1f} ms ({share:.1f}%)", fontsize=9)
        ax.set_xlabel("ms from the step's start")
        ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot_timeline: wrote {png}")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("png")
    ap.add_argument("--step", type=int)
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    if "runs" in data:  # check_cycle.py's JSON
        report, others = data["runs"]["deferalloc"], {"torch_memory_saver": data["runs"].get("tms")}
    else:
        report, others = data, None
    return 0 if plot(report, args.png, args.step, others) else 1


if __name__ == "__main__":
    sys.exit(main())
