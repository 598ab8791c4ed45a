#!/usr/bin/env python3
"""The before/after comparison's tools on synthetic Google Benchmark output (no GPU, no torch):
benchmarks/bench_json.py convert reads a repeated row by its median and records how far its
repetitions spread (over several processes' runs too); benchmarks/compare_builds.py calls a change "noise" when that spread is wider
than the tolerance and "outside" when it is not, and names the two builds when given labels; bench_json.py missed keeps a run that missed only
performance targets; given a bench_overlap JSON, that its checks carry the marks; and that
tests/torch/test_megatron_gpu.py's parts, evaluated on made-up run summaries, each report only
checks and figures of the whole run (none of a run the part does not do), all of them together."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MR64 = "BM_materialize_release/reservations:64/warm:1/batch:0/real_time"
PG64 = "BM_per_granule_baseline/reservations:64/real_time"
failures = []


def check(what: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}")
    if not ok:
        failures.append(what)


def gbench(rows: dict[str, list[float | None]]) -> dict:
    """Google Benchmark JSON: each row's bytes_per_second per repetition (one value: run once;
    None: that repetition failed).  The aggregates carry a repetition index too, so that only
    their run_type keeps them out of the repetitions."""
    out = []
    for name, values in rows.items():
        n = len(values)
        for k, v in enumerate(values):
            b = {"name": name, "run_name": name, "run_type": "iteration", "real_time": 1.0, "time_unit": "ms"}
            b.update({"error_occurred": True, "error_message": "failed"} if v is None else {"bytes_per_second": v})
            if n > 1:
                b.update(repetitions=n, repetition_index=k)
            out.append(b)
        ran = sorted(v for v in values if v is not None)
        if n > 1:
            for agg, v in (("mean", 1e12), ("median", ran[len(ran) // 2])):
                out.append({"name": f"{name}_{agg}", "run_name": name, "run_type": "aggregate",
                            "aggregate_name": agg, "repetitions": n, "repetition_index": 0, "real_time": 1.0,
                            "time_unit": "ms", "bytes_per_second": v})
    return {"context": {"host_name": "test"}, "benchmarks": out}


def convert(tmp: str, tag: str, rows: dict, *extra: str, more: tuple[str, ...] = ()) -> dict:
    """bench_json.py convert of these rows (with `more`: further processes' Google Benchmark files)."""
    src, dst = os.path.join(tmp, f"{tag}.gb.json"), os.path.join(tmp, f"{tag}.json")
    with open(src, "w") as f:
        json.dump(gbench(rows), f)
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_json.py"), "convert", src, *more, "--out", dst,
                    *extra], check=True, stdout=subprocess.DEVNULL)
    with open(dst) as f:
        return json.load(f)


def megatron_summary(name: str) -> dict:
    """A made-up train_gpt.py summary of test_megatron_gpu's run ``name`` on which every check
    passes: the same loss at each step in every run, Megatron's own HBM 20 GiB, the tiers' 10."""
    steps = 14 if name == "deferalloc-auto-timing" else 4 if "timing" in name or "bf16" in name else 20
    gib = 2**30
    between = {"used": 9 * gib, "torch_reserved": 8 * gib, "torch_allocated": 7 * gib}
    return {"params": 500_000_000, "model_class": "HybridModel",
            "losses": {str(k): 10 - k / 8 for k in range(11 if name.endswith("resumed") else 1, steps + 1)},
            "peak_hbm": (20 if name.startswith("megatron") else 10) * gib,
            "between_hbm": (19 if name.startswith("megatron") else 9) * gib,
            "hbm": {"between": between, "non_torch_between": gib}, "engine_peak_backed": 256 * 2**20,
            "optimizer_seconds": [1.0 if "hdo" in name else 0.1] * steps, "step_seconds": [0.2] * steps,
            "reference": [{"inner": "torch.optim.adamw.AdamW", "fused": ["True"], "param_dtypes": ["torch.float32"],
                           "lr_type": "float", "hdo": {"cpu_optimizers": 1}}],
            "engine": [{"seconds": 0.1, "map_seconds": 0.01, "retire_seconds": 0.01, "pieces": 8,
                        "python_seconds": 0.001}],
            "backward_step": {"step_aside": "plain"}, "saved_digest": "d", "loaded_digest": "d"}


