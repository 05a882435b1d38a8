#include "acc/util/system.hpp"

#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "acc/util/error.hpp"

namespace acc {
namespace {

// A value of /proc/meminfo in bytes ("MemTotal:  24684084 kB"), or nothing when absent.
std::optional<int64_t> meminfo(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  ACC_CHECK_AS(IoError, in.good(), "cannot read /proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) != 0) continue;
    std::istringstream fields(line.substr(key.size() + 1));
    int64_t kib = 0;
    if (fields >> kib) return kib * 1024;
  }
  return std::nullopt;
}

// The first line of a file, or "" when it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (in.good()) std::getline(in, line);
  return line;
}

std::optional<int64_t> read_int(const std::string& path) {
  const std::string s = first_line(path);
  try {
    size_t used = 0;
    const long long v = std::stoll(s, &used);
    return static_cast<int64_t>(v);
  } catch (const std::exception&) {
    return std::nullopt;  // missing file, "max", or not a number
  }
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) out.push_back(part);
  return out;
}

// The directories of this process's cgroup that may hold `controller`'s files, each with its
// ancestors up to the mount point: v2 (controller "" in /proc/self/cgroup) and v1 hierarchies
// whose controller list names it.
std::vector<std::string> cgroup_dirs(const std::string& controller) {
  struct Mount {
    std::string root, point;
    bool v2;
    std::vector<std::string> controllers;
  };
  std::vector<Mount> mounts;
  std::ifstream mi("/proc/self/mountinfo");
  std::string line;
  while (std::getline(mi, line)) {
    // id parent major:minor root mount-point options [optional...] - fstype source super-options
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream pre(line.substr(0, dash)), post(line.substr(dash + 3));
    std::string id, parent, dev, root, point, fstype, source, super;
    pre >> id >> parent >> dev >> root >> point;
    post >> fstype >> source >> super;
    if (fstype == "cgroup2") mounts.push_back({root, point, true, {}});
    if (fstype == "cgroup") mounts.push_back({root, point, false, split(super, ',')});
  }
  std::vector<std::string> dirs;
  std::ifstream cg("/proc/self/cgroup");
  while (std::getline(cg, line)) {
    // hierarchy-id:controller-list:path
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::vector<std::string> ctrls = split(line.substr(a + 1, b - a - 1), ',');
    const std::string path = line.substr(b + 1);
    const bool v2 = ctrls.empty();
    if (!v2 && std::find(ctrls.begin(), ctrls.end(), controller) == ctrls.end()) continue;
    for (const Mount& m : mounts) {
      if (m.v2 != v2) continue;
      if (!v2 && std::find(m.controllers.begin(), m.controllers.end(), controller) ==
                     m.controllers.end()) {
        continue;
      }
      // The path is relative to the hierarchy's root; a mount of a sub-tree (a container's own
      // cgroup) shows only what lies below its root, and outside it (a cgroup namespace) the
      // mount point itself is this process's cgroup.
      std::string rel;
      if (m.root == "/") {
        rel = path;
      } else if (path.rfind(m.root, 0) == 0) {
        rel = path.substr(m.root.size());
      }
      std::string dir = m.point + (rel == "/" ? "" : rel);
      while (true) {
        dirs.push_back(dir);
        if (dir.size() <= m.point.size()) break;
        dir = dir.substr(0, dir.rfind('/'));
      }
    }
  }
  return dirs;
}

// v1 reports "no limit" as a huge page-aligned number (9223372036854771712).
bool is_limit(int64_t v) {
  return v > 0 && v < (int64_t{1} << 62);
}

}  // namespace

int64_t physical_memory_bytes() {
  const std::optional<int64_t> total = meminfo("MemTotal");
  ACC_CHECK_AS(IoError, total.has_value(), "/proc/meminfo has no MemTotal");
  int64_t bytes = *total;
  for (const std::string& dir : cgroup_dirs("memory")) {
    for (const char* file : {"/memory.max", "/memory.limit_in_bytes"}) {
      const std::optional<int64_t> limit = read_int(dir + file);
      if (limit && is_limit(*limit)) bytes = std::min(bytes, *limit);
    }
  }
  return bytes;
}

int64_t available_memory_bytes() {
  std::optional<int64_t> avail = meminfo("MemAvailable");
  if (!avail) avail = meminfo("MemFree");  // kernels before 3.14
  ACC_CHECK_AS(IoError, avail.has_value(), "/proc/meminfo has neither MemAvailable nor MemFree");
  int64_t bytes = *avail;
  for (const std::string& dir : cgroup_dirs("memory")) {
    const std::pair<const char*, const char*> files[] = {
        {"/memory.max", "/memory.current"}, {"/memory.limit_in_bytes", "/memory.usage_in_bytes"}};
    for (const auto& [limit_file, usage_file] : files) {
      const std::optional<int64_t> limit = read_int(dir + limit_file);
      const std::optional<int64_t> usage = read_int(dir + usage_file);
      if (limit && usage && is_limit(*limit)) {
        bytes = std::min(bytes, std::max<int64_t>(*limit - *usage, 0));
      }
    }
  }
  return bytes;
}

// v2 cpu.max or v1 cfs quota, rounded up.
int capped_by_cpu_quota(int cores) {
  for (const std::string& dir : cgroup_dirs("cpu")) {
    int64_t quota = -1, period = 0;
    const std::vector<std::string> max = split(first_line(dir + "/cpu.max"), ' ');
    if (max.size() == 2 && max[0] != "max") {
      try {
        quota = std::stoll(max[0]);
        period = std::stoll(max[1]);
      } catch (const std::exception&) {
        quota = -1;
      }
    } else if (auto q = read_int(dir + "/cpu.cfs_quota_us")) {
      quota = *q;
      period = read_int(dir + "/cpu.cfs_period_us").value_or(0);
    }
    if (quota > 0 && period > 0) {
      cores = static_cast<int>(std::min<int64_t>(cores, (quota + period - 1) / period));
    }
  }
  return std::max(cores, 1);
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return capped_by_cpu_quota(sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1);
}

std::vector<int> affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

int machine_cores() {
  return capped_by_cpu_quota(static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))));
}

}  // namespace acc
