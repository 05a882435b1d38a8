// Memory of tensor parallelism (issue 32), at 2 ranks: the tracked peak of a training step per rank
// at tp2 and tp2 + megatron sequence parallelism against the prediction from a trace of the
// transformed model (estimate_memory of the rank's own shards and the loss it runs), within 5 %;
// and the activations of one layer (the difference between 3 and 2 layers, measured and traced)
// against Korthikanti et al.'s per-layer formulas, sbh(10 + 24/t + 5as/(ht)) bytes at 16-bit for
// tp and sbh(34/t + 5as/(ht)) with sequence parallelism, doubled for fp32. The ratio is printed,
// not bounded: the fused attention keeps none of the formula's 5as/(ht) (scores, softmax, their
// dropout), and no 1-byte dropout masks exist here. Sequence parallelism must take less than tp
// alone, measured and traced, which holds by construction (the norms' and residuals' activations
// are split along the sequence).
//
// Measured (GPT d128 L2/L3 H4 V256, B 8 x T 128, 2026-11-26): tp2 peak predicted 15483396 bytes,
// measured the same (0.00 %); tp2 + sp predicted 14418436, measured 14.2-14.8 MB (-2.6 % to +1.4 %:
// the ring reduce-scatter's buffers live as long as the communication thread keeps them, which
// varies by run). One layer's activations traced: 5.27 MB (tp2), 4.73 MB (tp2 + sp), 0.63 and 0.67
// of the formulas; the measured difference of the 3- and 2-layer peaks less their state is noisier
// (0.53-0.58 and 0.53-0.61), the peak's position moving between the runs.
#include <gtest/gtest.h>

#include <cstdio>

#include "../../strategies/tp_layers.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/random.hpp"
#include "acc/trace/passes.hpp"
#include "acc/trace/tracer.hpp"

namespace acc {
namespace {

constexpr int64_t kB = 8, kT = 128, kC = 128, kHeads = 4, kVocab = 256;

struct Measured {
  int64_t peak = 0;         // tracked bytes over a step, from before the model existed
  int64_t predicted = 0;    // the trace's peak
  int64_t activations = 0;  // the trace's activation peak
  int64_t state = 0;        // parameters, gradients and optimizer state (memory_report)
};

Measured run(const std::string& strategy, int64_t layers) {
  const int64_t base = memory::current_bytes();
  Measured m;
  {
    manual_seed(3);
    auto model = models::create_model("gpt", {{"n_layer", layers},
                                              {"n_head", kHeads},
                                              {"n_embd", kC},
                                              {"vocab_size", kVocab},
                                              {"block_size", kT},
                                              {"bias", false}});
    auto trainer = strategies::apply(model, optim::AdamW::factory({.lr = 1e-3}),
                                     strategies::parse_strategy(nlohmann::json::parse(strategy)));
    std::vector<int64_t> ids(static_cast<size_t>(kB * kT));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 37) % kVocab);
    const data::Batch batch(from_vector(ids, {kB, kT}), from_vector(ids, {kB, kT}));
    trainer->train_step(batch);  // the optimizer state exists from here on
    memory::reset_peak();
    trainer->train_step(batch);
    m.peak = memory::peak_bytes() - base;
    const strategies::MemoryReport r = trainer->memory_report();
    m.state = r.parameters + r.gradients + r.optimizer_state;

    // The trace of the model as this rank runs it: its shards, through the vocabulary-parallel
    // loss the strategy runs.
    const dist::ProcessGroupPtr tp = trainer->context()->group(dist::MeshDim::kTp);
    const Tensor idx = empty({kB, kT}, {DType::kInt64, Device::kMeta});
    trace::LossFn loss = [tp](nn::Module& mod, const std::vector<Tensor>& in) {
      auto& lm = static_cast<models::LanguageModel&>(mod);
      return strategies::vocab_parallel_cross_entropy(lm.forward(in[0]), in[1], kVocab, tp);
    };
    const trace::Trace t = trace::trace(trainer->model(), loss, {idx, idx});
    const trace::MemoryEstimate e = trace::estimate_memory(t, "adamw");
    m.predicted = e.peak;
    m.activations = e.activations_peak;
  }
  return m;
}

TEST(TensorParallelMemory, PeakAgainstTheTraceAndKorthikanti) {
  if (dist::ProcessGroup::world()->size() != 2) GTEST_SKIP() << "tp2 at 2 ranks";
  const std::string tp = R"([{"name": "tensor_parallel", "config": {"size": 2}}])";
  const std::string sp = R"([{"name": "tensor_parallel", "config": {"size": 2}},
                             {"name": "sequence_parallel", "config": {"kind": "megatron"}}])";
  const double sbh = static_cast<double>(kT * kB * kC), t = 2;
  const double attention = 5.0 * kHeads * kT / (kC * t);
  const double formula_tp = 2 * sbh * (10 + 24 / t + attention);  // fp32: 16-bit doubled
  const double formula_sp = 2 * sbh * (34 / t + attention);
  std::map<std::string, std::pair<Measured, Measured>> runs;  // 2 and 3 layers
  for (const auto& [name, s] : {std::pair{"tp2", tp}, std::pair{"tp2+sp", sp}}) {
    const Measured two = run(s, 2), three = run(s, 3);
    for (const Measured& m : {two, three}) {
      const double err = static_cast<double>(m.predicted - m.peak) / static_cast<double>(m.peak);
      EXPECT_LE(std::abs(err), 0.05)
          << name << ": predicted " << m.predicted << ", measured " << m.peak;
    }
    runs[name] = {two, three};
    // A layer's activations, measured: what the peak grows by, less the layer's own state.
    const double layer_measured =
        static_cast<double>((three.peak - three.state) - (two.peak - two.state));
    const double layer_traced = static_cast<double>(three.activations - two.activations);
    const double formula = std::string(name) == "tp2" ? formula_tp : formula_sp;
    std::printf(
        "%s: peak per rank predicted %lld / measured %lld (%+.2f%%); one layer's activations "
        "traced %.0f, measured %.0f bytes, Korthikanti fp32 %.0f: ratio %.3f "
        "(traced) %.3f (measured)\n",
        name, static_cast<long long>(two.predicted), static_cast<long long>(two.peak),
        100.0 * static_cast<double>(two.predicted - two.peak) / static_cast<double>(two.peak),
        layer_traced, layer_measured, formula, layer_traced / formula, layer_measured / formula);
  }
  EXPECT_LT(runs["tp2+sp"].first.peak, runs["tp2"].first.peak);
  EXPECT_LT(runs["tp2+sp"].first.activations, runs["tp2"].first.activations);
}

}  // namespace
}  // namespace acc
