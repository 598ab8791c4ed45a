#!/usr/bin/env python3
"""Runs the documentation's examples as a user would (ctest readme_examples / readme_examples_gpu).

Every fenced code block of each page given (--readme README.md docs/ALLOCATOR.md ...) must
follow a marker comment, which says how it runs:
    <!-- example: NAME.py [gpu] -->                  run with --python (the pip-installed venv)
    <!-- example: NAME.cpp [links TARGET] [gpu] -->  built against an install of --build
                                                     (find_package(deferalloc), TARGET), then run
    <!-- example: NAME.sh [gpu] -->                  bash -euo pipefail in the repository root,
                                                     the venv's bin first on PATH (`python`)
    <!-- example: excerpt PATH [host: ARGS] [cuda: ARGS] -->
        the block is a verbatim excerpt of the repository file PATH (indentation aside; the
        test fails when they drift apart), and PATH runs with the venv's python and the
        ARGS given for the driver (none given: not run on that driver, said so)
    <!-- not an example: WHY -->                     a block that is not code (the layout),
                                                     or the two commands this test runs under
A C++ block without main() is a fragment: its #include lines go first, the rest runs as the
body of main() after #include <deferalloc/deferalloc.hpp>, with `stream` the default stream.
`gpu` marks an example that needs a GPU: it runs with --driver cuda only.  Every example runs
with the driver given by --driver: `host` (DEFERALLOC_CONF=driver:host, which the host driver
serves everywhere) or `cuda` (exit 77, ctest's Skipped, without a GPU).  A fenced block with
no marker, or pages with no Python or no C++ example among them, fails the test; example
names are file names, unique across the pages.
An example whose Python module is missing (megatron-core) is skipped with the reason printed.

--docstrings FILE...: the commands in each example program's module docstring run too, as
written, from the repository root (`python` is --python, `torchrun` is --python -m
torch.distributed.run, leading VAR=value words are the environment): a line that starts
with `python ` or `torchrun ` (after VAR=value words; a trailing `\\` continues it; a
trailing `# comment` is dropped).  One that names --cpu or --cpu-emulation runs with --driver
host only; any other needs a GPU and runs with --driver cuda only.  A docstring must not set
DEFERALLOC_LIB (a pip user has no build tree).  Every command run is printed at the end.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```[a-z]*\n(.*?)\n```", re.S | re.M)
MARKER = re.compile(r"<!-- (example|not an example): ([^\n]*?) -->[^\n]*\n\s*\Z")
FRAGMENT = """#include <deferalloc/deferalloc.hpp>
{includes}int main() {{
  deferalloc::stream_t stream = nullptr;
{code}}}
"""
# Python modules an excerpt needs beyond torch and deferalloc: skipped, said so, when missing.
NEEDS = {"examples/megatron/": "megatron.core"}


ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def docstring_commands(path):
    """The commands of the module docstring of the program `path`: (line, env, argv, gpu)."""
    import ast
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    out, lines, i = [], doc.splitlines(), 0
    while i < len(lines):
        start, text = i, lines[i].strip()
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        text = text.split(" # ")[0].split("  #")[0].strip()
        words = shell_words(text)
        env = []
        while words and ASSIGN.match(words[0]):
            env.append(words.pop(0))
        if not words or words[0] not in ("python", "torchrun") or len(words) < 2:
            continue
        where = f"{rel} docstring line {start + 1}"
        if any(w.startswith("DEFERALLOC_LIB=") for w in env):
            raise ValueError(f"{where}: sets DEFERALLOC_LIB (only a source build needs it; a pip user has none)")
        gpu = not ({"--cpu", "--cpu-emulation"} & set(words))
        out.append((where, env, words, gpu))
    return out


def shell_words(text):
    """`text` split at blanks outside quotes and $( ... ) (enough for the docstrings' commands)."""
    words, cur, depth, quote = [], "", 0, None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "(" and text[i - 1:i] == "$":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif ch.isspace() and depth == 0:
            if cur:
                words.append(cur)
            cur = ""
            continue
        cur += ch
    return words + ([cur] if cur else [])


class Example:
    def __init__(self, spec, code, line):
        words = spec.split()  # line: "PAGE line N", where the block starts
        self.line, self.code, self.gpu, self.target, self.args = line, code + "\n", False, None, {}
        if words[0] == "excerpt":
            self.kind, self.name, self.path = "excerpt", os.path.basename(words[1]), words[1]
            driver = None
            for w in words[2:]:
                if w in ("host:", "cuda:"):
                    driver = w[:-1]
                    self.args[driver] = []
                elif driver is None:
                    raise ValueError(f"{line}: excerpt arguments must follow host: or cuda:")
                else:
                    self.args[driver].append(w)
            return
        self.name = words[0]
        self.kind = os.path.splitext(self.name)[1][1:]
        rest = words[1:]
        if rest[-1:] == ["gpu"]:
            self.gpu, rest = True, rest[:-1]
        if rest[:1] == ["links"] and len(rest) == 2:
            self.target, rest = rest[1], []
        if rest or self.kind not in ("py", "cpp", "sh"):
            raise ValueError(f"{line}: cannot read the marker 'example: {spec}'")

    def runs_on(self, driver):
        """None when it runs on `driver`, else why not."""
        if self.kind == "excerpt":
            return None if driver in self.args else f"no arguments for the {driver} driver in its marker"
        return f"needs a GPU: not run on the {driver} driver" if self.gpu and driver != "cuda" else None


def examples(readme):
    """Every fenced block of the page `readme` with its marker; raises ValueError on an unmarked one."""
    text = open(readme).read()
    page = os.path.relpath(os.path.abspath(readme), ROOT)
    out = []
    for m in FENCE.finditer(text):
        line = f"{page} line {text.count(chr(10), 0, m.start()) + 1}"
        marker = MARKER.search(text, 0, m.start())
        if marker is None:
            raise ValueError(f"{line}: a code block without an example marker "
                             "(<!-- example: ... --> or <!-- not an example: why -->)")
        if marker.group(1) == "example":
            out.append(Example(marker.group(2), m.group(1), line))
    return out


def check_excerpt(ex):
    """The block is a contiguous run of PATH's lines, shifted by one indentation."""
    path = os.path.join(ROOT, ex.path)
    lines, block = open(path).read().splitlines(), ex.code.rstrip("\n").splitlines()
    for i in range(len(lines) - len(block) + 1):
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        if all(lines[i + j] == (indent + b if b else "") or (not b and not lines[i + j].strip())
               for j, b in enumerate(block)):
            return i + 1
    raise SystemExit(f"readme_examples: the block at {ex.line} is not a verbatim excerpt of {ex.path}: "
                     "update one of them")


def cpp_source(code):
    if "int main(" in code:
        return code
    includes = [ln for ln in code.splitlines() if ln.startswith("#include")]
    body = [ln for ln in code.splitlines() if not ln.startswith("#include")]
    return FRAGMENT.format(includes="".join(ln + "\n" for ln in includes),
                           code="".join("  " + ln + "\n" for ln in body))


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def has_gpu():
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"],
                                                                     capture_output=True).returncode == 0


