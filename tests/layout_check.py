#!/usr/bin/env python3
"""The source tree's layout rules (docs/DESIGN.md "Layers"), checked on every ctest run.

1. No source folder holds more than a third of the library's lines (files directly in
   the folder; the library is allocator/, optimizer/, include/ and python/deferalloc/).
2. No include climbs a layer: a library file includes only files of its own layer or
   of a layer below it.
3. No run of six identical lines stands at two places of library code (lines compared
   with their whitespace trimmed; blank lines, comments, includes and imports, and
   lines of punctuation alone are passed over, so a run is six lines of code).
4. Library source comments (C/C++ `//` and `/* */`, Python `#` and triple-quoted strings)
   hold no commit id (a word of 7 to 40 hex digits mixing digits and letters a-f) and no
   date (YYYY-MM-DD, as in a dated run folder): run diaries belong in docs/BENCHMARKS.md and
   CHANGELOG.md, and a Note points at docs/BENCHMARKS.md for numbers.
5. README.md, the user's document, is at most 250 lines (details go to docs/*.md).
6. Each library owns its settings: no key of the optimizer's table (optimizer/settings.cpp)
   is a row of the allocator's (allocator/core/config.cpp); the allocator only names the
   optimizer's keys (Note [Keys other libraries own]).
7. include/deferalloc/ holds the installed API only: every header there is one of the entry
   headers users include (PUBLIC_ENTRIES) or is included by one, directly or not.  An internal
   header lives beside its code (the fault driver in allocator/core/driver/).  Its top level
   holds the C ABIs and the C++ umbrella only (TOP_LEVEL); the C++ headers sit in the folder of
   their layer (core/, caching/, optim/, distributed/, torch/), whose rank rule 2 checks.
8. No library include climbs out of its folder (`#include "../x.hpp"`): a file reaches
   another folder through its target's include directories (`"kernels/moment_format.hpp"`).
9. No library function is longer than 100 lines (MAX_FUNCTION_LINES): C++ in allocator/ and
   optimizer/, Python in python/deferalloc/.  C++: with comments and literals blanked, a `{`
   at namespace or class scope whose head (the text since the last `;`, `{` or `}`) is a
   name, a parameter list and then only qualifiers, a trailing return type or a
   constructor's initializer list opens a function (a brace right after a name in that list
   is a member's initializer); its length is the lines from that
   `{` to its matching `}`, both included (lambdas and local classes count in their
   function).  Python: a def's lines, from `def` to its last line.  The functions in
   KNOWN_LONG ("path:name", name as the rule prints it) are reported as warnings, not
   failures, until they are split.
10. Python modules keep their private names: no module of python/deferalloc/ imports another's
    private name (``from .optim import _x``) or reaches one through an object (``opt._params``,
    ``super()._read``, a subclass's ``self._x`` of its base class in another module) where the
    name is defined by another of the package's modules and not by its own.  They reach each
    other through public methods and documented hooks; the optimizer's C ABI has one caller,
    ``deferalloc._engine``.
11. The user's pages, the build and the project's own tools hold no run diaries either: no line of
    docs/*.md (but docs/BENCHMARKS.md and docs/benchmarks.template.md, where measured runs live),
    of a file under examples/ or of a CMakeLists.txt or *.cmake, and no comment or docstring of the
    code and scripts under tests/ (but this file, whose self-test plants diaries), benchmarks/,
    scripts/ and .ci/ (DIARY_CODE_EXT and extensionless scripts; not data such as JSON) holds a
    commit id, a date or an "issue N" (the history is CHANGELOG.md's; a page says what holds, a
    test says what it checks).  Only the comments of that code are read (Python `#` and
    triple-quoted strings, C/C++ `//` and `/* */`, else `#`), so a hex constant, a digest or a
    date in code or test data is not a diary.

Usage: layout_check.py [ROOT] [--self-test].  Prints each violation and exits 1.
"""
import ast
import io
import os
import re
import sys
import tokenize

