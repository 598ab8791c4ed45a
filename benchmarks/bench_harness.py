"""The harness of the Python (torch) benchmarks: bench_overlap.py and bench_file_tier.py.

A benchmark's Bench subclasses Harness, which keeps its results (benchmarks/bench_json.py's
rows) and its checks (extra.checks: check, value, target, ok, perf; ``bench_json.py missed``
reads the perf marks), enforces --budget-s (a mode or row that would end past it is not run:
BudgetSpent, a failed check, so that a run under a time limit still ends with its table and
JSON), writes the JSON through bench_json and prints the checks' table.
"""
from __future__ import annotations

import gc
import time

import torch

import bench_json  # beside this file: the scripts put benchmarks/ on sys.path


class BudgetSpent(Exception):
    """--budget-s would be exceeded by the next mode or row (Harness.budget)."""


class Harness:
    """``a``: the parsed arguments (a.smoke, a.budget_s); ``cuda``: whether it runs on the GPU.
    ``estimate_s``, set by the benchmark after each mode or row, is what budget() expects the
    next one to take; ``estimate_what`` says which that is in the message."""

    estimate_what = "the last mode"

    def __init__(self, a, cuda):
        self.a = a
        self.cuda = cuda
        self.t_start = time.perf_counter()
        self.estimate_s = 0.0
        self.results, self.checks = [], []

    def result(self, name, value, unit, baseline=None):
        self.results.append(bench_json.result(name, value, unit, baseline))

    def check(self, what, value, target="", ok=None, perf=False, in_smoke=None):
        """A row of the checks.  perf: a performance target, marked so that a run that missed
        only such targets still counts as measured (benchmarks/bench_json.py missed).
        in_smoke: whether --smoke asserts it (default: all but the performance targets)."""
        asserted_in_smoke = not perf if in_smoke is None else in_smoke
        if self.a.smoke and not asserted_in_smoke:
            ok = None
        self.checks.append(dict(check=what, value=value, target=target, ok=ok, perf=perf))
        print(f"  {what}: {value} {target} {'' if ok is None else ('pass' if ok else 'FAIL')}", flush=True)

    def passed(self):
        return all(c["ok"] is not False for c in self.checks)

    def budget(self, name):
        """Raises BudgetSpent where ``name`` would end past --budget-s (estimated from
        estimate_s)."""
        b = self.a.budget_s
        spent = time.perf_counter() - self.t_start
        if b and spent + self.estimate_s > b:
            raise BudgetSpent(f"{name} not run: --budget-s {b:g} s would be exceeded ({spent:.0f} s spent, "
                              f"{self.estimate_what} took {self.estimate_s:.0f} s)")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def write_json(self, path, benchmark, device, extra, command=None):
        """bench_json's document, with extra.checks and extra.passed added."""
        extra.update(checks=self.checks, passed=self.passed())
        bench_json.write(path, benchmark, self.results, device, command, extra)

    def print_checks(self):
        print("| check | result | target | |\n|---|---|---|---|")
        for c in self.checks:
            verdict = "" if c["ok"] is None else "pass" if c["ok"] else "FAIL"
            print(f"| {c['check']} | {c['value']} | {c['target']} | {verdict} |")
