// The attentions take their heads from their projections: with q/k/v projections replaced by the
// rows of some heads (nn::fused_qkv_rows, nn::qkv_rows), an attention computes exactly those heads
// of the whole attention's output before the output projection; widths that are not whole heads
// are refused by name.
//
// Equal by construction, so compared bitwise: the inputs and weights are multiples of 1/4 and 1/8
// small enough that every projection is exact in f32 whatever order a GEMM sums in (the shard's
// GEMM has fewer columns than the whole one), and the fused attention kernel computes each head
// from that head's q, k and v only, in the same way whatever the number of heads.

#include <gtest/gtest.h>

#include "acc/nn/nn.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

using test::error_of;

struct Identity : nn::Module {
  Identity() : nn::Module("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
};

// Values on a grid of `step` in [-range, range], deterministic in `seed`.
void fill_grid(Tensor& t, float step, int range_steps, int seed) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t v = (i * 7 + seed * 13 + (i * i) % 11) % (2 * range_steps + 1) - range_steps;
    p[i] = static_cast<float>(v) * step;
  }
}

void gridify(nn::Module& m, int seed) {
  NoGradGuard ng;
  for (auto& [name, p] : m.named_parameters()) fill_grid(p, 0.125f, 8, seed++);
}

Tensor grid_input(int64_t B, int64_t T, int64_t C) {
  Tensor x = empty({B, T, C});
  fill_grid(x, 0.25f, 8, 5);
  return x;
}

// A Linear holding the rows `blocks` of `whole` (weight and, when it has one, bias).
std::shared_ptr<nn::Linear> linear_rows(nn::Linear& whole,
                                        const std::vector<nn::RowBlock>& blocks) {
  int64_t rows = 0;
  for (const auto& b : blocks) rows += b.size;
  auto shard = std::make_shared<nn::Linear>(whole.in_features(), rows, whole.bias().defined());
  NoGradGuard ng;
  shard->weight().copy_(nn::gather_rows(whole.weight(), blocks));
  if (whole.bias().defined()) shard->bias().copy_(nn::gather_rows(whole.bias(), blocks));
  return shard;
}

std::vector<float> features(const Tensor& y, int64_t first, int64_t count) {
  return y.narrow(2, first, count).contiguous().to_vector<float>();
}

TEST(AttentionHeads, GptAttentionOfTwoOfFourHeadsIsTheirSliceOfTheWhole) {
  const int64_t B = 2, T = 9, C = 16, NH = 4, HS = C / NH;
  auto attn = std::make_shared<nn::CausalSelfAttention>(C, NH, /*bias=*/true);
  gridify(*attn, 1);
  auto c_attn = std::static_pointer_cast<nn::Linear>(attn->submodule("c_attn"));
  const Tensor x = grid_input(B, T, C);
  // The output before the output projection.
  nn::Undo no_proj = attn->replace_module("c_proj", std::make_shared<Identity>());
  const Tensor whole = (*attn)(x);
  ASSERT_EQ(whole.shape(), (Shape{B, T, C}));
  for (int tp : {2, 4}) {
    for (int r = 0; r < tp; ++r) {
      const auto blocks = nn::fused_qkv_rows(NH, HS, tp, r);
      nn::Undo undo =
          attn->replace_module("c_attn", linear_rows(*c_attn, {blocks.begin(), blocks.end()}));
      const Tensor y = (*attn)(x);
      const int64_t width = C / tp;
      ASSERT_EQ(y.shape(), (Shape{B, T, width})) << "tp " << tp << " rank " << r;
      EXPECT_EQ(y.to_vector<float>(), features(whole, r * width, width))
          << "tp " << tp << " rank " << r;
      undo();
    }
  }
  // Two heads, but not the rows fused_qkv_rows gives (q of heads 0-1, k and v of heads 2-3): the
  // comparison can tell.
  nn::Undo wrong = attn->replace_module(
      "c_attn",
      linear_rows(*c_attn, {{0, 2 * HS}, {C + 2 * HS, 2 * HS}, {2 * C + 2 * HS, 2 * HS}}));
  EXPECT_NE((*attn)(x).to_vector<float>(), features(whole, 0, 2 * HS));
  wrong();
  no_proj();
  EXPECT_EQ((*attn)(x).shape(), (Shape{B, T, C}));
}