# The layers, lowest first (keep in step with docs/DESIGN.md).  A file belongs to the
# layer of the longest entry that matches its path: a folder prefix, or the file's path
# without its extension (the layers inside allocator/core/ and, Note [Optimizer layers], inside optimizer/).
LAYERS = [
    ("include/deferalloc", 0),   # public headers
    ("allocator/core/log", 1.1),          # the allocator core: the internal logger,
    ("allocator/core/settings", 1.1),     #   the rows of every settings table,
    ("allocator/core/driver", 1.1),       #   the driver (VMM primitives, streams and copies),
    ("allocator/core/errors", 1.1),       #   the typed errors,
    ("allocator/core/files", 1.1),        #   the file machinery (checked files, checksum64) and disk spills,
    ("allocator/core/chunk_pool", 1.2),   #   the chunk pool,
    ("allocator/core/pinned_pool", 1.2),  #   the pinned pool (the host backup tier),
    ("allocator/core/reservations", 1.3), #   the reservations and their backups,
    ("allocator/core/mode_checks", 1.3),  #   (release modes' checks)
    ("allocator/core", 1.4),              #   the settings table and the context
    ("allocator/caching", 2),    # the caching allocator
    ("optimizer/kernels", 3),    # the AdamW arithmetic, CPU twin and CUDA kernels
    ("optimizer/store", 4),      # the file tier's I/O
    ("optimizer/shard_table", 5.1),      # the optimizer: the shard table,
    ("optimizer/window", 5.2),           #   the window's slots and the streams,
    ("optimizer/progress", 5.2),         #   progress reports,
    ("optimizer/home", 5.3),             #   the homes (tiers),
    ("optimizer/file_home", 5.3),        #   the file tier's home, over the file store,
    ("optimizer/window_pipeline", 5.4),  #   the window pipeline,
    ("optimizer", 5.5),                  #   the streamed_adamw facade, resident shards, checkpoints
    ("optimizer/distributed", 6),  # the ZeRO-1 optimizer over NCCL
    ("allocator/abi", 7),        # faces: C ABI, DLPack, LD_PRELOAD
    ("allocator/torch", 7),      #        LibTorch
    ("optimizer/abi", 7),        #        the optimizer's C ABI
    ("python/deferalloc", 7),    #        Python
]
# The public C++ headers: one folder per layer, at its layer's rank (the C ABIs and the C++ umbrella
# at the top of include/deferalloc/ are the public headers' 0 above).
LAYERS += [
    ("include/deferalloc/core", 0),
    ("include/deferalloc/caching", 2),
    ("include/deferalloc/optim", 3),  # its value types reach the kernels
    ("include/deferalloc/distributed", 6),
    ("include/deferalloc/torch", 7),
]
# Where a quoted include that is not beside its file is looked up (the CMake targets'
# private include directories and the internal targets deferalloc_log / deferalloc_abi_guard /
# deferalloc_setting_rows / deferalloc_files).
INCLUDE_ROOTS = ["include", "allocator", "allocator/core/log", "allocator/core/settings", "allocator/core/files",
                 "allocator/abi", "optimizer"]
SOURCE_EXT = (".cpp", ".hpp", ".h", ".cu", ".cuh", ".py")
LIBRARY = ["allocator", "optimizer", "include", "python/deferalloc"]
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
CLIMBING_INCLUDE = re.compile(r'^\s*#\s*include\s*"((?:[^"]*/)?\.\./[^"]*)"', re.M)
MAX_FUNCTION_LINES = 100
# Today's functions over MAX_FUNCTION_LINES outside allocator/: warnings until split.
KNOWN_LONG = []


def layer_of(rel):
    best = None
    stem = os.path.splitext(rel)[0]
    for prefix, rank in LAYERS:
        if rel == prefix or stem == prefix or rel.startswith(prefix + "/"):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    return best


def library_files(root):
    for top in LIBRARY:
        for d, _, names in os.walk(os.path.join(root, top)):
            for n in sorted(names):
                if n.endswith(SOURCE_EXT):
                    yield os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")


def resolve(root, rel, target):
    here = os.path.dirname(rel)
    for base in [here] + INCLUDE_ROOTS:
        p = os.path.normpath(os.path.join(base, target)).replace(os.sep, "/")
        if os.path.isfile(os.path.join(root, p)):
            return p
    return None  # a system or third-party header


RUN = 6
COMMENT = re.compile(r"^(//|#(?!\s*(define|if|else|endif))|\*|/\*|\"\"\"|'''|import |from \S+ import )")
PUNCT = re.compile(r"^[\s{}()\[\];,:]*$")


