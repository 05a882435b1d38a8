// Golden tests against PyTorch (tests/golden/make_golden.py): logits, loss, every gradient and
// ten AdamW steps (with and without clipping) of a tiny GPT and a tiny Llama, for both the fused
// flash attention and the reference attention path.
//
// Tolerances (fp32 vs fp32 PyTorch; tests/golden/README.md measured fp32-vs-fp64 differences of
// ~1e-6 on these values): logits and gradients within 1e-4 + 1e-4*|ref|; losses within 1e-4
// relative; final parameters after 10 AdamW steps within 1e-4 + 1e-4*|ref|.

#include <gtest/gtest.h>

#include <cmath>

#include "acc/autograd/ops.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/optim/clip_grad.hpp"

namespace acc {
namespace {

struct Case {
  std::string name;
  std::string type;
  bool fused;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return info.param.name + (info.param.fused ? "_fused" : "_reference");
}

// `steps` AdamW steps of `model` on one batch (clipping the gradient norm to `clip` when > 0);
// the loss before each step.
std::vector<double> train_steps(models::LanguageModel& model, const Tensor& idx,
                                const Tensor& targets, optim::AdamW& opt, int steps, double clip) {
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    Tensor loss = model.loss(idx, targets);
    losses.push_back(loss.item());
    loss.backward();
    if (clip > 0) optim::clip_grad_norm_(model.named_parameters(), clip);
    opt.step();
  }
  return losses;
}

class Golden : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const std::string dir = ACC_GOLDEN_DIR;
    file_ = io::load_safetensors(dir + "/" + GetParam().name + ".safetensors");
    model_ = models::create_model(
        GetParam().type, models::read_json_file(dir + "/" + GetParam().name + ".config.json"));
    model_->set_fused_attention(GetParam().fused);
    nn::NamedTensors weights;
    for (auto& [name, t] : model_->state_dict()) weights.emplace_back(name, file_.at(name));
    model_->load_state_dict(weights);
    idx_ = file_.at("input.idx");
    targets_ = file_.at("input.targets");
  }

  // Elementwise |a - b| <= atol + rtol |b|, reporting the worst element.
  static void expect_close(const Tensor& got, const Tensor& want, double atol, double rtol,
                           const std::string& what) {
    ASSERT_EQ(got.shape(), want.shape()) << what;
    auto g = got.to_vector<double>(), w = want.to_vector<double>();
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      double excess = std::abs(g[i] - w[i]) - (atol + rtol * std::abs(w[i]));
      if (excess > worst || !std::isfinite(g[i])) {
        worst = std::isfinite(g[i]) ? excess : INFINITY;
        at = i;
      }
    }
    EXPECT_LE(worst, 0.0) << what << ": element " << at << " got " << g[at] << " want " << w[at];
  }

  std::vector<double> train_adamw(double clip) {
    optim::AdamW opt(model_->named_parameters(),
                     {.lr = 1e-2, .betas = {0.9, 0.95}, .eps = 1e-8, .weight_decay = 0.1});
    return train_steps(*model_, idx_, targets_, opt, 10, clip);
  }

  io::SafetensorsFile file_;
  models::LanguageModelPtr model_;
  Tensor idx_, targets_;
};

TEST_P(Golden, LogitsLossAndEveryGradientMatchPyTorch) {
  Tensor logits = model_->forward(idx_);
  expect_close(logits, file_.at("output.logits"), 1e-4, 1e-4, "logits");
  Tensor loss = model_->loss_from_logits(logits, targets_);
  const double want = file_.at("output.loss").item();
  EXPECT_NEAR(loss.item(), want, 1e-4 * std::abs(want));
  loss.backward();
  int checked = 0;
  for (auto& [name, p] : model_->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    expect_close(p.grad(), file_.at("grad." + name), 1e-4, 1e-4, "grad." + name);
    ++checked;
  }
  EXPECT_EQ(checked, GetParam().type == "gpt" ? 28 : 21);
}

