"""Messages on a machine without a GPU point the right way (CPU; Skipped, 77, where a GPU is).

- DEFERALLOC_CONF=driver:cuda: deferalloc.driver_name() and StreamedAdamW on CPU parameters
  both raise NoDevice naming driver:cuda (not a silent step on the host driver);
- deferalloc.install() raises NoDevice naming the missing GPU and what serves on the CPU;
- deferalloc.region() warns once (logging "deferalloc") that PyTorch's CPU tensors are not
  deferalloc's.
Each case runs in a fresh process: the library's process instance reads DEFERALLOC_CONF once.
Run by ctest (label torch) with DEFERALLOC_LIB and DEFERALLOC_OPTIMIZER_LIB set.
"""
import os
import subprocess
import sys
import textwrap
import unittest

import torch

from unittest_main import run_tests


def run(code: str, conf: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEFERALLOC_CONF=conf)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


RAISES = """
import torch, deferalloc
from deferalloc.optim import StreamedAdamW
try:
    {call}
    raise SystemExit("no error: {call}")
except deferalloc.NoDevice as e:
    for part in {parts!r}:
        assert part in str(e), (part, str(e))
"""


class NoGpuMessages(unittest.TestCase):
    def check(self, code: str, conf: str = "driver:host"):
        r = run(code, conf)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r

    def raises_no_device(self, call: str, parts, conf: str = "driver:host"):
        self.check(RAISES.format(call=call, parts=tuple(parts)), conf)

    def test_explicit_cuda_driver_fails_naming_the_setting(self):
        self.raises_no_device("deferalloc.driver_name()", ["driver:cuda", "driver:host"], conf="driver:cuda")

    def test_explicit_cuda_driver_fails_for_the_optimizer(self):
        # Not a silent step on the host driver.
        self.raises_no_device("StreamedAdamW(torch.nn.Linear(8, 8).to(torch.bfloat16).parameters(), window_mb=4)",
                              ["driver:cuda"], conf="driver:cuda,host_granularity_kb:64")

    def test_install_raises(self):
        self.raises_no_device("deferalloc.install()", ["no CUDA GPU", "deferred_empty"])

    def test_region_warns_once(self):
        r = self.check("""
            import logging, torch, deferalloc
            logging.basicConfig(level=logging.WARNING)
            for _ in range(3):
                with deferalloc.region("rollout"):
                    x = torch.ones(4)
            """)
        self.assertEqual(r.stderr.count("deferalloc.region(): there is no CUDA GPU"), 1, r.stderr)


if __name__ == "__main__":
    if torch.cuda.is_available():
        print("test_no_gpu_messages: a GPU is present: skipped (these are the messages without one)")
        sys.exit(77)
    run_tests()
