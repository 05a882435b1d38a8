#include <gtest/gtest.h>

#include "acc/autograd/flops.hpp"
#include "acc/autograd/recompute.hpp"
#include "acc/models/models.hpp"
#include "acc/nn/nn.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

// A user-defined module, written the way a user would.
struct TwoLayer : nn::Module {
  TwoLayer() : nn::Module("TwoLayer") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(4, 8));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(8, 2, /*bias=*/false));
    register_buffer("scale", full({1}, 2.0));
    register_buffer("cache", zeros({3}), /*persistent=*/false);
  }
  Tensor forward(const Tensor& x) override { return (*fc2)(relu((*fc1)(x))); }
  std::shared_ptr<nn::Linear> fc1, fc2;
};

Tensor& entry(nn::NamedTensors& v, const std::string& name) {
  for (auto& [n, t] : v) {
    if (n == name) return t;
  }
  throw std::runtime_error("no entry " + name);
}

std::vector<std::string> names(const nn::NamedTensors& v) {
  std::vector<std::string> out;
  for (auto& [n, t] : v) out.push_back(n);
  return out;
}

TEST(Module, NamedParametersAreDottedInRegistrationOrder) {
  auto m = std::make_shared<TwoLayer>();
  EXPECT_EQ(names(m->named_parameters()),
            (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight"}));
  EXPECT_EQ(names(m->named_buffers()), (std::vector<std::string>{"scale", "cache"}));
  // As in PyTorch: each module's own parameters and buffers, then its children's.
  EXPECT_EQ(names(m->state_dict()),
            (std::vector<std::string>{"scale", "fc1.weight", "fc1.bias", "fc2.weight"}));
  EXPECT_EQ(m->num_parameters(), 4 * 8 + 8 + 8 * 2);
  for (auto& [n, p] : m->named_parameters()) EXPECT_TRUE(p.requires_grad()) << n;
  auto mods = m->named_modules();
  ASSERT_EQ(mods.size(), 3u);
  EXPECT_EQ(mods[0].first, "");
  EXPECT_EQ(mods[1].first, "fc1");
  EXPECT_EQ(m->fc2->qualified_name(), "fc2");
  EXPECT_EQ(m->submodule("fc2").get(), m->fc2.get());
  EXPECT_TRUE(m->find_tensor("fc1.bias").is_same(m->fc1->bias()));
  EXPECT_THROW(m->submodule("fc3"), ValueError);
  EXPECT_THROW(m->find_tensor("fc1.gamma"), ValueError);
}

TEST(Module, DuplicateAndBadNamesAreRejected) {
  nn::Module m("M");
  m.register_parameter("w", zeros({2}));
  EXPECT_THROW(m.register_parameter("w", zeros({2})), ValueError);
  EXPECT_THROW(m.register_buffer("w", zeros({2})), ValueError);
  EXPECT_THROW(m.register_parameter("a.b", zeros({2})), ValueError);
  EXPECT_THROW(m.register_parameter("", zeros({2})), ValueError);
  EXPECT_THROW(m.register_parameter("u", Tensor()), ValueError);
}

TEST(Module, StateDictRoundTripAndChecks) {
  manual_seed(1);
  auto a = std::make_shared<TwoLayer>();
  manual_seed(2);
  auto b = std::make_shared<TwoLayer>();
  EXPECT_FALSE(allclose(a->fc1->weight(), b->fc1->weight()));
  b->load_state_dict(a->state_dict());
  EXPECT_TRUE(allclose(a->fc1->weight(), b->fc1->weight(), 0, 0));
  EXPECT_TRUE(allclose(a->fc2->weight(), b->fc2->weight(), 0, 0));

  auto sd = a->state_dict();
  entry(sd, "fc1.weight") = zeros({8, 5});
  try {
    b->load_state_dict(sd);
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("fc1.weight"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("[8, 5]"), std::string::npos);
  }
  auto missing = a->state_dict();
  missing.erase(missing.begin());  // "scale"
  missing.emplace_back("fc9.weight", zeros({1}));
  try {
    b->load_state_dict(missing);
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("missing keys: scale"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("unexpected keys: fc9.weight"), std::string::npos);
  }
  // A failed load changes nothing.
  manual_seed(3);
  auto c = std::make_shared<TwoLayer>();
  Tensor before = c->fc1->weight().clone();
  auto bad = a->state_dict();
  entry(bad, "fc2.weight") = zeros({3, 3});
  EXPECT_THROW(c->load_state_dict(bad), ShapeError);
  EXPECT_TRUE(allclose(c->fc1->weight(), before, 0, 0));
  // Non-strict ignores missing/unexpected names.
  c->load_state_dict(missing, /*strict=*/false);
  EXPECT_TRUE(allclose(c->fc1->weight(), a->fc1->weight(), 0, 0));
}

TEST(Module, TrainEvalPropagates) {
  auto m = std::make_shared<TwoLayer>();
  m->eval();
  EXPECT_FALSE(m->fc1->is_training());
  m->train();
  EXPECT_TRUE(m->fc2->is_training());
}

TEST(Module, CallRunsHooksWrapperAndScope) {
  auto m = std::make_shared<TwoLayer>();
  std::vector<std::string> log;
  m->fc1->register_forward_pre_hook(
      [&](nn::Module& mod, const Tensor&) { log.push_back("pre " + mod.qualified_name()); });
  int id = m->fc2->register_forward_hook([&](nn::Module&, const Tensor&, const Tensor& out) {
    log.push_back("post fc2 " + to_string(out.shape()) + " in " + nn::Module::current_scope());
  });
  m->fc1->set_forward_wrapper([&](nn::Module&, const Tensor& x, const auto& fwd) {
    log.push_back("wrap " + nn::Module::current_scope());
    return fwd(x);
  });
  Tensor y = (*m)(ones({3, 4}));
  EXPECT_EQ(y.shape(), (Shape{3, 2}));
  EXPECT_EQ(log, (std::vector<std::string>{"pre fc1", "wrap fc1", "post fc2 [3, 2] in fc2"}));
  m->fc2->remove_hook(id);
  log.clear();
  (*m)(ones({1, 4}));
  EXPECT_EQ(log.size(), 2u);
  EXPECT_EQ(nn::Module::current_scope(), "");
}

TEST(Module, ZeroGradClearsGradients) {
  auto m = std::make_shared<TwoLayer>();
  sum((*m)(ones({2, 4}))).backward();
  EXPECT_TRUE(m->fc1->weight().grad().defined());
  m->zero_grad(/*set_to_none=*/false);
  for (float v : m->fc1->weight().grad().to_vector<float>()) EXPECT_EQ(v, 0.f);
  m->zero_grad();
  EXPECT_FALSE(m->fc1->weight().grad().defined());
}

TEST(Module, ForwardWithoutOverrideThrows) {
  auto m = std::make_shared<nn::Module>("Plain");
  EXPECT_THROW((*m)(ones({1})), ValueError);
}

// A GPT of `layers` blocks, width 8, 2 heads, vocabulary 16, context 8.
models::GPTConfig tiny_gpt(int64_t layers) {
  models::GPTConfig c;
  c.n_layer = layers;
  c.n_head = 2;
  c.n_embd = 8;
  c.vocab_size = 16;
  c.block_size = 8;
  return c;
}

// parameters() and num_parameters() walk the modules without building names; they must list
// named_parameters()'s tensors in its order, a tied tensor once (GPT ties lm_head to wte).
TEST(Module, ParametersAreNamedParametersInOrderWithTiesOnce) {
  models::GPT gpt(tiny_gpt(3));
  const auto named = gpt.named_parameters();
  const auto plain = gpt.parameters();
  ASSERT_EQ(plain.size(), named.size());
  int64_t numel = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(plain[i].is_same(named[i].second)) << named[i].first;
    numel += named[i].second.numel();
  }
  EXPECT_EQ(gpt.num_parameters(), numel);
  // The tied head is counted once: 3 blocks of 12 C^2 + 13 C, the embeddings, the final norm.
  EXPECT_EQ(numel, 3 * (12 * 8 * 8 + 13 * 8) + 16 * 8 + 8 * 8 + 2 * 8);
  // Not recursing: the module's own only (a GPT's are all in its children).
  EXPECT_TRUE(gpt.parameters(false).empty());
}

TEST(Models, GptHasNanoGptNamesAndTiedEmbeddings) {
  models::GPT gpt(tiny_gpt(2));
  auto n = names(gpt.named_parameters());
  std::vector<std::string> expect = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (int i = 0; i < 2; ++i) {
    std::string p = "transformer.h." + std::to_string(i) + ".";
    for (const char* s :
         {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
          "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"}) {
      expect.push_back(p + s);
    }
  }
  expect.push_back("transformer.ln_f.weight");
  expect.push_back("transformer.ln_f.bias");
  EXPECT_EQ(n, expect);
  EXPECT_EQ(gpt.find_tensor("transformer.h.0.attn.c_attn.weight").shape(), (Shape{24, 8}));
  Tensor idx = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor logits = gpt.forward(idx);
  EXPECT_EQ(logits.shape(), (Shape{2, 3, 16}));
  Tensor loss = gpt.loss(idx, idx);
  EXPECT_NEAR(loss.item(), std::log(16.0), 0.5);
  EXPECT_THROW(gpt.forward(from_vector(std::vector<int64_t>(9, 0), {1, 9})), ValueError);
  EXPECT_THROW(gpt.forward(from_vector(std::vector<int64_t>{16}, {1, 1})), ValueError);
}

TEST(Models, LlamaHasHuggingFaceNames) {
  auto cfg = nlohmann::json{{"hidden_size", 16},
                            {"intermediate_size", 24},
                            {"num_hidden_layers", 1},
                            {"num_attention_heads", 4},
                            {"num_key_value_heads", 2},
                            {"vocab_size", 32},
                            {"max_position_embeddings", 8},
                            {"architectures", {"LlamaForCausalLM"}},
                            {"torch_dtype", "float32"}};
  auto model = models::create_model("llama", cfg);
  EXPECT_EQ(names(model->named_parameters()),
            (std::vector<std::string>{
                "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"}));
  EXPECT_EQ(model->find_tensor("model.layers.0.self_attn.k_proj.weight").shape(), (Shape{8, 16}));
  Tensor idx = from_vector(std::vector<int64_t>{1, 2, 3, 4}, {1, 4});
  EXPECT_EQ(model->forward(idx).shape(), (Shape{1, 4, 32}));
}

TEST(Models, BadConfigsNameTheField) {
  auto expect_error = [](const std::string& type, const nlohmann::json& j,
                         const std::string& needle) {
    try {
      models::create_model(type, j);
      FAIL() << "no error for " << j.dump();
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const nlohmann::json gpt = {{"n_layer", 2}, {"n_head", 4}, {"n_embd", 16}};
  auto with = [](nlohmann::json j, const nlohmann::json& more) {
    j.update(more);
    return j;
  };
  expect_error("gpt", with(gpt, {{"n_embd", 10}}), "n_embd 10");
  expect_error("gpt", with(gpt, {{"n_layers", 2}}), "unknown field 'n_layers'");
  expect_error("gpt", with(gpt, {{"n_layer", "two"}}), "'n_layer' must be an integer");
  // Out of range before any conversion (1e300 cast to int64 was undefined behaviour).
  expect_error("gpt", with(gpt, {{"n_layer", 1e300}}),
               "field 'n_layer' must be an integer that fits in 64 bits, got 1e+300");
  expect_error("gpt", with(gpt, {{"n_layer", 18446744073709551615ull}}), "fits in 64 bits");
  expect_error("gpt", with(gpt, {{"n_layer", 2.5}}), "must be an integer");
  expect_error("gpt", with(gpt, {{"activation", "swish2"}}), "swish2");
  expect_error("gpt", nlohmann::json::array(), "must be a JSON object");
  // A config without the fields that say which model it is (issue 16: a GPT config given to
  // llama built the 6.48B default Llama).
  expect_error("gpt", {{"n_embd", 10}, {"n_head", 4}},
               "gpt config is missing required field(s) n_layer; it has n_embd, n_head");
  expect_error("llama", gpt,
               "llama config is missing required field(s) hidden_size, intermediate_size, "
               "num_hidden_layers, num_attention_heads, vocab_size; it has n_embd, n_head, "
               "n_layer (is it a config for another model?)");
  expect_error("gpt", nlohmann::json::object(), "it has no fields");
  const nlohmann::json llama = {{"hidden_size", 48},
                                {"intermediate_size", 96},
                                {"num_hidden_layers", 1},
                                {"num_attention_heads", 6},
                                {"vocab_size", 32}};
  expect_error("llama", with(llama, {{"num_key_value_heads", 4}}), "num_key_value_heads 4");
  expect_error("llama", with(llama, {{"hidden_act", "gelu"}}), "hidden_act 'gelu'");
  expect_error("llama", with(llama, {{"rope_scaling", {{"type", "linear"}}}}), "rope_scaling");
  expect_error("bert", nlohmann::json::object(), "unknown model type 'bert'");
}

TEST(Models, FlopCounterMatchesGptClosedForm) {
  models::GPTConfig c;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 100;
  c.block_size = 32;
  DefaultDeviceGuard meta(Device::kMeta);  // counting needs shapes only
  models::GPT gpt(c);
  const int64_t B = 2, T = 32, C = 64, L = 3, V = 100, NH = 4, HS = 16;
  Tensor idx = empty({B, T}, {DType::kInt64, Device::kMeta});
  autograd::FlopCounter counter;
  Tensor loss = gpt.loss(idx, idx);
  const int64_t fwd = counter.count().forward;
  loss.backward();
  // Linear weights per block: 3C^2 + C^2 + 4C^2 + 4C^2 = 12 C^2, plus the tied lm_head V*C.
  const int64_t gemm = 2 * B * T * (L * 12 * C * C + V * C);
  const int64_t attention = 2 * B * NH * T * T * HS * L;  // causal
  EXPECT_EQ(fwd, gemm + attention);
  // Backward: dx and dw for every linear (the embedding lookup has no GEMM), 2x attention.
  EXPECT_EQ(counter.count().backward, 2 * gemm + 2 * attention);
}

// Recomputing every block's activations in backward gives the same loss and gradients as keeping
// them, with less memory held between forward and backward.
TEST(Models, CheckpointedBlocksMatchAndSaveMemory) {
  models::GPTConfig c;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 50;
  c.block_size = 64;
  c.dropout = 0.1;  // the recomputation must replay the same dropout masks
  manual_seed(11);
  models::GPT plain(c);
  manual_seed(11);
  models::GPT recomputed(c);
  for (const auto& block : recomputed.blocks()) {
    block->set_forward_wrapper(
        [](nn::Module&, const Tensor& x, const auto& fwd) { return recompute(fwd, x); });
  }
  Tensor idx = randint(0, 50, {4, 64});
  auto run = [&](models::GPT& m, int64_t* held) {
    manual_seed(99);
    const int64_t before = memory::current_bytes();
    Tensor loss = m.loss(idx, idx);
    *held = memory::current_bytes() - before;  // activations kept for backward
    loss.backward();
    return loss.item();
  };
  int64_t held_plain = 0, held_recomputed = 0;
  const double l1 = run(plain, &held_plain);
  const double l2 = run(recomputed, &held_recomputed);
  EXPECT_EQ(l1, l2);
  auto p1 = plain.named_parameters(), p2 = recomputed.named_parameters();
  for (size_t i = 0; i < p1.size(); ++i) {
    EXPECT_TRUE(allclose(p1[i].second.grad(), p2[i].second.grad(), 1e-5, 1e-6)) << p1[i].first;
  }
  EXPECT_LT(held_recomputed, held_plain / 2) << held_recomputed << " vs " << held_plain;
}

TEST(Models, MetaDeviceBuildsWithoutMemory) {
  const int64_t before = memory::current_bytes();
  DefaultDeviceGuard meta(Device::kMeta);
  models::GPTConfig c;  // GPT-2 small, 124M parameters
  models::GPT gpt(c);
  EXPECT_EQ(memory::current_bytes(), before);
  EXPECT_NEAR(static_cast<double>(gpt.num_parameters()), 124.0e6, 1.5e6);
  Tensor idx = empty({2, 64}, {DType::kInt64, Device::kMeta});
  Tensor loss = gpt.loss(idx, idx);
  EXPECT_TRUE(loss.is_meta());
  loss.backward();
  EXPECT_TRUE(gpt.find_tensor("transformer.wte.weight").grad().is_meta());
  EXPECT_EQ(memory::current_bytes(), before);
}

TEST(Models, MlpClassifierLearns) {
  manual_seed(0);
  models::MLP mlp({.in_features = 2, .hidden_sizes = {16}, .num_classes = 2});
  // XOR-ish: class = x0 * x1 > 0
  Tensor x = randn({64, 2});
  auto xv = x.to_vector<float>();
  std::vector<int64_t> y(64);
  for (int i = 0; i < 64; ++i) y[i] = xv[2 * i] * xv[2 * i + 1] > 0 ? 1 : 0;
  Tensor labels = from_vector(y, {64});
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    Tensor loss = mlp.loss(x, labels);
    if (step == 0) first = loss.item();
    last = loss.item();
    mlp.zero_grad();
    loss.backward();
    NoGradGuard ng;
    for (auto& [n, p] : mlp.named_parameters()) p.add_(p.grad(), -0.5);
  }
  EXPECT_LT(last, first * 0.5);
}

}  // namespace
}  // namespace acc

