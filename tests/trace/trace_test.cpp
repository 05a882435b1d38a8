#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <limits>
#include <map>
#include <thread>

#include "acc/autograd/recompute.hpp"
#include "acc/models/models.hpp"
#include "acc/nn/recompute.hpp"
#include "acc/optim/adam.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/trace/batch_traces.hpp"
#include "acc/trace/dump.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/trace/model_ref.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"
#include "acc/util/system.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

models::GPTConfig small_gpt(int64_t layers = 2) {
  models::GPTConfig c;
  c.n_layer = layers;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 128;
  c.block_size = 64;
  return c;
}

nlohmann::json small_llama() {
  return {{"hidden_size", 64},
          {"intermediate_size", 160},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"vocab_size", 128},
          {"max_position_embeddings", 64}};
}

Tensor tokens(int64_t B, int64_t T, int64_t V) {
  return randint(0, V, {B, T});
}

// A user's own module: two linears around a tanh, nested one level deep.
struct Encoder : nn::Module {
  Encoder() : nn::Module("Encoder") {
    inner = register_module("inner", std::make_shared<nn::Linear>(8, 16));
    out = register_module("out", std::make_shared<nn::Linear>(16, 3));
  }
  Tensor forward(const Tensor& x) override { return (*out)(tanh((*inner)(x))); }
  std::shared_ptr<nn::Linear> inner, out;
};
struct UserModel : nn::Module {
  UserModel() : nn::Module("UserModel") {
    enc = register_module("enc", std::make_shared<Encoder>());
  }
  Tensor forward(const Tensor& x) override { return (*enc)(x); }
  std::shared_ptr<Encoder> enc;
};

std::vector<std::string> op_scopes(const trace::Trace& t, const std::string& op, trace::Phase ph) {
  std::vector<std::string> out;
  for (auto v : t.graph.ops()) {
    const auto& vx = t.graph.vertex(v);
    if (vx.op == op && vx.phase == ph) out.push_back(vx.scope);
  }
  return out;
}

TEST(Trace, GptOpsHaveScopesShapesAndBothPhases) {
  models::GPT gpt(small_gpt());
  trace::Trace t = trace::trace(gpt, {tokens(2, 16, 128), tokens(2, 16, 128)});
  auto linears = op_scopes(t, "Linear", trace::Phase::kForward);
  EXPECT_NE(std::find(linears.begin(), linears.end(), "transformer.h.1.attn.c_attn"),
            linears.end());
  EXPECT_NE(std::find(linears.begin(), linears.end(), "transformer.h.0.mlp.c_fc"), linears.end());
  auto back = op_scopes(t, "LinearBackward", trace::Phase::kBackward);
  EXPECT_EQ(back.size(), linears.size());
  EXPECT_EQ(op_scopes(t, "Attention", trace::Phase::kForward),
            (std::vector<std::string>{"transformer.h.0.attn", "transformer.h.1.attn"}));
  // Shapes, FLOPs and bytes of one op.
  for (auto v : t.graph.ops()) {
    const auto& vx = t.graph.vertex(v);
    if (vx.scope == "transformer.h.0.mlp.c_fc" && vx.op == "Linear") {
      EXPECT_EQ(vx.outputs.at(0).shape, (Shape{2, 16, 256}));
      EXPECT_EQ(vx.flops, 2 * 2 * 16 * 64 * 256);
      EXPECT_EQ(vx.bytes_written, 2 * 16 * 256 * 4);
      EXPECT_TRUE(vx.saves_activations);
    }
  }
  // Parameters are vertices with their dotted names, feeding the ops that read them.
  int params = 0;
  const auto& g = t.graph.boost_graph();
  for (auto [v, end] = boost::vertices(g); v != end; ++v) {
    if (g[*v].kind != trace::VertexKind::kParameter) continue;
    ++params;
    if (g[*v].name == "transformer.wte.weight") {
      EXPECT_GE(boost::out_degree(*v, g), 2u);  // embedding and the tied output projection
    }
  }
  EXPECT_EQ(params, static_cast<int>(gpt.named_parameters().size()));
  EXPECT_GT(t.graph.backward_begin(), 0);
  EXPECT_LT(t.graph.backward_begin(), static_cast<int64_t>(t.graph.ops().size()));
}

TEST(Trace, TracingLeavesTheModelUntouchedAndAllocatesNothing) {
  manual_seed(3);
  models::GPT gpt(small_gpt());
  Tensor idx = tokens(2, 16, 128);
  gpt.loss(idx, idx).backward();
  Tensor w = gpt.find_tensor("transformer.h.0.attn.c_attn.weight");
  Tensor w_before = w.clone(), g_before = w.grad().clone();
  const int64_t before = memory::current_bytes();
  trace::trace(gpt, {idx, idx});
  EXPECT_EQ(memory::current_bytes(), before);
  EXPECT_FALSE(w.is_meta());
  EXPECT_TRUE(allclose(w, w_before, 0, 0));
  EXPECT_TRUE(allclose(w.grad(), g_before, 0, 0));
  // Still trains.
  EXPECT_TRUE(std::isfinite(gpt.loss(idx, idx).item()));
}

TEST(Trace, UserDefinedModuleIsTracedWithItsScopes) {
  auto m = std::make_shared<UserModel>();
  trace::Trace t = trace::trace(*m, {randn({5, 8})});
  EXPECT_EQ(op_scopes(t, "Linear", trace::Phase::kForward),
            (std::vector<std::string>{"enc.inner", "enc.out"}));
  EXPECT_EQ(op_scopes(t, "Tanh", trace::Phase::kForward), (std::vector<std::string>{"enc"}));
  auto stats = trace::scope_stats(t);
  EXPECT_EQ(stats["enc.inner"].forward_flops, 2 * 5 * 8 * 16);
  EXPECT_EQ(stats["enc"].forward_flops, 2 * 5 * 8 * 16 + 2 * 5 * 16 * 3);
  // The input needs no gradient, so the first linear computes only its weight gradient.
  EXPECT_EQ(stats["enc.out"].backward_flops, 2 * stats["enc.out"].forward_flops);
  EXPECT_EQ(stats["enc.inner"].backward_flops, stats["enc.inner"].forward_flops);
  EXPECT_EQ(stats["enc.inner"].parameters, 8 * 16 + 16);
  EXPECT_EQ(stats[""].parameters, m->num_parameters());
}

