// The search report as files: render_report_html gives a well-formed page with one row per
// candidate and both charts, write_report writes report.json and report.html atomically, and bad
// reports or paths are errors that name the field or the path.
//
// The page is checked by tests/search/check_report_html.py (a strict XML parse plus what a
// reader relies on), run from here with std::system rather than as a separate CTest test: this
// test builds the report and writes it, so the script checks exactly the files it just wrote,
// and a failing script fails this test with the script's message in the log.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "acc/search/report.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc::search {
namespace {

namespace fs = std::filesystem;
using test::error_of;

// A name with every character the page must escape.
const std::string kOddName = "ddp{\"tag\":\"<&>\"} + checkpoint{blocks:all}";

nlohmann::json memory(int64_t peak) {
  return {{"parameters", peak / 8}, {"gradients", peak / 8},        {"optimizer_state", peak / 4},
          {"buffers", 0},           {"activations_peak", peak / 2}, {"peak", peak}};
}

nlohmann::json time(double step_s) {
  return {{"compute_s", 0.8 * step_s}, {"backward_s", 0.5 * step_s},      {"optimizer_s", 0.01},
          {"comm_s", 0.1 * step_s},    {"exposed_comm_s", 0.05 * step_s}, {"step_s", step_s}};
}

nlohmann::json candidate(const std::string& name, int64_t micro_batch, const std::string& status,
                         int64_t peak, double step_s) {
  nlohmann::json c = {{"strategy", {{{"name", "ddp"}, {"config", nlohmann::json::object()}}}},
                      {"name", name},
                      {"micro_batch", micro_batch},
                      {"predicted", {{"memory", memory(peak)}}},
                      {"status", status}};
  if (status != "rejected" && status != "excluded") c["predicted"]["time"] = time(step_s);
  return c;
}

nlohmann::json measured(const std::string& status, double step_s, int64_t peak,
                        const std::string& error = "") {
  nlohmann::json m = {{"status", status}, {"step_seconds", step_s}, {"peak_bytes", peak}};
  if (!error.empty()) m["error"] = error;
  return m;
}

// Shaped like auto_accelerate's report on 2 ranks with a 24 MiB budget: two candidates over it,
// two priced and never run, and four dry-runs (two ok, one out of memory, one failed).
nlohmann::json realistic_report() {
  constexpr int64_t kMiB = 1 << 20;
  nlohmann::json rows = nlohmann::json::array();
  auto rejected = candidate("ddp", 8, "rejected", 31 * kMiB, 0);
  rejected["reason"] = "predicted peak 31.00 MiB over the budget of 24.00 MiB";
  rows.push_back(rejected);
  auto ok = candidate("zero2 + grad_accum{\"steps\":2}", 4, "ok", 20 * kMiB, 0.0318);
  ok["measured"] = measured("ok", 0.0387, 20 * kMiB + 4096);
  ok["chosen"] = true;
  rows.push_back(ok);
  auto odd = candidate(kOddName, 4, "ok", 18 * kMiB, 0.0325);
  odd["measured"] = measured("ok", 0.0412, 18 * kMiB);
  rows.push_back(odd);
  auto oom = candidate("zero1 + grad_accum{\"steps\":2}", 4, "oom", 23 * kMiB, 0.0330);
  oom["measured"] = measured("oom", 0, 25 * kMiB, "allocation of 2.00 MiB over the limit");
  oom["reason"] = "allocation of 2.00 MiB over the limit";
  rows.push_back(oom);
  auto error = candidate("zero2 + grad_accum{\"steps\":4}", 2, "error", 16 * kMiB, 0.0336);
  error["measured"] = measured("error", 0, 0, "comm: peer <1> said \"no\" & left");
  error["reason"] = "comm: peer <1> said \"no\" & left";
  rows.push_back(error);
  rows.push_back(candidate("ddp + checkpoint{blocks:all}", 8, "ranked", 14 * kMiB, 0.0402));
  rows.push_back(candidate("zero1 + checkpoint{blocks:all}", 8, "ranked", 13 * kMiB, 0.0411));
  auto rejected2 = candidate("zero1", 8, "rejected", 27 * kMiB, 0);
  rejected2["reason"] = "predicted peak 27.00 MiB over the budget of 24.00 MiB";
  rows.push_back(rejected2);
  // A layout that cannot run the model: listed once with its transform's reason, never priced.
  auto excluded = candidate("tensor_parallel{\"size\":4}", 4, "excluded", 0, 0);
  excluded["reason"] =
      "tensor_parallel: 'transformer.h.0.attn' has 6 heads, not a multiple of tp 4";
  excluded["mesh"] = "pp=1 dp=1 cp=1 tp=2";
  rows.push_back(excluded);
  // A pipeline: its bubble and each stage's peak.
  auto pipe = candidate("zero1 + pipeline_parallel{\"micro_batches\":4,\"size\":2}", 4, "ranked",
                        15 * kMiB, 0.0452);
  pipe["predicted"]["time"]["bubble_s"] = 0.009;
  pipe["predicted"]["memory"]["stage_peaks"] = {15 * kMiB, 12 * kMiB};
  pipe["mesh"] = "pp=2 dp=1 cp=1 tp=1";
  rows.push_back(pipe);
  for (auto& r : rows) {
    if (!r.contains("mesh")) r["mesh"] = "pp=1 dp=2 cp=1 tp=1";
  }
  return {{"chosen", {{{"name", "zero2"}, {"config", nlohmann::json::object()}}}},
          {"chosen_name", "zero2 + grad_accum{\"steps\":2}"},
          {"world", 2},
          {"global_batch", 16},
          {"seq_len", 64},
          {"budget_bytes", 24 * kMiB},
          {"dry_runs", 4},
          {"out_of_time", false},
          {"key", "a field the page does not know"},
          {"candidates", rows},
          {"timing",
           {{"calibration_s", 4.03},
            {"dry_run_s", 0.40},
            {"total_s", 4.46},
            {"machine_calibration_from_cache", false}}}};
}

// A fresh directory under the system's temporary directory, removed at the end of the test.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(fs::temp_directory_path() /
              ("acc-report-test-" + std::to_string(::getpid()) + "-" + name)) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The exit status of check_report_html.py on `dir` (0: the page is right).
