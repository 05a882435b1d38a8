// bench_tp: tensor parallelism against data parallelism on the same ranks and global batch, one
// JSON line per configuration and one summary line (rank 0).
//
//   mpirun -np 2 build/benchmarks/bench_tp --config gpt17m --global-batch 16 --rounds 5
//
// Three configurations over all the ranks (t = the world's size): dp = [ddp] (each rank a
// global-batch / t slice), tp = [tensor_parallel {size t}] and tp_sp = tp + [sequence_parallel
// {kind megatron}] (every rank the whole global batch, a 1/t slice of the model). All three are
// built first, then timed in turns (dp, tp, tp_sp, dp, tp, tp_sp, ...), each turn one untimed step
// (the previous turn's model left the caches cold, which training never has) and --steps timed
// ones, so that the load of a shared machine weighs on each alike. Every step starts from a
// barrier; the job's step time is, step by step, its slowest rank's.
//
// Communication is read from outside the strategies, from the flight recorder of the group the
// configuration communicates over (tp's group for tp and tp_sp, the dp group for dp): the
// collectives whose sequence numbers the step issued, their [start_ms, end_ms] clipped to the
// step. comm_share = the sum of their durations ÷ the step, comm_busy_share = the union of the
// intervals ÷ the step (the two differ when collectives overlap one another, as ddp's buckets
// may), and exposed_share = the time blocked in Work::wait (acc::dist::wait_seconds) ÷ the step.
// compute_ms = step − the union: what the step costs besides its collectives, comparable across
// the configurations (dp's collectives overlap its backward, tp's sit between its GEMMs).
//
// Then, for a GPT config, the step's linears alone (--linear-reps turns of dp's shapes, tp's
// shapes): every block's four linears and the head, forward and backward, on rows = this rank's
// tokens at their whole widths (dp) or on all the tokens at 1/t of the widths (tp). The same
// FLOPs; linears_tp_over_dp says what the layout itself costs the GEMMs, and median_compute_ms
// minus these times is what the rest of the step (attention, norms, elementwise, loss,
// optimizer) costs each configuration.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>

#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "bench_util.hpp"