TEST(AttentionHeads, LlamaAttentionOfItsShardsHeadsIsTheirSliceOfTheWhole) {
  const int64_t B = 2, T = 7, C = 16, NH = 4, NKV = 2, HS = 4;
  auto rope = rope_cache(32, HS, 10000.0);
  auto attn = std::make_shared<nn::LlamaAttention>(C, NH, NKV, HS, rope);
  gridify(*attn, 2);
  auto proj = [&](const char* name) {
    return std::static_pointer_cast<nn::Linear>(attn->submodule(name));
  };
  auto q_proj = proj("q_proj"), k_proj = proj("k_proj"), v_proj = proj("v_proj");
  const Tensor x = grid_input(B, T, C);
  nn::Undo no_proj = attn->replace_module("o_proj", std::make_shared<Identity>());
  const Tensor whole = (*attn)(x);
  ASSERT_EQ(whole.shape(), (Shape{B, T, NH * HS}));
  // tp 2: 2 query heads and their kv head each; tp 4: 1 query head, its kv head shared by 2 ranks.
  for (int tp : {2, 4}) {
    for (int r = 0; r < tp; ++r) {
      const nn::QkvRows rows = nn::qkv_rows(NH, NKV, HS, tp, r);
      std::vector<nn::Undo> undos;
      undos.push_back(attn->replace_module("q_proj", linear_rows(*q_proj, {rows.q})));
      undos.push_back(attn->replace_module("k_proj", linear_rows(*k_proj, {rows.k})));
      undos.push_back(attn->replace_module("v_proj", linear_rows(*v_proj, {rows.v})));
      const Tensor y = (*attn)(x);
      ASSERT_EQ(y.shape(), (Shape{B, T, rows.q.size})) << "tp " << tp << " rank " << r;
      EXPECT_EQ(y.to_vector<float>(), features(whole, rows.q.offset, rows.q.size))
          << "tp " << tp << " rank " << r;
      for (auto it = undos.rbegin(); it != undos.rend(); ++it) (*it)();
    }
  }
  no_proj();
}

TEST(AttentionHeads, WidthsThatAreNotWholeHeadsAreRefused) {
  const int64_t C = 16;
  const Tensor x = grid_input(1, 3, C);
  auto gpt = std::make_shared<nn::CausalSelfAttention>(C, 4, true);
  auto outer = std::make_shared<nn::Module>("Outer");
  outer->register_module("attn", gpt);
  nn::Undo u1 = gpt->replace_module("c_attn", std::make_shared<nn::Linear>(C, 3 * 4 + 1));
  std::string msg = error_of<ShapeError>([&] { (*gpt)(x); });
  EXPECT_NE(msg.find("CausalSelfAttention 'attn': c_attn gives 13 features, not 3 x a multiple of "
                     "head_dim 4 (q | k | v of whole heads)"),
            std::string::npos)
      << msg;
  u1();

  auto llama = std::make_shared<nn::LlamaAttention>(C, 4, 2, 4, rope_cache(8, 4, 1e4));
  struct Row {
    const char* proj;
    int64_t width;
    std::string expect;
  };
  const std::vector<Row> rows = {
      {"q_proj", 6, "LlamaAttention '': q_proj gives 6 features, not a multiple of head_dim 4"},
      {"k_proj", 2, "k_proj gives 2 features, not a multiple of head_dim 4"},
      {"q_proj", 12, "3 query heads (q_proj) are not a multiple of 2 key/value heads (k_proj)"},
      {"v_proj", 4, "v_proj gives [1, 3, 4] but k_proj [1, 3, 8] (a value head per key head)"},
  };
  for (const auto& r : rows) {
    nn::Undo u = llama->replace_module(r.proj, std::make_shared<nn::Linear>(C, r.width, false));
    msg = error_of<ShapeError>([&] { (*llama)(x); });
    EXPECT_NE(msg.find(r.expect), std::string::npos) << msg;
    u();
  }
  EXPECT_EQ((*llama)(x).shape(), (Shape{1, 3, C}));
}

}  // namespace
}  // namespace acc
