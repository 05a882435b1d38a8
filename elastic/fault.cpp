#include "acc/elastic/fault.hpp"

#include <set>

#include "acc/util/error.hpp"
#include "acc/util/parse.hpp"

namespace acc::elastic {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\n");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\n") - a + 1);
}

progress::Phase parse_phase(const std::string& v, const std::string& spec) {
  for (auto p : {progress::Phase::kForward, progress::Phase::kBackward, progress::Phase::kUpdate,
                 progress::Phase::kCollective, progress::Phase::kSave, progress::Phase::kLoad}) {
    if (v == progress::phase_name(p)) return p;
  }
  ACC_THROW(ValueError, "ACC_FAULT '", spec, "': unknown phase '", v,
            "' (expected forward, backward, update, collective, save or load)");
}

progress::Point parse_point(const std::string& v, const std::string& spec) {
  for (progress::Point p : progress::kPoints) {
    if (v == progress::point_name(p)) return p;
  }
  ACC_THROW(ValueError, "ACC_FAULT '", spec, "': unknown point '", v,
            "' (expected mid_write, before_rename or after_rename)");
}

}  // namespace

const char* fault_action_name(FaultAction a) {
  switch (a) {
    case FaultAction::kKill:
      return "kill";
    case FaultAction::kStall:
      return "stall";
    case FaultAction::kSlow:
      return "slow";
    case FaultAction::kKillNode:
      return "kill-node";
  }
  return "unknown";
}

std::vector<FaultSpec> parse_faults(const std::string& text) {
  std::vector<FaultSpec> out;
  for (const std::string& raw : split(text, ';')) {
    const std::string spec = trim(raw);
    if (spec.empty()) continue;
    const std::vector<std::string> parts = split(spec, ':');
    FaultSpec f;
    f.text = spec;
    const std::string& action = parts[0];
    if (action == "kill") {
      f.action = FaultAction::kKill;
    } else if (action == "stall") {
      f.action = FaultAction::kStall;
    } else if (action == "slow") {
      f.action = FaultAction::kSlow;
    } else if (action == "kill-node") {
      f.action = FaultAction::kKillNode;
    } else {
      ACC_THROW(ValueError, "ACC_FAULT '", spec, "': unknown action '", action,
                "' (expected kill, stall, slow or kill-node)");
    }
    bool has_rank = false, has_step = false, has_factor = false;
    std::string factor_text;
    std::set<std::string> keys;
    for (size_t i = 1; i < parts.size(); ++i) {
      const size_t eq = parts[i].find('=');
      ACC_CHECK(eq != std::string::npos, "ACC_FAULT '", spec, "': '", parts[i],
                "' is not KEY=VALUE");
      const std::string key = parts[i].substr(0, eq), value = parts[i].substr(eq + 1);
      // One value per key: "rank=1:rank=2" is a typo, not "the last one wins".
      ACC_CHECK(keys.insert(key).second, "ACC_FAULT '", spec, "': key '", key, "' is given twice");
      const std::string what = "ACC_FAULT '" + spec + "' " + key;
      if (key == "rank") {
        const int64_t r = parse_int64(value, what);
        ACC_CHECK(r >= 0 && r < (int64_t{1} << 30), what, " must be >= 0, got ", value);
        f.rank = static_cast<int>(r);
        has_rank = true;
      } else if (key == "step") {
        f.step = parse_int64(value, what);
        ACC_CHECK(f.step >= 0, what, " must be >= 0, got ", value);
        has_step = true;
      } else if (key == "phase") {
        f.phase = parse_phase(value, spec);
      } else if (key == "point") {
        f.point = parse_point(value, spec);
      } else if (key == "factor") {
        f.factor = parse_double(value, what);
        factor_text = value;
        has_factor = true;
      } else {
        ACC_THROW(ValueError, "ACC_FAULT '", spec, "': unknown key '", key,
                  "' (expected rank, step, phase, point or factor)");
      }
    }
    ACC_CHECK(has_rank && has_step, "ACC_FAULT '", spec, "': rank=R and step=S are required");
    // A point is a place inside a save, reached on whatever thread writes it: a stall or a slow
    // step there would stop a background writer, not the rank.
    ACC_CHECK(!f.point || f.action == FaultAction::kKill || f.action == FaultAction::kKillNode,
              "ACC_FAULT '", spec, "': point applies to kill and kill-node only");
    ACC_CHECK(!f.point || !f.phase, "ACC_FAULT '", spec,
              "': a fault is reached at a phase or at a point, not both");
    if (f.action == FaultAction::kSlow) {
      ACC_CHECK(has_factor && f.factor > 1.0, "ACC_FAULT '", spec,
                "': slow needs factor=F with F > 1, got ", has_factor ? factor_text : "none");
      ACC_CHECK(f.factor <= kMaxSlowFactor, "ACC_FAULT '", spec, "': factor must be at most ",
                kMaxSlowFactor, " (a rank slowed more is stalled: use stall), got ", factor_text);
    } else {
      ACC_CHECK(!has_factor, "ACC_FAULT '", spec, "': factor applies to slow only");
    }
    // A fault that fired is remembered by its text (JOB/faults): the same text twice would be
    // one fault, fired once.
    for (const FaultSpec& earlier : out) {
      ACC_CHECK(earlier.text != spec, "ACC_FAULT '", spec, "' is listed twice");
    }
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace acc::elastic
