// bench_train: end-to-end training throughput of GPT and Llama configs, one JSON object per config
// on stdout. This is where AutoAcc's speed targets live (see benchmarks/README.md); unit tests
// never time anything.
//
//   build-bench/benchmarks/bench_train --config gpt17m --config llama17m --threads 1
//
// Each step does exactly what benchmarks/reference/torch_train.py does in PyTorch: zero_grad,
// loss = model->loss(idx, targets), backward, clip_grad_norm_(1.0), AdamW step (lr 1e-3, betas
// 0.9/0.95, eps 1e-8, weight decay 0.1); the clipping is fused into the AdamW update
// (step_scaled(clip_coefficient(1.0, norm)), the same update as clip_grad_norm_ + step). Batches
// come from sequential windows (data::SampleOrder::kSequential), so PyTorch sees the same tokens.
// Batch assembly is outside the timed region in both programs.
//
// FLOPs: model_flops_per_step is counted by acc::autograd::FlopCounter over the first step
// (forward + backward matrix products, causal attention counted as its half; the optimizer and
// elementwise ops are not counted); achieved_gflops = model_flops_per_step / median step time.
//
// MFU: achieved_gflops over the sgemm peak of this process: before the model is built, the best
// of kSgemmReps timed --sgemm-n^3 cblas_sgemm calls (after one untimed call) at the same thread
// count; the JSON states the size ("sgemm"). A peak taken at one moment and steps taken at others
// also measure how the machine's speed drifts in between (shared cores), so compare_torch.sh
// takes medians over rounds.

#include <cblas.h>
#include <sys/resource.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "acc/acc.hpp"
#include "acc/data/token_data.hpp"
#include "bench_util.hpp"