TEST_P(Golden, TenAdamWStepsMatchPyTorch) {
  auto losses = train_adamw(0.0);
  auto want = file_.at("adamw.losses").to_vector<double>();
  ASSERT_EQ(want.size(), losses.size());
  for (size_t s = 0; s < want.size(); ++s) {
    EXPECT_NEAR(losses[s], want[s], 1e-4 * std::abs(want[s])) << "step " << s;
  }
  EXPECT_LT(losses.back(), losses.front() * 0.5);  // it actually trains
  for (auto& [name, p] : model_->named_parameters()) {
    Tensor got = p, ref = file_.at("adamw.final." + name);
    if (name.find("attn.c_attn.bias") != std::string::npos) {
      // The key bias has an exactly zero true gradient (softmax is invariant to it); its fp32
      // gradient is rounding noise that AdamW amplifies, so PyTorch's own fp32 and fp64 runs
      // disagree there (tests/golden/README.md). Compare the query and value parts only.
      const int64_t C = p.size(0) / 3;
      expect_close(got.narrow(0, 0, C), ref.narrow(0, 0, C), 1e-4, 1e-4, name + "[q]");
      expect_close(got.narrow(0, 2 * C, C), ref.narrow(0, 2 * C, C), 1e-4, 1e-4, name + "[v]");
      continue;
    }
    expect_close(got, ref, 1e-4, 1e-4, "adamw.final." + name);
  }
}

TEST_P(Golden, TenClippedAdamWStepsMatchPyTorch) {
  auto losses = train_adamw(0.05);
  auto want = file_.at("adamw.losses_clip").to_vector<double>();
  ASSERT_EQ(want.size(), losses.size());
  for (size_t s = 0; s < want.size(); ++s) {
    EXPECT_NEAR(losses[s], want[s], 1e-4 * std::abs(want[s])) << "step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Golden,
                         testing::Values(Case{"gpt_tiny", "gpt", true},
                                         Case{"gpt_tiny", "gpt", false},
                                         Case{"llama_tiny", "llama", true},
                                         Case{"llama_tiny", "llama", false}),
                         case_name);

// Padded GEMM rows (acc::gemm_row_padding) change where rows sit in memory, not what is computed.
// A GPT and a Llama whose widths are multiples of 512 with 64 rows (so LayerNorm / RMSNorm,
// attention, the MLP activation and the loss gradient all get padded rows) train three clipped
// AdamW steps to the same losses and parameters, bit for bit, with padding on and off.
TEST(PaddedGemmRows, ModelsTrainIdenticallyWithAndWithoutPadding) {
  const std::vector<std::pair<std::string, nlohmann::json>> configs = {
      {"gpt",
       {{"n_layer", 1}, {"n_head", 8}, {"n_embd", 512}, {"vocab_size", 512}, {"block_size", 64}}},
      {"llama",
       {{"hidden_size", 512},
        {"intermediate_size", 1024},
        {"num_hidden_layers", 1},
        {"num_attention_heads", 8},
        {"num_key_value_heads", 4},
        {"vocab_size", 512},
        {"max_position_embeddings", 64}}},
  };
  const int64_t T = 64;
  std::vector<int64_t> idx(T), targets(T);
  for (int64_t t = 0; t < T; ++t) {
    idx[static_cast<size_t>(t)] = (t * 37 + 11) % 512;
    targets[static_cast<size_t>(t)] = (t * 53 + 7) % 512;
  }
  const Tensor idx_t = from_vector(idx, {1, T}), targets_t = from_vector(targets, {1, T});
  const GemmRowPaddingGuard restore(gemm_row_padding());  // train() switches it
  for (const auto& [type, config] : configs) {
    nn::NamedTensors init;
    auto train = [&](bool pad) {
      set_gemm_row_padding(pad);
      models::LanguageModelPtr model = models::create_model(type, config);
      if (init.empty()) {
        for (auto& [name, t] : model->state_dict()) init.emplace_back(name, t.clone());
      } else {
        model->load_state_dict(init);
      }
      optim::AdamW opt(model->named_parameters(), {.lr = 1e-3, .weight_decay = 0.1});
      const std::vector<double> losses = train_steps(*model, idx_t, targets_t, opt, 3, 1.0);
      std::vector<std::vector<float>> params;
      for (auto& [name, p] : model->named_parameters()) params.push_back(p.to_vector<float>());
      return std::make_pair(losses, params);
    };
    const auto on = train(true), off = train(false);
    EXPECT_EQ(on.first, off.first) << type << ": losses";
    EXPECT_EQ(on.second, off.second) << type << ": parameters after three steps";
  }
}

}  // namespace
}  // namespace acc
