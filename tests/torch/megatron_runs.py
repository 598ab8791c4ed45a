"""What the Megatron acceptance scripts share (test_megatron_gpu.py, test_megatron_dp2.py):
examples/megatron/train_gpt.py under torchrun with its JSON summary, and the closing table
plus the JSON of benchmarks/bench_json.py's schema."""
from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.normpath(os.path.join(HERE, "..", "..", "examples", "megatron", "train_gpt.py"))


def work_dir(prefix: str) -> str:
    """A new directory under the system's temporary one for the runs' summaries, checkpoints
    and state files (hundreds of MB), removed when this process exits: what a run shows is
    printed, and the table and JSON carry the figures."""
    work = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, work, True)
    return work


def torchrun(name: str, nproc: int, script_args: list[str], env: dict, work: str, wall: dict,
             script: str = EXAMPLE) -> dict | None:
    """``script`` (train_gpt.py or a wrapper taking its arguments) on ``nproc`` processes with
    ``--summary`` into ``work``; prints its step lines, records its wall time in ``wall``;
    the summary, or None when it failed (its output's tail printed)."""
    summary = os.path.join(work, f"{name}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script,
           *script_args, "--summary", summary]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall[name] = time.perf_counter() - t0
    print(f"--- {name} ({nproc} process{'es' if nproc > 1 else ''}, {wall[name]:.0f} s, rc {r.returncode})",
          flush=True)
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith(("step", "params"))), flush=True)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:], flush=True)
        return None
    with open(summary) as f:
        return json.load(f)


def report(benchmark: str, device: str, rows: list, results: list, extra: dict, json_path: str | None) -> int:
    """Prints the checks (what, value, ok: True / False / None for a figure beside them) as a
    table and writes the JSON (schema 1, ``results`` with checks_passed and checks_total added)
    when ``json_path``; returns how many checks failed."""
    width = max(len(r[0]) for r in rows)
    for what, value, ok in rows:
        print(f"{'    ' if ok is None else 'PASS' if ok else 'FAIL'}  {what:<{width}}  {value}")
    judged = [ok for _, _, ok in rows if ok is not None]
    failed = judged.count(False)
    print(f"{len(judged) - failed}/{len(judged)} checks passed")
    if json_path:
        counts = [{"name": "checks_passed", "value": len(judged) - failed, "unit": "count", "baseline": None},
                  {"name": "checks_total", "value": len(judged), "unit": "count", "baseline": None}]
        out = {"benchmark": benchmark, "schema": 1, "device": device,
               "command": shlex.join([sys.executable, *sys.argv]), "results": results + counts,
               "extra": dict(extra, checks=[{"what": w, "value": v, "ok": o} for w, v, o in rows])}
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return failed


# ---- the CPU tests' checks ------------------------------------------------------------------

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    """Prints one check; a failed one is remembered in ``failures``."""
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def in_child(fn) -> None:
    """Runs ``fn`` (checks) in a forked child: Megatron's process groups are per process.  A
    failed check or an exception there is one failure here."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported as a failure below
            import traceback
            traceback.print_exc()
            failures.append(f"{fn.__name__} raised {type(e).__name__}: {e}")
        os._exit(1 if failures else 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        failures.append(fn.__name__)


def require_megatron() -> str:
    """The importable megatron-core's version; exits 77 (skip) when there is none or
    DFA_MEGATRON_CORE_DIR (the version's own directory) is missing, 1 when
    DFA_MEGATRON_CORE_EXPECTED names another (a ctest test of the version matrix must run
    the version it is named for)."""
    where = os.environ.get("DFA_MEGATRON_CORE_DIR")
    if where and not os.path.isdir(os.path.join(where, "megatron", "core")):
        print(f"SKIP: no megatron-core in {where}; scripts/setup.sh unpacks the tested versions there")
        sys.exit(77)
    try:
        import megatron.core
    except ImportError as e:
        print(f"SKIP: megatron-core not importable ({e}); scripts/setup.sh installs the tested versions")
        sys.exit(77)
    from deferalloc.megatron import megatron_core_version
    version = megatron_core_version()
    expected = os.environ.get("DFA_MEGATRON_CORE_EXPECTED")
    if expected and expected != version:
        print(f"FAIL: megatron-core {version} imported ({megatron.core.__file__}), {expected} expected")
        sys.exit(1)
    print(f"megatron-core {version} ({os.path.dirname(megatron.core.__file__)})", flush=True)
    return version


_PROBE = ("import deferalloc.megatron as dm; v = dm.megatron_core_version(); "
          "print(v, v in dm.TESTED_VERSIONS)")


def probe_megatron(env: dict) -> str | None:
    """The tested megatron-core version ``env``'s Python imports; None (why printed as a
    SKIP line) when there is none."""
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)
    out = r.stdout.split()
    if r.returncode != 0 or len(out) != 2 or out[1] != "True":
        print(f"SKIP: no tested megatron-core importable ({r.stdout.strip() or r.stderr.strip()[-300:]})")
        return None
    return out[0]
