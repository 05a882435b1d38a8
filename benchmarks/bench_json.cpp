// bench_json: do the readers of users' files take time and memory linear in the file? Each reader
// is given files of n entries for every n of --sizes (default 1e5 and 4e5) and timed in a child
// process of its own (its peak RSS is the child's): a strategy file of n `{}` (refused after the
// parse, as the hostile probe of issue 29 made it), a valid checkpoint metadata.json of n tensors,
// a valid safetensors header of n tensors, and a config-like JSON array of n `{}` through
// acc::read_json_file. One JSON line per reader and size, then one per reader with the ratio of
// the largest size's time to the smallest's against the ratio of sizes (linear: equal; quadratic:
// its square). nlohmann's callback parser took 55 s for the 4e5 strategy file.
//
//   build/benchmarks/bench_json                  # 1e5 and 4e5, median of 3 rounds
//   build/benchmarks/bench_json --sizes 1000,4000 --rounds 1

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "acc/checkpoint/format.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"
#include "bench_util.hpp"

namespace {

namespace fs = std::filesystem;

std::string array_of_empty_objects(int64_t n) {
  std::string s = "[";
  for (int64_t i = 0; i < n; ++i) s += i ? ",{}" : "{}";
  return s + "]";
}

// A valid metadata.json (format.hpp, version 2) of n one-element f32 tensors, one chunk each.
std::string metadata_of(int64_t n) {
  std::string s = R"({"format": "autoacc-checkpoint", "version": 2, "step": 1, "world": 1,)"
                  R"( "model_trace_hash": "0123456789abcdef", "strategy": [], "extra": {},)"
                  R"( "files": ["shard-00000.bin"], "tensors": [)";
  for (int64_t i = 0; i < n; ++i) {
    if (i) s += ",";
    s += R"({"name": "t)" + std::to_string(i) + R"(", "kind": "parameter", "param": "t)" +
         std::to_string(i) +
         R"(", "field": "", "shape": [1], "dtype": "f32", "chunks": [{"file": 0, "offsets": [0],)"
         R"( "sizes": [1], "byte_offset": )" +
         std::to_string(i * 13) + R"(, "byte_length": 13, "xxh64": "0123456789abcdef"}]})";
  }
  return s + "]}";
}

// A valid safetensors file of n one-element f32 tensors.
std::string safetensors_of(int64_t n) {
  std::string header = "{";
  for (int64_t i = 0; i < n; ++i) {
    if (i) header += ",";
    header += "\"t" + std::to_string(i) + R"(":{"dtype":"F32","shape":[1],"data_offsets":[)" +
              std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]}";
  }
  header += "}";
  std::string out(8, '\0');
  uint64_t len = header.size();
  for (int b = 0; b < 8; ++b)
    out[static_cast<size_t>(b)] = static_cast<char>((len >> (8 * b)) & 0xff);
  out += header;
  out.append(static_cast<size_t>(4 * n), '\0');
  return out;
}

struct Reader {
  std::string name;
  std::function<std::string(int64_t)> make;      // the file's bytes for n entries
  std::function<void(const std::string&)> read;  // reads the file at a path
};

int64_t peak_rss_bytes() {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

// Times `read(path)` in a child process; returns seconds and how far the child's peak RSS grew
// while reading (the parse's own memory, without the process's baseline).
std::pair<double, int64_t> measure(const Reader& r, const std::string& path) {
  int fds[2];
  ACC_CHECK_AS(acc::IoError, ::pipe(fds) == 0, "bench_json: pipe failed");
  const pid_t pid = ::fork();
  ACC_CHECK_AS(acc::IoError, pid >= 0, "bench_json: fork failed");
  if (pid == 0) {
    ::close(fds[0]);
    const int64_t before = peak_rss_bytes();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      r.read(path);
    } catch (const acc::Error&) {
      // The strategy file of `{}` is refused after the parse: the time to the refusal counts.
    }
    const double out[2] = {
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
        static_cast<double>(peak_rss_bytes() - before)};
    const ssize_t w = ::write(fds[1], out, sizeof(out));
    std::_Exit(w == sizeof(out) ? 0 : 1);
  }
  ::close(fds[1]);
  double in[2] = {-1, -1};
  const ssize_t got = ::read(fds[0], in, sizeof(in));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ACC_CHECK_AS(acc::IoError, got == sizeof(in) && WIFEXITED(status) && WEXITSTATUS(status) == 0,
               "bench_json: the ", r.name, " reader's child failed");
  return {in[0], static_cast<int64_t>(in[1])};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {100000, 400000};
  int rounds = 3;
  std::string dir =
      (fs::temp_directory_path() / ("bench_json_" + std::to_string(::getpid()))).string();
  CLI::App app{"bench_json: time and memory of the JSON readers against the size of the file"};
  app.add_option("--sizes", sizes, "entries per file (at least two sizes)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "runs per reader and size (the median is reported)")
      ->check(CLI::Range(1, 100));
  app.add_option("--dir", dir, "where the generated files go (removed at the end)");
  CLI11_PARSE(app, argc, argv);
  if (sizes.size() < 2) {
    std::fprintf(stderr, "bench_json: --sizes needs at least two sizes, got %zu\n", sizes.size());
    return 2;
  }

  const std::vector<Reader> readers = {
      {"strategy_file", array_of_empty_objects,
       [](const std::string& p) { acc::strategies::parse_strategy_arg(p); }},
      {"checkpoint_metadata", metadata_of,
       [](const std::string& p) {
         std::ifstream in(p, std::ios::binary);
         const std::string text((std::istreambuf_iterator<char>(in)), {});
         acc::ckpt::parse_metadata(text, p);
       }},
      {"safetensors_header", safetensors_of,
       [](const std::string& p) { acc::io::read_safetensors_header(p); }},
      {"read_json_file", array_of_empty_objects,
       [](const std::string& p) { acc::read_json_file(p, "bench"); }},
  };

  fs::create_directories(dir);
  for (const Reader& r : readers) {
    std::vector<double> medians;
    for (const int64_t n : sizes) {
      const std::string path = dir + "/" + r.name + "_" + std::to_string(n);
      int64_t file_bytes = 0;
      {
        const std::string bytes = r.make(n);  // freed before the children fork
        std::ofstream(path, std::ios::binary) << bytes;
        file_bytes = static_cast<int64_t>(bytes.size());
      }
      std::vector<double> secs;
      int64_t rss = 0;
      for (int i = 0; i < rounds; ++i) {
        const auto [s, growth] = measure(r, path);
        secs.push_back(s);
        rss = std::max(rss, growth);
      }
      medians.push_back(acc::bench::median(secs));
      std::cout << nlohmann::json{{"reader", r.name},
                                  {"entries", n},
                                  {"file_bytes", file_bytes},
                                  {"median_s", medians.back()},
                                  {"rss_growth_bytes", rss},
                                  {"rss_growth_per_file_byte",
                                   static_cast<double>(rss) / static_cast<double>(file_bytes)}}
                       .dump()
                << std::endl;
      fs::remove(path);
    }
    const double size_ratio = static_cast<double>(sizes.back()) / sizes.front();
    const double time_ratio = medians.back() / std::max(medians.front(), 1e-9);
    std::cout << nlohmann::json{{"reader", r.name},
                                {"size_ratio", size_ratio},
                                {"time_ratio", time_ratio},
                                {"time_ratio_per_size_ratio", time_ratio / size_ratio}}
                     .dump()
              << std::endl;
  }
  fs::remove_all(dir);
  return 0;
}
