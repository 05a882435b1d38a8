// acc-trace: traces a GPT or Llama config on the meta device (no memory, no data) and prints what
// the strategy search will see: parameters, FLOPs per step, estimated peak memory by component,
// the repeated blocks and the tensor-parallel patterns, and a per-scope table.
//
//   acc-trace --model gpt --config gpt3_175b.json --batch-size 1 --seq-len 2048 --json t.json

#include <sys/resource.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "acc/models/models.hpp"
#include "acc/trace/dump.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/timer.hpp"

namespace {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", b, units[u]);
  return buf;
}

std::string human_count(double n) {
  char buf[32];
  if (n >= 1e12) {
    std::snprintf(buf, sizeof(buf), "%.3fT", n / 1e12);
  } else if (n >= 1e9) {
    std::snprintf(buf, sizeof(buf), "%.3fB", n / 1e9);
  } else if (n >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.3fM", n / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f", n);
  }
  return buf;
}

int depth_of(const std::string& scope) {
  if (scope.empty()) return 0;
  return 1 + static_cast<int>(std::count(scope.begin(), scope.end(), '.'));
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_type = "gpt", config_path, json_out, dot_out, recompute = "none",
              optimizer = "adamw";
  int64_t batch = 1, seq = 0, recompute_blocks = -1;
  int depth = 3;
  bool bf16_activations = false;
  CLI::App app{"Trace a model on the meta device and print its FLOPs, memory and structure"};
  app.add_option("--model", model_type, "gpt | llama")->capture_default_str();
  app.add_option("--config", config_path, "model config JSON")->required();
  app.add_option("--batch-size", batch, "micro-batch size B")->capture_default_str();
  app.add_option("--seq-len", seq, "sequence length T (default: the model's maximum)");
  app.add_option("--json", json_out, "write the whole trace as JSON");
  app.add_option("--dot", dot_out, "write the graph as Graphviz DOT");
  app.add_option("--recompute", recompute, "none | block")->capture_default_str();
  app.add_option("--recompute-blocks", recompute_blocks,
                 "with --recompute block: how many blocks from the first (-1: all), as the "
                 "checkpoint strategy's {\"blocks\": N}")
      ->capture_default_str();
  app.add_flag("--bf16-activations", bf16_activations,
               "keep the activations saved inside blocks in bf16, as the amp strategy does");
  app.add_option("--optimizer", optimizer, "adamw | adam | sgd_momentum | sgd (state estimate)")
      ->capture_default_str();
  app.add_option("--depth", depth, "deepest scope level in the table")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    using namespace acc;
    ACC_CHECK(batch > 0, "--batch-size must be > 0, got ", batch);
    ACC_CHECK(seq >= 0, "--seq-len must be > 0, got ", seq);
    Timer timer;
    trace::TraceOptions opts;
    opts.recompute = trace::parse_recompute(recompute);
    ACC_CHECK(recompute_blocks >= -1, "--recompute-blocks must be >= 0 or -1 (all), got ",
              recompute_blocks);
    opts.recompute_blocks = recompute_blocks;
    opts.bf16_activations = bf16_activations;
    (void)trace::optimizer_state_factor(optimizer);  // validate before the work
    if (!json_out.empty()) check_output_path(json_out, "--json");
    if (!dot_out.empty()) check_output_path(dot_out, "--dot");
    DefaultDeviceGuard meta(Device::kMeta);
    auto model = models::create_model(model_type, models::read_json_file(config_path));
    if (seq == 0) seq = model->max_seq_len();
    Tensor idx = empty({batch, seq}, {DType::kInt64, Device::kMeta});
    trace::Trace t = trace::trace(*model, {idx, idx}, opts);
    const double seconds = timer.elapsed_s();

    const auto compute = trace::estimate_compute(t);
    const auto mem = trace::estimate_memory(t, optimizer);
    const auto blocks = trace::find_blocks(*model);
    const auto mlp = trace::find_mlp_patterns(t);
    const auto attn = trace::find_attention_patterns(t);
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);

    std::printf("model        %s (%s), batch %lld x seq %lld, recompute %s%s%s\n",
                model_type.c_str(), config_path.c_str(), static_cast<long long>(batch),
                static_cast<long long>(seq), recompute.c_str(),
                recompute_blocks >= 0 && recompute != "none"
                    ? (" (" + std::to_string(recompute_blocks) + " blocks)").c_str()
                    : "",
                bf16_activations ? ", bf16 activations" : "");
    std::printf("parameters   %s (%lld)\n", human_count(t.num_parameters).c_str(),
                static_cast<long long>(t.num_parameters));
    std::printf("FLOPs/step   %s (forward %s, backward %s); 6*N*tokens = %s\n",
                human_count(compute.total()).c_str(), human_count(compute.forward_flops).c_str(),
                human_count(compute.backward_flops).c_str(),
                human_count(6.0 * t.num_parameters * batch * seq).c_str());
    std::printf(
        "memory       peak %s = parameters %s + gradients %s + %s state %s + "
        "activations peak %s\n",
        human_bytes(mem.peak).c_str(), human_bytes(mem.parameters).c_str(),
        human_bytes(mem.gradients).c_str(), optimizer.c_str(),
        human_bytes(mem.optimizer_state).c_str(), human_bytes(mem.activations_peak).c_str());
    for (const auto& g : blocks) {
      std::printf("blocks       %zu x %s in '%s' (%s parameters each)\n", g.blocks.size(),
                  g.type_name.c_str(), g.container.c_str(),
                  human_count(g.parameters_per_block).c_str());
    }
    std::printf("patterns     %zu mlp (linear->act->linear), %zu attention (qkv->attn->proj)\n",
                mlp.size(), attn.size());
    std::printf("graph        %zu vertices, %zu ops (%lld forward), traced in %.2f s, max RSS %s\n",
                t.graph.num_vertices(), t.graph.ops().size(),
                static_cast<long long>(t.graph.backward_begin()), seconds,
                human_bytes(static_cast<double>(ru.ru_maxrss) * 1024).c_str());
    std::printf("\n%-40s %12s %12s %12s %10s\n", "scope", "params", "fwd FLOPs", "bwd FLOPs",
                "ops");
    for (const auto& [scope, st] : trace::scope_stats(t)) {
      if (depth_of(scope) > depth) continue;
      std::printf("%-40s %12s %12s %12s %10lld\n", scope.empty() ? "<model>" : scope.c_str(),
                  human_count(st.parameters).c_str(), human_count(st.forward_flops).c_str(),
                  human_count(st.backward_flops).c_str(), static_cast<long long>(st.ops));
    }
    if (!json_out.empty()) write_text_file(json_out, trace::to_json(t).dump(1) + "\n", "--json");
    if (!dot_out.empty()) write_text_file(dot_out, trace::to_dot(t), "--dot");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "acc-trace: error: %s\n", e.what());
    return 1;
  }
}
