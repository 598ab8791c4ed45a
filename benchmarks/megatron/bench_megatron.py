"""Megatron at the bound: every way of stepping the optimizer of examples/megatron/train_gpt.py, each row beside its bound.

Models (``--model``; both at test_megatron_gpu's tokens per iteration, batch 2 x sequence 512):
  054    megatron-core's HybridModel at 0.54 G params (test_megatron_gpu's timing model);
  gqa1b  the same layers at 22 (pattern "*-" x 22), grouped-query attention with 4 query groups
         (train_gpt.py --query-groups), about 1.1 G params.
Rows (``--rows``, comma-separated names or the sets host, file, coalesce, gil, taper, chain, queue, clip, bucket, all),
one process each
(benchmarks/megatron/_runner.py, as sib.py's variants):
  resident                 Megatron's own optimizer (FP32 state in HBM)
  hdo                      megatron-core's HybridDeviceOptimizer(offload_fraction=1.0) (train_gpt.py --hdo,
                           as test_megatron_gpu runs it)
  {plain,inside,fwd}_{fp32,bf16,int8}_{host,file}
                           deferalloc, the plain step after backward, the step inside backward
                           (step_in_backward=True) or inside backward and across the next forward
                           (fwd: step_overlap_forward=True, with DDP's overlap_param_gather),
                           moment_dtype, tier (file: a directory under --dir)
  fwd{c2,call}_{fp32,bf16,int8}_host
                           a fwd row with coalesced bucket passes (train_gpt.py --coalesce 2: at most
                           two bucket groups whose grads are done per engine pass; --coalesce 0, call:
                           all of them), judged as the fwd rows and also beside their fwd twin
                           (iteration / fwd_<dtype>_host's, no target); the set coalesce: each dtype's
                           plain, fwd and fwdc2 rows, and fwdcall_fp32_host
  fwd{sw,c2sw}_{fp32,bf16,int8}_host
                           a fwd row (sw) or fwdc2 row (c2sw) under sys.setswitchinterval(0.0002)
                           (train_gpt.py --switch-interval: the training loop hands the GIL to the
                           optimizer's worker within 0.2 ms instead of 5), judged as the fwd rows and
                           beside their fwd twin; the set gil: each dtype's plain, fwd, fwdc2, fwdsw, fwdc2sw
  {plain,fwd}tp_{fp32,bf16,int8}_host
                           a plain or fwd row with the engine's tapered passes (DEFERALLOC_CONF
                           pass_taper:1: each pass's first and last pieces cut smaller, so it fills
                           and drains its pipeline sooner), judged as its mode and beside its twin
                           without the taper; the set taper: each dtype's plain, plaintp, fwd, fwdtp
  fwdch_{fp32,bf16,int8}_host
                           a fwd row with the engine's chained passes (DEFERALLOC_CONF pass_chain:1:
                           each bucket pass returns with its last write-backs in flight, the next
                           one filling while it drains), judged as the fwd rows and beside its fwd
                           twin; the set chain: each dtype's plain, fwd, fwdch; fwdchsw_*: chained
                           passes under sys.setswitchinterval(0.0002), beside the fwd twin too
  fwd{q,chq}_{fp32,bf16,int8}_host
                           a fwd row (q) or fwdch row (chq) with the engine's write-back queue bounded
                           (DEFERALLOC_CONF writeback_queue_mb:16: a pass keeps at most 16 MiB of
                           write-backs, plus a piece's, or two pieces', queued on the copy engine
                           instead of the window's 8 pieces (48-96 MiB here), so the training
                           thread's reads of the norm and loss wait behind less), judged as the fwd
                           rows and beside their fwd twin; the set queue: each dtype's fwd, fwdq,
                           fwdch, fwdchq
  {plain,fwd}clip_{fp32,bf16,int8}_host
                           a plain or fwd row whose clipping fires at every step (--clip-grad 1e-3;
                           the others never clip): fwdclip judged against plainclip (the policy then
                           steps after Megatron's clip, across the next forward), both beside their
                           unclipped twin; the set clip
  fwd{b20,tpb20}_{fp32,bf16,int8}_host
                           a fwd row (b20) or fwdtp row (tpb20) with DDP's bucket_size 20 M params
                           (train_gpt.py --bucket-size; Megatron's default at DP 1 is 40 M): smaller bucket
                           groups are final sooner in backward, so the link waits less for the first
                           one, at the cost of more passes to fill and drain; judged as the fwd rows and
                           beside their fwd twin; the set bucket: each dtype's fwd, fwdtp, fwdb20, fwdtpb20
  auto_{plain,inside}_host resident_mb="auto" (fp32 moments) under a budget that leaves about half of
                           the state streamed (_runner.py's Note [The auto budget's ballast])
  odirect_file             the synchronous O_DIRECT baseline a Megatron user has today (train_gpt.py
                           --odirect-baseline: per 256 MiB bucket, read FP32 main + moments with direct
                           I/O, AdamW on the GPU, write back; nothing overlaps), in the file set; its
                           bytes are its file's, read and written each step
Every run but hdo uses DDP's overlap_grad_reduce and a clip_grad never reached (1e9), sib.py's
settings; hdo runs as test_megatron_gpu's timing run does (the example's defaults).
resident runs first whenever a deferalloc row is asked for (the bounds need its iteration).

Bounds, measured in the same call: the transfer of the row's bytes each way (the engine's,
per iteration; an inside or fwd row takes its plain twin's where that ran, so that speculation's redos
do not raise its own bound) over the duplex pinned-copy rate (test_megatron_gpu's measurement,
``--bound-mib`` MiB each way) on the host tier; on the file tier dd with direct I/O writing and
reading exactly those bytes in --dir (benchmarks/optimizer/bench_file_tier.py's dd_bound: the
faster of write-then-read and both at once; once per distinct byte count).  plain is judged
against resident + transfer, inside and fwd against max(resident, transfer) and against their
plain twin; HDO against the inside and fwd rows (issue targets: 1.5x faster than HDO with FP32
moments, 2.2x with BF16).  odirect_file
stands beside its dd bound too (without a target) and beside plain_fp32_file: the plain FP32 file
step's speed-up over it (iteration over iteration; issue target >= 1.5x).  Its losses must equal
resident's bit for bit (clip never reached: the same fused AdamW arithmetic), and under --smoke
the final state's digest too (--smoke fails if either differs).

Iterations: ``--steps`` (8) per row, medians of the last ``--median-of`` (4: the first four hold
the fwd rows' warm-up, its speculative first iterations, which lasted three on a slow host); file tier
``--file-steps`` (4), the last ``--file-median-of`` (2).  An iteration runs from its start (the
device synchronised) until the device has finished what it queued, the step's passes still in
flight included (Note [The iteration's time] in _runner.py); ``--reanalyse JSON --logs DIR``
rebuilds an earlier run's JSON from its logs with the current analysis.  ``--repeat N`` runs the
rows N times, round after round (resident, A, B, resident, A, B, ...: a host that drifts during
the call moves every row alike), each round a process of its own (logs NAME@2, NAME@3, ...); a
row's figures are then those of its median round (the slower of two middles), every round's
iteration beside them, and each comparison of a row with its twin or its plain row says whether
the difference lies within the rounds' spread ((max - min) / median of either row's rounds): the
same variant timed twice differs by that much, so a smaller difference is noise.  ``--profile-rows
NAMES``: those rows' processes (first round) run two more iterations under torch.profiler after
the timed ones and say where the link idled (benchmarks/link_profile.py; the row's
``link_profile`` in extra.analysed, the trace beside its log).  A row is started only where it ends
within ``--budget-s`` at the longest row's time so far (file rows: the longest file row's).
``--json-dir DIR`` writes DIR/megatron_bench_<model>_<rows>.json (benchmarks/bench_json.py's
schema, benchmark "megatron_bench"), rewritten after every row (extra.complete: whether the run
ended): calls that measure other rows write other files, and benchmarks/plot.py shows every file
of one data directory.

    PYTHONPATH=python:/tmp/site-mc DEFERALLOC_LIB=... DEFERALLOC_OPTIMIZER_LIB=... \\
      python3 benchmarks/megatron/bench_megatron.py --model 054 --rows host --json-dir out
    python3 benchmarks/megatron/bench_megatron.py --smoke   # CPU: tiny model (train_gpt's --cpu-emulation)
Exit 0 when every row ran, 1 otherwise (--smoke: 77 without megatron-core).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
import bench_json  # noqa: E402

MODELS = {"054": _runner.MODEL_054,
          "gqa1b": "--layers 22 --hidden 2048 --heads 16 --query-groups 4 --vocab 32768 --seq 512 --batch 2"}
TIMING = ["--overlap-grad-reduce", "--clip-grad", "1e9"]
STATE_DIR = "{state_dir}"  # in a file row's options: its state directory under --dir
DTYPES, TIERS, MODES = ("fp32", "bf16", "int8"), ("host", "file"), ("plain", "inside", "fwd")
MODE_OPTS = {"plain": [], "inside": ["--step-in-backward"],
             "fwd": ["--step-in-backward", "--overlap-param-gather", "--step-overlap-forward"]}


def overlapped(name: str) -> bool:
    """A row whose step overlaps backward (and, fwd, the next forward): bound max(resident, transfer)."""
    return name.startswith(("inside", "fwd")) or name == "auto_inside_host"


# Variants of the host tier's plain and fwd rows: the name's suffix -> (the modes it varies,
# train_gpt.py's options added, the child's DEFERALLOC_CONF added, whether its plain twin is
# the plain row of the same variant).  c2 / call: coalesced bucket passes (the host tier's
# default is one bucket group a pass); sw / c2sw: a shorter GIL hand-over; tp: the engine's
# tapered passes (Note [Pass pieces] in optimizer/window_pipeline.cpp); ch: its chained passes
# (Note [Chained passes], same file); q: its bounded write-back queue (Note [The write-back
# queue], same file); clip: clipping firing
# at every step (Megatron's clip_grad 1e-3 against grad norms of about 1; the last --clip-grad
# wins over TIMING's 1e9), judged against the plain row that clips too.
SHORT_SWITCH = ["--switch-interval", "0.0002"]  # the sw variants' GIL hand-over
QUEUE = "writeback_queue_mb:16"  # the q variants' bound
VARIANTS = {"c2": (("fwd",), ["--coalesce", "2"], None, False),
            "call": (("fwd",), ["--coalesce", "0"], None, False),
            "sw": (("fwd",), SHORT_SWITCH, None, False),
            "c2sw": (("fwd",), ["--coalesce", "2"] + SHORT_SWITCH, None, False),
            "tp": (("plain", "fwd"), [], "pass_taper:1", False),
            "ch": (("fwd",), [], "pass_chain:1", False),
            "chsw": (("fwd",), SHORT_SWITCH, "pass_chain:1", False),
            "q": (("fwd",), [], QUEUE, False),
            "chq": (("fwd",), [], "pass_chain:1," + QUEUE, False),
            "clip": (("plain", "fwd"), ["--clip-grad", "1e-3"], None, True),
            "b20": (("fwd",), ["--bucket-size", "20000000"], None, False),
            "tpb20": (("fwd",), ["--bucket-size", "20000000"], "pass_taper:1", False)}


def fwd_twin(name: str) -> str | None:
    """A variant row's twin without it (fwdc2_fp32_host -> fwd_fp32_host, plaintp_bf16_host ->
    plain_bf16_host); None for others."""
    mode, _, rest = name.partition("_")
    for k, (modes, _, _, _) in VARIANTS.items():
        for m in modes:
            if mode == m + k:
                return f"{m}_{rest}"
    return None


def row_table() -> dict:
    """name -> (train_gpt.py's options, the child's options, tier or None, the plain twin)."""
    # HDO as test_megatron_gpu's timing run has it (the example's defaults: no overlap_grad_reduce,
    # clip_grad 1.0), the run its figures in the docs come from.
    rows = {"resident": (TIMING, {}, None, None), "hdo": (["--hdo"], {}, None, None)}
    for tier in TIERS:
        for dtype in DTYPES:
            for mode in MODES:
                opts = TIMING + ["--deferalloc", tier, "--moment-dtype", dtype] + \
                    (["--directory", STATE_DIR] if tier == "file" else [])
                rows[f"{mode}_{dtype}_{tier}"] = (opts + MODE_OPTS[mode], {}, tier, f"plain_{dtype}_{tier}")
    for k, (modes, extra, conf, own_plain) in VARIANTS.items():
        for dtype in DTYPES:
            for mode in modes:
                rows[f"{mode}{k}_{dtype}_host"] = (rows[f"{mode}_{dtype}_host"][0] + extra,
                                                   {"conf": conf} if conf else {}, "host",
                                                   f"plain{k if own_plain else ''}_{dtype}_host")
    for mode in ("plain", "inside"):
        opts = TIMING + ["--deferalloc", "host", "--resident-mb", "auto"]
        rows[f"auto_{mode}_host"] = (opts + MODE_OPTS[mode], {"streamed_fraction": 0.5}, "host", "auto_plain_host")
    rows["odirect_file"] = (TIMING + ["--odirect-baseline", STATE_DIR], {}, "file", "odirect_file")
    return rows


ROWS = row_table()
SETS = {"host": ["resident", "hdo"] + [f"{m}_{d}_host" for d in DTYPES for m in ("plain", "inside")]
        + ["auto_plain_host", "auto_inside_host"] + [f"fwd_{d}_host" for d in DTYPES],
        # odirect_file beside plain_fp32_file, before the budget can skip it.
        "file": ["plain_fp32_file", "odirect_file"] + [f"{m}_{d}_file" for d in DTYPES for m in ("plain", "inside")
                                                       if f"{m}_{d}_file" != "plain_fp32_file"]
        + [f"fwd_{d}_file" for d in DTYPES]}
# Coalesced passes beside the rows they are judged against (their plain and fwd twins), FP32 first.
SETS["coalesce"] = [f"{m}_{d}_host" for d in DTYPES for m in ("plain", "fwd", "fwdc2")
                    + (("fwdcall",) if d == "fp32" else ())]
SETS["gil"] = [f"{m}_{d}_host" for d in DTYPES for m in ("plain", "fwd", "fwdc2", "fwdsw", "fwdc2sw")]
SETS["clip"] = [f"{m}_{d}_host" for d in DTYPES for m in ("plainclip", "fwdclip")]
SETS["taper"] = [f"{m}_{d}_host" for d in DTYPES for m in ("plain", "plaintp", "fwd", "fwdtp")]
SETS["chain"] = [f"{m}_{d}_host" for d in DTYPES for m in ("plain", "fwd", "fwdch")]
SETS["queue"] = [f"{m}_{d}_host" for d in DTYPES for m in ("fwd", "fwdq", "fwdch", "fwdchq")]
SETS["bucket"] = [f"{m}_{d}_host" for d in DTYPES for m in ("fwd", "fwdtp", "fwdb20", "fwdtpb20")]
SETS["all"] = SETS["host"] + SETS["file"]
SMOKE_ROWS = ["resident", "plain_fp32_host", "inside_bf16_host", "fwd_fp32_host", "fwdc2_fp32_host", "fwdtp_fp32_host",
              "fwdch_fp32_host", "fwdchq_fp32_host",
              "plain_int8_file", "auto_plain_host",
              "plain_fp32_file", "odirect_file"]


def expand(spec: str) -> list[str]:
    names = []
    for part in spec.split(","):
        for n in SETS.get(part, [part]):
            if n not in names:
                names.append(n)
    return names


def bounds(a, drv, dd_cache: dict, rate: float | None, only: str | None = None) -> dict:
    """name -> {transfer_s, how, bound_s, ratio} of every deferalloc row that ran (or of
    ``only``; the file tier's dd measured here where ``dd_cache`` lacks its bytes)."""
    res = drv.analysed.get("resident", {}).get("iteration")
    out = {}
    for name, m in drv.analysed.items():
        spec = ROWS[name]
        if "iteration" not in m or spec[2] is None or only not in (None, name):
            continue
        twin = drv.analysed.get(spec[3], {})
        src = twin if "iteration" in twin else m
        rb, wb = int(src["to_bytes"]), int(src["from_bytes"])
        if spec[2] == "host":
            if not rate:
                continue
            transfer, how = max(rb, wb) / rate, f"duplex pinned copy {rate / 1e9:.1f} GB/s each way"
        else:
            # One dd run per pair of sizes as the row's name prints them (10 MB steps): rows whose
            # bytes differ by less share a bound, and no two bound rows get one name.
            key = (round(rb / 1e7), round(wb / 1e7))
            if key not in dd_cache:
                try:
                    dd_cache[key] = _runner.dd_bound(a.dir, rb, wb, smoke=a.smoke)
                except Exception as e:  # noqa: BLE001 - a bound that failed is reported, the row kept
                    dd_cache[key] = {"error": str(e)}
            dd = dd_cache[key]
            if "bound_s" not in dd:
                continue
            transfer = dd["bound_s"]
            how = f"dd direct I/O, {'both at once' if dd['at_once_s'] <= dd['sequential_s'] else 'write then read'}"
        b = {"transfer_s": transfer, "how": how, "read_bytes": rb, "write_bytes": wb}
        if res:
            b["bound_s"] = max(res, transfer) if overlapped(name) else res + transfer
            b["ratio"] = m["iteration"] / b["bound_s"]
        out[name] = b
    return out


def round_keys(name: str, repeat: int) -> list[str]:
    """The keys of a row's rounds under --repeat (its logs' names): NAME, NAME@2, ..."""
    return [name] + [f"{name}@{r}" for r in range(2, repeat + 1)]


def fold_rounds(drv, name: str, rounds: dict) -> None:
    """A row run in rounds (``rounds``: key -> (analysed, raw, seconds) of each round that ran,
    in the order they ran) into ``drv``'s one row ``name``: the round whose iteration is the
    median (the slower of two middles), with ``rounds_ms`` (every round's iteration) and
    ``median_round`` (its key) where there were several; the seconds of all rounds.  None ran
    to an iteration: the last round's error."""
    ran = [k for k in rounds if k == name or k.startswith(name + "@")]
    drv.took[name] = sum(rounds[k][2] for k in ran)
    ok = sorted((rounds[k][0]["iteration"], k) for k in ran if "iteration" in rounds[k][0])
    pick = ok[len(ok) // 2][1] if ok else ran[-1]
    m, raw, _ = rounds[pick]
    drv.analysed[name] = {**m, "rounds_ms": [rounds[k][0]["iteration"] * 1e3 for k in ran
                                             if "iteration" in rounds[k][0]], "median_round": pick} \
        if ok and len(ran) > 1 else m
    prof = next((rounds[k][0]["link_profile"] for k in ran if "link_profile" in rounds[k][0]), None)
    if prof is not None:  # (--profile-rows: the first round's, whichever round is the median)
        drv.analysed[name] = {**drv.analysed[name], "link_profile": prof}
    if raw is not None:
        drv.raw[name] = raw


def rounds_spread(m: dict) -> float | None:
    """(max - min) / median of a row's rounds' iterations (None under two rounds)."""
    r = sorted(m.get("rounds_ms") or [])
    if len(r) < 2:
        return None
    mid = (r[(len(r) - 1) // 2] + r[len(r) // 2]) / 2
    return (r[-1] - r[0]) / mid


def beside_rounds(a: dict, b: dict, ratio: float) -> str:
    """A comparison's note under --repeat: both rows' rounds and whether ``ratio`` (a / b) is
    within their spread; empty without rounds."""
    spreads = [x for x in (rounds_spread(a), rounds_spread(b)) if x is not None]
    if not spreads:
        return ""
    within = abs(ratio - 1.0) <= max(spreads)
    fmt = lambda m: "/".join(f"{v:.0f}" for v in m.get("rounds_ms", []))  # noqa: E731
    return (f" [rounds {fmt(a)} vs {fmt(b)} ms, spread {max(spreads):.0%}: "
            + ("within it]" if within else "beyond it]"))


def peak_of(drv, name: str) -> int:
    """Peak HBM of a row less its ballast (Note [The auto budget's ballast] in _runner.py)."""
    return (drv.analysed[name].get("peak_hbm") or 0) - drv.raw.get(name, {}).get("ballast_bytes", 0)


def results_and_table(drv, bnd: dict, bound: dict, dd_cache: dict) -> tuple[list, list]:
    res = bench_json.result
    results, lines = [], []
    if bound.get("duplex_bytes_per_s"):
        results.append(res("pinned copy duplex (each way)", bound["duplex_bytes_per_s"] / 1e9, "GB/s"))
    lines.append(f"{'row':<18} {'iter ms':>8} {'bound ms':>9} {'/bound':>7} {'transfer':>9} {'read GB':>8} "
                 f"{'write GB':>8} {'step ms':>8} {'peak GiB':>8}")
    for name, m in drv.analysed.items():
        if "iteration" not in m:
            lines.append(f"{name:<18} {m.get('error', 'failed')}")
            continue
        b = bnd.get(name, {})
        # The plot's pairs: each deferalloc row beside its bound, HDO beside the FP32 step inside backward.
        base = f"{name}: bound" if "bound_s" in b else \
            "inside_fp32_host: iteration" if name == "hdo" and "iteration" in drv.analysed.get("inside_fp32_host", {}) \
            else None
        results.append(res(f"{name}: iteration", m["iteration"] * 1e3, "ms", base))
        if "bound_s" in b:
            results += [res(f"{name}: bound", b["bound_s"] * 1e3, "ms"),
                        res(f"{name}: iteration / bound", b["ratio"], "x")]
        if "transfer_s" in b:
            results.append(res(f"{name}: transfer ({b['how']})", b["transfer_s"] * 1e3, "ms"))
        if rounds_spread(m) is not None:
            results.append(res(f"{name}: spread of its {len(m['rounds_ms'])} rounds ((max - min) / median)",
                               rounds_spread(m), "x"))
        results += [res(f"{name}: optimizer step", m["step"] * 1e3, "ms"),
                    res(f"{name}: link bytes read", m["to_bytes"], "B"),
                    res(f"{name}: link bytes written", m["from_bytes"], "B"),
                    res(f"{name}: peak HBM (ballast excluded)", peak_of(drv, name) / 2**20, "MiB")]
        lines.append(f"{name:<18} {m['iteration'] * 1e3:8.1f} "
                     + (f"{b['bound_s'] * 1e3:9.1f} {b['ratio']:7.2f} " if "bound_s" in b else f"{'-':>9} {'-':>7} ")
                     + (f"{b['transfer_s'] * 1e3:9.1f} " if "transfer_s" in b else f"{'-':>9} ")
                     + f"{m['to_bytes'] / 1e9:8.2f} {m['from_bytes'] / 1e9:8.2f} {m['step'] * 1e3:8.1f} "
                       f"{peak_of(drv, name) / 2**30:8.2f}")
    it = {n: m["iteration"] for n, m in drv.analysed.items() if "iteration" in m}
    verdicts = []
    for name, b in bnd.items():
        if "ratio" in b and name == "odirect_file":
            verdicts.append(f"{name}: {b['ratio']:.2f}x its bound (the baseline: no target)")
        elif "ratio" in b:
            target = 1.15 if overlapped(name) else 1.1
            verdicts.append(f"{name}: {b['ratio']:.2f}x its bound (target <= {target})"
                            + ("" if b["ratio"] <= target else " MISSED"))
    for name in it:
        if overlapped(name):
            plain = ROWS[name][3]
            if plain in it:
                r = it[name] / it[plain]
                results.append(res(f"{name}: iteration / {plain}'s", r, "x"))
                verdicts.append(f"{name} / {plain}: {r:.2f}x (target <= 1)" + ("" if r <= 1.0 else " MISSED")
                                + beside_rounds(drv.analysed[name], drv.analysed[plain], r))
        fwd = fwd_twin(name)
        if fwd in it:  # what coalescing or tapering the passes changed (no target yet)
            r = it[name] / it[fwd]
            results.append(res(f"{name}: iteration / {fwd}'s", r, "x"))
            verdicts.append(f"{name} / {fwd}: {r:.2f}x" + beside_rounds(drv.analysed[name], drv.analysed[fwd], r))
    for dtype, target in (("fp32", 1.5), ("bf16", 2.2)):
        for name in (f"inside_{dtype}_host", f"fwd_{dtype}_host"):
            if "hdo" in it and name in it:
                r = it["hdo"] / it[name]
                results.append(res(f"hdo / {name}", r, "x"))
                verdicts.append(f"HDO / {name}: {r:.2f}x faster (target >= {target})"
                                + ("" if r >= target else " MISSED"))
    for dtype, target in (("bf16", 1.35), ("int8", 1.7)):
        a, b = drv.analysed.get("plain_fp32_file", {}), drv.analysed.get(f"plain_{dtype}_file", {})
        if "step" in a and "step" in b and b["step"]:
            r = a["step"] / b["step"]
            results.append(res(f"plain_{dtype}_file: step speed-up over fp32", r, "x"))
            verdicts.append(f"file tier step, {dtype} over fp32: {r:.2f}x (target >= {target})"
                            + ("" if r >= target else " MISSED"))
    if "plain_fp32_file" in it and "odirect_file" in it:
        r = it["odirect_file"] / it["plain_fp32_file"]
        results.append(res("plain_fp32_file: speed-up over odirect_file (iteration)", r, "x"))
        plain, base = drv.analysed["plain_fp32_file"]["step"], drv.analysed["odirect_file"]["step"]
        if plain and base:
            results.append(res("plain_fp32_file: speed-up over odirect_file (optimizer step)", base / plain, "x"))
        verdicts.append(f"file tier, plain_fp32_file over the O_DIRECT baseline: {r:.2f}x faster (target >= 1.5)"
                        + ("" if r >= 1.5 else " MISSED"))
    odirect = drv.raw.get("odirect_file", {}).get("odirect") or {}
    if odirect.get("direct_io") is False:  # its figures are the page cache's, not the disk's
        verdicts.append(f"odirect_file ran with buffered I/O: {odirect.get('reason')}")
    same = baseline_matches(drv)
    if same is not None:
        what = "losses and state digest" if "final_digest" in drv.raw["odirect_file"] else "losses"
        results.append(res(f"odirect_file: {what} == resident's", float(same), "bool"))
        verdicts.append(f"odirect_file's {what} {'equal' if same else 'DIFFER FROM'} resident's (bit for bit)")
    for dd in dd_cache.values():
        if "bound_s" in dd:
            results.append(res(f"dd bound, read {dd['read_bytes'] / 1e9:.2f} GB + write {dd['write_bytes'] / 1e9:.2f} "
                               "GB", dd["bound_s"] * 1e3, "ms"))
    return results, lines + verdicts


def baseline_matches(drv) -> bool | None:
    """odirect_file against resident (None unless both ran): the losses of the iterations both
    ran, and the final state's digests where both took one (--smoke, the same iterations), equal,
    since with clipping never reached the baseline steps Megatron's arithmetic."""
    pair = ("resident", "odirect_file")
    if not all("iteration" in drv.analysed.get(n, {}) for n in pair):
        return None
    r, o = (drv.raw[n] for n in pair)
    same = all(x["loss"] == y["loss"] for x, y in zip(r["iterations"], o["iterations"]))
    if "final_digest" in r and "final_digest" in o:
        same = same and len(r["iterations"]) == len(o["iterations"]) and r["final_digest"] == o["final_digest"]
    return same


def report(a, drv, bound: dict, dd_cache: dict, model: str, names: list[str], final: bool,
           reanalysed_from: str | None = None) -> dict:
    """The bounds of the rows run so far, their JSON (--json-dir) and, ``final``, the table
    (``reanalysed_from``: the command of the run whose logs --reanalyse read)."""
    # --smoke: a nominal 10 GB/s for the host tier's bound (no GPU), so that its code runs.
    bnd = bounds(a, drv, dd_cache, 10e9 if a.smoke else bound.get("duplex_bytes_per_s"))
    results, lines = results_and_table(drv, bnd, bound, dd_cache)
    params = next((r["params"] for r in drv.raw.values()), None)
    # (runs before --grad-norm: megatron-core's fallback, the GPU machine having neither TE nor apex)
    norm = next((r["grad_norm"] for r in drv.raw.values() if r.get("grad_norm")), "megatron-core fallback")
    head = (f"megatron bench: {(params or 0) / 1e9:.3f} G params ({model}), window {a.window_mb} MiB, "
            f"{bound.get('device', 'CPU')}, median of the last {a.median_of} of {a.steps} iterations (file tier "
            f"{a.file_median_of} of {a.file_steps}), {a.clock} clock, grad norm: {norm}"
            + (f", median round of {a.repeat}" if a.repeat > 1 else "")
            + f", {sum(drv.took.values()) if reanalysed_from else drv.spent():.0f} s")
    if reanalysed_from:
        head += f"; re-analysed (Note [The iteration's time] in _runner.py) from the logs of: {reanalysed_from}"
    if final:
        print("\n" + head + "\n" + "\n".join(lines), flush=True)
    if a.json_dir and results:
        tag = "_".join(a.rows.split(","))
        if len(tag) > 40:
            tag = tag[:24] + "_" + hashlib.sha1(a.rows.encode()).hexdigest()[:8]
        path = os.path.join(a.json_dir, f"megatron_bench_{'cpu' if a.smoke else a.model}_{tag}.json")
        device = bound.get("device") or ("CPU (cpu_emulation)" if a.smoke else "unknown")
        bench_json.write(path, "megatron_bench", results, device,
                         extra={"notes": [head], "complete": final, "analysed": drv.analysed, "bounds": bnd,
                                "bound": bound, "dd": list(dd_cache.values()), "params": params, "model": model,
                                "rows": names, "took_s": drv.took, "table": lines,
                                "builds_s": {n: r.get("build_s") for n, r in drv.raw.items()},
                                "odirect": drv.raw.get("odirect_file", {}).get("odirect"),
                                "ballast": {n: {k: r[k] for k in ("ballast_bytes", "resident_target_bytes")}
                                            for n, r in drv.raw.items() if "ballast_bytes" in r}})
    return bnd


def smoke_options(a) -> tuple[str, list[str]]:
    """--smoke's model, rows and iterations (set in ``a``): the model and the rows."""
    # 16 MiB: int8 moments on the file tier need 12 MiB a piece in flight.
    a.window_mb, a.rows = 16, "smoke"
    a.steps = a.file_steps = 3
    a.median_of = a.file_median_of = 2
    return _runner.SMOKE_MODEL, list(SMOKE_ROWS)


def reanalyse(a) -> int:
    """--reanalyse: the results of an earlier run rebuilt from its --logs (each row's raw
    figures, as its child wrote them) with this file's analysis, under the run's own options
    and bounds (the duplex rate and dd figures its JSON holds); no process started.  The JSON
    goes to --json-dir under the run's file name."""
    with open(a.reanalyse) as f:
        old = json.load(f)
    ex = old["extra"]
    argv = shlex.split(old["command"])
    script = next(k for k, x in enumerate(argv) if x.endswith("bench_megatron.py"))
    run = parser().parse_args(argv[script + 1:])
    run.json_dir, run.logs = a.json_dir, a.logs
    if run.smoke:
        smoke_options(run)
    drv = _runner.Driver("megatron_bench", a.logs, 0.0, 0.0)
    rounds = {}
    for name in ex["rows"]:
        for key in round_keys(name, run.repeat):
            path = os.path.join(a.logs, f"{key}.json")
            took = ex.get("took_s", {}).get(key, 0.0)  # (a row's rounds together, under its name)
            if not os.path.exists(path):
                m = (ex["analysed"].get(name) if key == name else None) or {"error": f"no {path}"}
                rounds[key] = (m, None, took)
                continue
            with open(path) as f:
                raw = json.load(f)
            file = ROWS[name][2] == "file"
            last = min(run.file_median_of if file else run.median_of, max(1, len(raw["iterations"]) - 1))
            rounds[key] = (_runner.analyse(raw, last), raw, took)
        fold_rounds(drv, name, rounds)
    dd_cache = {(round(d["read_bytes"] / 1e7), round(d["write_bytes"] / 1e7)): d for d in ex.get("dd", [])
                if "read_bytes" in d}
    report(run, drv, ex.get("bound", {}), dd_cache, ex["model"], ex["rows"], final=True,
           reanalysed_from=old["command"])
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="054", choices=list(MODELS))
    ap.add_argument("--model-args", help="train_gpt.py's model options, one string (instead of --model's)")
    ap.add_argument("--rows", default="host", help="names or sets (host, file, coalesce, gil, taper, clip, bucket, all), comma-separated; choices: "
                                                   + ",".join(ROWS))
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="the file tier's state and dd's files")
    ap.add_argument("--window-mb", type=int, default=512)
    ap.add_argument("--clock", choices=("loop", "sync"), default="loop",
                    help="loop: iterations back to back, none synchronising the device (a training loop's "
                         "period); sync: the device synchronised around each step (Note [The iteration's time])")
    ap.add_argument("--grad-norm", choices=("device", "megatron"), default="device",
                    help="device: Megatron's grad norm on the device, as with Transformer Engine or apex installed; "
                         "megatron: megatron-core's fallback without them, a host read per grad (Note [Megatron's "
                         "grad norm in the benchmark] in _runner.py)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--median-of", type=int, default=4)
    ap.add_argument("--file-steps", type=int, default=4)
    ap.add_argument("--file-median-of", type=int, default=2)
    ap.add_argument("--bound-mib", type=int, default=2048, help="the duplex copy's size each way")
    ap.add_argument("--timeout", type=float, default=240, help="seconds one row's process may take")
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--repeat", type=int, default=1, help="run the rows this many times, round after round; a row's "
                                                          "median round, the rounds' spread beside each comparison")
    ap.add_argument("--profile-rows", default="", metavar="NAMES",
                    help="rows (comma-separated) whose process, in the first round, profiles two more iterations "
                         "after its timed ones: where the link idled (benchmarks/link_profile.py), in the JSON's "
                         "analysed[row].link_profile, the trace beside the row's log")
    ap.add_argument("--json-dir", help="write megatron_bench_<model>_<rows>.json here")
    ap.add_argument("--logs", help="keep each process's output here (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, 3 iterations, " + ",".join(SMOKE_ROWS))
    ap.add_argument("--reanalyse", metavar="JSON", help="rebuild JSON (an earlier run's --json-dir file) from that "
                                                        "run's --logs with this analysis; runs nothing")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.reanalyse:
        if not a.logs:
            ap.error("--reanalyse needs the run's --logs")
        return reanalyse(a)
    model = a.model_args or MODELS[a.model]
    names = expand(a.rows)
    if a.smoke:
        if not _runner.megatron_importable():
            print("SKIP: megatron-core not importable")
            return 77
        model, names = smoke_options(a)
    profile_rows = [n for n in a.profile_rows.split(",") if n]
    bad = [n for n in names + profile_rows if n not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad} (choices: {', '.join(ROWS)}, or {', '.join(SETS)})")
    if any(ROWS[n][2] for n in names) and "resident" not in names:
        names.insert(0, "resident")
    if a.model == "gqa1b" and not a.model_args and any(ROWS[n][2] == "file" for n in names):
        ap.error("the file-tier rows run on the 054 model (the disk's 64 GiB)")
    logs = a.logs or tempfile.mkdtemp(prefix="dfa_mb_")
    os.makedirs(logs, exist_ok=True)
    drv = _runner.Driver("megatron_bench", logs, a.budget_s, a.timeout)
    bound = {} if a.smoke else drv.bound(a.bound_mib)
    longest_file, dd_cache, rounds = 0.0, {}, {}
    for r, i, name in ((r, i, n) for r in range(1, a.repeat + 1) for i, n in enumerate(names)):
        key = round_keys(name, r)[-1]
        opts, child_opts, tier, _ = ROWS[name]
        file = tier == "file"
        state_dir = os.path.join(a.dir, f"dfa-mb-{name}")
        argv_ = shlex.split(model) + ["--window-mb", str(a.window_mb)] + [state_dir if o == STATE_DIR else o
                                                                           for o in opts]
        # A file row with none before it: 2.5x the longest host row (its state file, slower
        # iterations and its dd after it).
        estimate = (longest_file * 1.1 if longest_file else max(drv.longest, 1.0) * 2.5) if file else \
            max(drv.longest, 1.0) * 1.1
        if a.smoke and name in ("resident", "odirect_file"):
            child_opts = {**child_opts, "digest": True}  # baseline_matches compares them
        if name in profile_rows and r == 1:
            child_opts = {**child_opts, "profile": 2}
        conf = child_opts.get("conf")  # (the child's DEFERALLOC_CONF, not one of its options)
        child_opts = {k: v for k, v in child_opts.items() if k != "conf"}
        if a.clock == "loop":  # Note [The iteration's time] in _runner.py
            child_opts = {**child_opts, "loop": True}
        child_opts = {**child_opts, "grad_norm": a.grad_norm}
        drv.run(name, argv_, {"steps": a.file_steps if file else a.steps, **child_opts},
                a.file_median_of if file else a.median_of, conf=conf, estimate=estimate, port=29650 + i, key=key)
        took = drv.took.get(key, 0.0)
        if a.repeat > 1:
            rounds[key] = (drv.analysed.pop(key), drv.raw.pop(key, None), drv.took.pop(key, 0.0))
            fold_rounds(drv, name, rounds)
        if file:
            shutil.rmtree(state_dir, ignore_errors=True)  # the disk holds one state file at a time
            t0 = drv.spent()
            bounds(a, drv, dd_cache, None, only=name)  # its dd now, inside the budget
            longest_file = max(longest_file, took + drv.spent() - t0)
        report(a, drv, bound, dd_cache, model, names, final=False)  # a call cut short keeps the rows done
    bnd = report(a, drv, bound, dd_cache, model, names, final=True)
    # The last line (scripts/gpu_round.sh's summary row): iteration / bound per row.
    print("megatron_bench /bound: " + ", ".join(
        f"{n} {bnd[n]['ratio']:.2f}" if "ratio" in bnd.get(n, {}) else
        f"{n} {m['iteration'] * 1e3:.0f}ms" if "iteration" in m else f"{n} -" for n, m in drv.analysed.items()),
        flush=True)
    if a.smoke and baseline_matches(drv) is False:
        print("megatron_bench: odirect_file's losses or state differ from resident's", flush=True)
        return 1
    return 1 if drv.failed else 0


if __name__ == "__main__":
    sys.exit(main())
