"""The library's log messages reach logging.getLogger("deferalloc"), with the rank prefix
under torchrun, and nothing of them on stderr; DEFERALLOC_PY_LOGGING=0 keeps stderr.
Runs a child interpreter per case (the bridge is installed when the package loads)."""
import json
import os
import subprocess
import sys
import unittest

CHILD = r'''
import ctypes, json, logging
records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append([r.levelname, r.getMessage()])
logging.getLogger("deferalloc").addHandler(Keep())
logging.getLogger("deferalloc").setLevel(logging.DEBUG)
import deferalloc
lib = deferalloc._load()
lib.dfa_free.restype = None
lib.dfa_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.dfa_free(ctypes.c_void_p(0x1234000), 4096, 0, None)   # not ours: an error, logged
print(json.dumps(records))
'''


def child(**env):
    e = {k: v for k, v in os.environ.items() if k != "RANK"}
    e.update(env)
    r = subprocess.run([sys.executable, "-c", CHILD], env=e, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError(f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


class Logging(unittest.TestCase):
    def test_messages_go_to_the_python_logger_with_the_rank(self):
        records, err = child(RANK="3")
        errors = [m for level, m in records if level == "ERROR"]
        self.assertTrue(errors, records)
        self.assertTrue(all(m.startswith("[rank 3] ") for _, m in records), records)
        self.assertIn("dfa_free", errors[0])
        self.assertNotIn("[deferalloc error]", err)

    def test_no_rank_no_prefix(self):
        records, _ = child()
        self.assertTrue(records)
        self.assertFalse(any(m.startswith("[rank") for _, m in records), records)

    def test_opt_out_keeps_stderr(self):
        records, err = child(DEFERALLOC_PY_LOGGING="0")
        self.assertEqual(records, [])
        self.assertIn("[deferalloc error]", err)


if __name__ == "__main__":
    unittest.main()