TEST(Trace, ForwardErrorsPropagateUnchanged) {
  models::GPT gpt(small_gpt());
  Tensor too_long = tokens(1, 65, 128);
  std::string direct, traced;
  try {
    gpt.loss(too_long, too_long);
  } catch (const ValueError& e) {
    direct = e.what();
  }
  try {
    trace::trace(gpt, {too_long, too_long});
  } catch (const ValueError& e) {
    traced = e.what();
  }
  EXPECT_FALSE(direct.empty());
  EXPECT_EQ(direct, traced);
  // A shape error from inside the model, too.
  auto m = std::make_shared<UserModel>();
  EXPECT_THROW(trace::trace(*m, {randn({5, 7})}), ShapeError);
  // And the model is whole afterwards.
  EXPECT_FALSE(m->enc->inner->weight().is_meta());
  EXPECT_THROW(trace::trace(*m, {}), ValueError);
}

TEST(Trace, FindsRepeatedBlocksOfAnyModel) {
  models::GPT gpt(small_gpt(3));
  auto blocks = trace::find_blocks(gpt);
  ASSERT_FALSE(blocks.empty());
  EXPECT_EQ(blocks[0].container, "transformer.h");
  EXPECT_EQ(blocks[0].type_name, "GPTBlock");
  EXPECT_EQ(blocks[0].blocks,
            (std::vector<std::string>{"transformer.h.0", "transformer.h.1", "transformer.h.2"}));
  auto llama = models::create_model("llama", small_llama());
  auto lb = trace::find_blocks(*llama);
  ASSERT_FALSE(lb.empty());
  EXPECT_EQ(lb[0].container, "model.layers");
  EXPECT_EQ(lb[0].blocks.size(), 2u);
  // A user's stack of identical layers, not in a ModuleList.
  struct Stack : nn::Module {
    Stack() : nn::Module("Stack") {
      for (int i = 0; i < 4; ++i)
        register_module("layer" + std::to_string(i), std::make_shared<nn::Linear>(8, 8));
    }
  } stack;
  auto sb = trace::find_blocks(stack);
  ASSERT_EQ(sb.size(), 1u);
  EXPECT_EQ(sb[0].blocks.size(), 4u);
  EXPECT_EQ(sb[0].type_name, "Linear");
}

TEST(Trace, FindsTensorParallelPatterns) {
  models::GPT gpt(small_gpt());
  trace::Trace t = trace::trace(gpt, {tokens(1, 8, 128), tokens(1, 8, 128)});
  auto mlp = trace::find_mlp_patterns(t);
  ASSERT_EQ(mlp.size(), 2u);
  EXPECT_EQ(mlp[0].scope, "transformer.h.0.mlp");
  EXPECT_EQ(mlp[0].first, (std::vector<std::string>{"transformer.h.0.mlp.c_fc"}));
  EXPECT_EQ(mlp[0].activation, "Gelu");
  EXPECT_EQ(mlp[0].second, "transformer.h.0.mlp.c_proj");
  auto attn = trace::find_attention_patterns(t);
  ASSERT_EQ(attn.size(), 2u);
  EXPECT_EQ(attn[1].qkv, (std::vector<std::string>{"transformer.h.1.attn.c_attn"}));
  EXPECT_EQ(attn[1].proj, "transformer.h.1.attn.c_proj");

  auto llama = models::create_model("llama", small_llama());
  trace::Trace lt = trace::trace(*llama, {tokens(1, 8, 128), tokens(1, 8, 128)});
  auto lm = trace::find_mlp_patterns(lt);
  ASSERT_EQ(lm.size(), 2u);
  EXPECT_EQ(lm[0].first, (std::vector<std::string>{"model.layers.0.mlp.gate_proj",
                                                   "model.layers.0.mlp.up_proj"}));
  EXPECT_EQ(lm[0].activation, "Swiglu");
  EXPECT_EQ(lm[0].second, "model.layers.0.mlp.down_proj");
  auto la = trace::find_attention_patterns(lt);
  ASSERT_EQ(la.size(), 2u);
  EXPECT_EQ(la[0].qkv, (std::vector<std::string>{"model.layers.0.self_attn.q_proj",
                                                 "model.layers.0.self_attn.k_proj",
                                                 "model.layers.0.self_attn.v_proj"}));
  EXPECT_EQ(la[0].proj, "model.layers.0.self_attn.o_proj");
}

TEST(Trace, TopologicalOrderRespectsEveryEdge) {
  models::GPT gpt(small_gpt());
  trace::Trace t = trace::trace(gpt, {tokens(1, 8, 128), tokens(1, 8, 128)});
  auto order = trace::topological_order(t);
  ASSERT_EQ(order.size(), t.graph.num_vertices());
  std::map<trace::VertexId, size_t> pos;
  for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = i;
  const auto& g = t.graph.boost_graph();
  size_t edges = 0;
  for (auto [e, end] = boost::edges(g); e != end; ++e, ++edges) {
    EXPECT_LT(pos[boost::source(*e, g)], pos[boost::target(*e, g)]);
  }
  EXPECT_GT(edges, t.graph.ops().size() / 2);
}

TEST(Trace, DumpsAreIdenticalAcrossRunsAndFreeOfAddresses) {
  auto dump = [] {
    models::GPT gpt(small_gpt());
    Tensor idx = zeros({1, 8}, {DType::kInt64});
    trace::Trace t = trace::trace(gpt, {idx, idx});
    return std::make_pair(trace::to_json(t).dump(), trace::to_dot(t));
  };
  auto a = dump();
  Tensor noise = randn({1000});  // the process creates other storages in between
  auto b = dump();
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(a.second, b.second);
  EXPECT_EQ(a.first.find("0x"), std::string::npos);
  EXPECT_NE(a.second.find("transformer.h.0.attn.c_attn/Linear"), std::string::npos);
  auto j = nlohmann::json::parse(a.first);
  EXPECT_EQ(j["model"], "GPT");
  EXPECT_GT(j["vertices"].size(), 50u);
}

// FLOPs per step against the closed form: 6 x (matrix parameters) x tokens, plus the attention
// term (causal: 2 B NH T^2 HS per layer forward, twice that backward).
TEST(Trace, GptFlopsMatchClosedForm) {
  models::GPTConfig c = small_gpt(3);
  models::GPT gpt(c);
  const int64_t B = 2, T = 32, C = c.n_embd, L = c.n_layer, V = c.vocab_size, NH = c.n_head;
  trace::Trace t = trace::trace(gpt, {tokens(B, T, V), tokens(B, T, V)});
  const int64_t matrix_params = L * 12 * C * C + V * C;
  const int64_t attention = 3 * 2 * B * NH * T * T * (C / NH) * L;
  EXPECT_EQ(trace::estimate_compute(t).total(), 6 * matrix_params * B * T + attention);
}

