#!/usr/bin/env python3
"""Fails when a library's source or header includes a header of a layer it does not depend on.

    python3 tests/layering/check_layering.py [ROOT]
    python3 tests/layering/check_layering.py --self-test

The libraries and their dependencies are read from the acc_add_library(<layer> SOURCES ...
PUBLIC ... PRIVATE ...) calls in src/*/CMakeLists.txt, strategies/ and checkpoint/ (ROOT is the
repository, default: two folders up from this file). A library owns every .cpp/.hpp under the
folder of its CMakeLists.txt and its public headers in include/acc/<layer>/. It may include
"acc/<layer>/..." headers of itself, of the acc:: libraries it links (PUBLIC or PRIVATE), and of
the libraries those export (their PUBLIC dependencies, transitively): what the build lets it
link, and nothing a library keeps PRIVATE. A quoted relative include may not leave the library's
folder, and a public header may include only layers its library links PUBLIC (a user of the
library sees nothing else).

The layers also have an order, the rows of DESIGN.md's layer table (LAYER_ORDER): a library may
link only libraries of its own row or the rows above it, so a lower layer that declared a
dependency on a higher one (and then included it) is reported even though the build allows it.
A tool built beside a library (add_executable in the same CMakeLists.txt) is checked against what
its own target_link_libraries names instead of the library's.

Prints one line per offending include (file:line, the include, the library, what it may include)
and exits 1; prints a summary and exits 0 when there is none. --self-test runs the check on small
made-up repositories, one clean and one with each kind of violation, and fails unless it passes
the first and reports every violation of the second.
"""

import contextlib
import io
import os
import re
import sys
import tempfile

# DESIGN.md's layer table, top to bottom: a layer may use only those above it (and its own row:
# models builds on nn, io and data sit beside optim). session (TrainingSession: resume, saves, the
# hang detector's agent and the step log around auto_accelerate's result) is the last row, below
# accelerate, checkpoint and elastic, which it uses (README.md's "How it is built" has it).
LAYER_ORDER = [
    ["util"], ["tensor"], ["autograd"], ["nn", "models"], ["optim", "io", "data"], ["dist"],
    ["trace"], ["strategies"], ["search"], ["checkpoint"], ["elastic"], ["accelerate"],
    ["session"],
]
LAYER_ROW = {layer: row for row, layers in enumerate(LAYER_ORDER) for layer in layers}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
ACC_HEADER = re.compile(r"^acc/([A-Za-z0-9_]+)/")


def cmake_calls(text, name):
    """The argument lists (whitespace-split tokens) of every `name(...)` call in CMake text."""
    text = re.sub(r"#[^\n]*", "", text)  # comments (no '#' inside these calls' arguments)
    for m in re.finditer(r"\b" + re.escape(name) + r"\s*\(([^)]*)\)", text):
        yield m.group(1).split()


def read_libraries(root):
    """{layer: {"dir": folder, "public": set, "private": set, "cmake": path}}."""
    libs = {}
    folders = [os.path.join(root, "src", d) for d in sorted(os.listdir(os.path.join(root, "src")))]
    for top in ("strategies", "search", "checkpoint", "elastic"):
        folders.append(os.path.join(root, top))
    for folder in folders:
        cmake = os.path.join(folder, "CMakeLists.txt")
        if not os.path.isfile(cmake):
            continue
        with open(cmake) as f:
            text = f.read()
        for args in cmake_calls(text, "acc_add_library"):
            layer, section = args[0], None
            lib = {"dir": folder, "public": set(), "private": set(), "cmake": cmake,
                   "sources": set()}
            for tok in args[1:]:
                if tok in ("SOURCES", "PUBLIC", "PRIVATE"):
                    section = tok
                elif section == "SOURCES":
                    lib["sources"].add(os.path.normpath(os.path.join(folder, tok)))
                elif section in ("PUBLIC", "PRIVATE") and tok.startswith("acc::"):
                    lib[section.lower()].add(tok[len("acc::"):])
            if layer in libs:
                sys.exit(f"check_layering: layer '{layer}' is declared twice ({libs[layer]['cmake']}"
                         f" and {cmake})")
            libs[layer] = lib
    return libs


def read_executables(root, libs):
    """{name: {"dir", "sources", "links", "cmake"}} of the add_executable calls in the libraries'
    folders, with the acc:: libraries their target_link_libraries name."""
    exes = {}
    for cmake in sorted({lib["cmake"] for lib in libs.values()}):
        folder = os.path.dirname(cmake)
        with open(cmake) as f:
            text = f.read()
        for args in cmake_calls(text, "add_executable"):
            exes[args[0]] = {"dir": folder, "cmake": cmake, "links": set(),
                             "sources": {os.path.normpath(os.path.join(folder, a))
                                         for a in args[1:] if a.endswith((".cpp", ".cc"))}}
        for args in cmake_calls(text, "target_link_libraries"):
            if args and args[0] in exes:
                exes[args[0]]["links"] |= {t[len("acc::"):] for t in args[1:]
                                           if t.startswith("acc::")}
    return exes


