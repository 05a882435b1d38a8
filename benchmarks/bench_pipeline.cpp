// bench_pipeline: the pipeline bubble, measured. One JSON line per schedule and a summary (rank 0).
//
//   mpirun -np 2 build/benchmarks/bench_pipeline --config gpt_small --layers 8
//          --global-batch 16 --seq-len 64 --micro-batches 8 --rounds 5   (one line)
//
// pipeline_parallel over all the ranks (p = the world), the same model, global batch and m
// micro-batches, under 1F1B and under the interleaved schedule with 2 virtual stages a rank. Both
// are built first, then timed in turns (1f1b, interleaved, 1f1b, ...), each turn one untimed step
// and --steps timed ones; every step starts from a barrier.
//
// A rank's idle share of a step is the time it spends blocked in Work::wait during it
// (acc::dist::wait_seconds, read from outside the library) over the step's wall time: waiting for
// an activation or a gradient from its neighbour, for the step's last messages, and for the loss
// the last stage computed. Its median over the timed steps is set against the schedule's bubble
// as a share of the step, (p - 1) / (m + p - 1) for 1F1B and (p - 1) / (v m + p - 1) interleaved
// (Narayanan et al. 2021: bubble (p - 1) / m and (p - 1) / (v m) of the ideal time), which assumes
// stages of equal cost and free messages. More ranks than cores (p = 4 on 2 cores) share the cores
// in the steady state, where every stage computes, and not in the warm-up and cool-down, where
// only some do: the bubble then measures short of the formula.
//
// What the excess over the formula is made of, measured: a rank's busy time (the step less its
// waits) is its stages' compute. The formula with those measured stage times in place of equal
// ones, step* = m max_r t_r + (sum_r t_r - max_r t_r) / v with t_r = busy_r / m (for p = 2 that is
// exact for 1F1B; the optimizer's update is in every rank's busy time alike), gives each rank's
// idle share had its messages been free (idle_share_from_stage_times); the rest of the measured
// idle (message_share) is the messages on the critical path and the scheduling of the ranks'
// threads on shared cores.
//
// Beside the formula, each line gives the search's own prediction of the same run
// (search_idle_share, search_step_ms): search::CostModel on this machine's calibration (GEMM rates
// from the cache, the compute contention of the job's ranks) and the world's collective fits, its
// bubble_s over its schedule (stage imbalance and the messages on the slowest rank included). With
// more ranks x threads than cores it prices as auto_accelerate does: the schedule simulated on
// time-sliced cores (strategies::simulated_schedule_time) and each message's wait for a
// descheduled sender (search::measure_collective_wait on pairs). cpu_ms_per_rank is each rank's
// process CPU time over the step (its compute thread and its communication thread): with the
// cores shared, their sum over the cores against the step says how much of the step the cores
// stood idle (the fill and drain, and the ranks' hand-offs).

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <optional>

#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/search/calibration.hpp"
#include "acc/search/cost.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "bench_util.hpp"