def code_lines(text):
    """(line number, trimmed line) of the lines that count for rule 3."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        t = " ".join(line.split())
        if t and not PUNCT.match(t) and not COMMENT.match(t):
            out.append((i, t))
    return out


def repeated_runs(texts):
    """Rule 3: pairs of places sharing RUN identical code lines, one row per pair of files."""
    seen, found = {}, {}
    for rel, text in texts:
        cl = code_lines(text)
        for k in range(len(cl) - RUN + 1):
            key = tuple(t for _, t in cl[k:k + RUN])
            place = (rel, cl[k][0], cl[k + RUN - 1][0])
            first = seen.setdefault(key, place)
            if first is place or (first[0] == rel and first[2] >= place[1]):
                continue  # the first place, or overlapping itself
            found.setdefault((first[0], rel), (first, place))
    return [f"{a[0]}:{a[1]}-{a[2]} and {b[0]}:{b[1]}-{b[2]} share {RUN} identical lines of code"
            for a, b in found.values()]


README_LINES = 250
COMMIT_ID = re.compile(r"(?<![0-9A-Za-z_.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
DATE = re.compile(r"(?<![0-9])(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9](?![0-9])")


def c_comments(text):
    """(line number, text) of each comment line of C/C++/CUDA source; string and character
    literals are skipped, so a "//" inside one is not a comment."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((line, text[i:j]))
            i = j
            continue
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k, part in enumerate(text[i:j].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, j)
            i = j
            continue
        i += 1
    return out


def py_comments(text):
    """(line number, text) of each `#` comment and each line of a triple-quoted string."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
            elif tok.type == tokenize.STRING and tok.string.lstrip("rRbBuUfF")[:3] in ('"""', "'''"):
                out += [(tok.start[0] + k, part) for k, part in enumerate(tok.string.split("\n"))]
    except (tokenize.TokenError, SyntaxError):
        out = list(enumerate(text.splitlines(), 1))  # unreadable: every line counts
    return out


def diary_marks(rel, text):
    """Rule 4: commit ids and dates in the comments of one library file."""
    found = []
    for line, comment in (py_comments(text) if rel.endswith(".py") else c_comments(text)):
        for m in COMMIT_ID.finditer(comment):
            found.append(f"{rel}:{line}: a commit id ({m.group(0)}) in a comment: numbers and their runs "
                         "belong in docs/BENCHMARKS.md or CHANGELOG.md")
        for m in DATE.finditer(comment):
            found.append(f"{rel}:{line}: a date ({m.group(0)}) in a comment: run diaries belong in "
                         "docs/BENCHMARKS.md or CHANGELOG.md")
    return found


def climbing_includes(rel, text):
    """Rule 8."""
    return [f'{rel}: #include "{target}" climbs out of its folder: include it by its path under the '
            f"target's include directory" for target in CLIMBING_INCLUDE.findall(text)]


FUNCTION_TAIL = re.compile(r"^\s*((const|noexcept|override|final|mutable|&&|&)\s*|noexcept\s*\([^)]*\)\s*|"
                           r"->\s*[\w:<>,\s*&]+?\s*)*(:.*)?$", re.S)
SCOPE_HEAD = re.compile(r"^\s*(template\s*<.*?>\s*)?(namespace|struct|class|union|enum|extern)\b", re.S)
CONTROL = re.compile(r"(^|\W)(if|for|while|switch|catch|do|return)\s*$")
FUNCTION_NAME = re.compile(r"((?:[A-Za-z_]\w*\s*::\s*)*~?\s*(?:operator\s*\(\)|operator\s*[^\s(]+|[A-Za-z_]\w*))\s*$")


def blank_cpp(text):
    """C++ source with comments and string/character literals blanked (line breaks kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'" and not (text[i] == "'" and i > 0 and text[i - 1].isalnum()):  # 1'000 is a digit separator
            j = i + 1
            while j < n and text[j] != text[i] and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            out.append(text[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:j]))
        i = j
    return "".join(out)


def closing(s, i, open_c, close_c):
    """The index of the bracket that closes the one at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] == open_c) - (s[j] == close_c)
        if depth == 0:
            return j
    return len(s) - 1


def cpp_functions(text):
    """(name, first line, lines) of each function defined at namespace or class scope (rule 9)."""
    s, found, head_start, i = blank_cpp(text), [], 0, 0
    while i < len(s):
        if s[i] in ";}":
            head_start = i + 1
        elif s[i] == "{":
            head = s[head_start:i]
            p = head.find("(")
            name = FUNCTION_NAME.search(head[:p]) if p > 0 and not SCOPE_HEAD.match(head) else None
            tail = head[closing(head, p, "(", ")") + 1:] if name else ""
            init_list = FUNCTION_TAIL.match(tail) if name else None
            if init_list and init_list.group(3) and re.search(r"[\w>]\s*$", head):
                i = closing(s, i, "{", "}") + 1  # a member's brace initializer in a constructor's list
                continue
            if name and not CONTROL.search(head[:p]) and "=" not in head[:name.start()].replace("operator=", "") \
                    and FUNCTION_TAIL.match(tail):
                end = closing(s, i, "{", "}")
                first = s.count("\n", 0, i) + 1
                found.append((re.sub(r"\s+", "", name.group(1)), first, s.count("\n", i, end) + 1))
                i = end
            head_start = i + 1
        i += 1
    return found