namespace {

using acc::bench::median;
using nlohmann::json;

struct Args {
  std::vector<std::string> configs;
  int threads = 1;
  int64_t warmup = 3;
  int64_t steps = 10;
  int64_t batch_size = 0;  // 0: the config's own
  int64_t seq_len = 0;     // 0: the config's own
  std::string init_from;
  std::string write_init;
  std::string data;
  std::string data_format = "u16";
  std::string write_data;
  int64_t data_tokens = 1 << 20;
  uint64_t seed = 1337;
  bool reference_attention = false;
  bool write_only = false;
  std::string json_out;
  int64_t sgemm_n = 2048;
  double lr = 1e-3;
};

// A model to benchmark: type, model config and the batch it is trained with.
struct BenchConfig {
  std::string name;
  std::string model;  // "gpt" or "llama"
  json config;
  int64_t batch = 8;
  int64_t seq_len = 256;
};

// The built-in configs of the issue; the same numbers as examples/configs/{gpt_17m, gpt_90m,
// llama_d512}.json, inlined so the binary runs from any directory.
std::optional<BenchConfig> builtin_config(const std::string& name) {
  if (name == "gpt17m") {
    return BenchConfig{name, "gpt",
                       json{{"n_layer", 4},
                            {"n_head", 8},
                            {"n_embd", 512},
                            {"vocab_size", 8192},
                            {"block_size", 256},
                            {"bias", true},
                            {"activation", "gelu_tanh"}},
                       8, 256};
  }
  if (name == "gpt90m") {
    return BenchConfig{name, "gpt",
                       json{{"n_layer", 12},
                            {"n_head", 12},
                            {"n_embd", 768},
                            {"vocab_size", 8192},
                            {"block_size", 256},
                            {"bias", true},
                            {"activation", "gelu_tanh"}},
                       4, 256};
  }
  if (name == "llama17m") {
    return BenchConfig{name, "llama",
                       json{{"hidden_size", 512},
                            {"intermediate_size", 1376},
                            {"num_hidden_layers", 4},
                            {"num_attention_heads", 8},
                            {"num_key_value_heads", 4},
                            {"vocab_size", 8192},
                            {"rms_norm_eps", 1e-5},
                            {"rope_theta", 10000.0},
                            {"max_position_embeddings", 256}},
                       8, 256};
  }
  return std::nullopt;
}

// --config NAME or FILE. A file is either a bare model config (the type is inferred: "n_embd"
// means gpt, "hidden_size" llama; batch 8, seq_len 256 or the model's maximum) or a wrapper
// {"model": "gpt", "batch_size": 8, "seq_len": 256, "config": {...}}.
BenchConfig resolve_config(const std::string& spec) {
  if (auto c = builtin_config(spec)) return *c;
  ACC_CHECK(std::filesystem::exists(spec), "--config '", spec,
            "' is neither a built-in name (gpt17m, gpt90m, llama17m) nor an existing file");
  json j = acc::models::read_json_file(spec);
  ACC_CHECK(j.is_object(), "--config '", spec, "' must hold a JSON object");
  BenchConfig c;
  c.name = std::filesystem::path(spec).stem().string();
  if (j.contains("config")) {
    ACC_CHECK(j.contains("model") && j["model"].is_string(), "--config '", spec,
              "': a wrapper with \"config\" needs \"model\": \"gpt\" or \"llama\"");
    c.model = j["model"].get<std::string>();
    c.config = j["config"];
    c.batch = j.value("batch_size", int64_t{8});
    c.seq_len = j.value("seq_len", int64_t{256});
    if (j.contains("name")) c.name = j["name"].get<std::string>();
    return c;
  }
  if (j.contains("n_embd")) {
    c.model = "gpt";
    c.seq_len = std::min<int64_t>(256, j.value("block_size", int64_t{1024}));
  } else if (j.contains("hidden_size")) {
    c.model = "llama";
    c.seq_len = std::min<int64_t>(256, j.value("max_position_embeddings", int64_t{2048}));
  } else {
    ACC_CHECK(false, "--config '", spec,
              "': cannot tell the model type (no n_embd for gpt, no hidden_size for llama)");
  }
  c.config = j;
  return c;
}

// Replaces "{config}" in a path by the config name; several configs need the placeholder.
std::string path_for(const std::string& pattern, const std::string& name, size_t num_configs,
                     const char* flag) {
  const std::string key = "{config}";
  const size_t pos = pattern.find(key);
  if (pos == std::string::npos) {
    ACC_CHECK(num_configs == 1, flag, " '", pattern, "' is used for ", num_configs,
              " configs; put {config} in the path");
    return pattern;
  }
  std::string out = pattern;
  out.replace(pos, key.size(), name);
  return out;
}

// Deterministic synthetic tokens, uniform in [0, V): four Philox words per counter.
std::vector<uint32_t> synthetic_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<uint32_t> t(static_cast<size_t>(n));
  uint32_t w[4];
  for (int64_t i = 0; i < n; ++i) {
    if (i % 4 == 0) acc::Generator::philox(seed, static_cast<uint64_t>(i / 4), w);
    t[static_cast<size_t>(i)] = w[i % 4] % static_cast<uint32_t>(vocab);
  }
  return t;
}

void write_tokens(const std::string& path, const std::vector<uint32_t>& tokens,
                  acc::data::TokenFormat format) {
  ACC_CHECK(format != acc::data::TokenFormat::kText,
            "--write-data writes u16 or u32 tokens, not text");
  std::ofstream f(path, std::ios::binary);
  ACC_CHECK_AS(acc::IoError, f.good(), "cannot write --write-data file '", path, "'");
  for (uint32_t t : tokens) {
    if (format == acc::data::TokenFormat::kU16) {
      ACC_CHECK(t <= 0xFFFF, "token ", t, " does not fit u16; use --data-format u32");
      const uint8_t b[2] = {static_cast<uint8_t>(t), static_cast<uint8_t>(t >> 8)};
      f.write(reinterpret_cast<const char*>(b), 2);
    } else {
      const uint8_t b[4] = {static_cast<uint8_t>(t), static_cast<uint8_t>(t >> 8),
                            static_cast<uint8_t>(t >> 16), static_cast<uint8_t>(t >> 24)};
      f.write(reinterpret_cast<const char*>(b), 4);
    }
  }
  f.close();
  ACC_CHECK_AS(acc::IoError, f.good(), "failed writing --write-data file '", path, "'");
}