// Each product's FLOPs sit on its own vertex, with and without amp's bf16 activations (whose
// saved-input copies are ops of their own, recorded between the product's work and its vertex):
// every Linear and Attention vertex carries its closed-form FLOPs and nothing else carries any.
// The cost models price a vertex by its op, so FLOPs on a copy were priced as memory traffic.
TEST(Trace, ProductFlopsBelongToTheProductsVertexUnderAmp) {
  models::GPTConfig c = small_gpt(2);
  models::GPT gpt(c);
  const int64_t B = 2, T = 32, C = c.n_embd, V = c.vocab_size, NH = c.n_head;
  for (const bool bf16 : {false, true}) {
    trace::TraceOptions opts;
    opts.bf16_activations = bf16;
    trace::Trace t = trace::trace(gpt, {tokens(B, T, V), tokens(B, T, V)}, opts);
    int linears = 0, attentions = 0;
    for (auto v : t.graph.ops()) {
      const auto& vx = t.graph.vertex(v);
      if (vx.phase != trace::Phase::kForward) continue;
      if (vx.op == "Linear") {
        const int64_t OUT = vx.inputs.at(1).shape.at(0), IN = vx.inputs.at(1).shape.at(1);
        EXPECT_EQ(vx.flops, 2 * B * T * IN * OUT) << vx.name << (bf16 ? " (bf16)" : "");
        ++linears;
      } else if (vx.op == "Attention") {
        EXPECT_EQ(vx.flops, 2 * B * NH * T * T * (C / NH))  // causal: half of 2 products
            << vx.name << (bf16 ? " (bf16)" : "");
        ++attentions;
      } else {
        EXPECT_EQ(vx.flops, 0) << vx.op << " " << vx.name << (bf16 ? " (bf16)" : "");
      }
    }
    EXPECT_EQ(linears, 4 * c.n_layer + 1);
    EXPECT_EQ(attentions, c.n_layer);
  }
}

// The memory estimate from liveness over the trace predicts the tracking allocator's peak over a
// real training step (forward, backward, AdamW step), and over a second forward and backward
// that adds into the gradients held (a later micro-batch's), within 0.5% (the README's figure; the
// sizes of allocations are the same on every CPU, so this is not a timing or rounding figure:
// measured 0.03-0.19% over the cases below).
struct MemCase {
  std::string name;
  std::string model;
  int64_t B, T;
  trace::Recompute recompute;
};

class MemoryEstimate : public testing::TestWithParam<MemCase> {};

TEST_P(MemoryEstimate, PredictsMeasuredPeakWithinHalfAPercent) {
  const MemCase& mc = GetParam();
  manual_seed(0);
  models::LanguageModelPtr model =
      mc.model == "gpt" ? models::LanguageModelPtr(std::make_shared<models::GPT>(small_gpt(3)))
                        : models::create_model("llama", small_llama());
  Tensor idx = tokens(mc.B, mc.T, 128);
  trace::Trace t = trace::trace(*model, {idx, idx}, {.recompute = mc.recompute});
  const trace::MemoryEstimate est = trace::estimate_memory(t, "adamw");

  // The real step, with the same recomputation applied.
  std::vector<std::pair<nn::ModulePtr, nn::Module::ForwardWrapper>> saved;
  if (mc.recompute == trace::Recompute::kBlock) {
    const auto groups = trace::find_blocks(*model);
    for (const auto& name : groups.at(0).blocks) {
      auto block = model->submodule(name);
      saved.emplace_back(block, block->forward_wrapper());
      block->set_forward_wrapper(
          [](nn::Module&, const Tensor& x, const auto& fwd) { return recompute(fwd, x); });
    }
  }
  nn::Undo undo_selective;
  if (mc.recompute == trace::Recompute::kSelective) {
    undo_selective = nn::recompute_attention_cores(*model, trace::find_blocks(*model).at(0).blocks);
  }
  optim::AdamW opt(model->named_parameters());
  opt.zero_grad();
  memory::reset_peak();
  const int64_t base = memory::current_bytes() - est.parameters - est.optimizer_state;
  {
    Tensor loss = model->loss(idx, idx);
    loss.backward();
    opt.step();
  }
  const int64_t measured = memory::peak_bytes() - base;
  // A second micro-batch's backward adds into the gradients the first left: every gradient held
  // throughout, each new one alive until its accumulator adds it in (accumulating_peak).
  memory::reset_peak();
  {
    Tensor loss = model->loss(idx, idx);
    loss.backward();
  }
  const int64_t accumulating = memory::peak_bytes() - base;
  for (auto& [block, w] : saved) block->set_forward_wrapper(w);
  if (undo_selective) undo_selective();
  const double err = std::abs(static_cast<double>(est.peak - measured)) / measured;
  EXPECT_LT(err, 0.005) << mc.name << ": estimated " << est.peak << " measured " << measured;
  RecordProperty("relative_error", std::to_string(err));
  const int64_t predicted =
      est.parameters + est.optimizer_state + est.gradients + est.accumulating_peak;
  const double accumulating_err =
      std::abs(static_cast<double>(predicted - accumulating)) / accumulating;
  EXPECT_LT(accumulating_err, 0.005)
      << mc.name << ": accumulating step estimated " << predicted << " measured " << accumulating;
  EXPECT_GE(est.accumulating_peak, est.activations_peak);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MemoryEstimate,
    testing::Values(MemCase{"gpt_b2_t32", "gpt", 2, 32, trace::Recompute::kNone},
                    MemCase{"gpt_b8_t64", "gpt", 8, 64, trace::Recompute::kNone},
                    MemCase{"gpt_b4_t64_recompute", "gpt", 4, 64, trace::Recompute::kBlock},
                    MemCase{"gpt_b16_t16_recompute", "gpt", 16, 16, trace::Recompute::kBlock},
                    MemCase{"gpt_b4_t64_selective", "gpt", 4, 64, trace::Recompute::kSelective},
                    MemCase{"llama_b4_t32", "llama", 4, 32, trace::Recompute::kNone},
                    MemCase{"llama_b8_t64_selective", "llama", 8, 64, trace::Recompute::kSelective},
                    MemCase{"llama_b8_t64_recompute", "llama", 8, 64, trace::Recompute::kBlock},
                    MemCase{"llama_b2_t64", "llama", 2, 64, trace::Recompute::kNone}),
    [](const testing::TestParamInfo<MemCase>& info) { return info.param.name; });

TEST(Trace, RecomputeLowersTheActivationPeak) {
  models::GPT gpt(small_gpt(4));
  Tensor idx = tokens(8, 64, 128);
  auto none = trace::estimate_memory(trace::trace(gpt, {idx, idx}));
  auto block = trace::estimate_memory(
      trace::trace(gpt, {idx, idx}, {.recompute = trace::Recompute::kBlock}));
  EXPECT_LT(block.activations_peak, none.activations_peak / 2);
  EXPECT_EQ(block.parameters, none.parameters);
  // Recomputation runs each block's forward again in backward.
  trace::Trace tb = trace::trace(gpt, {idx, idx}, {.recompute = trace::Recompute::kBlock});
  trace::Trace tn = trace::trace(gpt, {idx, idx});
  EXPECT_GT(trace::estimate_compute(tb).total(), trace::estimate_compute(tn).total());
}

