// bench_checkpoint: how fast sharded checkpoints save and load against what the disk itself does,
// how well zstd compresses them, and how long an async save stalls training. One JSON line (rank
// 0), for one process or under mpirun:
//
//   build-bench/benchmarks/bench_checkpoint --config examples/configs/gpt_17m.json --dir /tmp/ck
//
// 1. The model trains one step (AdamW state exists) with --strategy (none on one rank, ddp on
//    more by default).
// 2. --rounds rounds of: the disk (each rank writes a file of its own as large as its share of the
//    checkpoint's raw bytes, fsynced as the checkpoint is, then drops it from the page cache with
//    posix_fadvise DONTNEED and reads it back; the slowest rank's time), then a synchronous save
//    (ckpt::save_trainer) and a load (ckpt::load_trainer, its shards dropped from the page cache
//    first). Throughput is the state's raw bytes over the median time; save_over_disk and
//    load_over_disk are the medians of the rounds' ratios (disk time ÷ save or load time), since
//    the disk's rate drifts between rounds.
// 3. Stall: --steps plain steps, then the same steps with an async save started before every
//    --every-th step and polled after each (what train_gpt does), alternated over --rounds; stall
//    share = (time with saves - time without) / time without, over the same steps; the process's
//    extra CPU time per save (getrusage: every thread's, the writer's included).

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "acc/acc.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/util/json.hpp"
#include "bench_util.hpp"

namespace {

using acc::bench::median;
namespace fs = std::filesystem;

double slowest(acc::dist::ProcessGroup& g, double seconds) {
  acc::Tensor t = acc::from_vector(std::vector<float>{static_cast<float>(seconds)}, {1});
  g.allreduce(t, acc::dist::ReduceOp::kMax)->wait();
  return t.to_vector<float>()[0];
}

void drop_cache(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void drop_cache_dir(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) drop_cache(e.path());
  }
}

// The disk's own fsynced write and cold read of `bytes`, seconds.
std::pair<double, double> disk(const fs::path& file, int64_t bytes) {
  std::vector<char> buf(size_t{8} << 20, 'x');
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<char>(i * 2654435761u >> 24);
  acc::Timer w;
  {
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ACC_CHECK_AS(acc::IoError, fd >= 0, "bench_checkpoint: cannot write '", file.string(), "'");
    for (int64_t done = 0; done < bytes;) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(bytes - done, buf.size()));
      ACC_CHECK_AS(acc::IoError, ::write(fd, buf.data(), n) == static_cast<ssize_t>(n),
                   "bench_checkpoint: writing '", file.string(), "' failed");
      done += static_cast<int64_t>(n);
    }
    ::fsync(fd);
    ::close(fd);
  }
  const double write_s = w.elapsed_s();
  drop_cache(file);
  acc::Timer r;
  {
    const int fd = ::open(file.c_str(), O_RDONLY);
    while (::read(fd, buf.data(), buf.size()) > 0) {
    }
    ::close(fd);
  }
  const double read_s = r.elapsed_s();
  fs::remove(file);
  return {write_s, read_s};
}