int64_t max_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

constexpr int kSgemmReps = 5;

// GFLOP/s of the best of kSgemmReps timed n^3 cblas_sgemm calls (after one untimed call), with
// OpenBLAS's own threading at `threads` threads whatever the engine's GEMM threading mode
// (ACC_GEMM_THREADING may keep OpenBLAS single-threaded and split GEMMs itself); OpenBLAS's
// setting is restored on return. Its buffers are freed on return, before the model exists, so
// they stay below the training run's peak resident set.
double sgemm_peak_gflops(int64_t n, int threads) {
  std::vector<float> a(static_cast<size_t>(n * n)), b(a.size()), c(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i % 7) * 0.01f;
    b[i] = static_cast<float>(i % 5) * 0.01f;
  }
  const int saved = openblas_get_num_threads();
  openblas_set_num_threads(threads);
  const int ni = static_cast<int>(n);
  double best_s = 1e30;
  for (int r = 0; r <= kSgemmReps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a.data(), ni, b.data(),
                ni, 0.0f, c.data(), ni);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best_s = std::min(best_s, s);  // call 0 warms up
  }
  openblas_set_num_threads(saved);
  return 2.0 * static_cast<double>(n) * n * n / best_s / 1e9;
}

json run_config(const Args& a, const BenchConfig& bc, size_t num_configs) {
  using namespace acc;
  const int64_t B = a.batch_size > 0 ? a.batch_size : bc.batch;
  const int64_t T = a.seq_len > 0 ? a.seq_len : bc.seq_len;

  const double sgemm_gflops = a.write_only ? 0.0 : sgemm_peak_gflops(a.sgemm_n, a.threads);

  // Model (seeded init, or the weights of --init-from).
  memory::reset_peak();
  manual_seed(a.seed);
  models::LanguageModelPtr model = models::create_model(bc.model, bc.config);
  model->set_fused_attention(!a.reference_attention);
  ACC_CHECK(T <= model->max_seq_len(), "seq_len ", T, " exceeds the maximum ", model->max_seq_len(),
            " of config ", bc.name);
  if (!a.init_from.empty()) {
    const std::string path = path_for(a.init_from, bc.name, num_configs, "--init-from");
    model->load_pretrained(io::load_safetensors(path).tensors);
    logging::info("{}: loaded weights from {}", bc.name, path);
  }
  if (!a.write_init.empty()) {
    const std::string path = path_for(a.write_init, bc.name, num_configs, "--write-init");
    // torch_train.py rebuilds the model from this metadata, so both run the same config.
    io::save_safetensors(path, model->state_dict(),
                         {{"model_type", bc.model},
                          {"config", model->config_json().dump()},
                          {"bench_config", bc.name},
                          {"batch_size", std::to_string(B)},
                          {"seq_len", std::to_string(T)}});
    logging::info("{}: wrote initial weights to {}", bc.name, path);
  }

  // Data: a token file, or synthetic tokens (written for PyTorch with --write-data).
  std::string data_desc;
  std::shared_ptr<data::TokenFile> tokens;
  const data::TokenFormat format = data::parse_token_format(a.data_format);
  if (!a.data.empty()) {
    const std::string path = path_for(a.data, bc.name, num_configs, "--data");
    tokens =
        std::make_shared<data::TokenFile>(data::TokenFile::load(path, format, model->vocab_size()));
    data_desc = path;
  } else {
    const int64_t need = (a.warmup + a.steps) * B * T + T + 1;
    auto t = synthetic_tokens(std::max(a.data_tokens, need), model->vocab_size(), a.seed);
    if (!a.write_data.empty()) {
      const std::string path = path_for(a.write_data, bc.name, num_configs, "--write-data");
      write_tokens(path, t, format);
      logging::info("{}: wrote {} synthetic tokens to {}", bc.name, t.size(), path);
    }
    tokens = std::make_shared<data::TokenFile>(std::move(t), "<synthetic>", model->vocab_size());
    data_desc = "synthetic uniform, seed " + std::to_string(a.seed);
  }
  if (a.write_only) return json();  // null: nothing to report
  data::BatchLoader loader(
      tokens, {.batch_size = B, .seq_len = T, .order = data::SampleOrder::kSequential});

  auto opt = std::make_unique<optim::AdamW>(
      model->named_parameters(),
      optim::AdamW::Options{.lr = a.lr, .betas = {0.9, 0.95}, .eps = 1e-8, .weight_decay = 0.1});
  const auto params = model->named_parameters();

  logging::info("{}: {} with {:.2f}M parameters, batch {}x{}, {} thread(s), {} warm-up + {} steps",
                bc.name, bc.model, model->num_parameters() / 1e6, B, T, a.threads, a.warmup,
                a.steps);

  std::vector<double> step_ms;
  autograd::FlopCount flops;
  double first_loss = NAN, last_loss = NAN;
  for (int64_t s = 0; s < a.warmup + a.steps; ++s) {
    data::Batch batch = loader.next();
    std::optional<autograd::FlopCounter> counter;
    if (s == 0) counter.emplace();  // one step's model FLOPs; counting is free
    const auto t0 = std::chrono::steady_clock::now();
    opt->zero_grad();
    Tensor loss = model->loss(batch.idx(), batch.targets());
    loss.backward();
    // clip_grad_norm_(params, 1.0) + step(), with the scaling fused into the update (the same
    // update bitwise, without a pass over the gradients).
    opt->step_scaled(optim::clip_coefficient(1.0, optim::get_total_norm(params)));
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (counter) {
      flops = counter->count();
      counter.reset();
    }
    const double lv = loss.item();
    ACC_CHECK(std::isfinite(lv), bc.name, ": loss became ", lv, " at step ", s);
    if (s == 0) first_loss = lv;
    last_loss = lv;
    if (s >= a.warmup) step_ms.push_back(ms);
    logging::debug("{}: step {} loss {:.4f} {:.1f} ms", bc.name, s, lv, ms);
  }
  const int64_t peak_tracked = memory::peak_bytes();
  const int64_t num_params = model->num_parameters();
  const json model_config = model->config_json();

  const char* gemm_env = std::getenv("ACC_GEMM_THREADING");
  const std::string gemm_mode = gemm_env ? gemm_env : "default";
  const double med_ms = median(step_ms);
  const double tokens_per_step = static_cast<double>(B * T);
  const double tokens_per_s = med_ms > 0 ? tokens_per_step / (med_ms / 1000.0) : 0.0;
  const double achieved =
      med_ms > 0 ? static_cast<double>(flops.total()) / (med_ms / 1000.0) / 1e9 : 0.0;
  json out = {
      {"config", bc.name},
      {"model", bc.model},
      {"params", num_params},
      {"batch", B},
      {"seq_len", T},
      {"threads", a.threads},
      {"attention", a.reference_attention ? "reference" : "fused"},
      {"gemm_threading", gemm_mode},
      {"warmup", a.warmup},
      {"steps", a.steps},
      {"median_step_ms", med_ms},
      {"min_step_ms", step_ms.empty() ? 0.0 : *std::min_element(step_ms.begin(), step_ms.end())},
      {"tokens_per_s", tokens_per_s},
      {"model_flops_per_step", flops.total()},
      {"model_flops_forward", flops.forward},
      {"model_flops_backward", flops.backward},
      {"achieved_gflops", achieved},
      {"sgemm", std::to_string(a.sgemm_n) + "^3, best of " + std::to_string(kSgemmReps)},
      {"sgemm_gflops", sgemm_gflops},
      {"mfu", achieved / sgemm_gflops},
      {"peak_tracked_bytes", peak_tracked},
      {"max_rss_bytes", max_rss_bytes()},
      {"first_loss", first_loss},
      {"last_loss", last_loss},
      {"step_ms", step_ms},
      {"data", data_desc},
      {"model_config", model_config}};
  return out;
}