def py_functions(text):
    """(name, first line, lines) of each def (rule 9)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


KNOWN_HIT = re.compile(r"^warning: (\S+?):\d+: (\S+) is ")


def long_functions(rel, text):
    """Rule 9: failures, and warnings for the functions of KNOWN_LONG."""
    if rel.startswith(("allocator/", "optimizer/")) and rel.endswith((".cpp", ".hpp", ".h", ".cu", ".cuh")):
        functions = cpp_functions(text)
    elif rel.startswith("python/deferalloc/") and rel.endswith(".py"):
        functions = py_functions(text)
    else:
        return []
    out = []
    for name, line, n in functions:
        if n > MAX_FUNCTION_LINES:
            known = f"{rel}:{name}" in KNOWN_LONG and not rel.startswith("allocator/")
            out.append(f"{'warning: ' if known else ''}{rel}:{line}: {name} is {n} lines, more than "
                       f"{MAX_FUNCTION_LINES}: split it by step into named functions")
    return out


ISSUE = re.compile(r"\b[Ii]ssues?[ -]#?[0-9]+")  # issue 12, issues 14, Issue #3, issue-15
DIARY_FREE_EXT = (".md", ".py", ".cpp", ".hpp", ".h", ".txt", ".cmake", ".sh", ".in")
# The tools' code that rule 11 reads in its comments: these folders' files of these kinds, and in
# scripts/ and .ci/ also a file without an extension (a script, as .ci/run).  Not tests/layout_check.py.
DIARY_CODE_DIRS = ("tests/", "benchmarks/", "scripts/", ".ci/")
DIARY_CODE_EXT = (".py", ".cpp", ".hpp", ".h", ".cu", ".cuh", ".sh", ".txt", ".cmake")
C_EXT = (".cpp", ".hpp", ".h", ".cu", ".cuh")


def diary_pages(root):
    """Rule 11: (path, whole) of each file that rule 4 does not read.  whole: the user's pages, the
    examples and the build files are read line by line; the code of tests/, benchmarks/, scripts/ and
    .ci/ (not whole) in its comments and docstrings only (diary_lines)."""
    for d, dirs, names in os.walk(root):
        rel_dir = os.path.relpath(d, root).replace(os.sep, "/")
        dirs[:] = [x for x in dirs if (not x.startswith(".") or (rel_dir == "." and x == ".ci"))
                   and not x.startswith("build") and x != "__pycache__"]
        for n in sorted(names):
            rel = n if rel_dir == "." else f"{rel_dir}/{n}"
            if n == "CMakeLists.txt" or n.endswith(".cmake") or n.endswith(".cmake.in"):
                yield rel, True
            elif rel.startswith("examples/") and n.endswith(DIARY_FREE_EXT):
                yield rel, True
            elif rel_dir == "docs" and n.endswith(".md") and n not in ("BENCHMARKS.md", "benchmarks.template.md"):
                yield rel, True
            elif rel == "tests/layout_check.py":
                continue  # its self-test plants diaries
            elif rel.startswith(DIARY_CODE_DIRS) and (n.endswith(DIARY_CODE_EXT)
                                                     or (rel.startswith(("scripts/", ".ci/")) and "." not in n)):
                yield rel, False


def hash_comments(text):
    """(line number, text) of each `#` comment of a shell script or a text file: a `#` at the start of
    a line or after a blank, `;` or a bracket, outside the quotes of its line (`$#`, `${x#y}` and a
    quoted "#3" are not comments)."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        quote, k = None, 0
        while k < len(line):
            c = line[k]
            if c == "\\" and quote != "'":
                k += 1  # an escaped character
            elif quote:
                quote = None if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c == "#" and (k == 0 or line[k - 1] in " \t;()"):
                out.append((i, line[k:]))
                break
            k += 1
    return out


def diary_lines(rel, text, whole):
    """Rule 11: (line number, text) that it reads of one file: every line of a page, the comments of code."""
    if whole:
        return list(enumerate(text.splitlines(), 1))
    if rel.endswith(".py"):
        return py_comments(text)
    return c_comments(text) if rel.endswith(C_EXT) else hash_comments(text)