def exported(libs, layer, seen=None):
    """The layer and what it exports: its PUBLIC dependencies, transitively."""
    seen = set() if seen is None else seen
    if layer in seen or layer not in libs:
        return seen
    seen.add(layer)
    for dep in libs[layer]["public"]:
        exported(libs, dep, seen)
    return seen


def sources(folder):
    for dirpath, _, files in os.walk(folder):
        for name in sorted(files):
            if name.endswith((".cpp", ".hpp", ".h", ".cc")):
                yield os.path.join(dirpath, name)


def check(root):
    libs = read_libraries(root)
    errors = []
    for layer, lib in sorted(libs.items()):
        for dep in sorted(lib["public"] | lib["private"]):
            if dep not in libs:
                errors.append(f"{os.path.relpath(lib['cmake'], root)}: library acc_{layer} links "
                              f"acc::{dep}, which no acc_add_library declares")
        if layer in LAYER_ROW:
            for dep in sorted(lib["public"] | lib["private"]):
                if dep in LAYER_ROW and LAYER_ROW[dep] > LAYER_ROW[layer]:
                    errors.append(f"{os.path.relpath(lib['cmake'], root)}: library acc_{layer} "
                                  f"links acc::{dep}, a layer below it in DESIGN.md's table (a "
                                  "layer may use only those above it)")
    allowed = {}
    exports = {}
    for layer, lib in libs.items():
        exports[layer] = exported(libs, layer)
        allowed[layer] = {layer}
        for dep in lib["public"] | lib["private"]:
            allowed[layer] |= exported(libs, dep)

    # Every file of a library: its SOURCES, the other files of its folder (private headers, tools
    # built beside it; with several libraries in one folder, checked against each), and its
    # public headers.
    files = []  # (path, layer, is_public_header)
    exes = read_executables(root, libs)
    tool_of = {src: name for name, exe in exes.items() for src in exe["sources"]}
    listed = {src for lib in libs.values() for src in lib["sources"]} | set(tool_of)
    for layer, lib in libs.items():
        files += [(p, layer, False) for p in sources(lib["dir"])
                  if p in lib["sources"] or p not in listed]
    for name, exe in exes.items():
        tool = "tool:" + name
        allowed[tool] = set()
        for dep in exe["links"]:
            allowed[tool] |= exported(libs, dep)
        libs[tool] = {"dir": exe["dir"], "cmake": exe["cmake"]}
        files += [(p, tool, False) for p in sorted(exe["sources"]) if os.path.exists(p)]
    include_root = os.path.join(root, "include", "acc")
    for layer in sorted(os.listdir(include_root)):
        folder = os.path.join(include_root, layer)
        if not os.path.isdir(folder):
            continue
        if layer not in libs:
            errors.append(f"include/acc/{layer}/: no acc_add_library declares layer '{layer}'")
            continue
        files += [(p, layer, True) for p in sources(folder)]

    checked = 0
    for path, layer, public in sorted(files):
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        checked += 1
        may = exports[layer] if public else allowed[layer]
        for lineno, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            header = m.group(2)
            acc = ACC_HEADER.match(header)
            if acc:
                target = acc.group(1)
                if target not in may:
                    kind = "public header of" if public else "file of"
                    who = layer[len("tool:"):] if layer.startswith("tool:") else "acc_" + layer
                    errors.append(
                        f"{rel}:{lineno}: #include \"{header}\": {kind} library {who} "
                        f"includes layer '{target}', not among {sorted(may)}"
                        + (" (a public header sees only PUBLIC dependencies)" if public else
                           f" (dependencies declared in {os.path.relpath(libs[layer]['cmake'], root)})"))
            elif m.group(1) == '"' and not public:
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), header))
                inside = os.path.commonpath([resolved, libs[layer]["dir"]]) == libs[layer]["dir"]
                if not inside:
                    errors.append(f"{rel}:{lineno}: #include \"{header}\": file of library "
                                  f"acc_{layer} reaches outside its folder "
                                  f"{os.path.relpath(libs[layer]['dir'], root)}/")
    for e in errors:
        print(e)
    if errors:
        print(f"check_layering: {len(errors)} layering violation(s) in {checked} files of "
              f"{len(libs) - len(exes)} libraries and {len(exes)} tools")
        return 1
    print(f"check_layering: {checked} files of {len(libs) - len(exes)} libraries and "
          f"{len(exes)} tools include only the layers their CMake dependencies allow, in "
          "DESIGN.md's order")
    return 0