// Selective recomputation drops what the attention cores keep for backward (the fused kernel's
// output and row statistics) and keeps the rest: between none and whole blocks. Its recomputed
// cores add forward FLOPs, fewer than whole blocks do.
TEST(Trace, SelectiveRecomputationSitsBetweenNoneAndWholeBlocks) {
  models::GPT gpt(small_gpt(4));
  Tensor idx = tokens(8, 64, 128);
  auto traced = [&](trace::Recompute r) { return trace::trace(gpt, {idx, idx}, {.recompute = r}); };
  const trace::Trace tn = traced(trace::Recompute::kNone), tb = traced(trace::Recompute::kBlock),
                     ts = traced(trace::Recompute::kSelective);
  const auto none = trace::estimate_memory(tn), block = trace::estimate_memory(tb),
             selective = trace::estimate_memory(ts);
  EXPECT_LT(selective.activations_peak, none.activations_peak);
  EXPECT_GT(selective.activations_peak, block.activations_peak);
  const double cn = trace::estimate_compute(tn).total(), cb = trace::estimate_compute(tb).total(),
               cs = trace::estimate_compute(ts).total();
  EXPECT_GT(cs, cn);
  EXPECT_LT(cs, cb);
  EXPECT_EQ(trace::parse_recompute("selective"), trace::Recompute::kSelective);
  EXPECT_STREQ(trace::recompute_name(trace::Recompute::kSelective), "selective");
}

TEST(Trace, BadOptionsAreRejected) {
  EXPECT_THROW(trace::parse_recompute("partial"), ValueError);
  EXPECT_THROW(trace::optimizer_state_factor("lamb"), ValueError);
  EXPECT_THROW(trace::optimizer_state_factor("buffers:x"), ValueError);
  EXPECT_THROW(trace::optimizer_with_state_buffers(-1), ValueError);
}

// A user's optimizer by its state buffers a parameter, back to the state the trace charges.
TEST(Trace, AnOptimizersStateBuffersNameItsStateFactor) {
  EXPECT_EQ(trace::optimizer_with_state_buffers(0), "sgd");
  EXPECT_EQ(trace::optimizer_with_state_buffers(1), "sgd_momentum");
  EXPECT_EQ(trace::optimizer_with_state_buffers(2), "adamw");
  EXPECT_EQ(trace::optimizer_with_state_buffers(3), "buffers:3");
  for (int k = 0; k <= 4; ++k) {
    EXPECT_EQ(trace::optimizer_state_factor(trace::optimizer_with_state_buffers(k)), k);
  }
}

// ---- the training need of a deep model, extrapolated from 1 and 2 blocks ----

struct NeedCase {
  std::string name;
  std::string model;
  trace::TraceOptions options;
};

class TrainingNeed : public testing::TestWithParam<NeedCase> {};

// trace::stage_highs of a full trace, straight from its memory events: each op's stage and phase
// from its scope (ops outside the blocks: the embedding before the first block's forward, head
// and loss until the first block's backward, the embedding's backward after), the running total
// of every storage but the parameters (and, accumulating, of the activations with each gradient
// counted as it is made), the highest point while each stage runs, the level it starts from
// included.
std::vector<trace::StageHighs> stage_highs_of(const trace::Trace& t,
                                              const std::vector<std::string>& blocks,
                                              const std::vector<int64_t>& stage_blocks) {
  const trace::Graph& g = t.graph;
  std::vector<int> stage_of_block;
  for (size_t st = 0; st < stage_blocks.size(); ++st) {
    for (int64_t b = 0; b < stage_blocks[st]; ++b) stage_of_block.push_back(static_cast<int>(st));
  }
  // Per op: its stage, and whether it belongs to the stage's backward.
  std::vector<std::pair<int, bool>> where;
  bool block_forward_seen = false, block_backward_seen = false;
  for (trace::VertexId v : g.ops()) {
    const trace::Vertex& vx = g.vertex(v);
    int block = -1;
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (vx.scope == blocks[b] || vx.scope.rfind(blocks[b] + ".", 0) == 0) {
        block = static_cast<int>(b);
      }
    }
    const bool backward = vx.phase != trace::Phase::kForward;
    if (block >= 0) {
      (backward ? block_backward_seen : block_forward_seen) = true;
      where.emplace_back(stage_of_block.at(static_cast<size_t>(block)), backward);
    } else if (!block_forward_seen) {
      where.emplace_back(0, false);
    } else if (!block_backward_seen) {
      where.emplace_back(static_cast<int>(stage_blocks.size()) - 1, true);
    } else {
      where.emplace_back(0, true);
    }
  }
  const int64_t lowest = std::numeric_limits<int64_t>::min();
  std::vector<trace::StageHighs> out(stage_blocks.size(), {lowest, lowest, lowest});
  int64_t live = 0, accumulating = 0;
  std::pair<int, bool> now{-1, false};
  for (const trace::MemoryEvent& ev : g.memory_events()) {
    const std::pair<int, bool> at =
        ev.op_index < 0 ? std::pair{0, false} : where.at(static_cast<size_t>(ev.op_index));
    trace::StageHighs& h = out.at(static_cast<size_t>(at.first));
    int64_t& high = at.second ? h.backward : h.forward;
    if (at != now) {  // a stage's action begins at the level the one before left
      high = std::max(high, live);
      if (at.second) h.backward_accumulating = std::max(h.backward_accumulating, accumulating);
      now = at;
    }
    const bool parameter = g.parameter_storages().count(ev.storage) > 0;
    const bool gradient = g.gradient_storages().count(ev.storage) > 0;
    const bool input = g.input_storages().count(ev.storage) > 0;
    if (parameter) continue;
    live += ev.bytes;
    high = std::max(high, live);
    if (!gradient && !input) accumulating += ev.bytes;
    if (at.second) {
      const int64_t moment = accumulating + (gradient && ev.bytes > 0 ? ev.bytes : 0);
      h.backward_accumulating = std::max(h.backward_accumulating, moment);
    }
  }
  return out;
}