def megatron_parts() -> None:
    """test_megatron_gpu's parts (PARTS) against --part all, on megatron_summary's runs."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "torch"))
    import argparse
    import test_megatron_gpu as mg
    args = argparse.Namespace(perf_targets="report", steps=20, save_at=10, auto_steps=14, window_mb=512,
                              model="m", timing_model="m")

    def evaluate(part: str, failed: str = "") -> tuple[set, set]:
        runs = {r: None if r == failed else megatron_summary(r) for r in mg.runs_of(part)}
        rows, results = mg.evaluate(args, runs, 50e9 if "deferalloc-host-timing" in runs else None)
        return set(rows), {json.dumps(r, sort_keys=True) for r in results}

    every_rows, every_figures = evaluate("all")
    check("test_megatron_gpu all: every check passes on the made-up runs",
          all(ok is not False for _, _, ok in every_rows), str(sorted(r for r in every_rows if r[2] is False)))
    check("test_megatron_gpu: the parts' runs are all the runs",
          set().union(*map(mg.runs_of, mg.PARTS)) == set(mg.RUNS), ", ".join(mg.PARTS))
    union_rows, union_figures = set(), set()
    for part in mg.PARTS:
        rows, figures = evaluate(part)
        union_rows |= rows
        union_figures |= figures
        check(f"test_megatron_gpu {part}: its checks are checks of the whole run, none failing", rows <= every_rows,
              str(sorted(rows - every_rows)))
        check(f"test_megatron_gpu {part}: its figures are figures of the whole run", figures <= every_figures,
              str(sorted(figures - every_figures)))
    check("test_megatron_gpu: the parts' checks are all the checks", union_rows == every_rows,
          str(sorted(every_rows - union_rows)))
    check("test_megatron_gpu: the parts' figures are all the figures", union_figures == every_figures,
          str(sorted(every_figures - union_figures)))
    for part in mg.PARTS:  # a run of the part that failed fails a check of it
        for run in mg.runs_of(part):
            rows, _ = evaluate(part, failed=run)
            failed = sorted(what.strip() for what, _, ok in rows if ok is False)
            check(f"test_megatron_gpu {part}: {run} failed fails a check", bool(failed), "; ".join(failed))


def link_profile_parts() -> None:
    """benchmarks/link_profile.py on a made-up Chrome trace: two H2D copies with a 3 ms gap
    during which a backward kernel and then an engine kernel ran, D2H copies overlapping
    them, a gap shorter than the threshold left out."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import link_profile as lp

    def ev(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}
    h2d, d2h = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"
    trace = [ev("gpu_memcpy", h2d, 1000, 2000, bytes=100_000_000), ev("gpu_memcpy", h2d, 6000, 1000, bytes=50_000_000),
             ev("gpu_memcpy", h2d, 7500, 500, bytes=25_000_000),  # 0.5 ms after the last: not a gap at 1 ms
             ev("gpu_memcpy", d2h, 2000, 3000, bytes=150_000_000),
             ev("kernel", "void at::native::backward_kernel<float>", 3000, 2000),
             ev("kernel", "deferalloc::optim::detail::adamw_vec4(...)", 5000, 500),
             ev("kernel", "void at::native::forward_kernel<float>", 6500, 1500),  # the model's idle: 5.0-6.5
             ev("cuda_runtime", "cudaEventSynchronize", 5200, 1200),
             ev("cpu_op", "aten::mm", 0, 9000)]  # (host events are not the device's)
    a = lp.analyse(trace, gap_ms=1.0)
    h = a["h2d"]
    check("link_profile: busy time, bytes and rate of a direction",
          h["busy_ms"] == 3.5 and h["bytes"] == 175_000_000 and abs(h["gbps_busy"] - 50.0) < 1e-9, str(h))
    gaps = h["gaps"]
    check("link_profile: a gap at least the threshold, with the kernels in it (the engine's apart)",
          len(gaps) == 1 and gaps[0]["at_ms"] == 2.0 and gaps[0]["ms"] == 3.0 and gaps[0]["engine_kernel_ms"] == 0.5
          and gaps[0]["kernels"][0] == ["void at::native::backward_kernel<float>", 2.0], str(gaps))
    check("link_profile: both directions busy at once, and either",
          a["both_busy_ms"] == 1.0 and a["either_busy_ms"] == 5.5 and a["window_ms"] == 7.0, str(a))
    c = a["compute"]
    check("link_profile: the model's kernels' gap, with what the host was in",
          c["busy_ms"] == 3.5 and len(c["gaps"]) == 1 and c["gaps"][0]["at_ms"] == 4.0 and c["gaps"][0]["ms"] == 1.5
          and c["gaps"][0]["host"][0] == ["aten::mm [tid None]", 1.5] and c["gaps"][0]["host"][1][1] == 1.2, str(c))
    both = lp._intersect([(0, 2), (3, 5), (6, 8)], [(1, 4), (4.5, 6), (7, 8)])
    check("link_profile: intersections of several pairs, equal end points", both == [(1, 2), (3, 4), (4.5, 5), (7, 8)],
          str(both))
    one = lp.analyse([ev("gpu_memcpy", h2d, 0, 1000, bytes=1), ev("kernel", "k", 0, 500)])
    check("link_profile: a direction without copies", one["d2h"]["copies"] == 0 and one["d2h"]["first_ms"] is None
          and one["d2h"]["gaps"] == [] and one["h2d"]["busy_ms"] == 1.0, str(one))
    check("link_profile: the report names the gap", "gap at     2.0 ms:   3.00 ms" in lp.report(a, 50.0),
          lp.report(a, 50.0))
    # Host reads: an .item() called while its stream still ran a kernel, whose 4-byte copy then
    # waited 3 ms behind a write-back on the copy engine; a second one with nothing before it.
    reads = [ev("kernel", "void at::native::norm_kernel", 0, 1000) | {"tid": 7},
             ev("gpu_memcpy", d2h, 0, 4000, bytes=150_000_000) | {"tid": 147},
             ev("cuda_runtime", "cudaMemcpyAsync", 500, 10, correlation=11) | {"tid": 100},
             ev("gpu_memcpy", d2h, 4000, 5, bytes=4, correlation=11) | {"tid": 7},
             ev("cuda_runtime", "cudaMemcpyAsync", 5000, 10, correlation=12) | {"tid": 100},
             ev("gpu_memcpy", d2h, 5001, 4, bytes=4, correlation=12) | {"tid": 7}]
    r = lp.analyse(reads)["host_reads"]
    check("link_profile: host reads, the time behind other copies apart from the stream's own work",
          r["count"] == 2 and abs(r["wait_ms"] - 3.51) < 1e-9 and abs(r["behind_ms"] - 3.001) < 1e-9
          and r["longest"][0]["at_ms"] == 0.5 and r["longest"][0]["behind_ms"] == 3.0, str(r))
    check("link_profile: the report names the host reads", "host reads (small D2H copies a host thread waited "
          "for): 2, 3.5 ms, 3.0 ms of it" in lp.report(lp.analyse(reads)), lp.report(lp.analyse(reads)))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        # Three repetitions of ours (10, 12, 20 GB/s), the baseline steady at 5 GB/s.
        before = convert(tmp, "before", {MR64: [10e9, 20e9, 12e9], PG64: [5e9, 5e9, 5e9]},
                         "--name", "bench_reservations_host")
        values = {r["name"]: r["value"] for r in before["results"]}
        check("--name names the benchmark", before["benchmark"] == "bench_reservations_host", before["benchmark"])
        check("a repeated row is its median", abs(values.get("64 reservations, warm", 0) - 12.0) < 1e-9,
              str(values.get("64 reservations, warm")))
        spread = before["extra"].get("repetition_spread", {})
        check("the repetitions' spread is recorded", abs(spread.get("64 reservations, warm", 0) - 10 / 12) < 1e-9,
              str(spread))
        check("a steady row spreads 0", spread.get("per-granule VMM, 64 reservations") == 0.0, str(spread))
        failed = convert(tmp, "failed", {MR64: [10e9, None, 15e9], PG64: [5e9, 5e9, 5e9]})
        check("a failed repetition is left out of the spread",
              abs(failed["extra"].get("repetition_spread", {}).get("64 reservations, warm", 0) - 5 / 12.5) < 1e-9,
              str(failed["extra"].get("repetition_spread")))
        # Two processes' runs read as one: the median and the spread over all their repetitions.
        with open(os.path.join(tmp, "proc2.gb.json"), "w") as f:
            json.dump(gbench({MR64: [20e9, 22e9], PG64: [5e9, 5e9]}), f)
        procs = convert(tmp, "proc1", {MR64: [10e9, 12e9], PG64: [5e9, 5e9]},
                        more=(os.path.join(tmp, "proc2.gb.json"),))
        pv = {r["name"]: r["value"] for r in procs["results"]}
        check("several processes' runs: the median over all their repetitions",
              abs(pv.get("64 reservations, warm", 0) - 16.0) < 1e-9, str(pv.get("64 reservations, warm")))
        check("several processes' runs: the spread between the processes counts",
              abs(procs["extra"].get("repetition_spread", {}).get("64 reservations, warm", 0) - 12 / 16) < 1e-9,
              str(procs["extra"].get("repetition_spread")))
        # A repetition that failed in one process is left out; a row that only one process ran
        # is the median of its own rows.
        with open(os.path.join(tmp, "proc4.gb.json"), "w") as f:
            json.dump(gbench({MR64: [None, 30e9]}), f)
        odd = convert(tmp, "proc3", {MR64: [10e9, 12e9], PG64: [5e9, 7e9]}, more=(os.path.join(tmp, "proc4.gb.json"),))
        ov = {r["name"]: r["value"] for r in odd["results"]}
        check("several processes: a failed repetition is left out of the median",
              abs(ov.get("64 reservations, warm", 0) - 12.0) < 1e-9, str(ov))
        check("several processes: a row run by one of them is that one's median",
              abs(ov.get("per-granule VMM, 64 reservations", 0) - 6.0) < 1e-9, str(ov))
        once = convert(tmp, "once", {MR64: [11e9], PG64: [5e9]})
        check("a row run once is its value, with no spread recorded",
              once["results"][0]["value"] == 11.0 and "repetition_spread" not in once["extra"], json.dumps(once)[:200])
        # After: ours and the baseline 10% faster; ours within its repetitions' spread, the baseline not.
        convert(tmp, "after", {MR64: [11e9, 13.2e9, 13.2e9], PG64: [5.5e9, 5.5e9, 5.5e9]},
                        "--name", "bench_reservations_host")
        cmp = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare_builds.py"),
                              os.path.join(tmp, "before.json"), os.path.join(tmp, "after.json"),
                              "--json", os.path.join(tmp, "cmp.json")],
                             check=True, capture_output=True, text=True).stdout
        ours = next((ln for ln in cmp.splitlines() if "64 reservations, warm" in ln), "")
        base = next((ln for ln in cmp.splitlines() if "per-granule VMM, 64" in ln), "")
        check("a change inside the run's own spread is noise", ours.endswith("<-- noise"), ours)
        check("a change outside a steady row's spread is outside", base.endswith("<-- outside"), base)
        # Instruction counts: fewer is faster; a change wider than the spread is outside.
        for tag, value in (("ib", 100.0), ("ia", 90.0)):
            with open(os.path.join(tmp, f"{tag}.json"), "w") as f:
                json.dump({"benchmark": "bench_reservations_instructions", "schema": 1, "device": "t", "command": "t",
                           "results": [{"name": "materialize", "value": value, "unit": "instructions",
                                        "baseline": None}], "extra": {}}, f)
        ins = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare_builds.py"),
                              os.path.join(tmp, "ib.json"), os.path.join(tmp, "ia.json")],
                             check=True, capture_output=True, text=True).stdout
        row = next((ln for ln in ins.splitlines() if "materialize" in ln), "")
        check("fewer instructions after is faster (1.111x), outside", "1.111x" in row and row.endswith("<-- outside"), row)
        with open(os.path.join(tmp, "cmp.json")) as f:
            doc = json.load(f)
        own = doc["extra"]["own_spread"]
        check("compare_builds' JSON carries the spread within the run",
              abs(own.get("bench_reservations_host: 64 reservations, warm", 0) - 10 / 12) < 1e-9, str(own))
        check("compare_builds' JSON without labels names no sides", "sides" not in doc["extra"], str(doc["extra"]))
        labelled = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare_builds.py"),
                                   os.path.join(tmp, "before.json"), os.path.join(tmp, "after.json"),
                                   "--json", os.path.join(tmp, "cmp-labelled.json"), "--before-label", "aaa111",
                                   "--after-label", ""], check=True, capture_output=True, text=True).stdout
        with open(os.path.join(tmp, "cmp-labelled.json")) as f:
            extra = json.load(f)["extra"]
        check("--before-label/--after-label name the sides (an empty one unknown), printed first and in the JSON",
              labelled.startswith("before aaa111 / after unknown\n") and extra.get("sides") == "before aaa111 / after unknown"
              and extra.get("before") == "aaa111" and extra.get("after") == "unknown", str(extra))
        # bench_json.py missed: a run that missed only performance targets keeps its figures.
        def missed(tag: str, checks: list[dict], *extra: str) -> tuple[int, str]:
            path = os.path.join(tmp, f"{tag}.json")
            with open(path, "w") as f:
                json.dump({"benchmark": "bench_overlap", "schema": 1, "device": "t", "command": "t", "results": [],
                           "extra": {"checks": checks}}, f)
            r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_json.py"), "missed", path,
                                *extra], capture_output=True, text=True)
            return r.returncode, (r.stdout + r.stderr).strip()
        ok = dict(check="losses bit-identical", value="yes", target="yes", ok=True, perf=False)
        slow = dict(check="overlap / resident", value="1.10x", target="<= 1.1x", ok=False, perf=True)
        wrong = dict(check="losses bit-identical", value="no", target="yes", ok=False, perf=False)
        unmarked = dict(check="overlap / resident", value="1.10x", target="<= 1.1x", ok=False)
        rc, out = missed("perf", [ok, slow])
        check("a run that missed only a performance target stands, naming it", rc == 0 and "1.10x" in out, out)
        rc, out = missed("wrong", [wrong, slow])
        check("a failed correctness check leaves the run unmeasured", rc == 1 and "not a performance target" in out, out)
        rc, out = missed("unmarked", [unmarked])
        check("a failed check without the perf mark leaves the run unmeasured", rc == 1 and "(unmarked)" in out, out)
        missed("marked", [ok, slow])
        rc, out = missed("unmarked-borrowing", [unmarked], "--marks", os.path.join(tmp, "marked.json"))
        check("an unmarked check takes the other build's mark of the same check (--marks)", rc == 0 and "1.10x" in out,
              out)
        rc, out = missed("unmarked-no-such", [unmarked], "--marks", os.path.join(tmp, "never-written.json"))
        check("--marks without a file: the run stands on its own marks", rc == 1 and "(unmarked)" in out, out)
        with open(os.path.join(tmp, "list.json"), "w") as f:
            json.dump([1, 2], f)
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_json.py"), "missed",
                            os.path.join(tmp, "list.json")], capture_output=True, text=True)
        check("a JSON that is not a run's document has no figures", r.returncode == 1 and "no figures" in r.stdout,
              r.stdout + r.stderr)
        rc, out = missed("clean", [ok])
        check("a run with no failed check stands", rc == 0 and out == "none", out)
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_json.py"), "missed",
                            os.path.join(tmp, "never-written.json")], capture_output=True, text=True)
        check("a run that wrote no JSON has no figures", r.returncode == 1 and "no figures" in r.stdout, r.stdout)
    # benchmarks/megatron/_runner.analyse: a step carried across the next forward leaves the last
    # iteration's pass to the process's drain, after that iteration ended; it is in no iteration
    # (counted in the last one, the file tier's median of 2 read 1.44x the state's bytes).
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "megatron"))
    import _runner
    its, passes, t = [], [], 0.0
    for k in range(4):
        its.append({"start": t, "zeroed": t + 0.01, "fb_end": t + 5.0, "end": t + 6.0, "counts": {}})
        for a, b, n in ((t + 0.02, t + 4.9, 7), (t + 5.0, t + 5.9, 1)):  # across fb, then the step
            passes.append({"t0": a, "t1": b, "bytes": 2 * n, "to": n, "from": n, "host": 0.0})
        t += 6.0 + 1e-4
    passes.append({"t0": t + 1e-4, "t1": t + 5.0, "bytes": 14, "to": 7, "from": 7, "host": 0.0})  # the drain
    m = _runner.analyse({"iterations": its, "passes": passes}, 2)
    check("analyse: a pass after the last iteration ended is in no iteration",
          m["to_bytes"] == 8 and m["passes"] == 2, f"to_bytes {m['to_bytes']}, passes {m['passes']}")
    # Note [The iteration's time]: without a ``done`` mark an iteration runs to the next start
    # (the wait before it included), the last one left out; with it, to ``done``.
    check("analyse: a run without done marks times each iteration to the next start",
          abs(m["iteration"] - (6.0 + 1e-4)) < 1e-9 and m["per_iteration_ms"] == [6000.1] * 3,
          f"iteration {m['iteration']}, per iteration {m['per_iteration_ms']}")
    for it in its:
        it["done"] = it["end"] + 0.004  # the device still busy with passes the step left in flight
    m = _runner.analyse({"iterations": its, "passes": passes}, 2)
    check("analyse: an iteration runs to its done mark, the last one included",
          abs(m["iteration"] - 6.004) < 1e-9 and len(m["per_iteration_ms"]) == 4 and m["to_bytes"] == 8,
          f"iteration {m['iteration']}, per iteration {m['per_iteration_ms']}, to_bytes {m['to_bytes']}")
    # bench_megatron --repeat: a row's figures are its median round's (the slower of two middles),
    # a failed round left out, and a comparison says whether it lies within the rounds' spread.
    import bench_megatron as bm

    class Drv:  # what fold_rounds and results_and_table read of _runner.Driver
        def __init__(self):
            self.analysed, self.raw, self.took = {}, {}, {}

    def row(ms: float) -> dict:
        return {"iteration": ms / 1e3, "to_bytes": 1.0, "from_bytes": 1.0, "step": 0.01, "peak_hbm": 0}
    drv, rounds = Drv(), {}
    for key, ms in (("fwd_int8_host", 95.0), ("fwd_int8_host@2", 81.0), ("fwd_int8_host@3", 105.0),
                    ("fwdch_int8_host", 86.0), ("fwdch_int8_host@2", None), ("fwdch_int8_host@3", 75.0)):
        rounds[key] = (row(ms) if ms else {"error": "failed"}, {"key": key} if ms else None, 20.0)
    for name in ("fwd_int8_host", "fwdch_int8_host"):
        bm.fold_rounds(drv, name, rounds)
    fwd, ch = drv.analysed["fwd_int8_host"], drv.analysed["fwdch_int8_host"]
    check("bench_megatron --repeat: a row is its median round, every round beside it",
          fwd["iteration"] == 0.095 and fwd["rounds_ms"] == [95.0, 81.0, 105.0] and
          drv.raw["fwd_int8_host"] == {"key": "fwd_int8_host"} and drv.took["fwd_int8_host"] == 60.0, str(fwd))
    check("bench_megatron --repeat: of two rounds (one failed) the slower middle",
          ch["iteration"] == 0.086 and ch["median_round"] == "fwdch_int8_host" and ch["rounds_ms"] == [86.0, 75.0],
          str(ch))
    _, lines = bm.results_and_table(drv, {}, {}, {})
    line = next((x for x in lines if x.startswith("fwdch_int8_host / fwd_int8_host")), "")
    check("bench_megatron --repeat: a twin's difference inside the rounds' spread (25%) is said to be",
          line == "fwdch_int8_host / fwd_int8_host: 0.91x [rounds 86/75 vs 95/81/105 ms, spread 25%: within it]", line)
    for key, ms in (("fwd_int8_host", 110.0), ("fwd_int8_host@2", 112.0), ("fwd_int8_host@3", 115.0)):
        rounds[key] = (row(ms), None, 20.0)  # the fwd row's rounds 110-115 ms: 0.77x is beyond
    bm.fold_rounds(drv, "fwd_int8_host", rounds)
    _, lines = bm.results_and_table(drv, {}, {}, {})
    line = next((x for x in lines if x.startswith("fwdch_int8_host / fwd_int8_host")), "")
    check("bench_megatron --repeat: a difference beyond both rows' spreads is said to be", line.endswith("beyond it]"),
          line)
    megatron_parts()
    link_profile_parts()
    if len(sys.argv) > 1:  # a bench_overlap JSON (the bench_overlap_smoke test's): its checks carry the marks
        with open(sys.argv[1]) as f:
            checks = {c["check"]: c for c in json.load(f)["extra"]["checks"]}
        marked = {name: c.get("perf") for name, c in checks.items()}
        check("bench_overlap marks its performance targets perf",
              marked.get("host+overlap iteration / resident") is True, str(marked))
        with open(sys.argv[1]) as f:
            extra = json.load(f)["extra"]
        prof = extra.get("link_profile", {}).get("host+overlap b2", {})
        check("bench_overlap --profile-mode: the mode profiled (no device events on the CPU), its losses still "
              "bit-identical to the plain step's",
              prof.get("iterations") == 2 and "error" not in prof and
              checks.get("losses host+overlap b2 == host b2 (4 micro-batches)", {}).get("ok") is True,
              f"{prof} {checks.get('losses host+overlap b2 == host b2 (4 micro-batches)')}")
        check("bench_overlap marks its correctness checks not perf",
              any(n.startswith("losses") for n in marked) and
              all(v is False for n, v in marked.items() if n.startswith("losses")), str(marked))
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
