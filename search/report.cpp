#include "acc/search/report.hpp"
#include "acc/search/status.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "acc/trace/estimate.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/json_fields.hpp"

namespace acc::search {
namespace {

using json::Fields;

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

// ---- The report, read and checked once so the drawing below never meets a missing field. ----

struct Measured {
  Status status = Status::kOk;  // kOk | kOom | kError
  double step_s = 0;
  int64_t peak_bytes = 0;
  std::string error;
};

struct Row {
  int number = 0;  // 1-based position in the page's table, the label of the row's points
  std::string name;
  int64_t micro_batch = 0;
  std::string mesh;              // "pp=2 dp=1 cp=1 tp=2" ("" in older reports)
  std::optional<double> bubble;  // a pipeline's predicted idle share of the step
  Status status = Status::kRanked;
  std::string reason;
  int64_t peak_bytes = 0;            // predicted
  nlohmann::json memory;             // the predicted breakdown, for the cell's tooltip
  std::optional<double> step_s;      // predicted; none when rejected before pricing
  std::optional<Measured> measured;  // dry-run candidates only
  bool chosen = false;
  bool measured_ok() const { return measured && measured->status == Status::kOk; }
};

struct Report {
  std::string chosen_name;
  nlohmann::json chosen;         // the strategy list
  std::optional<Source> source;  // absent in older reports
  std::string note;
  int64_t world = 0, global_batch = 0, seq_len = 0, budget_bytes = 0, dry_runs = 0;
  bool out_of_time = false;
  std::optional<double> calibration_s, dry_run_s, total_s;
  std::optional<bool> calibration_from_cache;
  std::vector<Row> rows;  // best predicted first, rejected last
};

std::optional<double> optional_seconds(Fields& f, const std::string& name) {
  if (f.optional(name) == nullptr) return std::nullopt;
  return f.number(name, 0, false);
}

Row read_row(const nlohmann::json& j, const std::string& path) {
  Fields f(j, "report", path);
  Row r;
  r.name = f.string("name");
  r.micro_batch = f.integer("micro_batch", 1, kMaxInt);
  r.status = parse_status(f.string("status"), "report " + f.path("status"));
  if (f.optional("reason") != nullptr) r.reason = f.string("reason");
  if (f.optional("chosen") != nullptr) r.chosen = f.boolean("chosen");
  Fields predicted(f.at("predicted"), "report", f.path("predicted"));
  r.memory = predicted.at("memory");
  r.peak_bytes = Fields(r.memory, "report", predicted.path("memory")).integer("peak", 0, kMaxInt);
  if (f.optional("mesh") != nullptr) r.mesh = f.string("mesh");
  if (predicted.optional("time") != nullptr) {
    Fields time(predicted.at("time"), "report", predicted.path("time"));
    r.step_s = time.number("step_s", 0, false);
    if (time.optional("bubble_s") != nullptr) {
      const double bubble = time.number("bubble_s", 0, false);
      if (bubble > 0 && *r.step_s > 0) r.bubble = bubble / *r.step_s;
    }
  }
  if (f.optional("measured") != nullptr) {
    Fields m(f.at("measured"), "report", f.path("measured"));
    Measured measured;
    measured.status = parse_status(m.string("status"), "report " + m.path("status"));
    measured.step_s = m.number("step_seconds", 0, false);
    measured.peak_bytes = m.integer("peak_bytes", 0, kMaxInt);
    if (m.optional("error") != nullptr) measured.error = m.string("error");
    r.measured = std::move(measured);
  }
  return r;
}

Report read_report(const nlohmann::json& j) {
  Fields f(j, "report");
  Report r;
  r.chosen_name = f.string("chosen_name");
  r.chosen = f.at("chosen");
  if (f.optional("source") != nullptr) {
    r.source = parse_source(f.string("source"), "report " + f.path("source"));
  }
  if (f.optional("note") != nullptr) r.note = f.string("note");
  r.world = f.integer("world", 1, kMaxInt);
  r.global_batch = f.integer("global_batch", 1, kMaxInt);
  r.seq_len = f.integer("seq_len", 0, kMaxInt);  // 0: a module without sequence length
  r.budget_bytes = f.integer("budget_bytes", 0, kMaxInt);
  r.dry_runs = f.integer("dry_runs", 0, kMaxInt);
  if (f.optional("out_of_time") != nullptr) r.out_of_time = f.boolean("out_of_time");
  if (f.optional("timing") != nullptr) {
    Fields t(f.at("timing"), "report", "timing");
    r.calibration_s = optional_seconds(t, "calibration_s");
    r.dry_run_s = optional_seconds(t, "dry_run_s");
    r.total_s = optional_seconds(t, "total_s");
    if (t.optional("machine_calibration_from_cache") != nullptr) {
      r.calibration_from_cache = t.boolean("machine_calibration_from_cache");
    }
  }
  const nlohmann::json& candidates = f.at("candidates");
  if (!candidates.is_array()) {
    f.fail("candidates", "must be a list, got " + json::brief(candidates));
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    r.rows.push_back(read_row(candidates[i], "candidates[" + std::to_string(i) + "]"));
  }
  // Best predicted first; those without a predicted time (rejected by memory) last, smallest
  // predicted memory first.
  std::stable_sort(r.rows.begin(), r.rows.end(), [](const Row& a, const Row& b) {
    if (a.step_s.has_value() != b.step_s.has_value()) return a.step_s.has_value();
    if (a.step_s) return *a.step_s < *b.step_s;
    return a.peak_bytes < b.peak_bytes;
  });
  for (size_t i = 0; i < r.rows.size(); ++i) r.rows[i].number = static_cast<int>(i) + 1;
  return r;
}

// ---- Text. ----

// A string as valid UTF-8 (bad bytes become U+FFFD) without the control characters XML 1.0
// forbids, so that an error message with stray bytes cannot break the page.
std::string clean_utf8(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xE  ? 3
                 : (c >> 3) == 0x1E ? 4
                                    : 0;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) >> 6) == 0x2;
    if (!ok) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    if (len == 1 && c < 0x20 && c != '\t' && c != '\n' && c != '\r') {
      out += ' ';
    } else {
      out.append(s, i, len);
    }
    i += len;
  }
  return out;
}