// Against full traces of the same config at several depths, every figure equal: the counts are
// linear in the depth, the peaks follow from the timeline of the runs of blocks cut short.
TEST_P(TrainingNeed, ExtrapolationMatchesFullTraces) {
  const NeedCase& nc = GetParam();
  const nlohmann::json config = nc.model == "gpt" ? small_gpt(1).to_json() : small_llama();
  const int64_t B = 2, T = 32;
  for (int64_t n : {1, 2, 3, 4, 5, 8, 13}) {
    const nlohmann::json deep = models::config_with_num_layers(nc.model, config, n);
    const trace::TrainingNeed need = trace::estimate_training_need(
        nc.model, deep, B, T, nc.options, "adamw", trace::BlockwiseGradients{0.75});
    const trace::BlockwiseGradients accumulated{.in_flight_fraction = 0.5, .accumulated = true};
    const trace::TrainingNeed need_accumulated =
        trace::estimate_training_need(nc.model, deep, B, T, nc.options, "adamw", accumulated);
    DefaultDeviceGuard meta(Device::kMeta);
    auto model = models::create_model(nc.model, deep);
    Tensor idx = empty({B, T}, {DType::kInt64, Device::kMeta});
    const trace::Trace t = trace::trace(*model, {idx, idx}, nc.options);
    const auto mem = trace::estimate_memory(t, "adamw");
    const auto flops = trace::estimate_compute(t);
    const std::string at = nc.name + " at " + std::to_string(n) + " blocks";
    EXPECT_EQ(need.num_layers, n) << at;
    EXPECT_EQ(need.parameters, t.num_parameters) << at;
    EXPECT_EQ(need.compute.forward_flops, flops.forward_flops) << at;
    EXPECT_EQ(need.compute.backward_flops, flops.backward_flops) << at;
    EXPECT_EQ(need.graph_vertices, static_cast<int64_t>(t.graph.num_vertices())) << at;
    EXPECT_EQ(need.graph_ops, static_cast<int64_t>(t.graph.ops().size())) << at;
    EXPECT_EQ(need.graph_forward_ops, t.graph.backward_begin()) << at;
    EXPECT_EQ(need.memory.parameters, mem.parameters) << at;
    EXPECT_EQ(need.memory.gradients, mem.gradients) << at;
    EXPECT_EQ(need.memory.optimizer_state, mem.optimizer_state) << at;
    EXPECT_EQ(need.memory.activations_peak, mem.activations_peak) << at;
    EXPECT_EQ(need.memory.peak, mem.peak) << at;
    EXPECT_EQ(need.total(), need.memory.peak);
    const auto blocks = trace::find_blocks(*model).at(0);
    EXPECT_EQ(need.parameters_per_block, blocks.parameters_per_block);
    // Blocks' gradients held one block (and a 0.75 buffer in flight) at a time: what the full
    // timeline gives.
    const int64_t blockwise = trace::blockwise_live_peak(t, blocks.blocks, {0.75});
    EXPECT_EQ(need.blockwise_live_peak, blockwise) << at;
    // With the gradients of an earlier micro-batch held from the start: at least those.
    const int64_t held = trace::blockwise_live_peak(t, blocks.blocks, accumulated);
    EXPECT_EQ(need_accumulated.blockwise_live_peak, held) << at;
    EXPECT_GE(held, mem.gradients) << at;
    // The timeline over each stage of a pipeline rank holding these blocks: all in one stage,
    // the first or last block alone, the middle ones in stages of their own.
    std::vector<std::vector<int64_t>> splits{{n}};
    if (n >= 2) {
      splits.push_back({1, n - 1});
      splits.push_back({n - 1, 1});
    }
    if (n >= 4) splits.push_back({1, 1, n - 3, 1});
    for (const auto& split : splits) {
      const auto highs = trace::stage_highs(need, split);
      ASSERT_TRUE(highs.has_value()) << at;
      const std::vector<trace::StageHighs> full = stage_highs_of(t, blocks.blocks, split);
      ASSERT_EQ(highs->size(), split.size());
      int64_t top = 0;
      for (size_t st = 0; st < split.size(); ++st) {
        const std::string where =
            at + ", stage " + std::to_string(st) + " of " + std::to_string(split.size());
        EXPECT_EQ((*highs)[st].forward, full[st].forward) << where;
        EXPECT_EQ((*highs)[st].backward, full[st].backward) << where;
        EXPECT_EQ((*highs)[st].backward_accumulating, full[st].backward_accumulating) << where;
        top = std::max({top, (*highs)[st].forward, (*highs)[st].backward});
      }
      // The step's own peak is the highest of them.
      EXPECT_EQ(top, mem.peak - mem.parameters - mem.optimizer_state) << at;
    }
  }
  // Stages that do not hold the model's blocks are refused by name.
  const trace::TrainingNeed need = trace::estimate_training_need(
      nc.model, models::config_with_num_layers(nc.model, config, 4), B, T, nc.options);
  EXPECT_THAT(test::error_of<ValueError>([&] {
                (void)trace::stage_highs(need, {1, 2});
              }),
              testing::HasSubstr("the stages hold 3 blocks, the model 4"));
  EXPECT_THAT(test::error_of<ValueError>([&] {
                (void)trace::stage_highs(need, {4, 0});
              }),
              testing::HasSubstr("a stage of 0 blocks"));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, TrainingNeed,
    testing::Values(NeedCase{"gpt", "gpt", {}},
                    NeedCase{"gpt_recompute", "gpt", {.recompute = trace::Recompute::kBlock}},
                    NeedCase{"gpt_recompute_2",
                             "gpt",
                             {.recompute = trace::Recompute::kBlock, .recompute_blocks = 2}},
                    NeedCase{"gpt_recompute_4",
                             "gpt",
                             {.recompute = trace::Recompute::kBlock, .recompute_blocks = 4}},
                    NeedCase{"gpt_bf16", "gpt", {.bf16_activations = true}},
                    NeedCase{"gpt_bf16_recompute_3",
                             "gpt",
                             {.recompute = trace::Recompute::kBlock,
                              .recompute_blocks = 3,
                              .bf16_activations = true}},
                    NeedCase{"gpt_selective", "gpt", {.recompute = trace::Recompute::kSelective}},
                    NeedCase{"gpt_selective_2",
                             "gpt",
                             {.recompute = trace::Recompute::kSelective, .recompute_blocks = 2}},
                    NeedCase{"gpt_bf16_selective_3",
                             "gpt",
                             {.recompute = trace::Recompute::kSelective,
                              .recompute_blocks = 3,
                              .bf16_activations = true}},
                    NeedCase{"llama", "llama", {}},
                    NeedCase{
                        "llama_selective", "llama", {.recompute = trace::Recompute::kSelective}},
                    NeedCase{"llama_recompute", "llama", {.recompute = trace::Recompute::kBlock}},
                    NeedCase{"llama_recompute_1",
                             "llama",
                             {.recompute = trace::Recompute::kBlock, .recompute_blocks = 1}}),
    [](const testing::TestParamInfo<NeedCase>& info) { return info.param.name; });

