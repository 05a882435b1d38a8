// Megatron's column- and row-parallel linears (strategies/tp_layers.hpp) against the whole Linear
// on one rank, at whatever world size mpirun gives (CTest: 1, 2 and 4 ranks): outputs, the weight
// and bias gradients of each rank's block, and the input's gradient. fp32 with another summation
// order (a row-parallel output is a sum of partial products): within 1e-5 relative + 1e-6.
#include <gtest/gtest.h>

#include "../../strategies/tp_layers.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

constexpr int64_t kIn = 8, kOut = 12;

std::shared_ptr<nn::Linear> whole_linear() {
  Generator gen(3);
  return std::make_shared<nn::Linear>(kIn, kOut, true, gen);
}

Tensor input() {
  Generator gen(5);
  return randn({3, 5, kIn}, gen);
}

Tensor output_weights() {  // the loss is sum(y * r): every output element matters
  Generator gen(7);
  return randn({3, 5, kOut}, gen);
}

void expect_near(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto a = got.contiguous().to_vector<float>(), b = want.contiguous().to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_NEAR(a[i], b[i], 1e-6 + 1e-5 * std::abs(b[i])) << what << "[" << i << "]";
  }
}

struct Reference {
  Tensor y, dw, db, dx;
};

Reference reference() {
  auto lin = whole_linear();
  Tensor x = input();
  x.set_requires_grad(true);
  Tensor y = (*lin)(x);
  sum(mul(y, output_weights())).backward();
  NoGradGuard ng;
  return {y.detach(), lin->weight().grad(), lin->bias().grad(), x.grad()};
}

TEST(TensorParallelLinear, ColumnParallelKeepsItsRowsAndSumsTheInputGradient) {
  const int W = dist::world_size(), r = dist::rank();
  const Reference ref = reference();
  auto lin = whole_linear();
  const nn::RowBlock rows = strategies::even_block(kOut, W, r, "test");
  strategies::ColumnParallelLinear col(*lin, {rows}, dist::ProcessGroup::world());
  Tensor x = input();
  x.set_requires_grad(true);
  Tensor y = col(x);
  sum(mul(y, output_weights().narrow(2, rows.offset, rows.size))).backward();
  expect_near(y, ref.y.narrow(2, rows.offset, rows.size), "y");
  expect_near(col.weight().grad(), ref.dw.narrow(0, rows.offset, rows.size), "dW rows");
  expect_near(col.bias().grad(), ref.db.narrow(0, rows.offset, rows.size), "db rows");
  expect_near(x.grad(), ref.dx, "dx (summed over the ranks)");
}

TEST(TensorParallelLinear, RowParallelSumsThePartialsAndKeepsItsInputGradient) {
  const int W = dist::world_size(), r = dist::rank();
  const Reference ref = reference();
  auto lin = whole_linear();
  const nn::RowBlock cols = strategies::even_block(kIn, W, r, "test");
  strategies::RowParallelLinear row(*lin, {cols}, dist::ProcessGroup::world());
  Tensor x = input().narrow(2, cols.offset, cols.size).contiguous();
  x.set_requires_grad(true);
  Tensor y = row(x);
  sum(mul(y, output_weights())).backward();
  expect_near(y, ref.y, "y (every rank the whole output)");
  expect_near(row.weight().grad(), ref.dw.narrow(1, cols.offset, cols.size), "dW columns");
  expect_near(row.bias().grad(), ref.db, "db (replicated)");
  expect_near(x.grad(), ref.dx.narrow(2, cols.offset, cols.size), "dx of this rank's features");
}

// Column then row, as an MLP: the output equals the whole two-layer computation on every rank.
TEST(TensorParallelLinear, ColumnThenRowIsTheWholeMlp) {
  const int W = dist::world_size(), r = dist::rank();
  Generator gen(11);
  auto fc = std::make_shared<nn::Linear>(kIn, 4 * kIn, true, gen);
  auto proj = std::make_shared<nn::Linear>(4 * kIn, kIn, true, gen);
  Tensor x = input();
  const Tensor want = (*proj)(gelu((*fc)(x)));
  const nn::RowBlock hidden = strategies::even_block(4 * kIn, W, r, "test");
  strategies::ColumnParallelLinear col(*fc, {hidden}, dist::ProcessGroup::world());
  strategies::RowParallelLinear row(*proj, {hidden}, dist::ProcessGroup::world());
  expect_near(row(gelu(col(x))), want, "mlp");
}

// A fused q|k|v projection: each rank's three blocks (its heads of q, of k and of v) in order.
TEST(TensorParallelLinear, FusedQkvKeepsEachRanksHeadsOfQKAndV) {
  const int W = dist::world_size(), r = dist::rank();
  const int64_t heads = 4, head_dim = 2, C = heads * head_dim;
  if (heads % W != 0) GTEST_SKIP() << heads << " heads do not split over " << W;
  Generator gen(13);
  nn::Linear qkv(C, 3 * C, true, gen);
  Tensor x = randn({2, 3, C}, gen);
  const Tensor whole = qkv(x);
  const auto blocks = nn::fused_qkv_rows(heads, head_dim, W, r);
  strategies::ColumnParallelLinear col(qkv, {blocks.begin(), blocks.end()},
                                       dist::ProcessGroup::world());
  const Tensor mine = col(x);
  int64_t at = 0;
  for (const auto& b : blocks) {
    expect_near(mine.narrow(2, at, b.size), whole.narrow(2, b.offset, b.size), "qkv block");
    at += b.size;
  }
  EXPECT_EQ(at, 3 * C / W);
}

