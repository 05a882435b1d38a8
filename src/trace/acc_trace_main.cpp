// acc-trace: traces a GPT or Llama config on the meta device (no memory, no data) and prints what
// the strategy search will see: parameters, FLOPs per step, estimated peak memory by component,
// the repeated blocks and the tensor-parallel patterns, and a per-scope table.
//
//   acc-trace --model gpt --config gpt3_175b.json --batch-size 1 --seq-len 2048 --json t.json
//
// Before the model is built, the step is estimated from traces of 1 to 6 blocks
// (acc/trace/estimate.hpp; milliseconds at any depth, the same figures as the full trace). When
// the full trace would hold more than --max-vertices graph vertices (default 500000, about 7000
// GPT blocks: 30 s and 1 GiB, since the time grows faster than the graph) or need more than half
// of the available host memory (kTraceHostBytesPerVertex each), the model is not built: the
// summary is printed from the estimate, then a line
//   graph        not traced: gpt n_layer 1000000000 would make a graph of 71.000B vertices
//                needing ~132.25 TiB of host memory, more than --max-vertices 500000 and ...
// naming the depth and the figures, and acc-trace exits 0 without the patterns and the per-scope
// table. --json and --dot need the full graph: with them it exits 1 with that message instead,
// before printing anything. Every other error (a bad flag, a size that does not fit in 64 bits,
// naming the shape or the depth) exits 1 with "acc-trace: error: ..." on stderr.

#include <sys/resource.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "acc/models/models.hpp"
#include "acc/trace/dump.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/cli.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/system.hpp"
#include "acc/util/timer.hpp"