def page_diaries(root):
    """Rule 11: commit ids, dates and issue numbers in the pages, the examples, the build files and the
    comments of the tests, benchmarks and scripts."""
    found = []
    for rel, whole in diary_pages(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for i, line in diary_lines(rel, text, whole):
            for what, rx in (("a commit id", COMMIT_ID), ("a date", DATE), ("an issue number", ISSUE)):
                for m in rx.finditer(line):
                    found.append(f"{rel}:{i}: {what} ({m.group(0)}): run diaries and history belong in "
                                 "docs/BENCHMARKS.md or CHANGELOG.md; say what holds")
    return found


def readme_length(root):
    """Rule 5."""
    path = os.path.join(root, "README.md")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        n = sum(1 for _ in f)
    return [f"README.md has {n} lines, more than {README_LINES}: move details to a page under docs/"] \
        if n > README_LINES else []


# The headers a user includes (README.md and docs/*.md name them; paths under include/deferalloc/);
# keep in step with the docs.  TOP_LEVEL: the only headers directly in include/deferalloc/.
TOP_LEVEL = ["deferalloc.h", "optimizer.h", "deferalloc.hpp"]
PUBLIC_ENTRIES = TOP_LEVEL + ["caching/caching_allocator.hpp", "optim/optimizer.hpp", "optim/optimizer_settings.hpp",
                              "distributed/distributed.hpp", "torch/torch.hpp"]
PUBLIC_INCLUDE = re.compile(r'^\s*#\s*include\s*<deferalloc/([^>]+)>', re.M)


def internal_headers(root):
    """Rule 7."""
    top = os.path.join(root, "include", "deferalloc")
    if not os.path.isdir(top):
        return []
    headers = sorted(os.path.relpath(os.path.join(d, n), top).replace(os.sep, "/")
                     for d, _, names in os.walk(top) for n in names if n.endswith((".h", ".hpp")))
    reached, todo = set(), [h for h in PUBLIC_ENTRIES if h in headers]
    while todo:
        h = todo.pop()
        if h in reached:
            continue
        reached.add(h)
        with open(os.path.join(top, h), encoding="utf-8", errors="replace") as f:
            todo += [d for d in PUBLIC_INCLUDE.findall(f.read()) if d in headers]
    return [f"include/deferalloc/{h}: no public header includes it and it is not an entry header: an internal "
            f"header belongs beside its code (or add it to PUBLIC_ENTRIES and document it)"
            for h in headers if h not in reached] + \
           [f"include/deferalloc/{h}: only the C ABIs and the C++ umbrella ({', '.join(TOP_LEVEL)}) sit at the "
            f"top level: a C++ header goes in the folder of its layer (core/, caching/, optim/, ...)"
            for h in headers if "/" not in h and h not in TOP_LEVEL] + \
           [f"tests/layout_check.py: PUBLIC_ENTRIES names include/deferalloc/{h}, which does not exist"
            for h in PUBLIC_ENTRIES if h not in headers]


ALLOCATOR_TABLE, OPTIMIZER_TABLE = "allocator/core/config.cpp", "optimizer/settings.cpp"
TABLE_ROW = re.compile(r'^ {4}\{"([a-z0-9_]+)",', re.M)


def table_keys(root, rel):
    """The keys of the settings table (`k_table[] = {` ... `};`, one row per `{"key", ...`) in rel."""
    path = os.path.join(root, rel)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    start = text.find("k_table[] = {")
    if start < 0:
        return None
    return TABLE_ROW.findall(text[start:text.find("\n};", start)])


def settings_owners(root):
    """Rule 6."""
    found, tables = [], {}
    for rel in (ALLOCATOR_TABLE, OPTIMIZER_TABLE):
        tables[rel] = table_keys(root, rel)
        if not tables[rel]:
            found.append(f"{rel}: no settings table found (k_table[] = {{ with one row per key)")
    if all(tables.values()):
        for key in tables[ALLOCATOR_TABLE]:
            if key in tables[OPTIMIZER_TABLE]:
                found.append(f"{ALLOCATOR_TABLE}: the optimizer's key '{key}' is a row of the allocator's settings "
                             f"table: it belongs to {OPTIMIZER_TABLE} (the allocator only names it)")
    return found


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree):
    """The private names a module defines: its functions, classes, assigned names and
    attributes (``self._x = ...``, ``cls._x``), and its slots."""
    import ast
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.add(node.asname or node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            out.add(node.value)  # __slots__ entries, getattr(x, "_name") defaults
    return {n for n in out if _private(n)}


def private_crossings(texts):
    """Rule 10: (module, line, name) of each use of another module's private name."""
    import ast
    mods = {rel: ast.parse(text) for rel, text in texts
            if rel.startswith("python/deferalloc/") and rel.endswith(".py")}
    modules = {os.path.splitext(os.path.basename(rel))[0] for rel in mods}  # private modules are the package's own
    defined = {rel: _defined_private_names(tree) - modules for rel, tree in mods.items()}
    problems = []
    for rel, tree in mods.items():
        others = set().union(*(d for r, d in defined.items() if r != rel)) if len(defined) > 1 else set()
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                names = [(a.name, "imports") for a in node.names if _private(a.name) and a.name not in modules]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr):
                if node.attr not in defined[rel] and node.attr in others:
                    names = [(node.attr, "reaches")]
            for name, how in names:
                problems.append(f"{rel}:{node.lineno}: {how} the private name {name} of another module of the "
                                f"package (use a public method or a documented hook)")
    return problems