int check_page(const fs::path& dir) {
  const fs::path script = fs::path(__FILE__).parent_path() / "check_report_html.py";
  const std::string cmd = "python3 '" + script.string() + "' '" + dir.string() + "'";
  const int status = std::system(cmd.c_str());
  return status == -1 ? -1 : WEXITSTATUS(status);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

TEST(Report, WritesJsonAndAPageTheStrictCheckerAccepts) {
  TempDir tmp("ok");
  const fs::path dir = tmp.path() / "search";  // missing: write_report creates it
  const nlohmann::json report = realistic_report();
  write_report(report, dir.string());
  EXPECT_EQ(nlohmann::json::parse(read(dir / "report.json")), report);
  const std::string html = read(dir / "report.html");
  EXPECT_EQ(html, render_report_html(report));
  EXPECT_EQ(check_page(dir), 0) << "check_report_html.py rejected " << (dir / "report.html");

  // Names and errors escaped, never raw; no temporary file left behind.
  EXPECT_NE(html.find("ddp{&quot;tag&quot;:&quot;&lt;&amp;&gt;&quot;}"), std::string::npos);
  EXPECT_EQ(html.find("<&>"), std::string::npos);
  EXPECT_NE(html.find("peer &lt;1&gt; said &quot;no&quot; &amp; left"), std::string::npos);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 2);
  EXPECT_EQ(lower(html).find("nan"), std::string::npos);

  // Rows best predicted first, rejected last: the chosen (31.8 ms) is #1, rejected ones at the end.
  const size_t chosen_row = html.find("<tr class=\"candidate chosen\" data-candidate=\"1\"");
  EXPECT_NE(chosen_row, std::string::npos);
  EXPECT_LT(html.find("ddp + checkpoint"), html.find("zero1 + checkpoint"));
  EXPECT_GT(html.find("<tr class=\"candidate rejected\""), html.find("zero1 + checkpoint"));
  // The excluded layout: a row of its own with its reason, counted apart, on no chart.
  EXPECT_NE(html.find("<tr class=\"candidate excluded\""), std::string::npos);
  EXPECT_NE(html.find("has 6 heads, not a multiple of tp 4"), std::string::npos);
  EXPECT_NE(html.find("1 excluded by their layout, 2 rejected by memory"), std::string::npos);
}

TEST(Report, CheckerRejectsABrokenPage) {
  // The script must be able to fail: a bare '&' and a missing row.
  TempDir tmp("broken");
  const nlohmann::json report = realistic_report();
  write_report(report, tmp.path().string());
  std::string html = read(tmp.path() / "report.html");
  std::string bare = html;
  bare.insert(bare.find("</body>"), "<p>fish & chips</p>");
  std::ofstream(tmp.path() / "report.html") << bare;
  EXPECT_NE(check_page(tmp.path()), 0);
  const size_t row = html.find("<tr class=\"candidate\"");
  ASSERT_NE(row, std::string::npos);
  html.erase(row, html.find("</tr>", row) + 5 - row);
  std::ofstream(tmp.path() / "report.html") << html;
  EXPECT_NE(check_page(tmp.path()), 0);
}

