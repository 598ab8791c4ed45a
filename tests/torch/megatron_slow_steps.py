"""examples/megatron/train_gpt.py (same arguments, under torchrun) with every engine pass of
the streamed optimizer slowed by ``DFA_SLOW_STEP_MS`` (default 40 ms) before it starts: on
the CPU the tiny model's passes otherwise end long before the next forward needs them, so
the waits that keep a step which overlaps the next forward exact (each bucket group's
param all-gather waits for its step and for its grads' zeroing, which runs behind the step)
would never be exercised.  The arithmetic is unchanged.
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "megatron"))

import train_gpt  # noqa: E402
from deferalloc.optim import StreamedAdamW  # noqa: E402

DELAY = float(os.environ.get("DFA_SLOW_STEP_MS", "40")) / 1000.0
_step_grads = StreamedAdamW.step_grads


def slow_step_grads(self, *args, **kwargs):
    time.sleep(DELAY)
    return _step_grads(self, *args, **kwargs)


if __name__ == "__main__":
    StreamedAdamW.step_grads = slow_step_grads
    sys.exit(train_gpt.main())
