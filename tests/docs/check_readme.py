#!/usr/bin/env python3
"""The README's opening, as a person reads it: the title, then the two commands that work on a
fresh machine (scripts/demo, scripts/test) in a sh block, then prose. A formatter run over it by
mistake (clang-format once rewrote it as C++: "#AutoAcc", "scripts / demo") fails here."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
lines = (root / "README.md").read_text().splitlines()
want = ["# AutoAcc", "", "```sh"]
errors = []
if lines[:3] != want:
    errors.append(f"the first lines are {lines[:3]!r}, not {want!r}")
if len(lines) < 6 or not lines[3].startswith("scripts/demo ") or not lines[4].startswith(
        "scripts/test ") or lines[5] != "```":
    errors.append(f"lines 4-6 are {lines[3:6]!r}: not scripts/demo, scripts/test and the block's end")
# Prose is not indented as a formatter indents continued code: outside fenced blocks, a line of
# four spaces and a word right after an unindented line of prose (not a list item or a table row).
fenced = False
for n, line in enumerate(lines, 1):
    before = lines[n - 2] if n >= 2 else ""
    if line.startswith("```"):
        fenced = not fenced
        continue
    prose_before = before.strip() != "" and not before.startswith((" ", "-", "*", "|", "#"))
    if not fenced and prose_before and line.startswith("    ") and line[4:5].isalpha():
        errors.append(f"line {n} is indented like code continuing the line before: {line[:60]!r}")
        break
for e in errors:
    print(f"README.md: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
