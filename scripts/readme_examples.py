#!/usr/bin/env python3
"""Runs the README's examples as a user would (ctest readme_examples / readme_examples_gpu).

An example is the fenced block that follows a marker comment in README.md:
    <!-- example: NAME.py -->                      run with --python (the pip-installed venv)
    <!-- example: NAME.cpp links TARGET -->        built against an install of --build
                                                   (find_package(deferalloc), TARGET), then run
A C++ block without main() is a fragment: it runs as the body of main() after
#include <deferalloc/deferalloc.hpp>, with `stream` the default stream.  A marker ending in `gpu` names an example that needs a
GPU: it runs with --driver cuda only.  Every example runs with the driver given by
--driver: `host` (DEFERALLOC_CONF=driver:host, which the host driver serves everywhere) or
`cuda` (exit 77, ctest's Skipped, without a GPU).
A README with no marked Python or no marked C++ example fails: the test cannot pass empty.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

MARKER = re.compile(r"<!-- example: (\S+)(?: links (\S+))?( gpu)? -->[^\n]*\n\s*```[a-z]*\n(.*?)\n```", re.S)
FRAGMENT = """#include <deferalloc/deferalloc.hpp>
int main() {{
  deferalloc::stream_t stream = nullptr;
{code}}}
"""


def examples(readme, driver):
    """(file name, CMake target, code) of each example that runs on `driver`."""
    text = open(readme).read()
    out = []
    for m in MARKER.finditer(text):
        name, target, gpu, code = m.group(1), m.group(2), m.group(3), m.group(4) + "\n"
        if gpu and driver != "cuda":
            print(f"readme_examples: {name} needs a GPU: not run on the {driver} driver")
            continue
        if name.endswith(".cpp") and "int main(" not in code:
            code = FRAGMENT.format(code="".join("  " + line + "\n" for line in code.splitlines()))
        out.append((name, target, code))
    return out


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--readme", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--python", required=True, help="interpreter with deferalloc installed (pip)")
    ap.add_argument("--build", required=True, help="build tree to install for the C++ examples")
    ap.add_argument("--generator", default="Ninja")
    ap.add_argument("--driver", choices=("host", "cuda"), default="host")
    a = ap.parse_args(argv)
    found = examples(a.readme, a.driver)
    kinds = {os.path.splitext(name)[1] for name, _, _ in found}
    if not {".py", ".cpp"} <= kinds:
        print(f"readme_examples: {a.readme} must mark at least one .py and one .cpp example; found {kinds or 'none'}")
        return 1
    if a.driver == "cuda" and (shutil.which("nvidia-smi") is None or
                               subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0):
        print("readme_examples: no GPU (nvidia-smi -L fails): skipped")
        return 77
    env = {k: v for k, v in os.environ.items() if k not in ("DEFERALLOC_LIB", "PYTHONPATH")}
    env["DEFERALLOC_CONF"] = f"driver:{a.driver}"
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    cpp = [(name, target, code) for name, target, code in found if name.endswith(".cpp")]
    prefix = os.path.join(a.work, "prefix")
    run(["cmake", "--install", a.build, "--prefix", prefix])
    lists = ["cmake_minimum_required(VERSION 3.25)", "project(readme_examples LANGUAGES CXX)",
             "find_package(deferalloc CONFIG REQUIRED)"]
    for name, target, code in cpp:
        with open(os.path.join(a.work, name), "w") as f:
            f.write(code)
        exe = os.path.splitext(name)[0]
        lists += [f"add_executable({exe} {name})", f"target_link_libraries({exe} PRIVATE {target or 'deferalloc::deferalloc'})"]
    with open(os.path.join(a.work, "CMakeLists.txt"), "w") as f:
        f.write("\n".join(lists) + "\n")
    run(["cmake", "-S", a.work, "-B", os.path.join(a.work, "build"), "-G", a.generator, f"-DCMAKE_PREFIX_PATH={prefix}",
         "-DCMAKE_BUILD_TYPE=Release"])
    run(["cmake", "--build", os.path.join(a.work, "build")])
    ran = []
    for name, _, _ in cpp:
        run([os.path.join(a.work, "build", os.path.splitext(name)[0])], env=env, cwd=a.work)
        ran.append(name)
    for name, _, code in found:
        if name.endswith(".py"):
            path = os.path.join(a.work, name)
            with open(path, "w") as f:
                f.write(code)
            run([a.python, path], env=env, cwd=a.work)
            ran.append(name)
    print(f"readme_examples: {len(ran)} examples ran on the {a.driver} driver: {', '.join(ran)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
