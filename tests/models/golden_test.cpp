// Golden tests against PyTorch (tests/golden/make_golden.py): logits, loss, every gradient and
// ten AdamW steps (with and without clipping) of a tiny GPT and a tiny Llama, for both the fused
// flash attention and the reference attention path.
//
// Tolerances (fp32 vs fp32 PyTorch; tests/golden/README.md measured fp32-vs-fp64 differences of
// ~1e-6 on these values): logits and gradients within 1e-4 + 1e-4*|ref|; losses within 1e-4
// relative; final parameters after 10 AdamW steps within 1e-4 + 1e-4*|ref|.

#include <gtest/gtest.h>

#include <cmath>

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
    std::vector<double> losses;
    for (int step = 0; step < 10; ++step) {
      opt.zero_grad();
      Tensor loss = model_->loss(idx_, targets_);
      losses.push_back(loss.item());
      loss.backward();
      if (clip > 0) optim::clip_grad_norm_(model_->named_parameters(), clip);
      opt.step();
    }
    return losses;
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

}  // namespace
}  // namespace acc