def check(root):
    problems = []
    files = list(library_files(root))
    lines, per_folder, texts = 0, {}, []
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        texts.append((rel, text))
        n = text.count("\n")
        lines += n
        folder = os.path.dirname(rel)
        per_folder[folder] = per_folder.get(folder, 0) + n
        problems += diary_marks(rel, text)
        problems += long_functions(rel, text)
        if not rel.endswith(".py"):
            problems += climbing_includes(rel, text)
        mine = layer_of(rel)
        if rel.endswith(".py") or mine is None:
            continue
        for target in INCLUDE.findall(text):
            dep = resolve(root, rel, target)
            if dep is None or dep.startswith(("tests/", "benchmarks/")):
                continue
            theirs = layer_of(dep)
            if theirs is None:
                problems.append(f"{rel}: includes {target} ({dep}), which is outside every layer")
            elif theirs[1] > mine[1]:
                problems.append(f"{rel} (layer {mine[0]}) includes {target} of the higher layer {theirs[0]}")
    for folder, n in sorted(per_folder.items()):
        if 3 * n > lines:
            problems.append(f"{folder}/ holds {n} of the library's {lines} lines (more than a third)")
    problems += repeated_runs(texts)
    problems += private_crossings(texts)
    problems += readme_length(root)
    problems += page_diaries(root)
    problems += settings_owners(root)
    problems += internal_headers(root)
    known = {f"{m.group(1)}:{m.group(2)}" for m in (KNOWN_HIT.match(p) for p in problems) if m}
    problems += [f"tests/layout_check.py: KNOWN_LONG names {k}, which is not over {MAX_FUNCTION_LINES} lines "
                 f"(or does not exist): remove it" for k in KNOWN_LONG if k not in known]
    return problems, lines, per_folder


