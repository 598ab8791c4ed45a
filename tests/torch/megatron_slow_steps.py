"""examples/megatron/train_gpt.py (same arguments, under torchrun) with every bucket pass of
the step inside backward slowed by ``DFA_SLOW_STEP_MS`` (default 40 ms) before the worker
takes its grads: on the CPU the tiny model's passes otherwise end long before the next
forward needs them, so the waits that keep a step which overlaps the next forward exact
(each bucket group's param all-gather waits for its step and for its grads' zeroing, which
runs behind the step) would never be exercised.  The delay comes before the bucket's grads
are prepared (its reduce-scatter handle, Megatron's ``.float()``), so a worker that waits on
a handle after Megatron's clip (Note [A reduce-scatter waited twice] in
deferalloc/megatron.py) is exercised too.  The arithmetic is unchanged.
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "megatron"))

import train_gpt  # noqa: E402
from deferalloc.overlap import BackwardOverlap  # noqa: E402

DELAY = float(os.environ.get("DFA_SLOW_STEP_MS", "40")) / 1000.0
_step_bucket = BackwardOverlap._step_bucket


def slow_step_bucket(self, *args, **kwargs):
    time.sleep(DELAY)
    return _step_bucket(self, *args, **kwargs)


if __name__ == "__main__":
    BackwardOverlap._step_bucket = slow_step_bucket
    sys.exit(train_gpt.main())