def self_test():
    def write(root, rel, text):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def run(files):
        with tempfile.TemporaryDirectory() as root:
            for rel, text in files.items():
                write(root, rel, text)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = check(root)
            return rc, out.getvalue()

    # base <- mid (PUBLIC) <- top (PRIVATE mid); side links base PRIVATE only.
    clean = {
        "src/base/CMakeLists.txt": "acc_add_library(base SOURCES base.cpp)\n",
        "src/base/base.cpp": '#include "acc/base/base.hpp"\n#include "detail.hpp"\n',
        "src/base/detail.hpp": "",
        "include/acc/base/base.hpp": "#include <vector>\n",
        "src/mid/CMakeLists.txt": "acc_add_library(mid  # a comment (with parentheses)\n"
                                  "  SOURCES mid.cpp\n  PUBLIC acc::base Other::lib)\n",
        "src/mid/mid.cpp": '#include "acc/mid/mid.hpp"\n#include "acc/base/base.hpp"\n',
        "include/acc/mid/mid.hpp": '#include "acc/base/base.hpp"\n',
        "src/side/CMakeLists.txt": "acc_add_library(side SOURCES side.cpp PRIVATE acc::base)\n",
        "src/side/side.cpp": '#include "acc/base/base.hpp"\n',
        "strategies/CMakeLists.txt": "acc_add_library(top SOURCES top.cpp PRIVATE acc::mid)\n",
        "strategies/top.cpp": '#include "acc/base/base.hpp"  // exported by mid\n',
        # Two layers of DESIGN.md's table in its order, and a tool beside the upper one.
        "src/util/CMakeLists.txt": "acc_add_library(util SOURCES util.cpp)\n",
        "src/util/util.cpp": '#include "acc/util/util.hpp"\n',
        "include/acc/util/util.hpp": "",
        "src/tensor/CMakeLists.txt": "acc_add_library(tensor SOURCES tensor.cpp PUBLIC acc::util)\n"
                                     "add_executable(tool tool.cpp)\n"
                                     "target_link_libraries(tool PRIVATE acc::tensor)\n",
        "src/tensor/tensor.cpp": '#include "acc/util/util.hpp"\n',
        "src/tensor/tool.cpp": '#include "acc/tensor/tensor.hpp"\n#include "acc/util/util.hpp"\n',
        "include/acc/tensor/tensor.hpp": "",
    }
    rc, out = run(clean)
    if rc != 0:
        print("self-test: a clean repository failed:\n" + out)
        return 1
    bad = dict(clean)
    bad["src/base/base.cpp"] += '#include "acc/mid/mid.hpp"\n'  # a layer above
    bad["include/acc/side/side.hpp"] = '#include "acc/base/base.hpp"\n'  # PRIVATE dep in public
    bad["strategies/top.cpp"] += '  #  include "acc/side/side.hpp"\n'  # not linked
    bad["src/mid/mid.cpp"] += '#include "../base/detail.hpp"\n'  # another folder's private
    bad["include/acc/nolib/x.hpp"] = ""
    bad["src/side/CMakeLists.txt"] += "acc_add_library(side2 SOURCES s2.cpp PUBLIC acc::none)\n"
    # A lower layer of DESIGN.md's table that links (and includes) a higher one.
    bad["src/util/CMakeLists.txt"] = "acc_add_library(util SOURCES util.cpp PRIVATE acc::tensor)\n"
    bad["src/util/util.cpp"] += '#include "acc/tensor/tensor.hpp"\n'
    # A tool that includes a layer it does not link.
    bad["src/tensor/tool.cpp"] += '#include "acc/mid/mid.hpp"\n'
    rc, out = run(bad)
    expected = [
        'src/base/base.cpp:3: #include "acc/mid/mid.hpp": file of library acc_base',
        'include/acc/side/side.hpp:1: #include "acc/base/base.hpp": public header of library '
        "acc_side",
        'strategies/top.cpp:2: #include "acc/side/side.hpp": file of library acc_top',
        'src/mid/mid.cpp:3: #include "../base/detail.hpp": file of library acc_mid reaches outside',
        "include/acc/nolib/: no acc_add_library declares layer 'nolib'",
        "links acc::none, which no acc_add_library declares",
        "src/util/CMakeLists.txt: library acc_util links acc::tensor, a layer below it in "
        "DESIGN.md's table",
        'src/tensor/tool.cpp:3: #include "acc/mid/mid.hpp": file of library tool includes',
    ]
    missing = [e for e in expected if e not in out]
    if rc != 1 or missing or len(out.strip().splitlines()) != len(expected) + 1:
        print(f"self-test: violations not reported as expected (rc {rc}); missing {missing}; "
              f"output:\n{out}")
        return 1
    print(f"check_layering self-test: a clean repository passes, {len(expected)} violations "
          "reported")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    default_root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 ".."))
    sys.exit(check(sys.argv[1] if len(sys.argv) > 1 else default_root))
