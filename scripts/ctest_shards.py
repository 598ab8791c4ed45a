#!/usr/bin/env python3
"""Split the tests of a `ctest -N` listing into N shards of about equal duration.

    ctest_shards.py LISTING N    -> N lines, each a ctest -R regex (empty line: an empty shard)

Durations are the usual seconds on the H200 (scripts/gpu_round.sh); a test not listed
counts 30 s.  Longest first, each to the shard with the least so far.
"""
import re
import sys

SECONDS = {
    "readme_examples_gpu": 120, "test_python_gpu": 62, "test_torch_gpu": 60, "test_optimizer.cuda": 56,
    "pip_install": 36, "train_losses_identical": 35, "test_core.cuda": 31, "test_caching.cuda": 26,
    "test_optim_gpu": 120, "test_megatron_gpu_exact": 150, "test_megatron_gpu_file": 150,
    "test_megatron_gpu_timing": 170,  # the test_megatron_gpu parts: estimates from the whole test's runs
}


def main(listing: str, n: int) -> None:
    names = re.findall(r"Test +#\d+: (\S+)", open(listing).read())
    loads = [0.0] * n
    shards: list[list[str]] = [[] for _ in range(n)]
    for name in sorted(names, key=lambda t: -SECONDS.get(t, 30)):
        k = loads.index(min(loads))
        shards[k].append(name)
        loads[k] += SECONDS.get(name, 30)
    for s in shards:
        print("^(" + "|".join(re.escape(t) for t in s) + ")$" if s else "")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