namespace acc {
namespace {

// A tied model's lm_head.weight in pretrained weights is accepted only when it is the embedding
// (PyTorch saves the tied tensor under both names); other content or shape used to be dropped.
TEST(Models, PretrainedLmHeadMustEqualTheTiedEmbedding) {
  auto model = models::create_model(
      "gpt", {{"n_layer", 1}, {"n_head", 2}, {"n_embd", 8}, {"vocab_size", 16}, {"block_size", 8}});
  nn::NamedTensors weights;
  for (const auto& [name, t] : model->state_dict()) weights.emplace_back(name, t.clone());
  const Tensor wte = model->find_tensor("transformer.wte.weight").clone();
  auto load_with_head = [&](const Tensor& head) {
    nn::NamedTensors w = weights;
    w.emplace_back("lm_head.weight", head);
    model->load_pretrained(w);
  };
  EXPECT_NO_THROW(load_with_head(wte.clone()));
  Tensor other = wte.clone();
  other.data<float>()[5] += 0.25f;
  try {
    load_with_head(other);
    FAIL() << "a different lm_head was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight differs from the tied "
                                         "transformer.wte.weight (max abs difference 0.25"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(load_with_head(zeros({16, 4})), ShapeError);
}

}  // namespace
}  // namespace acc

namespace acc {
namespace {

// A copy for the search's dry-runs: equal values in storage of its own, the attention path and
// mode kept, and the default generator untouched.
TEST(Models, CloneModelIsAnIndependentEqualCopy) {
  auto model = models::create_model("llama", {{"hidden_size", 16},
                                              {"intermediate_size", 32},
                                              {"num_hidden_layers", 2},
                                              {"num_attention_heads", 2},
                                              {"vocab_size", 32},
                                              {"max_position_embeddings", 8}});
  model->set_fused_attention(false);
  model->eval();
  manual_seed(99);
  const uint64_t control = default_generator().next_u64();
  manual_seed(99);
  auto copy = models::clone_model(*model);
  EXPECT_EQ(default_generator().next_u64(), control) << "clone_model drew from the generator";
  EXPECT_FALSE(copy->fused_attention());
  EXPECT_FALSE(copy->is_training());
  const auto a = model->state_dict(), b = copy->state_dict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << a[i].first;
    EXPECT_NE(a[i].second.raw_data(), b[i].second.raw_data()) << a[i].first << " shares storage";
  }
}

}  // namespace
}  // namespace acc