// Vocab-parallel cross-entropy against cross_entropy of the whole logits: the loss on every rank,
// and each rank's columns of the gradient; a vocabulary padded to a multiple of the ranks (padded
// columns get no gradient) and ignored rows.
TEST(VocabParallelCrossEntropy, EqualsTheWholeLossAndItsGradient) {
  const int W = dist::world_size(), r = dist::rank();
  for (const int64_t vocab : {int64_t{12}, int64_t{10}}) {
    const int64_t padded = (vocab + W - 1) / W * W, cols = padded / W;
    Generator gen(17);
    const Tensor whole = randn({3, 4, vocab}, gen);
    std::vector<int64_t> t = {0, 3, 9, 1, 5, -100, 7, 2, 8, 4, -100, 6};
    const Tensor targets = from_vector(t, {3, 4});
    Tensor ref_logits = whole.clone();
    ref_logits.set_requires_grad(true);
    Tensor ref = cross_entropy(ref_logits, targets);
    ref.backward();
    // This rank's columns of the padded logits (padding: arbitrary values, here large, which
    // must not count).
    Tensor padded_logits = full({3, 4, padded}, 50.0);
    {
      NoGradGuard ng;
      padded_logits.narrow(2, 0, vocab).copy_(whole);
    }
    Tensor mine = padded_logits.narrow(2, r * cols, cols).contiguous();
    mine.set_requires_grad(true);
    Tensor loss =
        strategies::vocab_parallel_cross_entropy(mine, targets, vocab, dist::ProcessGroup::world());
    EXPECT_NEAR(loss.item(), ref.item(), 1e-6 + 1e-6 * std::abs(ref.item())) << "vocab " << vocab;
    loss.backward();
    const auto g = mine.grad().to_vector<float>();
    const auto want = ref_logits.grad().to_vector<float>();
    for (int64_t i = 0; i < 12; ++i) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t v = r * cols + c;
        const float expect = v < vocab ? want[static_cast<size_t>(i * vocab + v)] : 0.0f;
        ASSERT_NEAR(g[static_cast<size_t>(i * cols + c)], expect, 1e-7)
            << "vocab " << vocab << " row " << i << " column " << v;
      }
    }
  }
}

// Vocab-parallel embedding against the whole table: the output on every rank (one rank's row plus
// zeros: bitwise), and each rank's rows of the gradient (padding rows: none); a vocabulary of 12
// and one of 10 padded to a multiple of the ranks.
TEST(VocabParallelEmbedding, EqualsTheWholeTableAndItsGradient) {
  const int W = dist::world_size();
  for (const int64_t vocab : {int64_t{12}, int64_t{10}}) {
    Generator gen(29);
    nn::Embedding whole(vocab, 6, gen);
    const Tensor idx = randint(0, vocab, {3, 5}, gen);
    const Tensor r = randn({3, 5, 6}, gen);
    Tensor want = whole(idx);
    sum(mul(want, r)).backward();
    strategies::VocabParallelEmbedding mine(whole, dist::ProcessGroup::world());
    Tensor got = mine(idx);
    EXPECT_EQ(got.to_vector<float>(), want.detach().to_vector<float>()) << "vocab " << vocab;
    sum(mul(got, r)).backward();
    const int64_t rows = (vocab + W - 1) / W;
    EXPECT_EQ(mine.weight().size(0), rows);
    const auto g = mine.weight().grad().to_vector<float>();
    const auto ref = whole.weight().grad().to_vector<float>();
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t v = mine.first_row() + row;
      for (int64_t c = 0; c < 6; ++c) {
        const float expect = v < vocab ? ref[static_cast<size_t>(v * 6 + c)] : 0.0f;
        ASSERT_EQ(g[static_cast<size_t>(row * 6 + c)], expect)
            << "vocab " << vocab << " row " << v << " column " << c;
      }
    }
  }
  Generator gen(31);
  nn::Embedding table(8, 4, gen);
  strategies::VocabParallelEmbedding mine(table, dist::ProcessGroup::world());
  try {
    mine(from_vector(std::vector<int64_t>{3, 8}, {2}));
    FAIL() << "id 8 of a vocabulary of 8";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("id 8 at position 1 is outside [0, 8)"), std::string::npos)
        << e.what();
  }
}

TEST(VocabParallelCrossEntropy, BadTargetsAreNamed) {
  const int W = dist::world_size();
  Tensor mine = zeros({2, 4});
  try {
    strategies::vocab_parallel_cross_entropy(mine, from_vector(std::vector<int64_t>{1, 4 * W}, {2}),
                                             4 * W, dist::ProcessGroup::world());
    FAIL() << "a target of the vocabulary's size was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("target " + std::to_string(4 * W) + " at row 1"),
              std::string::npos)
        << e.what();
  }
}

TEST(TensorParallelLinear, BadSplitsAreNamed) {
  auto lin = whole_linear();
  try {
    strategies::even_block(kOut, 5, 0, "c_fc columns");
    FAIL() << "12 split over 5";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("c_fc columns: 12 is not a multiple of 5"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(strategies::ColumnParallelLinear(*lin, {}, dist::ProcessGroup::world()), ValueError);
  EXPECT_THROW(strategies::RowParallelLinear(*lin, {{0, 4}}, nullptr), ValueError);
  EXPECT_THROW(strategies::ColumnParallelLinear(*lin, {{10, 4}}, dist::ProcessGroup::world()),
               ShapeError);
}

}  // namespace
}  // namespace acc