def self_test():
    """The checker must be able to fail: a climbing include (between folders and inside the allocator's
    core and the optimizer), an include out of its folder, a long function (C++ and Python; one of
    KNOWN_LONG only warns), a fat folder, a repeated run, diary marks, a long README, an optimizer
    key in the allocator's settings table, an internal header under include/, another module's
    private names in Python and diaries in the pages, examples and build files and in the comments of the
    tests, benchmarks, scripts and CI are found (not in their code, strings or data)."""
    import tempfile
    with tempfile.TemporaryDirectory() as t:
        def put(rel, text):
            os.makedirs(os.path.join(t, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(t, rel), "w") as f:
                f.write(text)
        put("allocator/caching/impl.hpp", "int x;\n")
        put("allocator/core/reservations.cpp", '#include "caching/impl.hpp"\n' + "x\n" * 40)
        body = "".join(f"  int v{i} = f({i});\n" for i in range(RUN))
        put("optimizer/a.cpp", "x\n" + body)
        put("optimizer/kernels/b.cpp", "// other\n" + body.replace("\n", "  \n// note\n}\n"))
        put("optimizer/c.cpp", '// Note [X]: 1.19x at depth 3 (5061b2f)\nconst char* s = "// 1234abcd";\n'
                               '/* measured\n   2026-12-01 */ int y = 0x5061b2f0;  // 5.9604644775390625e-08\n')
        put("python/deferalloc/d.py", '"""Docstring.\n\nAt b64ed16 it ran."""\nx = "2026-12-01"  # code\n# on 2026-11-30\n')
        put("README.md", "line\n" * (README_LINES + 1))
        put("include/deferalloc/deferalloc.hpp",
            "#include <deferalloc/core/driver.hpp>\n#include <deferalloc/stray.hpp>\n")
        put("include/deferalloc/stray.hpp", "int s;\n")
        put("include/deferalloc/core/driver.hpp", "#include <deferalloc/caching/caching_allocator.hpp>\n")
        put("include/deferalloc/core/fault_driver.hpp", "#include <deferalloc/core/driver.hpp>\n")
        put("include/deferalloc/caching/caching_allocator.hpp", "int c;\n")
        put(ALLOCATOR_TABLE, 'const row k_table[] = {\n    {"driver", "name",\n    {"tier", "name",\n};\n')
        put("python/deferalloc/e.py", "class A:\n    def __init__(self):\n        self._hidden = 1\n")
        put("python/deferalloc/f.py", "from .e import A, _g\n\n\ndef peek(a):\n    return a._hidden\n")
        problems, _, _ = check(t)
        assert any(p.startswith(f"{OPTIMIZER_TABLE}: no settings table") for p in problems), problems
        put(OPTIMIZER_TABLE, 'const row k_table[] = {\n    {"tier", "name", 0,\n    {"depth", "integer",\n};\n')
        put("optimizer/optimizer_impl.hpp", "struct impl;\n")
        put("optimizer/home.hpp", '#include "optimizer_impl.hpp"\n')
        put("allocator/core/reservations/state.hpp", "int s;\n")
        put("allocator/core/driver/d.cpp", '#include "core/reservations/state.hpp"\n')
        put("optimizer/store/s.cpp", '#include "../kernels/k.hpp"\n#include "kernels/k.hpp"\n')
        lines = "".join(f"  if (x > {i}) {{ x += {i}; }}\n" for i in range(MAX_FUNCTION_LINES))
        put("allocator/core/long.cpp", "namespace deferalloc {\nstruct s {\n  int short_one() const { return 1; }\n};\n"
                                       "s::s(int x) noexcept : a_{x}, b_(x) {\n" + lines + "  c_ = x;\n}\n}\n")
        put("optimizer/checkpoint.cpp", "int detail::read_checkpoint_files(int x) {\n" + lines + "}\n")
        put("python/deferalloc/long.py", "def f(x):\n" + "".join(f"    x += {i}\n" for i in range(MAX_FUNCTION_LINES)))
        saved_known = KNOWN_LONG[:]
        KNOWN_LONG[:] = ["optimizer/checkpoint.cpp:detail::read_checkpoint_files"]  # the fixture's known long one
        try:
            problems, _, _ = check(t)
        finally:
            KNOWN_LONG[:] = saved_known
        assert any(p.startswith('optimizer/store/s.cpp: #include "../kernels/k.hpp" climbs') for p in problems), problems
        assert sum("climbs out of its folder" in p for p in problems) == 1, problems
        long_ones = sorted(p for p in problems if "split it by step" in p)
        assert long_ones == [
            f"allocator/core/long.cpp:5: s::s is {MAX_FUNCTION_LINES + 3} lines, more than {MAX_FUNCTION_LINES}: "
            "split it by step into named functions",
            f"python/deferalloc/long.py:1: f is {MAX_FUNCTION_LINES + 1} lines, more than {MAX_FUNCTION_LINES}: "
            "split it by step into named functions",
            f"warning: optimizer/checkpoint.cpp:1: detail::read_checkpoint_files is {MAX_FUNCTION_LINES + 2} lines, "
            f"more than {MAX_FUNCTION_LINES}: split it by step into named functions"], long_ones
        assert any("climb" in p or "higher layer" in p for p in problems), problems
        assert any("more than a third" in p for p in problems), problems
        assert any(p.startswith("optimizer/home.hpp (layer optimizer/home) includes optimizer_impl.hpp")
                   for p in problems), problems
        assert any(p.startswith("allocator/core/driver/d.cpp (layer allocator/core/driver) includes "
                                "core/reservations/state.hpp") for p in problems), problems
        assert any("optimizer/a.cpp:2-7 and optimizer/kernels/b.cpp" in p for p in problems), problems
        marks = sorted(" ".join(m.groups()) for m in (re.match(r"(\S+): a (commit id|date) \(([^)]+)\)", p)
                                                       for p in problems) if m)
        assert marks == ["optimizer/c.cpp:1 commit id 5061b2f", "optimizer/c.cpp:4 date 2026-12-01",
                         "python/deferalloc/d.py:3 commit id b64ed16", "python/deferalloc/d.py:5 date 2026-11-30"], marks
        assert any(p.startswith(f"README.md has {README_LINES + 1} lines") for p in problems), problems
        crossings = sorted(p.split(": ")[0] + " " + p.split("private name ")[1].split(" ")[0]
                           for p in problems if "private name" in p)
        assert crossings == ["python/deferalloc/f.py:1 _g", "python/deferalloc/f.py:5 _hidden"], crossings
        internal = [p.split(":")[0] for p in problems if "not an entry header" in p]
        assert internal == ["include/deferalloc/core/fault_driver.hpp"], internal
        # include/ also: a C++ header at its top level, a public core header including a caching one,
        # entry headers that do not exist.
        top = [p.split(":")[0] for p in problems if "top level" in p]
        assert top == ["include/deferalloc/stray.hpp"], top
        climbs = "include/deferalloc/core/driver.hpp (layer include/deferalloc/core) includes deferalloc/caching/"
        assert any(p.startswith(climbs + "caching_allocator.hpp of the higher layer") for p in problems), problems
        missing = sorted(p.split("/")[-1].split(",")[0] for p in problems if p.endswith("does not exist"))
        assert missing == ["deferalloc.h", "distributed.hpp", "optimizer.h", "optimizer.hpp", "optimizer_settings.hpp",
                           "torch.hpp"], missing
        # Rule 11: the pages, the examples and the build files (not BENCHMARKS.md, not code lines only).
        put("docs/OPTIM.md", "It used to advance (issue 12).\nMeasured at 5061b2f.\nSee issue #3.\n")
        put("docs/BENCHMARKS.md", "At 5061b2f on 2026-12-01 (issue 12).\n")
        put("docs/benchmarks.template.md", "At 5061b2f.\n")
        put("examples/python/e.py", '"""Run on 2026-11-30."""\nx = 1  # see Issue 9\n')
        put("tests/CMakeLists.txt", "# The distributed optimizer (issue 5).\nadd_test(NAME t COMMAND t)\n")
        put("cmake/x.cmake", "set(dfa_deadbeef0 1)  # cafe123\n")
        # The tools' code: its comments and docstrings only, not its code, strings or data.
        put("scripts/x.sh", '#!/usr/bin/env bash\n# Two GPUs (issue 17): one call.\n'
                            'echo "see issue 4 #5" ${x#y} $# ab12cd34ef  # at cafe123\nn=2026-12-01\n')
        put("tests/y.py", '"""Docstring (issue-8)."""\nDIGEST = "5061b2f0c0ffee"  # a digest\n'
                          'WHEN = "2026-12-01"\nK = 0xdeadbeef1\n# measured 2026-11-30\n')
        put("tests/z.cpp", '// Issue 29 item 2: x.\nconst char* s = "issue 3"; unsigned k = 0xdeadbeef;  // ok\n')
        put("benchmarks/b/k.cu", "int n = 2; /* at\n   5061b2f */\n")
        put("benchmarks/b/data.json", '{"commit": "5061b2f", "date": "2026-12-01", "note": "issue 12"}\n')
        put("benchmarks/b/notes.txt", "# runs of 2026-12-01\nv 5061b2f\n")
        put(".ci/run", "#!/usr/bin/env bash\n# CI (issue 2)\nbash scripts/test.sh\n")
        put("tests/layout_check.py", "# planted: issue 7 at 5061b2f\n")
        problems, _, _ = check(t)
        pages = sorted(re.match(r"(\S+): an? (commit id|date|issue number) \(([^)]+)\)", p).group(1, 3)
                       for p in problems if "run diaries and history" in p)
        assert pages == [(".ci/run:2", "issue 2"), ("benchmarks/b/k.cu:2", "5061b2f"),
                         ("benchmarks/b/notes.txt:1", "2026-12-01"), ("cmake/x.cmake:1", "cafe123"),
                         ("docs/OPTIM.md:1", "issue 12"), ("docs/OPTIM.md:2", "5061b2f"),
                         ("docs/OPTIM.md:3", "issue #3"), ("examples/python/e.py:1", "2026-11-30"),
                         ("examples/python/e.py:2", "Issue 9"), ("scripts/x.sh:2", "issue 17"),
                         ("scripts/x.sh:3", "cafe123"), ("tests/CMakeLists.txt:1", "issue 5"), ("tests/y.py:1", "issue-8"),
                         ("tests/y.py:5", "2026-11-30"), ("tests/z.cpp:1", "Issue 29")], pages
        owned = [p for p in problems if "settings table" in p]
        assert owned == [f"{ALLOCATOR_TABLE}: the optimizer's key 'tier' is a row of the allocator's settings table: "
                         f"it belongs to {OPTIMIZER_TABLE} (the allocator only names it)"], owned


def main(argv):
    root = next((a for a in argv[1:] if not a.startswith("--")), os.path.join(os.path.dirname(__file__), ".."))
    self_test()
    problems, lines, per_folder = check(os.path.abspath(root))
    biggest = max(per_folder.items(), key=lambda kv: kv[1])
    print(f"layout_check: {len(per_folder)} folders, {lines} library lines; largest {biggest[0]}/ "
          f"with {biggest[1]} ({100 * biggest[1] / lines:.0f}%)")
    for p in problems:
        print("layout_check: " + p)
    return 1 if any(not p.startswith("warning: ") for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
