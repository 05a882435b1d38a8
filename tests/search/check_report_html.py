#!/usr/bin/env python3
"""Checks a report directory written by acc::search::write_report the way a tool would read it.

    check_report_html.py DIR

DIR holds report.json and report.html. The page must parse with a strict XML parser and show
what report.json holds: one <tr class="candidate"> per candidate, the chosen one (and only it)
marked, a point in the time scatter for every dry-run candidate with a measured time (or the
"no candidate was dry-run" notice), a point in the memory-time chart for every candidate, and
the budget line. A page of a large space (more candidates than the page holds) has a
<p id="rows-left" data-left="N">: then the rows and N add up to the candidates, the rows are the
best predicted, and every candidate dry-run, chosen or excluded still has its row. Prints what is wrong and exits 1; exits 0 when all holds. Standard library only.
"""
import json
import os
import sys
import xml.etree.ElementTree as ET


def local(tag):
    """The tag without its XML namespace ('{http://www.w3.org/2000/svg}circle' -> 'circle')."""
    return tag.rsplit("}", 1)[-1]


def classes(el):
    return el.get("class", "").split()


def text_of(el):
    return "".join(el.itertext())


def check(directory):
    errors = []
    with open(os.path.join(directory, "report.json"), encoding="utf-8") as f:
        report = json.load(f)
    html_path = os.path.join(directory, "report.html")
    try:
        root = ET.parse(html_path).getroot()  # expat: any unclosed tag or bare '&' fails here
    except ET.ParseError as e:
        return ["report.html is not well-formed XML: %s" % e]
    everything = list(root.iter())

    candidates = report["candidates"]
    rows = [el for el in everything if local(el.tag) == "tr" and "candidate" in classes(el)]
    left_notes = [el for el in everything if el.get("id") == "rows-left"]
    left = int(left_notes[0].get("data-left")) if left_notes else 0
    if len(rows) + left != len(candidates):
        errors.append("%d tr.candidate rows and %d left out for %d candidates"
                      % (len(rows), left, len(candidates)))
    numbers = {row.get("data-candidate") for row in rows}
    on_page = set()
    for row in rows:
        name_cells = [el for el in row.iter() if local(el.tag) == "td" and "name" in classes(el)]
        on_page.add("".join(name_cells[0].text or "") if name_cells else "")
    if left:
        if str(len(candidates) - left) not in text_of(left_notes[0]) and \
                str(left) not in text_of(left_notes[0]):
            errors.append("#rows-left does not say how many candidates it leaves out")
        for c in candidates:
            if (c.get("measured") or c.get("chosen") or c["status"] == "excluded") and \
                    c["name"] not in on_page:
                errors.append("%r (dry-run, chosen or excluded) has no row" % c["name"])
        # The best predicted are the ones kept: every candidate predicted faster than the fastest
        # one left out has a row, and they are most of the rows (not a few by luck).
        left_out = [c["predicted"]["time"]["step_s"] for c in candidates
                    if "time" in c["predicted"] and c["name"] not in on_page]
        if left_out:
            fastest_left = min(left_out)
            faster = [c for c in candidates
                      if "time" in c["predicted"] and c["predicted"]["time"]["step_s"] < fastest_left]
            missing = [c["name"] for c in faster if c["name"] not in on_page]
            if missing or len(faster) < len(rows) // 2:
                errors.append("the page's rows are not the best predicted (%d faster than the "
                              "fastest left out, %d of them missing)" % (len(faster), len(missing)))
    # Below, the candidates the page shows.
    candidates = [c for c in candidates if c["name"] in on_page] if left else candidates

    # The chosen row: exactly one, and it names the candidate report.json marks as chosen.
    chosen = [c for c in candidates if c.get("chosen")]
    chosen_rows = [row for row in rows if "chosen" in classes(row)]
    if len(chosen_rows) != len(chosen):
        errors.append("%d chosen rows, report.json has %d" % (len(chosen_rows), len(chosen)))
    for row, c in zip(chosen_rows, chosen):
        cells = [el for el in row if local(el.tag) == "td"]
        if len(cells) < 2 or c["name"] not in text_of(cells[1]):
            errors.append("the chosen row does not name %r" % c["name"])

    svgs = {el.get("id"): el for el in everything if local(el.tag) == "svg"}
    for svg_id in ("time-scatter", "memory-time"):
        if svg_id not in svgs:
            errors.append("no <svg id=%r>" % svg_id)

    def points(svg_id):
        svg = svgs.get(svg_id)
        found = [] if svg is None else [el for el in svg.iter() if "point" in classes(el)]
        for el in found:
            if el.get("data-candidate") not in numbers:
                errors.append("%s: a point for candidate %r, which has no table row"
                              % (svg_id, el.get("data-candidate")))
        return found

    measured = [c for c in candidates
                if c.get("measured", {}).get("status") == "ok" and "time" in c["predicted"]]
    scatter = points("time-scatter")
    if len(scatter) < len(measured):
        errors.append("time-scatter: %d points for %d measured candidates"
                      % (len(scatter), len(measured)))
    if not measured and "time-scatter" in svgs and \
            "no candidate was dry-run" not in text_of(svgs["time-scatter"]):
        errors.append("time-scatter: no point and no 'no candidate was dry-run' notice")

    # Excluded candidates (a layout that cannot run the model) have no memory to stand at: a row
    # with its reason, no point.
    excluded = [c for c in candidates if c["status"] == "excluded"]
    excluded_rows = [row for row in rows if "excluded" in classes(row)]
    if len(excluded_rows) != len(excluded):
        errors.append("%d excluded rows, report.json has %d" % (len(excluded_rows), len(excluded)))
    for row, c in zip(excluded_rows, excluded):
        if c.get("reason", "") not in text_of(row):
            errors.append("the excluded row of %r does not give its reason" % c["name"])
    # Every mesh factorisation of the candidates has a row in the mesh table, and each candidate's
    # row shows its mesh ("pp2 tp2": the dimensions above 1).
    meshes = sorted({c["mesh"] for c in candidates if "mesh" in c})
    if meshes:
        def short(mesh):
            parts = [p.replace("=", "") for p in mesh.split() if not p.endswith("=1")]
            return " ".join(parts) or "dp1"
        tables = [el for el in root.iter() if local(el.tag) == "table" and el.get("id") == "meshes"]
        mesh_rows = [row for t in tables for row in t.iter()
                     if local(row.tag) == "tr" and "mesh" in classes(row)]
        shown = sorted(text_of(next(el for el in row.iter() if local(el.tag) == "td")).strip()
                       for row in mesh_rows)
        if shown != sorted(short(m) for m in meshes):
            errors.append("mesh table rows %r, the candidates' meshes are %r" % (shown, meshes))
        # The table is best first, report.json in its own order: rows are matched by name.
        by_name = {c["name"]: c for c in candidates}
        for row in rows:
            name_cells = [el for el in row.iter() if local(el.tag) == "td" and "name" in classes(el)]
            name = "".join(name_cells[0].text or "") if name_cells else ""
            c = by_name.get(name)
            cells = [el for el in row.iter() if local(el.tag) == "td" and "mesh" in classes(el)]
            if c is None:
                errors.append("a candidate row names %r, which report.json does not have" % name)
            elif "mesh" in c and (not cells or text_of(cells[0]).strip() != short(c["mesh"])):
                errors.append("the row of %r does not show its mesh %r" % (c["name"], c["mesh"]))
    plane = points("memory-time")
    if len(plane) < len(candidates) - len(excluded):
        errors.append("memory-time: %d points for %d candidates"
                      % (len(plane), len(candidates) - len(excluded)))
    if "memory-time" in svgs:
        budget = [el for el in svgs["memory-time"].iter() if el.get("id") == "budget-line"]
        if len(budget) != 1:
            errors.append("memory-time: %d budget lines, expected 1" % len(budget))
        if chosen and not [el for el in svgs["memory-time"].iter()
                           if "chosen-mark" in classes(el)]:
            errors.append("memory-time: the chosen point is not marked")
    return errors


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    errors = check(sys.argv[1])
    for e in errors:
        print("check_report_html: " + e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
