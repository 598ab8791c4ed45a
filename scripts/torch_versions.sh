#!/usr/bin/env bash
# The CPU torch suites against another torch than .venv's: a separate venv with that torch
# (and numpy) from PyPI, then every ctest of label torch whose command is the Python
# interpreter, without label gpu or pip (those use the pip-installed venv), run as ctest
# would run it (its command and environment, read from `ctest --show-only=json-v1`) with the
# other venv's Python.
#   bash scripts/torch_versions.sh VERSION [VENV_DIR] [BUILD_DIR]
#     VERSION    e.g. 2.6.0 (pyproject.toml's [torch] lower bound)
#     VENV_DIR   default .venv-torch-VERSION (kept: a second run reuses it)
#     BUILD_DIR  default build: a configured and built tree with -DDEFERALLOC_WITH_TORCH=ON
#                (scripts/test.sh's); the libraries are not rebuilt, only the Python runs change
# DFA_TORCH_EXTRA: other packages for the venv (default: .venv's transformers and accelerate).
# DFA_TORCH_TESTS (a regex, default: every such test except the Megatron ones, whose
# megatron-core pins its own torch range) picks the tests.  Torch's PyPI wheel for Linux
# is the CUDA one: about 2.6 GB to download; run it with `nice`.
set -uo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: torch_versions.sh VERSION [VENV_DIR] [BUILD_DIR]}
venv=${2:-.venv-torch-$version}
build=${3:-build}
pattern=${DFA_TORCH_TESTS:-.}
exclude=${DFA_TORCH_EXCLUDE:-megatron}
venv=$(realpath -m "$venv")
[ -f "$build/CTestTestfile.cmake" ] || { echo "torch_versions.sh: $build is not a configured build (scripts/test.sh)" >&2; exit 2; }
t0=$SECONDS
# The suites' other packages at .venv's versions (transformers, accelerate), when .venv has them.
extra=${DFA_TORCH_EXTRA-$(.venv/bin/python -c 'import transformers, accelerate
print(f"transformers=={transformers.__version__} accelerate=={accelerate.__version__}")' 2>/dev/null)}
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  python3 -m venv "$venv" || exit 2
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "torch==$version" numpy || exit 2
fi
if [ -n "$extra" ] && ! "$venv/bin/python" -c 'import transformers, accelerate' 2>/dev/null; then
  # shellcheck disable=SC2086
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir $extra || exit 2
fi
echo "torch_versions.sh: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') in $venv (install $((SECONDS - t0)) s)"
ctest --test-dir "$build" -L torch -N --show-only=json-v1 > "$venv/tests.json" || exit 2
"$venv/bin/python" - "$venv/tests.json" "$venv/bin/python" "$pattern" "$exclude" <<'PY'
import json, os, re, subprocess, sys, time
spec, py, pattern, exclude = sys.argv[1:]
tests = json.load(open(spec))["tests"]
failed, ran = [], 0
for t in tests:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    labels = props.get("LABELS", [])
    cmd = t.get("command") or []
    if "gpu" in labels or "pip" in labels or not cmd or "python" not in os.path.basename(cmd[0]):
        continue
    if not re.search(pattern, t["name"]) or (exclude and re.search(exclude, t["name"])):
        continue
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in props.get("ENVIRONMENT", []))
    skip = int(props.get("SKIP_RETURN_CODE", -1))
    t0 = time.time()
    r = subprocess.run([py] + cmd[1:], env=env, cwd=props.get("WORKING_DIRECTORY"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=float(props.get("TIMEOUT", 1500)))
    ran += 1
    state = "Skipped" if r.returncode == skip else ("Passed" if r.returncode == 0 else "FAILED")
    print(f"{t['name']:<40} {state:<8} {time.time() - t0:7.1f} s", flush=True)
    if state == "FAILED":
        failed.append(t["name"])
        log = os.path.join(os.path.dirname(spec), t["name"] + ".log")
        with open(log, "w") as f:
            f.write(r.stdout)
        print("\n".join(r.stdout.splitlines()[-40:]) + f"\n(the whole output: {log})")
print(f"{ran - len(failed)}/{ran} passed" + (f"; failed: {' '.join(failed)}" if failed else ""))
sys.exit(1 if failed or not ran else 0)
PY
rc=$?
echo "torch_versions.sh: total $((SECONDS - t0)) s"
exit $rc