// A plan for a cluster has 10^5 candidates: the page holds the best 1,000 predicted (and every
// candidate dry-run, chosen or excluded, and each mesh's best), says how many it leaves out, and
// stays a page a browser opens (GPT-3 175B on 64 devices made 160 MB, which headless Chromium had
// not drawn in two minutes; now 1.6 MB, drawn in 4 s). report.json keeps every candidate.
TEST(Report, ALargeSpaceGivesAPageOfTheBestCandidatesAndSaysHowManyItLeavesOut) {
  constexpr int64_t kMiB = 1 << 20;
  nlohmann::json report = realistic_report();
  nlohmann::json& rows = report["candidates"];
  // 5,000 more ranked ones, all slower than the realistic rows, in no order (the page sorts),
  // on two meshes; the slowest mesh's only candidate lies beyond the first 1,000 rows.
  for (int i = 0; i < 5000; ++i) {
    auto c = candidate("zero1 + grad_accum{\"steps\":" + std::to_string(i + 10) + "}", 1,
                       i % 3 == 0 ? "rejected" : "ranked", (10 + i % 7) * kMiB,
                       0.05 + 1e-4 * ((i * 7919) % 5000));
    c["mesh"] = "pp=1 dp=2 cp=1 tp=1";
    rows.push_back(c);
  }
  auto slow = candidate("ddp + tensor_parallel{\"size\":2}", 1, "ranked", 9 * kMiB, 9.5);
  slow["mesh"] = "pp=1 dp=1 cp=1 tp=2";
  rows.push_back(slow);
  TempDir tmp("large");
  write_report(report, tmp.path().string());
  EXPECT_EQ(nlohmann::json::parse(read(tmp.path() / "report.json")), report);
  const std::string html = read(tmp.path() / "report.html");
  EXPECT_EQ(check_page(tmp.path()), 0) << "check_report_html.py rejected the large page";
  const size_t left = html.find("id=\"rows-left\"");
  ASSERT_NE(left, std::string::npos);
  size_t shown = 0;
  for (size_t at = html.find("<tr class=\"candidate"); at != std::string::npos;
       at = html.find("<tr class=\"candidate", at + 1)) {
    ++shown;
  }
  // The best 1,000, the tp 2 mesh's best beyond them, and the excluded layout (not priced: it
  // sorts after every priced row); the dry-run and chosen rows are among the best.
  EXPECT_EQ(shown, 1002u);
  EXPECT_NE(html.find("data-left=\"" + std::to_string(rows.size() - shown) + "\""),
            std::string::npos);
  EXPECT_NE(html.find("ddp + tensor_parallel{&quot;size&quot;:2}"), std::string::npos);
  EXPECT_NE(html.find("has 6 heads, not a multiple of tp 4"), std::string::npos);
  EXPECT_NE(html.find(std::to_string(rows.size()) + " ("), std::string::npos);  // every one counted
  EXPECT_LT(html.size(), 2u << 20);
  // The checker fails a page that leaves rows out without saying so.
  std::string unsaid =
      html.substr(0, html.rfind("<p", left)) + html.substr(html.find("</p>", left) + 4);
  std::ofstream(tmp.path() / "report.html") << unsaid;
  EXPECT_NE(check_page(tmp.path()), 0);
}

// A step of 10 s or more is written in seconds, in the table and on the memory-time axis.
TEST(Report, LongStepsAreWrittenInSeconds) {
  nlohmann::json report = realistic_report();
  report["candidates"][5]["predicted"]["time"]["step_s"] = 277.3965;
  TempDir tmp("long");
  write_report(report, tmp.path().string());
  const std::string html = read(tmp.path() / "report.html");
  EXPECT_NE(html.find("277.40 s"), std::string::npos);
  EXPECT_NE(html.find("predicted step time (s)"), std::string::npos);
  EXPECT_NE(html.find("31.8 ms"), std::string::npos);  // the chosen one's, under 10 s
  EXPECT_EQ(check_page(tmp.path()), 0);
}

TEST(Report, ZeroDryRunsRendersWithoutNanOrInf) {
  nlohmann::json report = realistic_report();
  for (auto& c : report["candidates"]) {
    c.erase("measured");
    c.erase("chosen");
    if (c["status"] != "rejected") c["status"] = "ranked";
  }
  report["dry_runs"] = 0;
  report["out_of_time"] = true;
  TempDir tmp("zero");
  write_report(report, tmp.path().string());
  const std::string html = read(tmp.path() / "report.html");
  EXPECT_NE(html.find("no candidate was dry-run"), std::string::npos);
  EXPECT_NE(html.find("id=\"out-of-time\""), std::string::npos);
  EXPECT_EQ(lower(html).find("nan"), std::string::npos);
  EXPECT_EQ(lower(html).find("inf"), std::string::npos);
  EXPECT_EQ(check_page(tmp.path()), 0);
}

