#pragma once
// The search report of acc::auto_accelerate (AccelerateResult::report) as files a person opens:
// report.json as it is, and report.html, one self-contained page (inline CSS and SVG charts, no
// scripts, fonts or URLs) with the choice, one table row per candidate, the predicted against the
// measured step time of the dry-run candidates, and every candidate on the memory-time plane
// against the budget.
//
//   auto acc = acc::auto_accelerate(model, factory, opts);
//   if (dist::rank() == 0) acc::search::write_report(acc.report, "run/search");
//
// The page is well-formed XML (XHTML with inline SVG): every tag closed, attributes quoted, text
// escaped, so tools can read it with an XML parser as well as a browser.

#include <nlohmann/json.hpp>

#include <string>

namespace acc::search {

/// The report as one HTML page. Fields the page does not show are ignored (reports may grow).
/// Throws acc::ValueError naming the field ("report: field 'candidates[3].predicted' is missing")
/// when a field the page needs is missing or of the wrong type.
std::string render_report_html(const nlohmann::json& report);

/// Throws acc::IoError naming the path unless write_report() can write into `dir`: an existing
/// writable directory (whose report.json and report.html, if there, are writable), or a missing
/// one whose parent is. Creates nothing; auto_accelerate calls it before the search so that a bad
/// AccelerateOptions::report_dir fails at once, not after the dry-runs.
void check_report_dir(const std::string& dir);

/// Writes `dir`/report.json (the report, indented) and `dir`/report.html (render_report_html),
/// each to a temporary file renamed into place, so a reader never sees half a file. Creates `dir`
/// when it is missing (not its parents). Throws acc::ValueError for a bad report (before anything
/// is written) and acc::IoError naming the path when the directory or a file cannot be written.
void write_report(const nlohmann::json& report, const std::string& dir);

}  // namespace acc::search
