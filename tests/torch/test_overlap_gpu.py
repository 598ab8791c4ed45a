"""test_overlap_cpu.py's tests on the GPU: the overlap's side stream and events, the
engine's priority stream, the clipping norms of torch._foreach_norm's CUDA kernel (per
bucket, stacked as get_total_norm does: bit-identical to clip_grad_norm_), the file tier.
Exit status 77 (ctest: skipped) without a CUDA device.  Label gpu."""
import os
import sys
import unittest

import torch

if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (test_overlap_cpu runs the same tests on the host driver)")
        sys.exit(77)
    os.environ["DFA_OVERLAP_DEVICE"] = "cuda"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_overlap_cpu import Overlap  # noqa: E402,F401

    unittest.main()
