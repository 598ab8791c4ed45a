"""The Python suites' main: unittest with verbose output, then the plain closing line
'N passed, N failed' that CI reads; exit 1 on a failure or when no test ran."""
import sys
import unittest


def run_tests() -> None:
    result = unittest.main(module="__main__", exit=False, verbosity=2).result
    n_bad = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - n_bad} passed, {n_bad} failed")
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)