TEST(Report, OnePointEqualValuesAndNoCandidatesGiveFiniteCharts) {
  // One dry-run whose prediction was exact, all memories equal to the budget: zero-width ranges.
  nlohmann::json one = realistic_report();
  nlohmann::json c = one["candidates"][1];
  c["predicted"]["memory"]["peak"] = one["budget_bytes"];
  c["measured"]["step_seconds"] = c["predicted"]["time"]["step_s"];
  one["candidates"] = nlohmann::json::array({c});
  nlohmann::json none = one;
  none["candidates"] = nlohmann::json::array();
  nlohmann::json zeros = one;
  zeros["budget_bytes"] = 0;
  zeros["candidates"][0]["predicted"]["memory"]["peak"] = 0;
  zeros["candidates"][0]["predicted"]["time"]["step_s"] = 0;
  zeros["candidates"][0]["measured"]["step_seconds"] = 0;
  for (const auto& report : {one, none, zeros}) {
    TempDir tmp("one");
    write_report(report, tmp.path().string());
    const std::string html = lower(read(tmp.path() / "report.html"));
    EXPECT_EQ(html.find("nan"), std::string::npos) << report.dump();
    EXPECT_EQ(html.find("inf"), std::string::npos) << report.dump();
    EXPECT_EQ(check_page(tmp.path()), 0) << report.dump();
  }
}

TEST(Report, BadReportsNameTheField) {
  struct Case {
    const char* change;
    std::function<void(nlohmann::json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"no candidates", [](auto& r) { r.erase("candidates"); },
       "report: field 'candidates' is missing"},
      {"candidates not a list", [](auto& r) { r["candidates"] = "all"; },
       "report: field 'candidates' must be a list"},
      {"a candidate without predicted", [](auto& r) { r["candidates"][1].erase("predicted"); },
       "report: field 'candidates[1].predicted' is missing"},
      {"micro-batch a string", [](auto& r) { r["candidates"][2]["micro_batch"] = "4"; },
       "report: field 'candidates[2].micro_batch' must be an integer"},
      {"measured time a string",
       [](auto& r) { r["candidates"][1]["measured"]["step_seconds"] = "fast"; },
       "report: field 'candidates[1].measured.step_seconds' must be a finite number"},
      {"no budget", [](auto& r) { r.erase("budget_bytes"); },
       "report: field 'budget_bytes' is missing"},
      {"world a float", [](auto& r) { r["world"] = 2.5; }, "report: field 'world' must be"},
      {"not an object", [](auto& r) { r = nlohmann::json::array(); },
       "report: expected a JSON object"},
  };
  for (const auto& c : cases) {
    nlohmann::json report = realistic_report();
    c.edit(report);
    EXPECT_NE(error_of<ValueError>([&] { render_report_html(report); }).find(c.message),
              std::string::npos)
        << c.change << ": " << error_of<ValueError>([&] { render_report_html(report); });
    // write_report refuses before creating anything.
    TempDir tmp("bad");
    const fs::path dir = tmp.path() / "search";
    EXPECT_NE(error_of<ValueError>([&] { write_report(report, dir.string()); }).find(c.message),
              std::string::npos)
        << c.change;
    EXPECT_FALSE(fs::exists(dir)) << c.change;
  }
}

TEST(Report, UnwritablePathsAreIoErrorsNamingThePath) {
  TempDir tmp("paths");
  const nlohmann::json report = realistic_report();
  // A missing parent: only one level is created.
  const std::string deep = (tmp.path() / "missing" / "search").string();
  EXPECT_NE(error_of<IoError>([&] { write_report(report, deep); }).find(deep), std::string::npos)
      << error_of<IoError>([&] { write_report(report, deep); });
  // check_report_dir says the same before any work, and creates nothing.
  EXPECT_NE(error_of<IoError>([&] { check_report_dir(deep); }).find(deep), std::string::npos);
  const fs::path fresh = tmp.path() / "fresh";
  check_report_dir(fresh.string() + "/");
  EXPECT_FALSE(fs::exists(fresh));
  write_report(report, fresh.string() + "/");
  EXPECT_TRUE(fs::is_regular_file(fresh / "report.html"));
  // A file where the directory should be.
  const std::string file = (tmp.path() / "a-file").string();
  std::ofstream(file) << "x";
  EXPECT_NE(error_of<IoError>([&] { write_report(report, file); }).find(file), std::string::npos);
  // A directory where report.html should be.
  fs::create_directories(tmp.path() / "taken" / "report.html");
  const std::string taken = (tmp.path() / "taken" / "report.html").string();
  EXPECT_NE(
      error_of<IoError>([&] { write_report(report, (tmp.path() / "taken").string()); }).find(taken),
      std::string::npos);
}

}  // namespace
}  // namespace acc::search