int run(const Args& a) {
  using namespace acc;
  ACC_CHECK(a.threads >= 1, "--threads must be >= 1, got ", a.threads);
  ACC_CHECK(a.warmup >= 0, "--warmup must be >= 0, got ", a.warmup);
  ACC_CHECK(a.steps >= 1 || a.write_only, "--steps must be >= 1, got ", a.steps);
  ACC_CHECK(a.sgemm_n >= 1, "--sgemm-n must be >= 1, got ", a.sgemm_n);
  ACC_CHECK(a.data.empty() || a.write_data.empty(),
            "--write-data writes the synthetic tokens; it cannot be combined with --data");
  set_num_threads(a.threads);

  std::vector<BenchConfig> configs;
  for (const auto& spec : a.configs) configs.push_back(resolve_config(spec));
  if (configs.empty()) {
    for (const char* n : {"gpt17m", "gpt90m", "llama17m"}) configs.push_back(*builtin_config(n));
  }

  std::ofstream json_out;
  if (!a.json_out.empty()) {
    json_out.open(a.json_out);
    ACC_CHECK_AS(IoError, json_out.good(), "cannot write --json-out file '", a.json_out, "'");
  }
  for (const auto& c : configs) {
    json r = run_config(a, c, configs.size());
    if (r.is_null()) continue;
    std::cout << r.dump() << std::endl;
    if (json_out.is_open()) json_out << r.dump() << "\n" << std::flush;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"AutoAcc training throughput benchmark: one JSON object per config"};
  app.add_option("--config", a.configs,
                 "gpt17m | gpt90m | llama17m | FILE.json (repeatable; default: all three)");
  app.add_option("--threads", a.threads, "threads for OpenBLAS and TBB together")
      ->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed warm-up steps")->capture_default_str();
  app.add_option("--steps", a.steps, "measured steps")->capture_default_str();
  app.add_option("--batch-size", a.batch_size, "override the config's batch size");
  app.add_option("--seq-len", a.seq_len, "override the config's sequence length");
  app.add_option("--init-from", a.init_from,
                 "initial weights (safetensors; {config} is replaced by the config name)");
  app.add_option("--write-init", a.write_init,
                 "write the initial weights and config as safetensors (for torch_train.py)");
  app.add_option("--data", a.data, "token file (default: synthetic tokens; {config} allowed)");
  app.add_option("--data-format", a.data_format, "u16 | u32 | text")->capture_default_str();
  app.add_option("--write-data", a.write_data, "write the synthetic tokens (for torch_train.py)");
  app.add_option("--data-tokens", a.data_tokens, "number of synthetic tokens (at least enough)")
      ->capture_default_str();
  app.add_option("--seed", a.seed, "seed of the init and the synthetic tokens")
      ->capture_default_str();
  app.add_option("--lr", a.lr, "AdamW learning rate")->capture_default_str();
  bool fused_flag = false;
  auto* fused = app.add_flag("--fused", fused_flag, "fused flash attention (default)");
  app.add_flag("--reference", a.reference_attention, "unfused matmul/softmax attention")
      ->excludes(fused);
  app.add_flag("--write-only", a.write_only,
               "only write --write-init / --write-data files, do not train");
  app.add_option("--json-out", a.json_out, "also write the JSON lines to this file");
  app.add_option("--sgemm-n", a.sgemm_n, "size of the square sgemm the MFU is measured against")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train: error: %s\n", e.what());
    return 1;
  }
}
