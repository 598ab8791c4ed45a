"""examples/megatron/train_gpt.py (same arguments, under torchrun) with each of Megatron's
finalize_model_grads steps that change main_grad in place after the grad reduce-scatter
(the all-reduces of the layer-norm / non-tensor-parallel grads over TP, of the word and
position embeddings over the pipeline stages) started ``DFA_SLOW_FINALIZE_MS`` (default
300 ms) late: a bucket step that read its grads at the end of its reduce-scatter, before
them, would run inside that delay and read grads without them.  The arithmetic is unchanged.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "megatron"))

import train_gpt  # noqa: E402

DELAY = float(os.environ.get("DFA_SLOW_FINALIZE_MS", "300")) / 1000.0
NAMES = ("_allreduce_non_tensor_model_parallel_grads", "_allreduce_word_embedding_grads",
         "_allreduce_position_embedding_grads", "_allreduce_conditional_embedding_grads")


def slowed(fn):
    @functools.wraps(fn)
    def late(*args, **kwargs):
        time.sleep(DELAY)
        return fn(*args, **kwargs)
    return late


if __name__ == "__main__":
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    for name in NAMES:
        if hasattr(fmg, name):
            setattr(fmg, name, slowed(getattr(fmg, name)))
    sys.exit(train_gpt.main())