TEST(TrainingNeed, BillionsOfBlocksAnswerWithoutBuildingThem) {
  nlohmann::json config = small_gpt(1).to_json();
  config["n_layer"] = 1000000000;
  const auto start = std::chrono::steady_clock::now();
  const trace::TrainingNeed need = trace::estimate_training_need("gpt", config, 2, 32);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0) << "built the model?";  // milliseconds; generous for a loaded machine
  const trace::TrainingNeed one =
      trace::estimate_training_need("gpt", small_gpt(1).to_json(), 2, 32);
  const trace::TrainingNeed two =
      trace::estimate_training_need("gpt", small_gpt(2).to_json(), 2, 32);
  EXPECT_EQ(need.parameters, one.parameters + 999999999 * (two.parameters - one.parameters));
  EXPECT_EQ(need.parameters_per_block, two.parameters - one.parameters);
  EXPECT_EQ(need.block_type, "GPTBlock");
  EXPECT_GT(need.trace_host_bytes, int64_t{1} << 40);
}

TEST(TrainingNeed, FiguresThatDoNotFitNameTheBlockCountOrTheShape) {
  nlohmann::json config = small_gpt(1).to_json();
  config["n_layer"] = 1000000000000000000;
  try {
    trace::estimate_training_need("gpt", config, 2, 32);
    ADD_FAILURE() << "10^18 blocks were estimated";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("gpt n_layer 1000000000000000000: "), std::string::npos)
        << e.what();
  }
  config["n_layer"] = 2;
  config["n_embd"] = 1000000000;
  config["n_head"] = 1;
  try {
    trace::estimate_training_need("gpt", config, 1, 32);
    ADD_FAILURE() << "n_embd 1e9 was estimated";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("shape [3000000000, 1000000000]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(trace::estimate_training_need("gpt", small_gpt(1).to_json(), 0, 32), ValueError);
  EXPECT_THROW(trace::estimate_training_need("gpt", small_gpt(1).to_json(), 1, -1), ValueError);
  EXPECT_THROW(trace::estimate_training_need("gpt", small_gpt(1).to_json(), 1, 32, {}, "lamb"),
               ValueError);
  EXPECT_THROW(trace::estimate_training_need("bert", small_gpt(1).to_json(), 1, 32), ValueError);
}

TEST(TrainingNeed, CheckFitsRefusesWithBothFigures) {
  const trace::TrainingNeed need =
      trace::estimate_training_need("gpt", small_gpt(2).to_json(), 2, 32);
  EXPECT_NO_THROW(trace::check_fits(need, need.total(), "train_gpt"));
  try {
    trace::check_fits(need, need.total() - 1, "train_gpt");
    ADD_FAILURE() << "a need one byte over the memory passed";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(
        msg.rfind("train_gpt: a training step of gpt n_layer 2 at batch 2 x seq 32 needs ", 0), 0u)
        << msg;
    EXPECT_NE(msg.find("(" + std::to_string(need.total()) + " bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(" + std::to_string(need.total() - 1) + " bytes) of memory available"),
              std::string::npos)
        << msg;
  }
}

TEST(TrainingNeed, ConfigDepthIsReadAndRewritten) {
  EXPECT_EQ(models::config_num_layers("gpt", small_gpt(3).to_json()), 3);
  EXPECT_EQ(models::config_num_layers("llama", small_llama()), 2);
  const nlohmann::json deep = models::config_with_num_layers("llama", small_llama(), 7);
  EXPECT_EQ(deep["num_hidden_layers"], 7);
  EXPECT_EQ(deep["hidden_size"], 64);
  EXPECT_THROW(models::config_with_num_layers("gpt", small_gpt(1).to_json(), 0), ValueError);
  nlohmann::json bad = small_gpt(1).to_json();
  bad["n_layer"] = -1;
  EXPECT_THROW(models::config_num_layers("gpt", bad), ValueError);
  bad.erase("n_layer");
  EXPECT_THROW(models::config_num_layers("gpt", bad), ValueError);  // required since 20e00c4
  EXPECT_THROW(models::config_num_layers("bert", bad), ValueError);
}

TEST(System, MemoryAndCoresArePositiveAndWithinTheMachine) {
  const int64_t total = physical_memory_bytes();
  const int64_t available = available_memory_bytes();
  EXPECT_GT(total, 0);
  EXPECT_GT(available, 0);
  EXPECT_LE(available, total);
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  meminfo >> key >> kib;
  ASSERT_EQ(key, "MemTotal:");
  EXPECT_LE(total, kib * 1024);
  EXPECT_GE(usable_cores(), 1);
  EXPECT_LE(usable_cores(), static_cast<int>(std::thread::hardware_concurrency()));
}

// A step traced at 2 and 3 samples gives the step at any larger batch: the rewritten trace's dump
// (every op, tensor shape and byte count, FLOPs, edges) and memory events are those of the trace
// made at that batch, for GPT and a GQA Llama, with and without recomputation and bf16
// activations, at 1 and 2 blocks.
TEST(BatchTraces, TheStepAtAnyBatchIsTheTracedOne) {
  const nlohmann::json llama = {{"hidden_size", 64},
                                {"intermediate_size", 176},
                                {"num_hidden_layers", 2},
                                {"num_attention_heads", 4},
                                {"num_key_value_heads", 2},
                                {"vocab_size", 256},
                                {"max_position_embeddings", 64}};
  std::vector<trace::TraceOptions> options(4);
  options[1].recompute = trace::Recompute::kBlock;
  options[2].recompute = trace::Recompute::kSelective;
  options[3].recompute = trace::Recompute::kBlock;
  options[3].recompute_blocks = 1;
  options[3].bf16_activations = true;
  const int64_t T = 16;
  int compared = 0;
  for (const auto& ref : {trace::ModelRef::registry("gpt", small_gpt().to_json()),
                          trace::ModelRef::registry("llama", llama)}) {
    for (const int64_t layers : {1, 2}) {
      for (const auto& o : options) {
        trace::BatchTraces pair(ref.trace(layers, 2, T, o).trace, ref.trace(layers, 3, T, o).trace);
        ASSERT_TRUE(pair.affine()) << ref.type() << " at " << layers << " blocks";
        for (const int64_t b : {2, 3, 4, 7, 4}) {  // back to 4: the copy is rewritten again
          const trace::Trace traced = ref.trace(layers, b, T, o).trace;
          const trace::Trace& made = pair.at(b);
          ASSERT_EQ(trace::to_json(made), trace::to_json(traced)) << ref.type() << " batch " << b;
          ASSERT_EQ(made.graph.memory_events().size(), traced.graph.memory_events().size());
          for (size_t i = 0; i < made.graph.memory_events().size(); ++i) {
            ASSERT_EQ(made.graph.memory_events()[i].bytes, traced.graph.memory_events()[i].bytes)
                << ref.type() << " batch " << b << " event " << i;
          }
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 2 * 2 * 4 * 5);
  trace::BatchTraces pair(
      trace::ModelRef::registry("gpt", small_gpt().to_json()).trace(1, 2, T, {}).trace,
      trace::ModelRef::registry("gpt", small_gpt().to_json()).trace(1, 3, T, {}).trace);
  EXPECT_THROW((void)pair.at(1), ValueError);
}

// A moved trace hands its graph over (Boost's adjacency_list has no move: Graph holds it by
// pointer) and leaves an empty one; a copy is a deep copy, equal in its dump.
TEST(Trace, GraphsMoveWithoutCopyingAndCopyDeeply) {
  auto model = models::create_meta_model("gpt", small_gpt().to_json(), 2);
  const Tensor idx = empty({2, 16}, {DType::kInt64, Device::kMeta});
  trace::Trace t = trace::trace(*model, {idx, idx});
  const nlohmann::json dump = trace::to_json(t);
  const size_t vertices = t.graph.num_vertices();
  ASSERT_GT(vertices, 10u);
  const trace::Vertex* first = &t.graph.vertex(0);
  trace::Trace moved = std::move(t);
  EXPECT_EQ(&moved.graph.vertex(0), first) << "the vertices were copied, not handed over";
  EXPECT_EQ(t.graph.num_vertices(), 0u);  // NOLINT(bugprone-use-after-move): the moved-from state
  EXPECT_TRUE(t.graph.ops().empty());     // NOLINT(bugprone-use-after-move)
  trace::Trace copy = moved;
  EXPECT_NE(&copy.graph.vertex(0), first);
  EXPECT_EQ(trace::to_json(copy), dump);
  const trace::Vertex* copied = &copy.graph.vertex(0);
  t = std::move(copy);
  EXPECT_EQ(&t.graph.vertex(0), copied) << "move-assigned by copying";
  EXPECT_EQ(trace::to_json(t), dump);
  EXPECT_EQ(copy.graph.num_vertices(), 0u);  // NOLINT(bugprone-use-after-move)
  copy = t;                                  // copy-assigned: deep
  EXPECT_NE(&copy.graph.vertex(0), copied);
  EXPECT_EQ(trace::to_json(copy), dump);
}

// A rewrite that counts its calls in `calls` and throws Exc(`message`): a model that fails to
// trace.
template <class Exc>
trace::ModelRef::Rewrite throwing_rewrite(int& calls, std::string message) {
  return [&calls, message](nn::Module&, const data::Batch&,
                           const trace::BatchLoss&) -> std::pair<nn::Undo, trace::BatchLoss> {
    ++calls;
    throw Exc(message);
  };
}

// The trace cache keeps a refusal of the model's (a layout that cannot be made) and throws it again
// without tracing again; recomputing none of the blocks is the trace without recomputation; a cache
// keeps one model's traces (any depth of it: a pipeline rank's share of the blocks).
TEST(TraceCache, KeepsRefusalsAndKeysAlikeOptionsAlike) {
  const int64_t T = 16;
  const auto gpt = trace::ModelRef::registry("gpt", small_gpt(4).to_json());
  auto cache = std::make_shared<trace::TraceCache>();
  int rewrites = 0;
  const auto refusing =
      gpt.rewritten(throwing_rewrite<ValueError>(
                        rewrites, "tensor_parallel: 4 heads do not divide over 3 ranks"))
          .shared_traces(cache, "refusing");
  for (int ask = 0; ask < 3; ++ask) {
    try {
      (void)refusing.traced(1, 2, T, {});
      ADD_FAILURE() << "no refusal";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("4 heads do not divide over 3 ranks"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(rewrites, 1);
  EXPECT_EQ(cache->refused(), 1u);
  EXPECT_EQ(cache->traced(), 0u);
  EXPECT_EQ(cache->served(), 2u);

  const auto kept = gpt.shared_traces(cache, "plain");
  trace::TraceOptions none_recomputed;
  none_recomputed.recompute = trace::Recompute::kBlock;
  none_recomputed.recompute_blocks = 0;
  const auto a = kept.traced(2, 2, T, none_recomputed);
  const auto b = kept.traced(2, 2, T, {});
  EXPECT_EQ(a.get(), b.get());
  nlohmann::json kept_dump = trace::to_json(a->trace),
                 fresh_dump = trace::to_json(gpt.trace(2, 2, T, {}).trace);
  kept_dump.erase("options");
  fresh_dump.erase("options");
  EXPECT_EQ(kept_dump, fresh_dump);
  trace::TraceOptions first_recomputed = none_recomputed;
  first_recomputed.recompute_blocks = 1;
  EXPECT_NE(kept.traced(2, 2, T, first_recomputed).get(), a.get());
  EXPECT_EQ(cache->traced(), 2u);

  // Another depth of the same model shares the cache; another model does not.
  nlohmann::json deeper = small_gpt(4).to_json();
  deeper["n_layer"] = 12;
  EXPECT_NO_THROW((void)trace::ModelRef::registry("gpt", deeper).shared_traces(cache, "deep"));
  nlohmann::json wider = small_gpt(4).to_json();
  wider["n_embd"] = 128;
  EXPECT_THROW((void)trace::ModelRef::registry("gpt", wider).shared_traces(cache, "plain"),
               InternalError);

  // What is not the model refusing (here an InternalError) is not kept: asked again, traced again.
  int failing = 0;
  const auto broken =
      gpt.rewritten(throwing_rewrite<InternalError>(failing, "a bug, not a refusal"))
          .shared_traces(cache, "broken");
  EXPECT_THROW((void)broken.traced(1, 2, T, {}), InternalError);
  EXPECT_THROW((void)broken.traced(1, 2, T, {}), InternalError);
  EXPECT_EQ(failing, 2);
  EXPECT_EQ(cache->refused(), 1u);
}

// A cache that keeps traces of at most 2 blocks (the search's): a deeper trace is made each time
// it is asked, equal to one made fresh, and counted as made and dropped; a shallow one is kept;
// a deeper refusal is kept all the same (asked again, thrown without tracing again); the figures
// made from a deep trace are kept. A negative bound is refused by name.
TEST(TraceCache, KeepsTracesUpToItsBlockBoundAndEveryRefusal) {
  const int64_t T = 16;
  const auto gpt = trace::ModelRef::registry("gpt", small_gpt(4).to_json());
  auto cache = std::make_shared<trace::TraceCache>(2);
  const auto kept = gpt.shared_traces(cache, "plain");
  const auto shallow = kept.traced(2, 2, T, {});
  EXPECT_EQ(kept.traced(2, 2, T, {}).get(), shallow.get());
  const auto deep = kept.traced(3, 2, T, {});
  const auto again = kept.traced(3, 2, T, {});
  EXPECT_NE(deep.get(), again.get());
  EXPECT_EQ(trace::to_json(deep->trace), trace::to_json(again->trace));
  nlohmann::json fresh = trace::to_json(gpt.trace(3, 2, T, {}).trace);
  EXPECT_EQ(trace::to_json(deep->trace), fresh);
  EXPECT_EQ(cache->traced(), 3u);  // the shallow one, the deep one twice
  EXPECT_EQ(cache->dropped(), 2u);
  EXPECT_EQ(cache->served(), 1u);

  int made = 0;
  auto figures = [&] {
    ++made;
    return std::shared_ptr<const trace::TraceFigures>();
  };
  (void)kept.figures(3, 2, T, {}, "what", figures);
  (void)kept.figures(3, 2, T, {}, "what", figures);
  EXPECT_EQ(made, 1);

  int rewrites = 0;
  const auto refusing = gpt.rewritten(throwing_rewrite<ValueError>(rewrites, "heads do not divide"))
                            .shared_traces(cache, "refusing");
  EXPECT_THROW((void)refusing.traced(4, 2, T, {}), ValueError);
  EXPECT_THROW((void)refusing.traced(4, 2, T, {}), ValueError);
  EXPECT_EQ(rewrites, 1);
  EXPECT_EQ(cache->refused(), 1u);

  try {
    trace::TraceCache bad(-1);
    ADD_FAILURE() << "kept_blocks -1 accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("kept_blocks must be >= 0, got -1"), std::string::npos)
        << e.what();
  }
}

// A digest of one reader's: the trace's op count and a serial number (which digest was served).
struct CountedDigest final : trace::TraceDigest {
  size_t ops = 0;
  int serial = 0;
};

// A cache that keeps its shallow traces as digests (the search's, for its time model): a trace of
// at most 2 blocks is digested when it is made, the digest kept and served (no trace made again
// for it), the trace itself dropped and made again when asked; a deeper trace is not digested by
// the cache (digest() makes one from a fresh trace each time); a refusal is thrown through
// digest() as through traced(), kept; without a cache digest() is the maker's of a fresh trace.
// An empty maker is refused by name.
TEST(TraceCache, KeepsShallowTracesAsTheirDigests) {
  const int64_t T = 16;
  const auto gpt = trace::ModelRef::registry("gpt", small_gpt(4).to_json());
  int digested = 0;
  const trace::DigestMaker make = [&](const trace::Trace& t) {
    auto d = std::make_shared<CountedDigest>();
    d->ops = t.graph.ops().size();
    d->serial = ++digested;
    return d;
  };
  auto counted = [](const std::shared_ptr<const trace::TraceDigest>& d) {
    return dynamic_cast<const CountedDigest&>(*d);
  };
  auto cache = std::make_shared<trace::TraceCache>(2, make);
  const auto kept = gpt.shared_traces(cache, "plain");
  const size_t ops = gpt.trace(2, 2, T, {}).trace.graph.ops().size();
  const auto first = kept.traced(2, 2, T, {});
  EXPECT_EQ(first->trace.graph.ops().size(), ops);
  EXPECT_EQ(digested, 1);
  EXPECT_EQ(counted(kept.digest(2, 2, T, {}, make)).serial, 1);  // served, not made again
  EXPECT_EQ(counted(kept.digest(2, 2, T, {}, make)).ops, ops);
  EXPECT_EQ(digested, 1);
  EXPECT_NE(kept.traced(2, 2, T, {}).get(), first.get());        // the trace was not kept
  EXPECT_EQ(counted(kept.digest(1, 3, T, {}, make)).serial, 2);  // made with its trace
  EXPECT_EQ(counted(kept.digest(1, 3, T, {}, make)).serial, 2);
  EXPECT_EQ(cache->digests_made(), 2u);
  EXPECT_EQ(cache->digests_served(), 3u);
  EXPECT_EQ(cache->traced(), 3u);
  EXPECT_EQ(cache->dropped(), 3u);
  EXPECT_EQ(cache->served(), 0u);

  // Deeper than the bound: not the cache's to keep; digest() digests a fresh trace each time.
  EXPECT_EQ(counted(kept.digest(3, 2, T, {}, make)).serial, 3);
  EXPECT_EQ(counted(kept.digest(3, 2, T, {}, make)).serial, 4);
  EXPECT_EQ(cache->digests_made(), 2u);

  int rewrites = 0;
  const auto refusing = gpt.rewritten(throwing_rewrite<ValueError>(rewrites, "heads do not divide"))
                            .shared_traces(cache, "refusing");
  EXPECT_THROW((void)refusing.digest(1, 2, T, {}, make), ValueError);
  EXPECT_THROW((void)refusing.digest(1, 2, T, {}, make), ValueError);
  EXPECT_THROW((void)refusing.traced(1, 2, T, {}), ValueError);
  EXPECT_EQ(rewrites, 1);
  EXPECT_EQ(cache->refused(), 1u);

  EXPECT_EQ(counted(gpt.digest(2, 2, T, {}, make)).ops, ops);  // no cache
  EXPECT_EQ(digested, 5);

  try {
    trace::TraceCache bad(2, trace::DigestMaker{});
    ADD_FAILURE() << "an empty digest maker accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("an empty digest maker"), std::string::npos) << e.what();
  }
}

// ModelRef::at_depth: the registry model at another depth (a pipeline rank's blocks), checked as
// registry() checks it, tracing as registry() of that config does.
TEST(ModelRef, AtDepthIsTheRegistryModelAtThatDepth) {
  const auto gpt = trace::ModelRef::registry("gpt", small_gpt(4).to_json());
  const auto deep = gpt.at_depth(12);
  EXPECT_EQ(deep.num_layers(), 12);
  EXPECT_EQ(deep.config()["n_layer"], 12);
  EXPECT_EQ(gpt.num_layers(), 4);
  EXPECT_EQ(deep.hash(), trace::ModelRef::registry("gpt", deep.config()).hash());
  EXPECT_NE(deep.hash(), gpt.hash());
  EXPECT_THROW((void)gpt.at_depth(0), ValueError);
  auto user = std::make_shared<UserModel>();
  const auto module = trace::ModelRef::module(
      user, data::Batch(std::vector<data::Batch::Entry>{{"x", randn({2, 8})}}),
      [](nn::Module& m, const data::Batch& b) { return sum(m.forward(b.at("x"))); });
  EXPECT_THROW((void)module.at_depth(2), ValueError);
}

}  // namespace
}  // namespace acc