// CPU seconds of this process so far, every thread's (the async writer's included).
double process_cpu_s() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_file, dir = "/tmp/acc-bench-checkpoint", strategy;
  int64_t batch = 4, seq = 128, steps = 10, every = 2;
  int rounds = 3;
  int zstd_level = acc::ckpt::SaveOptions{}.zstd_level;
  CLI::App app{"Sharded checkpoint throughput against the disk, and the stall of async saves"};
  app.add_option("--config", config_file, "GPT config JSON")->required();
  app.add_option("--dir", dir, "where checkpoints are written (removed at the end)")
      ->capture_default_str();
  app.add_option("--strategy", strategy, "strategy JSON (default: none, ddp on several ranks)");
  app.add_option("--batch-size", batch, "per rank")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seq-len", seq)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--steps", steps, "steps timed with and without saves")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--every", every, "an async save every N steps in the stall pass")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--rounds", rounds, "timed saves and loads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--zstd-level", zstd_level, "compression level (negative: zstd's fast levels)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  int rc = 0;
  acc::dist::init(argc, argv);
  try {
    using namespace acc;
    auto world = dist::ProcessGroup::world();
    const bool leader = world->rank() == 0;
    const nlohmann::json config = read_json_file(config_file, "--config");
    manual_seed(1);
    auto model = models::create_model("gpt", config);
    const std::string s = !strategy.empty()   ? strategy
                          : world->size() > 1 ? R"([{"name": "ddp"}])"
                                              : "[]";
    auto trainer = strategies::apply(model, optim::AdamW::factory({}),
                                     strategies::parse_strategy(parse_json(s, "--strategy")),
                                     {.group = world});
    Generator gen(7);
    const data::Batch b{randint(0, model->vocab_size(), {batch, seq}, gen),
                        randint(0, model->vocab_size(), {batch, seq}, gen)};
    trainer->train_step(b);
    const std::string hash = trace::model_trace_hash("gpt", config);

    // The state's raw bytes this rank writes (replica 0's regions), and in all.
    int64_t mine = 0;
    for (const auto& e : trainer->placements()) {
      if (e.kind == dist::TensorKind::kGradient || e.replica != 0) continue;
      mine += e.held_numel() * static_cast<int64_t>(element_size(e.dtype));
    }
    Tensor total_t = from_vector(std::vector<int64_t>{mine}, {1});
    world->allreduce(total_t, dist::ReduceOp::kSum)->wait();
    const int64_t total = total_t.to_vector<int64_t>()[0];
    if (leader) fs::create_directories(dir);
    world->barrier()->wait();

    // The disk's rate moves a lot from run to run on a VM (5x between rounds here): each round
    // measures the disk, then a save and a load, and the ratios are taken per round (the median).
    std::vector<double> disk_writes, disk_reads, save_s, load_s, save_ratio, load_ratio;
    std::string step_dir;
    for (int r = 0; r < rounds; ++r) {
      world->barrier()->wait();
      const auto [dw, dr] = disk(fs::path(dir) / ("disk-" + std::to_string(world->rank())), mine);
      disk_writes.push_back(slowest(*world, dw));
      disk_reads.push_back(slowest(*world, dr));
      world->barrier()->wait();
      Timer t;
      // keep_last 0: removing the previous round's step (an unlink of its shards, 25-30 ms here)
      // is not the write; it is removed after the timing instead.
      const std::string previous = step_dir;
      step_dir = ckpt::save_trainer(dir + "/sync", r, *trainer, hash, {},
                                    {.zstd_level = zstd_level, .keep_last = 0});
      save_s.push_back(slowest(*world, t.elapsed_s()));
      if (leader && !previous.empty()) fs::remove_all(previous);
      if (leader) drop_cache_dir(step_dir);
      world->barrier()->wait();
      Timer l;
      ckpt::load_trainer(step_dir, *trainer, hash);
      load_s.push_back(slowest(*world, l.elapsed_s()));
      save_ratio.push_back(disk_writes.back() / save_s.back());
      load_ratio.push_back(disk_reads.back() / load_s.back());
    }
    const double disk_write = median(disk_writes), disk_read = median(disk_reads);
    int64_t stored = 0;
    for (const auto& t : ckpt::read_metadata(step_dir).tensors) {
      for (const auto& c : t.chunks) stored += c.byte_length;
    }

    // Stall: the same steps without and with async saves.
    std::vector<double> save_calls;  // the part of an async save the training thread runs
    std::vector<double> poll_calls;  // the poll()s of a save, summed
    const int64_t saves_per_pass = (steps + every - 1) / every;
    std::vector<double> cpu_plain, cpu_saving;  // this process's CPU seconds (all its threads)
    auto pass = [&](bool saving) {
      ckpt::AsyncSaver saver(dir + "/async", {.zstd_level = zstd_level, .keep_last = 1});
      world->barrier()->wait();
      const double cpu0 = process_cpu_s();
      Timer t;
      double polls = 0;
      for (int64_t i = 0; i < steps; ++i) {
        if (saving && i % every == 0) {
          Timer c;
          saver.save(i, *trainer, hash);
          save_calls.push_back(c.elapsed_s());
        }
        trainer->train_step(b);
        if (saving) {
          Timer c;
          saver.poll();
          polls += c.elapsed_s();
        }
      }
      const double s = slowest(*world, t.elapsed_s());
      saver.finish();  // a write still running at the end is not the training's stall
      (saving ? cpu_saving : cpu_plain).push_back(slowest(*world, process_cpu_s() - cpu0));
      if (saving) poll_calls.push_back(polls / static_cast<double>(saves_per_pass));
      return s;
    };
    std::vector<double> plain, with_saves;
    for (int r = 0; r < rounds; ++r) {  // alternated, so a drift of the machine weighs on both
      plain.push_back(pass(false));
      with_saves.push_back(pass(true));
    }
    const double p = median(plain), w = median(with_saves);
    if (leader) {
      const double gb = static_cast<double>(total) / 1e9;
      const double save_gbps = gb / median(save_s), load_gbps = gb / median(load_s);
      const double disk_w = gb / disk_write, disk_r = gb / disk_read;
      const nlohmann::json out = {
          {"config", config_file},
          {"world", world->size()},
          {"strategy", parse_json(s, "--strategy")},
          {"state_bytes", total},
          {"stored_bytes", stored},
          {"zstd_level", zstd_level},
          {"zstd_ratio", static_cast<double>(total) / static_cast<double>(stored)},
          {"disk_write_gbps", disk_w},
          {"disk_read_gbps", disk_r},
          {"save_gbps", save_gbps},
          {"load_gbps", load_gbps},
          {"save_over_disk", median(save_ratio)},
          {"load_over_disk", median(load_ratio)},
          {"disk_write_s", disk_writes},
          {"disk_read_s", disk_reads},
          {"save_s", save_s},
          {"load_s", load_s},
          {"steps", steps},
          {"save_every", every},
          {"steps_s_plain", plain},
          {"steps_s_with_async_saves", with_saves},
          {"median_step_s", p / static_cast<double>(steps)},
          {"async_save_call_s", median(save_calls)},
          {"async_polls_per_save_s", median(poll_calls)},
          {"async_cpu_per_save_s",
           (median(cpu_saving) - median(cpu_plain)) / static_cast<double>(saves_per_pass)},
          {"async_stall_share", (w - p) / p},
          {"async_stall_per_save_over_step",
           (w - p) / static_cast<double>(saves_per_pass) / (p / static_cast<double>(steps))}};
      std::printf("%s\n", out.dump().c_str());
    }
    world->barrier()->wait();
    if (leader) fs::remove_all(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_checkpoint: error: %s\n", e.what());
    rc = 1;
  }
  acc::dist::finalize();
  return rc;
}