namespace {

using acc::bench::median;

nlohmann::json config_for(const std::string& name) {
  return acc::bench::named_config(name, ACC_SOURCE_DIR "/examples/configs/");
}

// What one rank saw in one timed step.
struct StepSample {
  double step_ms = 0, wait_ms = 0, comm_sum_ms = 0, comm_union_ms = 0;
  // CPU time over the step: the thread that runs it (the compute), and the process (the compute
  // and the communication thread, which polls while the step waits).
  double main_cpu_ms = 0, process_cpu_ms = 0;
  std::map<std::string, double> ms_by_op;  // collective op -> summed duration in the step
  std::map<std::string, int> count_by_op;
};
constexpr int kFields = 6;  // the scalar fields of a StepSample, as allgathered

struct Run {
  std::string label;
  nlohmann::json strategy;
  int64_t batch_per_rank = 0;
  std::unique_ptr<acc::strategies::Trainer> trainer;
  acc::dist::ProcessGroupPtr comm_group;  // the group whose collectives are this run's comm
  acc::Generator gen;
  std::vector<StepSample> samples;
  int64_t peak_bytes = 0;  // tracked tensor bytes of this run at its highest, on this rank
  acc::strategies::MemoryReport report;
};

// The collectives of `group` numbered (seq0, seq1], clipped to [t0, t1] (FlightRecorder::now_ms).
void add_comm(acc::dist::ProcessGroup& group, uint64_t seq0, uint64_t seq1, double t0, double t1,
              StepSample& s) {
  std::vector<std::pair<double, double>> spans;
  for (const auto& r : group.flight_recorder().entries()) {
    if (r.group != group.name() || r.p2p || r.seq <= seq0 || r.seq > seq1) continue;
    ACC_CHECK(r.start_ms >= 0 && r.end_ms >= 0, "bench_tp: collective ", r.op, " seq ", r.seq,
              " of group ", r.group, " unfinished after the step");
    const double a = std::max(r.start_ms, t0), b = std::min(r.end_ms, t1);
    if (b <= a) continue;
    spans.emplace_back(a, b);
    s.comm_sum_ms += b - a;
    s.ms_by_op[r.op] += b - a;
    ++s.count_by_op[r.op];
  }
  std::sort(spans.begin(), spans.end());
  double end = -1;
  for (const auto& [a, b] : spans) {
    if (a >= end) {
      s.comm_union_ms += b - a;
      end = b;
    } else if (b > end) {
      s.comm_union_ms += b - end;
      end = b;
    }
  }
}

double cpu_ms(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

void run_step(Run& run, const acc::models::LanguageModel& model, int64_t seq,
              const acc::dist::ProcessGroupPtr& world, bool timed) {
  using namespace acc;
  data::Batch b{randint(0, model.vocab_size(), {run.batch_per_rank, seq}, run.gen),
                randint(0, model.vocab_size(), {run.batch_per_rank, seq}, run.gen)};
  world->barrier()->wait();  // every step starts together (its wait is not the step's)
  dist::ProcessGroup& g = *run.comm_group;
  const uint64_t seq0 = g.sequence_number();
  const double wait0 = dist::wait_seconds();
  const double main0 = cpu_ms(CLOCK_THREAD_CPUTIME_ID), proc0 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID);
  const double t0 = dist::FlightRecorder::now_ms();
  run.trainer->train_step(b);
  const double t1 = dist::FlightRecorder::now_ms();
  if (!timed) return;
  StepSample s;
  s.step_ms = t1 - t0;
  s.main_cpu_ms = cpu_ms(CLOCK_THREAD_CPUTIME_ID) - main0;
  s.process_cpu_ms = cpu_ms(CLOCK_PROCESS_CPUTIME_ID) - proc0;
  s.wait_ms = (dist::wait_seconds() - wait0) * 1e3;
  const uint64_t seq1 = g.sequence_number();
  ACC_CHECK(seq1 - seq0 < 200, "bench_tp: ", seq1 - seq0,
            " collectives in one step may not fit the flight recorder (ACC_FLIGHT_RECORDER_SIZE)");
  add_comm(g, seq0, seq1, t0, t1, s);
  run.samples.push_back(std::move(s));
}

// One linear of a step: `count` times x (rows, in) -> (rows, out), forward and backward.
struct LinearShape {
  int64_t rows, in, out;
  int count;
  bool bias;
};

// The linears of one GPT step (L blocks' c_attn, attn.c_proj, c_fc, mlp.c_proj and the tied
// head) as a rank runs them: dp on rows = its slice of the tokens, whole widths; tp on all the
// tokens, the column-parallel outputs and row-parallel inputs divided by t, the head over the
// padded vocabulary / t (tensor_parallel.cpp).
std::vector<LinearShape> gpt_linears(const nlohmann::json& c, int64_t rows, int t) {
  const int64_t C = c.at("n_embd").get<int64_t>(), L = c.at("n_layer").get<int64_t>();
  const int64_t V = c.at("vocab_size").get<int64_t>(), Vt = (V + t - 1) / t;
  const int n = static_cast<int>(L);
  return {{rows, C, 3 * C / t, n, true},
          {rows, C / t, C, n, true},
          {rows, C, 4 * C / t, n, true},
          {rows, 4 * C / t, C, n, true},
          {rows, C, Vt, 1, false}};
}

// Milliseconds of forward + backward (input, weight and bias gradients) of `shapes`.
double time_linears(const std::vector<LinearShape>& shapes) {
  using namespace acc;
  double ms = 0;
  for (const auto& s : shapes) {
    auto leaf = [](Shape shape, double std) {
      return (randn(std::move(shape)) * std).detach().set_requires_grad(true);
    };
    Tensor x = leaf({s.rows, s.in}, 1.0), w = leaf({s.out, s.in}, 0.02);
    Tensor b = s.bias ? leaf({s.out}, 0.0) : Tensor();
    const Tensor dy = randn({s.rows, s.out});
    for (int i = 0; i < s.count; ++i) {
      const double t0 = dist::FlightRecorder::now_ms();
      linear(x, w, b).backward(dy);
      ms += dist::FlightRecorder::now_ms() - t0;
      for (Tensor* p : {&x, &w, &b}) {
        if (p->defined()) p->set_grad(Tensor());
      }
    }
  }
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "gpt17m", model_type = "gpt", only = "dp,tp,tp_sp";
  int64_t global_batch = 16, seq = 256, warmup = 2, steps = 2, rounds = 5;
  int threads = 1, linear_reps = 3;
  CLI::App app{"Tensor parallelism (with and without Megatron sequence parallelism) against ddp"};
  app.add_option("--config", config, "gpt17m | gpt90m | llama17m | FILE.json")
      ->capture_default_str();
  app.add_option("--model", model_type, "gpt | llama (with a FILE.json config)");
  app.add_option("--global-batch", global_batch, "sequences per step over all ranks")
      ->capture_default_str();
  app.add_option("--seq-len", seq, "tokens per sequence")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps per configuration before the turns")
      ->capture_default_str();
  app.add_option("--steps", steps, "timed steps per turn (after one untimed step)")
      ->capture_default_str();
  app.add_option("--rounds", rounds, "turns per configuration")->capture_default_str();
  app.add_option("--threads", threads, "threads per rank")->capture_default_str();
  app.add_option("--runs", only, "the configurations to run (a profile of one: --runs tp)")
      ->capture_default_str();
  app.add_option("--linear-reps", linear_reps,
                 "turns of the linears alone at dp's and tp's shapes (a GPT config; 0: none)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  int rc = 0;
  try {
    using namespace acc;
    ACC_CHECK(steps >= 1 && rounds >= 1, "bench_tp: --steps and --rounds must be >= 1, got ", steps,
              " and ", rounds);
    dist::init(argc, argv);
    set_num_threads(threads);
    auto world = dist::ProcessGroup::world();
    const int t = world->size();
    ACC_CHECK(global_batch % t == 0, "bench_tp: --global-batch ", global_batch,
              " does not split over ", t, " ranks");
    if (config == "llama17m") model_type = "llama";
    const nlohmann::json tp = {{"name", "tensor_parallel"}, {"config", {{"size", t}}}};
    const nlohmann::json sp = {{"name", "sequence_parallel"}, {"config", {{"kind", "megatron"}}}};
    std::vector<Run> runs(3);
    runs[0].label = "dp" + std::to_string(t);
    runs[0].strategy = nlohmann::json::array({nlohmann::json{{"name", "ddp"}}});
    runs[0].batch_per_rank = global_batch / t;
    runs[1].label = "tp" + std::to_string(t);
    runs[1].strategy = nlohmann::json::array({tp});
    runs[1].batch_per_rank = global_batch;
    runs[2].label = "tp" + std::to_string(t) + "_sp";
    runs[2].strategy = nlohmann::json::array({tp, sp});
    runs[2].batch_per_rank = global_batch;
    for (const char* kind : {"dp", "tp_sp", "tp"}) {  // tp_sp before tp: "tp" is inside it
      const size_t at = ("," + only + ",").find("," + std::string(kind) + ",");
      if (at == std::string::npos) {
        const size_t i = kind == std::string("dp") ? 0 : kind == std::string("tp") ? 1 : 2;
        runs[i].label.clear();
      }
    }
    std::erase_if(runs, [](const Run& r) { return r.label.empty(); });
    ACC_CHECK(!runs.empty(), "bench_tp: --runs names none of dp, tp, tp_sp: '", only, "'");
    std::vector<models::LanguageModelPtr> models_of_runs;
    // Built one after the other; a run's peak is its own because the runs built before it hold
    // constant state meanwhile (their parameters, gradients and optimizer state).
    for (Run& run : runs) {
      const int64_t base = memory::current_bytes();
      memory::reset_peak();
      manual_seed(1);
      auto model = models::create_model(model_type, config_for(config));
      run.trainer = strategies::apply(
          model, optim::AdamW::factory({.lr = 1e-4, .betas = {0.9, 0.95}, .weight_decay = 0.1}),
          strategies::parse_strategy(run.strategy), {.group = world, .grad_clip = 1.0});
      const auto& ctx = run.trainer->context();
      run.comm_group =
          ctx->size(dist::MeshDim::kTp) > 1 ? ctx->group(dist::MeshDim::kTp) : ctx->dp_cp_group();
      run.gen = Generator(7).for_rank(ctx->data_rank());
      for (int64_t s = 0; s < warmup; ++s) run_step(run, *model, seq, world, false);
      run.peak_bytes = memory::peak_bytes() - base;
      run.report = run.trainer->memory_report();
      models_of_runs.push_back(model);
    }
    for (int64_t r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < runs.size(); ++i) {
        run_step(runs[i], *models_of_runs[i], seq, world, false);
        for (int64_t s = 0; s < steps; ++s) run_step(runs[i], *models_of_runs[i], seq, world, true);
      }
    }
    nlohmann::json summary = {{"summary", true}, {"config", config}, {"world", t}};
    double dp_tokens_per_s = 0;
    for (Run& run : runs) {
      // Every rank's scalar fields per step, to find each step's slowest rank.
      const int64_t n = static_cast<int64_t>(run.samples.size());
      std::vector<float> mine;
      for (const auto& s : run.samples) {
        for (double v : {s.step_ms, s.wait_ms, s.comm_sum_ms, s.comm_union_ms, s.main_cpu_ms,
                         s.process_cpu_ms})
          mine.push_back(static_cast<float>(v));
      }
      Tensor all = empty({world->size() * n * kFields});
      world->allgather(all, from_vector(mine, {n * kFields}))->wait();
      const std::vector<float> v = all.to_vector<float>();
      Tensor peaks = empty({world->size()});
      world
          ->allgather(peaks,
                      from_vector(std::vector<float>{static_cast<float>(run.peak_bytes)}, {1}))
          ->wait();
      std::vector<double> step_ms, wait_ms, sum_share, union_share, exposed, compute_ms;
      // Per rank, over its steps: the median CPU milliseconds of its compute thread and process.
      std::vector<std::vector<double>> main_cpu(static_cast<size_t>(world->size())),
          process_cpu(static_cast<size_t>(world->size()));
      for (int64_t i = 0; i < n; ++i) {
        auto at = [&](int rk, int k) { return v[static_cast<size_t>((rk * n + i) * kFields + k)]; };
        int slowest = 0;
        for (int rk = 1; rk < world->size(); ++rk) {
          if (at(rk, 0) > at(slowest, 0)) slowest = rk;
        }
        const double st = at(slowest, 0);
        step_ms.push_back(st);
        wait_ms.push_back(at(slowest, 1));
        sum_share.push_back(at(slowest, 2) / st);
        union_share.push_back(at(slowest, 3) / st);
        exposed.push_back(at(slowest, 1) / st);
        compute_ms.push_back(st - at(slowest, 3));
        for (int rk = 0; rk < world->size(); ++rk) {
          main_cpu[static_cast<size_t>(rk)].push_back(at(rk, 4));
          process_cpu[static_cast<size_t>(rk)].push_back(at(rk, 5));
        }
      }
      if (world->rank() != 0) continue;
      // Rank 0's collectives by op: median over steps of the time and count per step.
      nlohmann::json by_op = nlohmann::json::object();
      std::map<std::string, std::vector<double>> op_ms;
      for (const auto& s : run.samples) {
        for (const auto& [op, ms] : s.ms_by_op) op_ms[op].push_back(ms);
      }
      for (const auto& [op, list] : op_ms) {
        by_op[op] = {{"median_ms", median(list)},
                     {"count", run.samples.front().count_by_op.count(op)
                                   ? run.samples.front().count_by_op.at(op)
                                   : 0}};
      }
      const double med = median(step_ms);
      const double tokens_per_s = static_cast<double>(global_batch * seq) / (med / 1e3);
      std::vector<double> round_medians;
      for (int64_t r = 0; r < rounds; ++r) {
        round_medians.push_back(median(
            std::vector<double>(step_ms.begin() + r * steps, step_ms.begin() + (r + 1) * steps)));
      }
      nlohmann::json main_cpu_per_rank = nlohmann::json::array(),
                     process_cpu_per_rank = nlohmann::json::array();
      double cpu_all_ranks = 0;
      for (int rk = 0; rk < world->size(); ++rk) {
        main_cpu_per_rank.push_back(median(main_cpu[static_cast<size_t>(rk)]));
        process_cpu_per_rank.push_back(median(process_cpu[static_cast<size_t>(rk)]));
        cpu_all_ranks += median(process_cpu[static_cast<size_t>(rk)]);
      }
      nlohmann::json peak_per_rank = nlohmann::json::array();
      for (float p : peaks.to_vector<float>()) peak_per_rank.push_back(static_cast<int64_t>(p));
      nlohmann::json out = {{"run", run.label},
                            {"strategy", run.strategy},
                            {"config", config},
                            {"world", t},
                            {"threads_per_rank", threads},
                            {"global_batch", global_batch},
                            {"batch_per_rank", run.batch_per_rank},
                            {"seq_len", seq},
                            {"timed_steps", n},
                            {"median_step_ms", med},
                            {"round_median_step_ms", round_medians},
                            {"tokens_per_s", tokens_per_s},
                            {"comm_group", run.comm_group->name()},
                            {"comm_share", median(sum_share)},
                            {"comm_busy_share", median(union_share)},
                            {"exposed_share", median(exposed)},
                            {"median_wait_ms", median(wait_ms)},
                            {"median_compute_ms", median(compute_ms)},
                            {"comm_by_op", by_op},
                            {"main_cpu_ms_per_rank", main_cpu_per_rank},
                            {"process_cpu_ms_per_rank", process_cpu_per_rank},
                            // The CPU the job's processes took over the step, in cores: against
                            // the machine's cores, how much of it the step left idle.
                            {"cores_busy", cpu_all_ranks / med},
                            {"peak_tracked_bytes_per_rank", peak_per_rank},
                            {"parameter_bytes", run.report.parameters},
                            {"gradient_bytes", run.report.gradients},
                            {"optimizer_state_bytes", run.report.optimizer_state}};
      std::printf("%s\n", out.dump().c_str());
      std::fflush(stdout);
      if (&run == &runs.front()) {
        dp_tokens_per_s = tokens_per_s;
      } else {
        summary[run.label + "_over_" + runs.front().label + "_tokens_per_s"] =
            tokens_per_s / dp_tokens_per_s;
      }
    }
    if (linear_reps > 0 && model_type == "gpt") {
      // The step's GEMMs alone, the same work at both layouts: whether half the width on all the
      // tokens costs what the whole width on a slice does. Turns of dp, tp; every rank at once
      // (the cores are shared as in training); per turn the slowest rank's time.
      runs.clear();  // their memory and threads out of the way
      models_of_runs.clear();
      const nlohmann::json c = config_for(config);
      const auto dp_shapes = gpt_linears(c, global_batch / t * seq, 1);
      const auto tp_shapes = gpt_linears(c, global_batch * seq, t);
      std::vector<double> dp_ms, tp_ms;
      for (int r = 0; r < linear_reps; ++r) {
        for (auto* out : {&dp_ms, &tp_ms}) {
          world->barrier()->wait();
          const double ms = time_linears(out == &dp_ms ? dp_shapes : tp_shapes);
          Tensor all = empty({world->size()});
          world->allgather(all, from_vector(std::vector<float>{static_cast<float>(ms)}, {1}))
              ->wait();
          const auto v = all.to_vector<float>();
          out->push_back(*std::max_element(v.begin(), v.end()));
        }
      }
      summary["linears_dp_median_ms"] = median(dp_ms);
      summary["linears_tp_median_ms"] = median(tp_ms);
      summary["linears_tp_over_dp"] = median(tp_ms) / median(dp_ms);
      summary["linears_dp_ms"] = dp_ms;
      summary["linears_tp_ms"] = tp_ms;
    }
    if (world->rank() == 0) {
      std::printf("%s\n", summary.dump().c_str());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tp: error: %s\n", e.what());
    rc = 1;
  }
  acc::dist::finalize();
  return rc;
}