namespace {

using acc::bench::median;

struct Run {
  std::string label;
  int virtual_stages = 1;
  std::unique_ptr<acc::strategies::Trainer> trainer;
  // This rank's, per timed step; cpu_ms: the process's CPU time (every thread of it).
  std::vector<double> step_ms, idle_share, busy_ms, cpu_ms;
  double predicted = 0;
  acc::strategies::Strategy strategy;
  double search_idle = 0, search_step_ms = 0;  // the search's cost model, rank 0's
};

// The CPU time of this process, all threads (its compute and its communication thread), ms.
double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return 1e3 * static_cast<double>(ts.tv_sec) + 1e-6 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace acc;
  dist::Session session(argc, argv);
  CLI::App app{"bench_pipeline: the pipeline bubble of 1F1B and interleaved 1F1B, measured"};
  std::string config = "gpt_small";
  int64_t layers = 8, global_batch = 16, seq_len = 64;
  int micro_batches = 8, warmup = 1, steps = 2, rounds = 5;
  app.add_option("--config", config, "gpt17m, gpt90m, llama17m or a config file");
  app.add_option("--layers", layers, "blocks (a multiple of 2 x ranks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--global-batch", global_batch)->check(CLI::PositiveNumber);
  app.add_option("--seq-len", seq_len)->check(CLI::PositiveNumber);
  app.add_option("--micro-batches", micro_batches)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps per turn")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", steps, "timed steps per turn")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "turns of each schedule")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    auto world = dist::ProcessGroup::world();
    const int p = world->size();
    nlohmann::json cfg = bench::named_config(config, ACC_SOURCE_DIR "/examples/configs/");
    const std::string type = cfg.contains("n_layer") ? "gpt" : "llama";
    cfg[models::config_num_layers_key(type)] = layers;
    ACC_CHECK(layers % (2 * p) == 0, "bench_pipeline: --layers ", layers,
              " must be a multiple of 2 x ", p, " ranks (the interleaved run has 2 stages a rank)");
    std::vector<Run> runs(2);
    runs[0].label = "pp" + std::to_string(p) + "_1f1b_m" + std::to_string(micro_batches);
    runs[1].label = "pp" + std::to_string(p) + "_interleaved_v2_m" + std::to_string(micro_batches);
    runs[1].virtual_stages = 2;
    for (Run& r : runs) {
      manual_seed(1);
      auto model = models::create_model(type, cfg);
      nlohmann::json pp = {{"size", p}, {"micro_batches", micro_batches}};
      if (r.virtual_stages > 1) pp["virtual"] = r.virtual_stages;
      r.strategy = strategies::parse_strategy({{{"name", "pipeline_parallel"}, {"config", pp}}});
      r.trainer = strategies::apply(model, optim::AdamW::factory({}), r.strategy);
      const double v = r.virtual_stages;
      r.predicted = (p - 1) / (v * micro_batches + p - 1);
    }
    {
      // The search's prediction: the GEMM shapes of every rank's stages, measured (or read from
      // the cache) on rank 0 alone, then shared; the contention and collectives over the world.
      const trace::ModelRef ref = trace::ModelRef::registry(type, cfg);
      std::vector<search::GemmShape> shapes;
      std::vector<search::Candidate> cands;
      for (const Run& r : runs) {
        cands.push_back(
            search::candidate_of(r.strategy, p, global_batch,
                                 {.world = p, .num_blocks = layers, .per_rank_batch = global_batch},
                                 strategies::searchable_methods()));
        for (const auto& rm : search::rank_models(ref, cands.back(), seq_len)) {
          for (const auto& g : search::CostModel::shapes_to_measure(
                   rm.model, {cands.back().micro_batch}, seq_len)) {
            shapes.push_back(g);
          }
        }
      }
      search::MachineCalibration machine;
      if (world->rank() == 0) machine = search::load_or_calibrate_machine(shapes, {});
      machine = search::broadcast_calibration(*world, machine);
      const double contention = search::contention_for_job(*world, machine, shapes, {});
      search::CommCalibration comm = search::calibrate_collectives_for_search(*world);
      // More ranks x threads than cores: as auto_accelerate prices it, the schedule on
      // time-sliced cores and each message's wait for a descheduled sender (measured between
      // GEMMs of the median shape, by the 2-rank fits' group size).
      const search::JobCores cores = search::job_cores(*world, get_num_threads());
      std::optional<search::CommCalibration> pair;
      if (cores.share > 1 && !shapes.empty()) {
        const search::WaitProbe probe = search::collective_wait_probe(shapes, machine);
        pair = comm;
        if (p != 2) pair = search::calibrate_contiguous_groups(*world, 2);  // as auto_accelerate
        pair->wait_s = search::measure_collective_wait(*world, 2, probe.shape, probe.calls, *pair);
      }
      search::CostModel cost(ref, seq_len, machine, comm, contention);
      if (cores.share > 1) cost.set_time_slicing(std::min(cores.share, contention));
      if (pair) cost.add_group_calibration(*pair);
      for (size_t i = 0; i < runs.size(); ++i) {
        const search::TimePrediction t = cost.predict(cands[i]);
        runs[i].search_idle = t.bubble_s / t.step_s;  // as measured: waits over the step
        runs[i].search_step_ms = 1e3 * t.step_s;
      }
    }
    Generator gen;
    gen.set_state(7, 0);
    const int64_t V = cfg.value("vocab_size", int64_t{256});
    auto step = [&](Run& r, bool timed) {
      data::Batch b{randint(0, V, {global_batch, seq_len}, gen),
                    randint(0, V, {global_batch, seq_len}, gen)};
      world->barrier()->wait();
      const double wait0 = dist::wait_seconds();
      const double cpu0 = process_cpu_ms();
      const double t0 = dist::FlightRecorder::now_ms();
      r.trainer->train_step(b);
      const double ms = dist::FlightRecorder::now_ms() - t0;
      const double cpu_ms = process_cpu_ms() - cpu0;
      if (!timed) return;
      r.cpu_ms.push_back(cpu_ms);
      r.step_ms.push_back(ms);
      const double waited_ms = (dist::wait_seconds() - wait0) * 1e3;
      r.idle_share.push_back(waited_ms / ms);
      r.busy_ms.push_back(ms - waited_ms);
    };
    for (int round = 0; round < rounds; ++round) {
      for (Run& r : runs) {
        for (int i = 0; i < warmup; ++i) step(r, false);
        for (int i = 0; i < steps; ++i) step(r, true);
      }
    }
    nlohmann::json summary = {{"world", p}, {"micro_batches", micro_batches}, {"layers", layers}};
    std::vector<double> idle_medians;
    for (Run& r : runs) {
      // Each rank's median step and idle share, gathered: a rank is a stage (a stage pair
      // interleaved), so the per-rank list is the per-stage one.
      Tensor mine = from_vector(std::vector<float>{static_cast<float>(median(r.step_ms)),
                                                   static_cast<float>(median(r.idle_share)),
                                                   static_cast<float>(median(r.busy_ms)),
                                                   static_cast<float>(median(r.cpu_ms))},
                                {4});
      Tensor all = zeros({4 * p});
      world->allgather(all, mine)->wait();
      const std::vector<float> v = all.to_vector<float>();
      std::vector<double> idle, step_ms, busy, cpu;
      for (int k = 0; k < p; ++k) {
        step_ms.push_back(v[static_cast<size_t>(4 * k)]);
        idle.push_back(v[static_cast<size_t>(4 * k + 1)]);
        busy.push_back(v[static_cast<size_t>(4 * k + 2)]);
        cpu.push_back(v[static_cast<size_t>(4 * k + 3)]);
      }
      const double idle_median = median(idle);
      // The schedule over the measured stage times, messages free.
      std::vector<double> per_micro_batch;
      for (const double b : busy) per_micro_batch.push_back(b / micro_batches);
      const double schedule_ms =
          strategies::schedule_time(per_micro_batch, micro_batches, r.virtual_stages);
      std::vector<double> stage_idle;
      for (const double b : busy) stage_idle.push_back((schedule_ms - b) / schedule_ms);
      const double stage_idle_median = median(stage_idle);
      idle_medians.push_back(idle_median);
      if (world->rank() == 0) {
        const nlohmann::json line = {{"run", r.label},
                                     {"median_step_ms", median(step_ms)},
                                     {"idle_share_per_rank", idle},
                                     {"median_idle_share", idle_median},
                                     {"predicted_idle_share", r.predicted},
                                     {"idle_over_predicted", idle_median / r.predicted},
                                     {"busy_ms_per_rank", busy},
                                     {"cpu_ms_per_rank", cpu},
                                     {"idle_share_from_stage_times", stage_idle_median},
                                     {"message_share", idle_median - stage_idle_median},
                                     {"search_idle_share", r.search_idle},
                                     {"search_step_ms", r.search_step_ms},
                                     {"timed_steps", r.step_ms.size()}};
        std::printf("%s\n", line.dump().c_str());
      }
      summary[r.label + "_median_step_ms"] = median(step_ms);
    }
    summary["interleaved_over_1f1b_idle"] = idle_medians[1] / idle_medians[0];
    summary["interleaved_over_1f1b_predicted"] = runs[1].predicted / runs[0].predicted;
    if (world->rank() == 0) std::printf("%s\n", summary.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline: %s\n", e.what());
    return 1;
  }
  return 0;
}