namespace {

using acc::trace::human_bytes;

std::string human_count(double n) {
  static const std::pair<double, const char*> units[] = {
      {1e18, "E"}, {1e15, "P"}, {1e12, "T"}, {1e9, "B"}, {1e6, "M"}};
  char buf[48];
  for (const auto& [scale, suffix] : units) {
    if (n >= scale) {
      std::snprintf(buf, sizeof(buf), "%.3f%s", n / scale, suffix);
      return buf;
    }
  }
  std::snprintf(buf, sizeof(buf), "%.0f", n);
  return buf;
}

std::string human_count(int64_t n) {
  return human_count(static_cast<double>(n));
}

int depth_of(const std::string& scope) {
  if (scope.empty()) return 0;
  return 1 + static_cast<int>(std::count(scope.begin(), scope.end(), '.'));
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_type = "gpt", config_path, json_out, dot_out, recompute = "none",
              optimizer = "adamw";
  int64_t batch = 1, seq = 0, recompute_blocks = -1, max_vertices = 500'000;
  int depth = 3;
  bool bf16_activations = false;
  CLI::App app{"Trace a model on the meta device and print its FLOPs, memory and structure"};
  app.add_option("--model", model_type, "gpt | llama")->capture_default_str();
  app.add_option("--config", config_path, "model config JSON")->required();
  // Numbers are taken whole and in range (acc::cli): no clamping past int64, no "3abc".
  using acc::cli::integer;
  app.add_option("--batch-size", batch, "micro-batch size B")
      ->check(integer(1))
      ->capture_default_str();
  app.add_option("--seq-len", seq, "sequence length T (omitted: the model's maximum)")
      ->check(integer(1));
  app.add_option("--json", json_out, "write the whole trace as JSON");
  app.add_option("--dot", dot_out, "write the graph as Graphviz DOT");
  app.add_option("--recompute", recompute, "none | block | selective")->capture_default_str();
  app.add_option("--recompute-blocks", recompute_blocks,
                 "with --recompute block or selective: how many blocks from the first (-1: all), "
                 "as the checkpoint strategy's {\"blocks\": N}")
      ->check(integer(-1))
      ->capture_default_str();
  app.add_flag("--bf16-activations", bf16_activations,
               "keep the activations saved inside blocks in bf16, as the amp strategy does");
  app.add_option("--optimizer", optimizer, "adamw | adam | sgd_momentum | sgd (state estimate)")
      ->capture_default_str();
  app.add_option("--depth", depth, "deepest scope level in the table (0: the model only)")
      ->check(integer(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-vertices", max_vertices,
                 "largest graph traced in full (500000: about 7000 GPT blocks, 30 s and 1 GiB); "
                 "a deeper model gets the summary from its estimate only")
      ->check(integer(1))
      ->capture_default_str();
  if (const auto code = acc::cli::parse(app, argc, argv)) return *code;  // bad: 2
  try {
    using namespace acc;
    Timer timer;
    trace::TraceOptions opts;
    opts.recompute = trace::parse_recompute(recompute);
    opts.recompute_blocks = recompute_blocks;
    opts.bf16_activations = bf16_activations;
    (void)trace::optimizer_state_factor(optimizer);  // validate before the work
    if (!json_out.empty()) check_output_path(json_out, "--json");
    if (!dot_out.empty()) check_output_path(dot_out, "--dot");
    const nlohmann::json config = models::read_json_file(config_path);
    const trace::TrainingNeed need =
        trace::estimate_training_need(model_type, config, batch, seq, opts, optimizer);
    seq = need.seq_len;

    // Whether the full graph fits: a vertex cap (time) and half the available memory (space).
    const int64_t available = available_memory_bytes();
    const bool too_many = need.graph_vertices > max_vertices;
    const bool too_large = need.trace_host_bytes > available / 2;
    std::string skipped;
    if (too_many || too_large) {
      skipped = detail::str_cat(
          model_type, " ", need.layers_key, " ", need.num_layers, " would make a graph of ",
          human_count(need.graph_vertices), " vertices needing ~",
          human_bytes(static_cast<double>(need.trace_host_bytes)), " of host memory, more than ",
          too_many ? "--max-vertices " + std::to_string(max_vertices) : "",
          too_many && too_large ? " and " : "",
          too_large ? "half the " + human_bytes(static_cast<double>(available)) + " available"
                    : "");
      ACC_CHECK(json_out.empty() && dot_out.empty(), json_out.empty() ? "--dot" : "--json",
                " needs the full graph, but ", skipped);
    }

    // The summary: from the full trace, or from the estimate when it is not traced.
    std::unique_ptr<trace::Trace> t;
    models::LanguageModelPtr model;
    int64_t parameters = need.parameters;
    trace::ComputeEstimate compute = need.compute;
    trace::MemoryEstimate mem = need.memory;
    double seconds = 0;
    if (skipped.empty()) {
      DefaultDeviceGuard meta(Device::kMeta);
      model = models::create_model(model_type, config);
      Tensor idx = empty({batch, seq}, {DType::kInt64, Device::kMeta});
      t = std::make_unique<trace::Trace>(trace::trace(*model, {idx, idx}, opts));
      seconds = timer.elapsed_s();
      parameters = t->num_parameters;
      compute = trace::estimate_compute(*t);
      mem = trace::estimate_memory(*t, optimizer);
    }
    std::printf("model        %s (%s), batch %lld x seq %lld, recompute %s%s%s\n",
                model_type.c_str(), config_path.c_str(), static_cast<long long>(batch),
                static_cast<long long>(seq), recompute.c_str(),
                recompute_blocks >= 0 && recompute != "none"
                    ? (" (" + std::to_string(recompute_blocks) + " blocks)").c_str()
                    : "",
                bf16_activations ? ", bf16 activations" : "");
    std::printf("parameters   %s (%lld)\n", human_count(parameters).c_str(),
                static_cast<long long>(parameters));
    std::printf("FLOPs/step   %s (forward %s, backward %s); 6*N*tokens = %s\n",
                human_count(compute.total()).c_str(), human_count(compute.forward_flops).c_str(),
                human_count(compute.backward_flops).c_str(),
                human_count(6.0 * static_cast<double>(parameters) * static_cast<double>(batch) *
                            static_cast<double>(seq))
                    .c_str());
    std::printf(
        "memory       peak %s = parameters %s + gradients %s + %s state %s + "
        "activations peak %s\n",
        human_bytes(mem.peak).c_str(), human_bytes(mem.parameters).c_str(),
        human_bytes(mem.gradients).c_str(), optimizer.c_str(),
        human_bytes(mem.optimizer_state).c_str(), human_bytes(mem.activations_peak).c_str());
    if (!skipped.empty()) {
      if (!need.block_type.empty()) {
        std::printf("blocks       %lld x %s in '%s' (%s parameters each)\n",
                    static_cast<long long>(need.num_layers), need.block_type.c_str(),
                    need.block_container.c_str(), human_count(need.parameters_per_block).c_str());
      }
      std::printf(
          "graph        not traced: %s; the figures above are the estimate from traces of a few "
          "blocks (equal to the full trace's), the patterns and the per-scope table need the "
          "full trace (estimated in %.3f s)\n",
          skipped.c_str(), timer.elapsed_s());
      return 0;
    }

    const auto blocks = trace::find_blocks(*model);
    const auto mlp = trace::find_mlp_patterns(*t);
    const auto attn = trace::find_attention_patterns(*t);
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    for (const auto& g : blocks) {
      std::printf("blocks       %zu x %s in '%s' (%s parameters each)\n", g.blocks.size(),
                  g.type_name.c_str(), g.container.c_str(),
                  human_count(g.parameters_per_block).c_str());
    }
    std::printf("patterns     %zu mlp (linear->act->linear), %zu attention (qkv->attn->proj)\n",
                mlp.size(), attn.size());
    std::printf("graph        %zu vertices, %zu ops (%lld forward), traced in %.2f s, max RSS %s\n",
                t->graph.num_vertices(), t->graph.ops().size(),
                static_cast<long long>(t->graph.backward_begin()), seconds,
                human_bytes(static_cast<double>(ru.ru_maxrss) * 1024).c_str());
    std::printf("\n%-40s %12s %12s %12s %10s\n", "scope", "params", "fwd FLOPs", "bwd FLOPs",
                "ops");
    for (const auto& [scope, st] : trace::scope_stats(*t)) {
      if (depth_of(scope) > depth) continue;
      std::printf("%-40s %12s %12s %12s %10lld\n", scope.empty() ? "<model>" : scope.c_str(),
                  human_count(st.parameters).c_str(), human_count(st.forward_flops).c_str(),
                  human_count(st.backward_flops).c_str(), static_cast<long long>(st.ops));
    }
    if (!json_out.empty()) write_text_file(json_out, trace::to_json(*t).dump(1) + "\n", "--json");
    if (!dot_out.empty()) write_text_file(dot_out, trace::to_dot(*t), "--dot");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "acc-trace: error: %s\n", e.what());
    return 1;
  }
}