def build_cpp(cpp, a, env):
    prefix = os.path.join(a.work, "prefix")
    run(["cmake", "--install", a.build, "--prefix", prefix])
    prefixes = [prefix]
    torch = any(ex.target == "deferalloc::torch" for ex in cpp)
    if torch:
        prefixes.append(subprocess.run([a.python, "-c", "import torch; print(torch.utils.cmake_prefix_path)"],
                                       check=True, capture_output=True, text=True, env=env).stdout.strip())
    lists = ["cmake_minimum_required(VERSION 3.25)", "project(readme_examples LANGUAGES CXX)",
             f"find_package(deferalloc CONFIG REQUIRED{' COMPONENTS torch' if torch else ''})"]
    for ex in cpp:
        with open(os.path.join(a.work, ex.name), "w") as f:
            f.write(cpp_source(ex.code))
        exe = os.path.splitext(ex.name)[0]
        lists += [f"add_executable({exe} {ex.name})",
                  f"target_link_libraries({exe} PRIVATE {ex.target or 'deferalloc::deferalloc'})"]
    with open(os.path.join(a.work, "CMakeLists.txt"), "w") as f:
        f.write("\n".join(lists) + "\n")
    run(["cmake", "-S", a.work, "-B", os.path.join(a.work, "build"), "-G", a.generator,
         "-DCMAKE_PREFIX_PATH=" + ";".join(prefixes), "-DCMAKE_BUILD_TYPE=Release"])
    run(["cmake", "--build", os.path.join(a.work, "build")])


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--readme", required=True, nargs="+", help="the pages whose code blocks run")
    ap.add_argument("--work", required=True)
    ap.add_argument("--python", required=True, help="interpreter with deferalloc installed (pip)")
    ap.add_argument("--build", required=True, help="build tree to install for the C++ examples")
    ap.add_argument("--generator", default="Ninja")
    ap.add_argument("--driver", choices=("host", "cuda"), default="host")
    ap.add_argument("--docstrings", nargs="*", default=[], help="example programs whose docstring commands run")
    a = ap.parse_args(argv)
    a.python, a.build, a.work = (os.path.abspath(p) for p in (a.python, a.build, a.work))
    try:
        every = [ex for page in a.readme for ex in examples(page)]
        commands = [c for path in a.docstrings for c in docstring_commands(path)]
    except ValueError as e:
        print(f"readme_examples: {e}")
        return 1
    kinds = {ex.kind for ex in every}
    if not {"py", "cpp"} <= kinds:
        print(f"readme_examples: {' '.join(a.readme)} must mark at least one .py and one .cpp example; "
              f"found {kinds or 'none'}")
        return 1
    names = [ex.name for ex in every if ex.kind != "excerpt"]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        print(f"readme_examples: example names must be unique across the pages: {', '.join(twice)}")
        return 1
    for ex in every:  # a drifted excerpt fails on every driver
        if ex.kind == "excerpt":
            print(f"readme_examples: {ex.line} = {ex.path} line {check_excerpt(ex)} onwards")
    if a.driver == "cuda" and not has_gpu():
        print("readme_examples: no GPU (nvidia-smi -L fails): skipped")
        return 77
    found = []
    for ex in every:
        why = ex.runs_on(a.driver)
        if why:
            print(f"readme_examples: {ex.name} ({ex.line}) {why}")
        else:
            found.append(ex)
    # The installed package, not the source tree: no DEFERALLOC_LIB, and no PYTHONPATH entry
    # holding a deferalloc package (other entries, e.g. megatron-core's, stay).
    env = {k: v for k, v in os.environ.items() if k != "DEFERALLOC_LIB"}
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and not os.path.exists(os.path.join(p, "deferalloc", "__init__.py"))]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    env["DEFERALLOC_CONF"] = f"driver:{a.driver}"
    env["PATH"] = os.path.dirname(os.path.abspath(a.python)) + os.pathsep + env.get("PATH", "")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    cpp = [ex for ex in found if ex.kind == "cpp"]
    if cpp:
        build_cpp(cpp, a, env)
    ran, skipped = [], []
    for ex in found:
        if ex.kind == "cpp":
            run([os.path.join(a.work, "build", os.path.splitext(ex.name)[0])], env=env, cwd=a.work)
        elif ex.kind == "py":
            path = os.path.join(a.work, ex.name)
            with open(path, "w") as f:
                f.write(ex.code)
            run([a.python, path], env=env, cwd=a.work)
        elif ex.kind == "sh":
            run(["bash", "-euo", "pipefail", "-c", ex.code], env=env, cwd=ROOT)
        else:
            module = next((m for p, m in NEEDS.items() if ex.path.startswith(p)), None)
            if module and subprocess.run([a.python, "-c", f"import {module}"], env=env,
                                         capture_output=True).returncode != 0:
                print(f"readme_examples: {ex.path} skipped: {module} is not importable by {a.python}")
                skipped.append(ex.name)
                continue
            run([a.python, os.path.join(ROOT, ex.path), *ex.args[a.driver]], env=env, cwd=a.work)
        ran.append(ex.name)
    for where, cenv, words, gpu in commands:
        if gpu != (a.driver == "cuda"):  # a CPU command (train_gpt.py --cpu-emulation refuses a GPU)
            why = "needs a GPU" if gpu else "is a CPU command (--cpu, --cpu-emulation)"
            print(f"readme_examples: {where} {why}: not run on the {a.driver} driver: {' '.join(words)}")
            continue
        module = next((m for p, m in NEEDS.items() if where.startswith(p)), None)
        if module and subprocess.run([a.python, "-c", f"import {module}"], env=env,
                                     capture_output=True).returncode != 0:
            print(f"readme_examples: {where} skipped: {module} is not importable by {a.python}")
            skipped.append(where)
            continue
        line = " ".join(cenv + [a.python] + (["-m", "torch.distributed.run"] if words[0] == "torchrun" else [])
                        + words[1:])
        run(["bash", "-euo", "pipefail", "-c", line], env=env, cwd=ROOT)
        ran.append(where)
    print(f"readme_examples: {len(ran)} examples and commands ran on the {a.driver} driver:")
    for name in ran:
        print(f"  {name}")
    if skipped:
        print(f"readme_examples: skipped: {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