// Text for an element or an attribute value.
std::string esc(const std::string& raw) {
  std::string out;
  for (const char c : clean_utf8(raw)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string fixed(double v, int decimals) {
  // Every value drawn is checked finite on reading; a NaN here is a bug in the drawing.
  ACC_CHECK_INTERNAL(std::isfinite(v), "report: non-finite value ", v, " in the page");
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

// Coordinates in the SVG, in pixels.
std::string px(double v) {
  return fixed(v, 1);
}

// A step time: in ms below 10 s, else in s (a plan for a cluster predicts steps of minutes).
std::string ms(double seconds) {
  return seconds < 10 ? fixed(1e3 * seconds, 1) + " ms" : fixed(seconds, 2) + " s";
}

// The unit a chart's time axis is drawn in: ms, or s when its longest time is 10 s or more
// (tick labels of 7 digits ran into each other and into the rejected strip's label).
struct TimeUnit {
  double per_second;
  const char* name;
};
TimeUnit time_unit(double longest_seconds) {
  return longest_seconds < 10 ? TimeUnit{1e3, "ms"} : TimeUnit{1, "s"};
}

std::string bytes(int64_t b) {
  return trace::human_bytes(static_cast<double>(b));
}

// ---- Axes. ----

struct Axis {
  double lo = 0, hi = 1, step = 1;
  int decimals = 0;
  // Pixel of `v` along an axis drawn from p0 (at lo) to p1 (at hi).
  double map(double v, double p0, double p1) const { return p0 + (v - lo) / (hi - lo) * (p1 - p0); }
};

// Ticks at 1, 2 or 5 times a power of ten, about five of them, covering [lo, hi] with a little
// room so that no point sits on the frame. Equal or missing values still give a range.
Axis nice_axis(double lo, double hi, bool from_zero) {
  const bool non_negative = lo >= 0;  // times and bytes: no negative ticks
  if (from_zero) lo = std::min(lo, 0.0);
  if (!(hi > lo)) {
    const double half = std::max(std::abs(hi) * 0.1, 1e-3);
    lo = from_zero ? 0.0 : lo - half;
    hi = hi + half;
  }
  const double pad = 0.04 * (hi - lo);
  if (!from_zero || lo < 0) lo -= pad;
  hi += pad;
  Axis a;
  const double raw = (hi - lo) / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  a.step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  a.lo = std::floor(lo / a.step) * a.step;
  a.hi = std::ceil(hi / a.step) * a.step;
  if (non_negative && a.lo < 0) a.lo = 0;
  if (!(a.hi > a.lo)) a.hi = a.lo + a.step;
  a.decimals = std::max(0, -static_cast<int>(std::floor(std::log10(a.step) + 1e-9)));
  return a;
}

// Memory axes are drawn in one unit chosen from the largest value.
struct ByteUnit {
  const char* name;
  double bytes;
};
ByteUnit byte_unit(double largest) {
  if (largest >= 1024.0 * 1024 * 1024) return {"GiB", 1024.0 * 1024 * 1024};
  if (largest >= 1024.0 * 1024) return {"MiB", 1024.0 * 1024};
  if (largest >= 1024.0) return {"KiB", 1024.0};
  return {"B", 1.0};
}

// ---- SVG pieces. ----

// Status colours (the Okabe-Ito palette, readable by colour-blind readers).
const char* status_colour(Status status) {
  switch (status) {
    case Status::kOk:
      return "#009E73";
    case Status::kRanked:
      return "#9a9a9a";
    case Status::kOom:
      return "#E69F00";
    case Status::kError:
      return "#D55E00";
    case Status::kRejected:
      return "#CC79A7";
    case Status::kExcluded:
      return "#6b6b6b";
    case Status::kFits:
      break;
  }
  return "#56B4E9";
}
constexpr const char* kChosenColour = "#0072B2";

std::string text(double x, double y, const std::string& s, const std::string& attrs = "") {
  return "<text x=\"" + px(x) + "\" y=\"" + px(y) + "\"" + (attrs.empty() ? "" : " " + attrs) +
         ">" + esc(s) + "</text>\n";
}

std::string line(double x1, double y1, double x2, double y2, const std::string& attrs) {
  return "<line x1=\"" + px(x1) + "\" y1=\"" + px(y1) + "\" x2=\"" + px(x2) + "\" y2=\"" + px(y2) +
         "\" " + attrs + "/>\n";
}

// One candidate's marker: class "point" and data-candidate (the table's #) let tools find it,
// the <title> is the browser's tooltip.
std::string point(double x, double y, const Row& r, const std::string& chart_class,
                  const std::string& tooltip) {
  std::string s = "<circle class=\"point " + chart_class + "\" data-candidate=\"" +
                  std::to_string(r.number) + "\" cx=\"" + px(x) + "\" cy=\"" + px(y) +
                  "\" r=\"4.5\" fill=\"" + status_colour(r.status) +
                  "\" fill-opacity=\"0.85\" stroke=\"#333\" stroke-width=\"0.6\"><title>" +
                  esc(tooltip) + "</title></circle>\n";
  if (r.chosen) {
    s += "<circle class=\"chosen-mark\" cx=\"" + px(x) + "\" cy=\"" + px(y) +
         "\" r=\"9\" fill=\"none\" stroke=\"" + kChosenColour + "\" stroke-width=\"2.5\"/>\n";
  }
  return s;
}

// The width of an average character of the 11 px sans-serif labels (measured on a screenshot): how
// much room a label takes, for placing labels and spacing legends.
constexpr double kCharWidth = 5.6;

// Puts point labels where they overlap no other label and no labelled point: right of the point,
// else left, else further up or down with a leader line back to the point.
class LabelPlacer {
 public:
  LabelPlacer(double x0, double y0, double x1, double y1) : x0_(x0), y0_(y0), x1_(x1), y1_(y1) {}

  /// Keeps labels off a marker of radius `r` at (x, y).
  void reserve_point(double x, double y, double r = 5) {
    used_.push_back({x - r, y - r, x + r, y + r});
  }

  /// The label of the point at (x, y), `gap` pixels from its centre (more for a ringed point).
  std::string place(double x, double y, const std::string& label, const std::string& colour,
                    double gap) {
    const double w = kCharWidth * static_cast<double>(label.size()) + 2, h = 12;
    for (int k = 0; k < 24; ++k) {
      // Offsets 0, +h, -h, +2h, -2h, ...
      const double dy = ((k + 1) / 2) * h * (k % 2 == 1 ? 1 : -1);
      for (const bool right : {true, false}) {
        const double bx = right ? x + gap : x - gap - w, by = y + dy - h / 2;
        const Box box = {bx, by, bx + w, by + h};
        if (box.x0 < x0_ || box.x1 > x1_ || box.y0 < y0_ || box.y1 > y1_ || overlaps(box)) continue;
        used_.push_back(box);
        std::string s;
        if (dy != 0) {
          s += line(x, y, right ? box.x0 : box.x1, box.y0 + h / 2,
                    "stroke=\"#888\" stroke-width=\"0.7\"");
        }
        // A white halo keeps the label readable over the points it crosses.
        return s + text(box.x0 + 1, box.y0 + h - 2.5, label,
                        "class=\"label\" fill=\"" + colour +
                            "\" stroke=\"#fff\" stroke-width=\"3\" stroke-linejoin=\"round\" "
                            "paint-order=\"stroke\"");
      }
    }
    return "";  // no room: the table and the tooltip still name the point
  }

 private:
  struct Box {
    double x0, y0, x1, y1;
  };
  bool overlaps(const Box& b) const {
    return std::any_of(used_.begin(), used_.end(), [&](const Box& u) {
      return b.x0 < u.x1 && u.x0 < b.x1 && b.y0 < u.y1 && u.y0 < b.y1;
    });
  }
  double x0_, y0_, x1_, y1_;
  std::vector<Box> used_;
};

// Grid lines, tick labels and the axis titles of a plot area.
std::string axes(const Axis& xa, const Axis& ya, double left, double top, double right,
                 double bottom, const std::string& x_title, const std::string& y_title) {
  std::string s;
  const int nx = static_cast<int>(std::lround((xa.hi - xa.lo) / xa.step));
  for (int i = 0; i <= nx; ++i) {
    // Rounding must not print "-0.0" for the tick at zero.
    const double v = std::abs(xa.lo + i * xa.step) < 1e-9 * xa.step ? 0.0 : xa.lo + i * xa.step;
    const double x = xa.map(v, left, right);
    s += line(x, top, x, bottom, "class=\"grid\" stroke=\"#e4e4e4\"");
    s += line(x, bottom, x, bottom + 5, "stroke=\"#444\"");
    s += text(x, bottom + 18, fixed(v, xa.decimals), "class=\"tick\" text-anchor=\"middle\"");
  }
  const int ny = static_cast<int>(std::lround((ya.hi - ya.lo) / ya.step));
  for (int i = 0; i <= ny; ++i) {
    const double v = std::abs(ya.lo + i * ya.step) < 1e-9 * ya.step ? 0.0 : ya.lo + i * ya.step;
    const double y = ya.map(v, bottom, top);
    s += line(left, y, right, y, "class=\"grid\" stroke=\"#e4e4e4\"");
    s += line(left - 5, y, left, y, "stroke=\"#444\"");
    s += text(left - 8, y + 4, fixed(v, ya.decimals), "class=\"tick\" text-anchor=\"end\"");
  }
  s += "<rect x=\"" + px(left) + "\" y=\"" + px(top) + "\" width=\"" + px(right - left) +
       "\" height=\"" + px(bottom - top) + "\" fill=\"none\" stroke=\"#444\"/>\n";
  s +=
      text((left + right) / 2, bottom + 40, x_title, "class=\"axis-title\" text-anchor=\"middle\"");
  const double ym = (top + bottom) / 2;
  s += text(
      18, ym, y_title,
      "class=\"axis-title\" text-anchor=\"middle\" transform=\"rotate(-90 18 " + px(ym) + ")\"");
  return s;
}

// A legend entry at (x, y): a marker like the chart's and its text; returns the next free x.
double legend_entry(std::string& s, double x, double y, const std::string& colour,
                    const std::string& label, bool ring) {
  if (ring) {
    s += "<circle cx=\"" + px(x + 5) + "\" cy=\"" + px(y - 4) +
         "\" r=\"7\" fill=\"none\" stroke=\"" + colour + "\" stroke-width=\"2.5\"/>\n";
  } else {
    s += "<circle cx=\"" + px(x + 5) + "\" cy=\"" + px(y - 4) + "\" r=\"4.5\" fill=\"" + colour +
         "\" stroke=\"#333\" stroke-width=\"0.6\"/>\n";
  }
  s += text(x + 16, y, label, "class=\"legend\"");
  return x + 16 + kCharWidth * static_cast<double>(label.size()) + 22;
}

constexpr double kWidth = 640, kHeight = 480;

std::string svg_open(const std::string& id, const std::string& title) {
  return "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"" + id + "\" width=\"" + px(kWidth) +
         "\" height=\"" + px(kHeight) + "\" viewBox=\"0 0 " + px(kWidth) + " " + px(kHeight) +
         "\" role=\"img\" aria-label=\"" + esc(title) + "\">\n";
}

// Chart 1: predicted against measured step time of the dry-run candidates, on one scale with
// the line where the two agree.
std::string time_scatter(const Report& r) {
  std::vector<const Row*> pts;
  for (const Row& row : r.rows) {
    if (row.step_s && row.measured_ok()) pts.push_back(&row);
  }
  std::string s = svg_open("time-scatter", "predicted against measured step time");
  const double left = 72, top = 30, right = kWidth - 24, bottom = kHeight - 96;
  if (pts.empty()) {
    s += "<rect x=\"" + px(left) + "\" y=\"" + px(top) + "\" width=\"" + px(right - left) +
         "\" height=\"" + px(bottom - top) + "\" fill=\"#fafafa\" stroke=\"#bbb\"/>\n";
    s += text((left + right) / 2, (top + bottom) / 2, "no candidate was dry-run",
              "class=\"empty\" text-anchor=\"middle\"");
    return s + "</svg>\n";
  }
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const Row* p : pts) {
    lo = std::min({lo, 1e3 * *p->step_s, 1e3 * p->measured->step_s});
    hi = std::max({hi, 1e3 * *p->step_s, 1e3 * p->measured->step_s});
  }
  const Axis a = nice_axis(lo, hi, false);
  s += axes(a, a, left, top, right, bottom, "predicted step time (ms)", "measured step time (ms)");
  s += line(a.map(a.lo, left, right), a.map(a.lo, bottom, top), a.map(a.hi, left, right),
            a.map(a.hi, bottom, top),
            "id=\"identity-line\" stroke=\"#666\" stroke-dasharray=\"6 4\" stroke-width=\"1.2\"");
  LabelPlacer labels(left + 2, top + 2, right - 2, bottom - 2);
  // The y=x line's label runs along it, just below, near its top end (measured times are mostly
  // above it: a prediction leaves out what a real step also spends).
  {
    const double kPi = 3.14159265358979;
    const double angle = -std::atan2(bottom - top, right - left) * 180 / kPi;
    const double cx = left + 0.8 * (right - left), cy = bottom - 0.8 * (bottom - top);
    s += text(cx, cy + 13, "measured = predicted",
              "class=\"note\" text-anchor=\"middle\" fill=\"#555\" transform=\"rotate(" +
                  fixed(angle, 2) + " " + px(cx) + " " + px(cy) + ")\"");
  }
  std::string marks;
  for (const Row* p : pts) {
    const double x = a.map(1e3 * *p->step_s, left, right);
    const double y = a.map(1e3 * p->measured->step_s, bottom, top);
    labels.reserve_point(x, y, p->chosen ? 12 : 5);
    // Appended piece by piece: GCC 12 reports a false -Wrestrict overlap for "#" + to_string().
    std::string title = "#";
    title += std::to_string(p->number);
    title +=
        " " + p->name + ": predicted " + ms(*p->step_s) + ", measured " + ms(p->measured->step_s);
    marks += point(x, y, *p, "dry-run", title);
  }
  s += marks;
  for (const Row* p : pts) {
    const double x = a.map(1e3 * *p->step_s, left, right);
    const double y = a.map(1e3 * p->measured->step_s, bottom, top);
    s += labels.place(x, y, std::to_string(p->number) + (p->chosen ? " chosen" : ""),
                      p->chosen ? kChosenColour : "#222", p->chosen ? 13 : 8);
  }
  double lx = left;
  lx = legend_entry(s, lx, kHeight - 30, status_colour(Status::kOk),
                    "dry-run candidate (# in the table)", false);
  if (std::any_of(pts.begin(), pts.end(), [](const Row* p) { return p->chosen; })) {
    legend_entry(s, lx, kHeight - 30, kChosenColour, "chosen", true);
  }
  s += text(left, kHeight - 10, "above the dashed line: slower than predicted; below: faster",
            "class=\"note\" fill=\"#555\"");
  return s + "</svg>\n";
}

// Chart 2: every candidate on the plane of predicted step time and predicted peak memory, with
// the budget. Candidates rejected before pricing have no time: they stand in a strip on the
// right, at their predicted memory.
std::string memory_time(const Report& r) {
  std::string s = svg_open("memory-time", "predicted memory against predicted step time");
  std::vector<const Row*> timed, untimed;
  for (const Row& row : r.rows) {
    if (row.status == Status::kExcluded) continue;  // no memory to stand at: the table says why
    (row.step_s ? timed : untimed).push_back(&row);
  }
  const double left = 72, top = 30, bottom = kHeight - 96;
  const double strip = untimed.empty() ? 0 : 74;  // the rejected strip's width
  const double right = kWidth - 24 - strip;

  double longest = 0;
  for (const Row* p : timed) longest = std::max(longest, *p->step_s);
  const TimeUnit tu = time_unit(longest);
  double tlo = std::numeric_limits<double>::infinity(), thi = -tlo;
  for (const Row* p : timed) {
    tlo = std::min(tlo, tu.per_second * *p->step_s);
    thi = std::max(thi, tu.per_second * *p->step_s);
  }
  if (timed.empty()) tlo = thi = 0;
  int64_t peak = 0;
  for (const Row& row : r.rows) peak = std::max(peak, row.peak_bytes);
  // A budget far above every candidate (the default: most of the machine's memory) would squash
  // the points onto the axis: it is then drawn at the top edge and said to be off the chart.
  const bool budget_off_chart = peak > 0 && static_cast<double>(r.budget_bytes) > 2.5 * peak;
  const double top_bytes =
      budget_off_chart ? static_cast<double>(peak) : std::max<double>(peak, r.budget_bytes);
  const ByteUnit unit = byte_unit(top_bytes);
  const Axis xa = nice_axis(tlo, thi, false);
  const Axis ya = nice_axis(0, top_bytes / unit.bytes, true);
  s += axes(xa, ya, left, top, right, bottom, std::string("predicted step time (") + tu.name + ")",
            std::string("predicted peak memory per rank (") + unit.name + ")");

  // The budget line, labelled with the budget, above it on the right.
  const double by = budget_off_chart
                        ? top - 8
                        : ya.map(static_cast<double>(r.budget_bytes) / unit.bytes, bottom, top);
  const double bx1 = right + strip;
  s += line(left, by, bx1, by,
            "id=\"budget-line\" class=\"budget\" stroke=\"#c0392b\" stroke-width=\"1.8\"" +
                std::string(budget_off_chart ? " stroke-dasharray=\"3 3\"" : ""));
  const std::string budget_label =
      "budget " + bytes(r.budget_bytes) +
      (budget_off_chart ? " per rank (far above the chart)" : " per rank");
  LabelPlacer labels(left + 2, top + 2, bx1 - 2, bottom - 2);
  s += text(right - 6, by - 5, budget_label,
            "class=\"budget-label\" text-anchor=\"end\" fill=\"#c0392b\"");
  {
    // Keep point labels off the budget's label.
    const double w = kCharWidth * static_cast<double>(budget_label.size());
    const double ly = by - 11;
    for (double x = right - 6 - w; x < right; x += 9) labels.reserve_point(x, ly);
  }

  if (strip > 0) {
    const double sx0 = right + 8, sx1 = right + strip, sc = (sx0 + sx1) / 2;
    s += "<rect x=\"" + px(sx0) + "\" y=\"" + px(top) + "\" width=\"" + px(sx1 - sx0) +
         "\" height=\"" + px(bottom - top) + "\" fill=\"#f7f0f4\" stroke=\"#bbb\"/>\n";
    s += text(sc, bottom + 18, "no time:", "class=\"tick\" text-anchor=\"middle\"");
    s += text(sc, bottom + 31, "rejected", "class=\"tick\" text-anchor=\"middle\"");
    // Equal memories would hide each other: a small sideways step per neighbour shows them all.
    for (size_t i = 0; i < untimed.size(); ++i) {
      const Row* p = untimed[i];
      const double mem = static_cast<double>(p->peak_bytes) / unit.bytes;
      const double y = std::max(top, ya.map(std::min(mem, ya.hi), bottom, top));
      const double x = sc + (static_cast<double>(i % 5) - 2) * 6;
      s += point(x, y, *p, "rejected",
                 "#" + std::to_string(p->number) + " " + p->name + ": predicted peak " +
                     bytes(p->peak_bytes) + ", not priced (" + status_name(p->status) + ")");
    }
  }

  if (r.rows.empty()) {
    s += text((left + right) / 2, (top + bottom) / 2, "no candidates",
              "class=\"empty\" text-anchor=\"middle\"");
  }
  std::string marks;
  // Ranked (never run) points first, so the dry-run ones are drawn on top of them.
  std::vector<const Row*> order = timed;
  std::stable_partition(order.begin(), order.end(),
                        [](const Row* p) { return !p->measured && !p->chosen; });
  for (const Row* p : order) {
    const double x = xa.map(tu.per_second * *p->step_s, left, right);
    const double y = ya.map(static_cast<double>(p->peak_bytes) / unit.bytes, bottom, top);
    if (p->measured || p->chosen) labels.reserve_point(x, y, p->chosen ? 12 : 5);
    marks +=
        point(x, y, *p, "timed",
              "#" + std::to_string(p->number) + " " + p->name + ": predicted " + ms(*p->step_s) +
                  ", peak " + bytes(p->peak_bytes) + " (" + status_name(p->status) + ")");
  }
  s += marks;
  for (const Row* p : order) {
    if (!p->measured && !p->chosen) continue;  // only the dry-run ones are numbered
    const double x = xa.map(tu.per_second * *p->step_s, left, right);
    const double y = ya.map(static_cast<double>(p->peak_bytes) / unit.bytes, bottom, top);
    s += labels.place(x, y, std::to_string(p->number) + (p->chosen ? " chosen" : ""),
                      p->chosen ? kChosenColour : "#222", p->chosen ? 13 : 8);
  }

  // Legend: the statuses present, then the chosen ring.
  double lx = left;
  const std::pair<Status, const char*> kinds[] = {{Status::kOk, "ok (dry-run)"},
                                                  {Status::kOom, "oom (dry-run)"},
                                                  {Status::kError, "error (dry-run)"},
                                                  {Status::kRanked, "ranked, not run"},
                                                  {Status::kRejected, "rejected: memory"}};
  double ly = kHeight - 30;
  for (const auto& [status, label] : kinds) {
    const bool present = std::any_of(r.rows.begin(), r.rows.end(),
                                     [st = status](const Row& row) { return row.status == st; });
    if (!present) continue;
    if (lx + kCharWidth * static_cast<double>(std::string(label).size()) + 34 > kWidth) {
      lx = left;
      ly += 18;
    }
    lx = legend_entry(s, lx, ly, status_colour(status), label, false);
  }
  if (std::any_of(r.rows.begin(), r.rows.end(), [](const Row& row) { return row.chosen; })) {
    if (lx + 80 > kWidth) {
      lx = left;
      ly += 18;
    }
    legend_entry(s, lx, ly, kChosenColour, "chosen", true);
  }
  return s + "</svg>\n";
}

// ---- The page. ----

const char* kStyle = R"(
body { font-family: -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       margin: 24px 32px; color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 12px 0; }
h2 { font-size: 17px; margin: 28px 0 8px 0; }
dl.summary { display: grid; grid-template-columns: max-content auto; gap: 4px 16px; margin: 0; }
dl.summary dt { color: #555; }
dl.summary dd { margin: 0; }
code { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
.notice { background: #fff4d6; border: 1px solid #e0b84c; padding: 8px 12px; margin: 12px 0;
          border-radius: 4px; }
.charts { display: flex; flex-wrap: wrap; gap: 24px; }
figure { margin: 0; }
figcaption { font-size: 14px; font-weight: 600; margin-bottom: 4px; }
svg text { font-family: inherit; font-size: 11px; }
svg text.axis-title { font-size: 12px; font-weight: 600; }
svg text.empty { font-size: 15px; fill: #777; }
svg text.label { font-size: 11px; font-weight: 600; }
svg text.budget-label { font-size: 11px; font-weight: 600; }
ul.key { font-size: 12px; margin: 6px 0 0 0; padding-left: 18px; max-width: 640px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e4e4e4; text-align: left;
         vertical-align: top; }
th { background: #f3f3f3; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.name { max-width: 46em; overflow-wrap: anywhere; }
td.mesh { white-space: nowrap; }
tr.chosen td { background: #dcebf7; font-weight: 600; }
tr.rejected td, tr.excluded td { color: #777; }
span.status { display: inline-block; padding: 0 6px; border-radius: 3px; color: #fff;
              font-size: 12px; }
span.chosen-tag { color: #0072B2; font-weight: 700; margin-left: 6px; }
)";

std::string seconds(double s) {
  return fixed(s, 2) + " s";
}

// `all`: every candidate of the report (r.rows may be the page's share of them, page_rows).
std::string summary(const Report& r, const std::vector<Row>& all) {
  size_t rejected = 0, excluded = 0;
  for (const Row& row : all) {
    rejected += row.status == Status::kRejected;
    excluded += row.status == Status::kExcluded;
  }
  std::string s = "<dl class=\"summary\">\n";
  const auto item = [&](const std::string& k, const std::string& v_html) {
    s += "<dt>" + esc(k) + "</dt><dd>" + v_html + "</dd>\n";
  };
  std::string chosen = "<strong>" + esc(r.chosen_name) + "</strong>";
  for (const Row& row : all) {
    if (!row.chosen) continue;
    chosen +=
        " (#" + std::to_string(row.number) + ", micro-batch " + std::to_string(row.micro_batch);
    if (row.measured_ok()) chosen += ", measured " + ms(row.measured->step_s) + " per step";
    if (row.step_s) chosen += ", predicted " + ms(*row.step_s);
    chosen += ")";
  }
  item("chosen", chosen);
  if (r.source) item("source", esc(source_name(*r.source)));
  if (!r.note.empty()) item("note", esc(r.note));
  item("strategy", "<code>" + esc(r.chosen.dump()) + "</code>");
  item("ranks", std::to_string(r.world));
  item("global batch", r.seq_len > 0 ? std::to_string(r.global_batch) + " sequences of " +
                                           std::to_string(r.seq_len) + " tokens"
                                     : std::to_string(r.global_batch) + " samples");
  item("memory budget", esc(bytes(r.budget_bytes)) + " per rank");
  item("candidates", std::to_string(all.size()) + " (" +
                         (excluded > 0 ? std::to_string(excluded) + " excluded by their layout, "
                                       : std::string()) +
                         std::to_string(rejected) + " rejected by memory, " +
                         std::to_string(r.dry_runs) + " dry-run)");
  std::string timing;
  if (r.calibration_s) {
    timing += "calibration " + seconds(*r.calibration_s);
    if (r.calibration_from_cache) {
      timing += *r.calibration_from_cache ? " (machine from the cache)" : " (machine measured)";
    }
  }
  if (r.dry_run_s) timing += (timing.empty() ? "" : ", ") + ("dry-runs " + seconds(*r.dry_run_s));
  if (r.total_s) timing += (timing.empty() ? "" : ", ") + ("total " + seconds(*r.total_s));
  if (!timing.empty()) item("search time", esc(timing));
  return s + "</dl>\n";
}

// "pp=2 dp=1 cp=1 tp=2" -> "pp2 tp2": the dimensions larger than 1 ("dp1" for one rank).
std::string short_mesh(const std::string& mesh) {
  std::string out;
  std::istringstream in(mesh);
  std::string part;
  while (in >> part) {
    const size_t eq = part.find('=');
    if (eq == std::string::npos || part.substr(eq + 1) == "1") continue;
    if (!out.empty()) out += ' ';
    out.append(part, 0, eq);
    out.append(part, eq + 1, std::string::npos);
  }
  return out.empty() ? "dp1" : out;
}

// Every mesh factorisation of the world the candidates cover, each with its best candidate (the
// rows are best predicted first): its predicted time, memory, bubble and status, and how many
// candidates it had.
std::string meshes(const Report& r, const std::vector<Row>& all) {
  std::vector<std::string> order;
  std::map<std::string, std::pair<const Row*, int>> best;
  for (const Row& row : all) {
    if (row.mesh.empty()) continue;
    auto [it, fresh] = best.try_emplace(row.mesh, &row, 0);
    if (fresh) order.push_back(row.mesh);
    ++it->second.second;
  }
  if (order.empty()) return "";
  std::string s =
      "<h2>Mesh factorisations of the " + std::to_string(r.world) +
      " ranks</h2>\n<table id=\"meshes\">\n<thead><tr><th>mesh (pp &#215; dp &#215; cp &#215; "
      "tp)</th><th>candidates</th><th>best candidate</th><th>predicted time</th><th>bubble</th>"
      "<th>predicted memory</th><th>status</th></tr></thead>\n<tbody>\n";
  for (const std::string& mesh : order) {
    const auto& [row, count] = best.at(mesh);
    s += "<tr class=\"mesh\"><td class=\"mesh\">" + esc(short_mesh(mesh)) + "</td>";
    s += "<td class=\"num\">" + std::to_string(count) + "</td>";
    s += "<td class=\"name\">#" + std::to_string(row->number) + " " + esc(row->name) + "</td>";
    s += "<td class=\"num\">" + (row->step_s ? esc(ms(*row->step_s)) : "-") + "</td>";
    s += "<td class=\"num\">" + (row->bubble ? esc(fixed(100 * *row->bubble, 1) + "%") : "-") +
         "</td>";
    s += "<td class=\"num\">" +
         (row->status == Status::kExcluded ? std::string("-") : esc(bytes(row->peak_bytes))) +
         "</td>";
    std::string status = status_name(row->status);
    if (row->chosen) status = "chosen";
    s += "<td><span class=\"status\" style=\"background: " +
         std::string(status_colour(row->status)) + "\">" + esc(status) + "</span>" +
         (row->reason.empty() ? "" : " " + esc(row->reason)) + "</td></tr>\n";
  }
  return s + "</tbody>\n</table>\n";
}

std::string table(const Report& r) {
  std::string s =
      "<table id=\"candidates\">\n<thead><tr><th>#</th><th>candidate</th><th>mesh</th>"
      "<th>micro-batch</th><th>predicted time</th><th>bubble</th><th>predicted memory</th>"
      "<th>measured time</th><th>measured memory</th><th>status</th><th>reason</th></tr></thead>"
      "\n<tbody>\n";
  for (const Row& row : r.rows) {
    std::string cls = "candidate";
    if (row.chosen) cls += " chosen";
    if (row.status == Status::kRejected) cls += " rejected";
    if (row.status == Status::kExcluded) cls += " excluded";
    s += "<tr class=\"" + cls + "\" data-candidate=\"" + std::to_string(row.number) + "\">";
    s += "<td class=\"num\">" + std::to_string(row.number) + "</td>";
    s += "<td class=\"name\">" + esc(row.name) +
         (row.chosen ? "<span class=\"chosen-tag\">chosen</span>" : "") + "</td>";
    s += "<td class=\"mesh\">" + (row.mesh.empty() ? "-" : esc(short_mesh(row.mesh))) + "</td>";
    // An excluded layout stands for all its combinations: no one micro-batch.
    s += "<td class=\"num\">" +
         (row.status == Status::kExcluded ? std::string("-") : std::to_string(row.micro_batch)) +
         "</td>";
    s += "<td class=\"num\">" + (row.step_s ? esc(ms(*row.step_s)) : "-") + "</td>";
    s += "<td class=\"num\">" + (row.bubble ? esc(fixed(100 * *row.bubble, 1) + "%") : "-") +
         "</td>";
    s += row.status == Status::kExcluded ? std::string("<td class=\"num\">-</td>")
                                         : "<td class=\"num\" title=\"" + esc(row.memory.dump()) +
                                               "\">" + esc(bytes(row.peak_bytes)) + "</td>";
    const bool ok = row.measured_ok();
    s += "<td class=\"num\">" + (ok ? esc(ms(row.measured->step_s)) : "-") + "</td>";
    // An out-of-memory run's peak says by how much it went over.
    const bool peak =
        row.measured && row.measured->peak_bytes > 0 && row.measured->status != Status::kError;
    s += "<td class=\"num\">" + (peak ? esc(bytes(row.measured->peak_bytes)) : "-") + "</td>";
    s +=
        "<td><span class=\"status\" style=\"background: " + std::string(status_colour(row.status)) +
        "\">" + esc(status_name(row.status)) + "</span></td>";
    std::string reason = row.reason;
    if (reason.empty() && row.measured) reason = row.measured->error;
    s += "<td>" + esc(reason) + "</td></tr>\n";
  }
  return s + "</tbody>\n</table>\n";
}

// The dry-run candidates by number under the scatter, with the prediction's error, and those
// the scatter cannot show (their dry-run failed).
std::string scatter_key(const Report& r) {
  std::string s;
  for (const Row& row : r.rows) {
    if (!row.measured) continue;
    s += "<li><strong>" + std::to_string(row.number) + "</strong> " + esc(row.name);
    if (row.measured_ok() && row.step_s && *row.step_s > 0) {
      const double err = 100.0 * (row.measured->step_s - *row.step_s) / *row.step_s;
      s += ": predicted " + esc(ms(*row.step_s)) + ", measured " + esc(ms(row.measured->step_s)) +
           " (" + (err >= 0 ? "+" : "") + fixed(err, 0) + "%)";
    } else if (!row.measured_ok()) {
      s += ": not plotted, the dry-run ended with " + esc(status_name(row.measured->status));
    }
    if (row.chosen) s += " <span class=\"chosen-tag\">chosen</span>";
    s += "</li>\n";
  }
  return s.empty() ? "" : "<ul class=\"key\">\n" + s + "</ul>\n";
}

// Decision: the page holds at most kPageRows candidates in its table and on its memory-time
// chart, report.json every one. A plan for a cluster has 10^5 candidates: GPT-3 175B on 64
// devices made a page of 160 MB, which headless Chromium had not drawn after two minutes. The
// page keeps the best kPageRows (the table's order), every candidate dry-run, chosen or excluded
// (its reason is the only place a layout's refusal shows) and each mesh's best (the mesh table
// names it by its #), and says how many it leaves out, by status (#rows-left).
constexpr size_t kPageRows = 1000;

std::vector<Row> page_rows(const std::vector<Row>& all) {
  std::set<std::string> meshes_seen;
  std::vector<Row> shown;
  for (size_t i = 0; i < all.size(); ++i) {
    const Row& row = all[i];
    const bool mesh_best = !row.mesh.empty() && meshes_seen.insert(row.mesh).second;
    if (i < kPageRows || row.measured || row.chosen || row.status == Status::kExcluded ||
        mesh_best) {
      shown.push_back(row);
    }
  }
  return shown;
}

// The line under the table when the page leaves candidates out.
std::string rows_left(const std::vector<Row>& all, const std::vector<Row>& shown) {
  if (shown.size() == all.size()) return "";
  std::map<std::string, int64_t> left;  // by status name, alphabetically
  for (const Row& row : all) ++left[status_name(row.status)];
  for (const Row& row : shown) --left[status_name(row.status)];
  std::string by;
  for (const auto& [status, n] : left) {
    if (n > 0) by += (by.empty() ? "" : ", ") + std::to_string(n) + " " + status;
  }
  return "<p class=\"notice\" id=\"rows-left\" data-left=\"" +
         std::to_string(all.size() - shown.size()) + "\">" +
         std::to_string(all.size() - shown.size()) + " more candidates (" + esc(by) +
         ") are not on this page, which shows the best " + std::to_string(kPageRows) +
         " predicted, every one dry-run, chosen or excluded, and each mesh's best: report.json "
         "beside it lists every candidate.</p>\n";
}

}  // namespace

std::string render_report_html(const nlohmann::json& report) {
  Report r = read_report(report);
  // r.rows becomes the page's share of the candidates; `all` keeps every one for the counts.
  const std::vector<Row> all = std::move(r.rows);
  r.rows = page_rows(all);
  std::string page =
      "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n"
      "<meta charset=\"utf-8\"/>\n<title>auto_accelerate: " +
      esc(r.chosen_name) + "</title>\n<style>" + kStyle + "</style>\n</head>\n<body>\n";
  page += "<h1>auto_accelerate search report</h1>\n";
  if (r.out_of_time) {
    page +=
        "<p class=\"notice\" id=\"out-of-time\">The time budget ran out: the search stopped "
        "after " +
        std::to_string(r.dry_runs) +
        " dry-run(s), so a faster candidate may not have been tried.</p>\n";
  }
  page += summary(r, all);
  page += "<h2>Charts</h2>\n<div class=\"charts\">\n";
  page +=
      "<figure><figcaption>Predicted vs measured step time of the dry-run candidates"
      "</figcaption>\n" +
      time_scatter(r) + scatter_key(r) + "</figure>\n";
  page +=
      "<figure><figcaption>" +
      std::string(r.rows.size() == all.size() ? "Every candidate" : "The candidates of the table") +
      ": predicted step time and peak memory against the budget</figcaption>\n" + memory_time(r) +
      "<ul class=\"key\"><li>Numbers are the table's #; hover a point for its name.</li>"
      "</ul>\n</figure>\n</div>\n";
  page += meshes(r, all);
  page += "<h2>Candidates, best predicted first</h2>\n" + rows_left(all, r.rows) + table(r);
  return page + "</body>\n</html>\n";
}

void check_report_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  ACC_CHECK_AS(IoError, !dir.empty(), "report directory: the name is empty");
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    for (const char* name : {"report.json", "report.html"}) {
      check_output_path((fs::path(dir) / name).string(), "report directory");
    }
    return;
  }
  ACC_CHECK_AS(IoError, !fs::exists(dir, ec), "report directory '", dir,
               "' exists and is not a directory");
  // Missing: it is created, one level only (a missing parent is more likely a typo than a wish).
  fs::path p = fs::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // "run/search/" names "run/search"
  fs::path parent = p.parent_path();
  if (parent.empty()) parent = ".";
  ACC_CHECK_AS(IoError, fs::is_directory(parent, ec), "report directory '", dir,
               "' cannot be created: its parent '", parent.string(), "' does not exist");
  ACC_CHECK_AS(IoError, ::access(parent.c_str(), W_OK) == 0, "report directory '", dir,
               "' cannot be created: its parent '", parent.string(), "' is not writable (",
               std::strerror(errno), ")");
}

void write_report(const nlohmann::json& report, const std::string& dir) {
  namespace fs = std::filesystem;
  // Render first: a bad report fails before anything is created.
  const std::string html = render_report_html(report);
  const std::string json =
      report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  check_report_dir(dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    fs::create_directory(dir, ec);
    ACC_CHECK_AS(IoError, !ec, "write_report: cannot create the directory '", dir,
                 "': ", ec.message());
  }
  for (const auto& [name, text] :
       {std::pair<std::string, const std::string&>{"report.json", json},
        std::pair<std::string, const std::string&>{"report.html", html}}) {
    const std::string path = (fs::path(dir) / name).string();
    check_output_path(path, "write_report");
    write_text_file_atomically(path, text, "write_report");
  }
}

}  // namespace acc::search
