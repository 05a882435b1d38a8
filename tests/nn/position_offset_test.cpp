// forward(idx, {.position_offset = k}): a chunk [k, k + T) of a sequence gets the positions the
// whole sequence gives those tokens. Bitwise, since the same table rows meet the same values:
// GPT's embedding (wte + wpe rows, elementwise) and Llama's rotary q/k (row t of the tables
// rotates position t, elementwise).

#include <gtest/gtest.h>

#include "acc/models/models.hpp"
#include "acc/nn/nn.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

using test::error_of;

std::vector<float> slice(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  return t.narrow(dim, start, length).contiguous().to_vector<float>();
}

TEST(PositionOffset, GptEmbeddingOfAChunkIsTheSliceOfTheWholeSequence) {
  manual_seed(5);
  models::GPT gpt({.n_layer = 1, .n_head = 2, .n_embd = 8, .vocab_size = 32, .block_size = 16});
  Generator gen(1);
  const Tensor idx = randint(0, 32, {2, 12}, gen);
  const Tensor whole = gpt.embed(idx);
  for (const auto& [k, T] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {4, 5}, {7, 5}, {11, 1}}) {
    const Tensor chunk = idx.narrow(1, k, T).contiguous();
    Tensor x;
    {
      nn::ForwardOptionsGuard at({.position_offset = k});
      x = gpt.embed(chunk);
    }
    EXPECT_EQ(x.to_vector<float>(), slice(whole, 1, k, T)) << "k " << k;
    if (k > 0) {
      // Not what the chunk gets at positions [0, T): the comparison can tell.
      EXPECT_NE(gpt.embed(chunk).to_vector<float>(), slice(whole, 1, k, T));
    }
  }
  // Through forward(idx, options): the first block receives the same values.
  Tensor block_input;
  const int hook = gpt.blocks()[0]->register_forward_pre_hook(
      [&](nn::Module&, const Tensor& in) { block_input = in; });
  const Tensor chunk = idx.narrow(1, 4, 6).contiguous();
  const Tensor logits = gpt.forward(chunk, {.position_offset = 4});
  EXPECT_EQ(block_input.to_vector<float>(), slice(whole, 1, 4, 6));
  EXPECT_EQ(nn::current_forward_options().position_offset, 0) << "the options outlived the call";
  // Offset 0 is today's computation.
  EXPECT_EQ(gpt.forward(idx, {}).to_vector<float>(), gpt.forward(idx).to_vector<float>());
  EXPECT_EQ(gpt.loss(chunk, chunk, {.position_offset = 4}).item(),
            gpt.loss_from_logits(logits, chunk).item());
  gpt.blocks()[0]->remove_hook(hook);
}

TEST(PositionOffset, LlamaRotaryOfAChunkIsTheSliceOfTheWholeSequence) {
  const int64_t C = 16, NH = 4, NKV = 2, HS = 4, L = 12;
  nn::LlamaAttention attn(C, NH, NKV, HS, rope_cache(16, HS, 10000.0));
  Generator gen(3);
  const Tensor q = randn({2, NH, L, HS}, gen), k = randn({2, NKV, L, HS}, gen);
  const Tensor q_whole = attn.rotate(q, 0), k_whole = attn.rotate(k, 0);
  for (const auto& [off, T] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {3, 4}, {8, 4}, {5, 7}}) {
    EXPECT_EQ(attn.rotate(q.narrow(2, off, T), off).to_vector<float>(), slice(q_whole, 2, off, T))
        << "q at " << off;
    EXPECT_EQ(attn.rotate(k.narrow(2, off, T), off).to_vector<float>(), slice(k_whole, 2, off, T))
        << "k at " << off;
    if (off > 0) {
      EXPECT_NE(attn.rotate(q.narrow(2, off, T), 0).to_vector<float>(), slice(q_whole, 2, off, T));
    }
  }
}

// forward rotates q and k at the current offset: it equals its own steps written out with rotate
// at that offset (the same ops on the same values).
TEST(PositionOffset, LlamaAttentionForwardRotatesAtTheOffset) {
  const int64_t B = 2, T = 5, C = 16, NH = 4, NKV = 2, HS = 4, off = 6;
  auto attn = std::make_shared<nn::LlamaAttention>(C, NH, NKV, HS, rope_cache(16, HS, 10000.0));
  Generator gen(9);
  const Tensor x = randn({B, T, C}, gen);
  auto proj = [&](const char* name, const Tensor& in) { return (*attn->submodule(name))(in); };
  const Tensor q = attn->rotate(proj("q_proj", x).view({B, T, NH, HS}).transpose(1, 2), off);
  const Tensor k = attn->rotate(proj("k_proj", x).view({B, T, NKV, HS}).transpose(1, 2), off);
  const Tensor v = proj("v_proj", x).view({B, T, NKV, HS}).transpose(1, 2);
  const Tensor y = scaled_dot_product_attention(q, k, v, true).transpose(1, 2).reshape({B, T, C});
  const Tensor want = proj("o_proj", y);
  nn::ForwardOptionsGuard at({.position_offset = off});
  EXPECT_EQ((*attn)(x).to_vector<float>(), want.to_vector<float>());
}

// A module whose output depends on the offset in a way backward sees: y = x * w * (k + 1).
struct OffsetScaled : nn::Module {
  OffsetScaled() : nn::Module("OffsetScaled") { w = register_parameter("w", ones({4})); }
  Tensor forward(const Tensor& x) override {
    return scale(mul(x, w), static_cast<double>(nn::current_forward_options().position_offset + 1));
  }
  Tensor w;
};

// acc::recompute runs a block's forward again in backward, after the call (and its guard) are
// gone: the replay must see the options of the first run.
TEST(PositionOffset, RecomputedBlocksReplayWithTheOptionsOfTheirForward) {
  auto root = std::make_shared<nn::ModuleList>();
  auto block = root->push_back(std::make_shared<OffsetScaled>());
  nn::Undo undo = nn::recompute_blocks(*root, {"0"});
  Tensor x = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  x.set_requires_grad(true);  // as a block's input is: acc::recompute then defers the replay
  Tensor loss;
  {
    nn::ForwardOptionsGuard at({.position_offset = 2});
    loss = sum((*root)(x));
  }
  loss.backward();  // outside the guard
  EXPECT_EQ(loss.item(), 36.0 * 3);
  EXPECT_EQ(block->w.grad().to_vector<float>(), (std::vector<float>{18, 24, 30, 36}));
  EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(8, 3.f));
  undo();
}

TEST(PositionOffset, PositionsPastTheModelAreRefused) {
  models::GPT gpt({.n_layer = 1, .n_head = 2, .n_embd = 8, .vocab_size = 32, .block_size = 16});
  const Tensor idx = from_vector(std::vector<int64_t>{1, 2, 3, 4}, {1, 4});
  std::string msg = error_of<ValueError>([&] { gpt.forward(idx, {.position_offset = 13}); });
  EXPECT_NE(msg.find("gpt: position_offset 13 with sequence length 4 gives positions [13, 17), not "
                     "within the model's 16 positions"),
            std::string::npos)
      << msg;
  msg = error_of<ValueError>([&] { gpt.loss(idx, idx, {.position_offset = -1}); });
  EXPECT_NE(msg.find("position_offset -1 with sequence length 4 gives positions [-1, 3)"),
            std::string::npos)
      << msg;
  EXPECT_NO_THROW(gpt.forward(idx, {.position_offset = 12}));

  auto llama = models::create_model("llama", {{"hidden_size", 16},
                                              {"intermediate_size", 24},
                                              {"num_hidden_layers", 1},
                                              {"num_attention_heads", 4},
                                              {"num_key_value_heads", 2},
                                              {"vocab_size", 32},
                                              {"max_position_embeddings", 8}});
  msg = error_of<ValueError>([&] { llama->forward(idx, {.position_offset = 5}); });
  EXPECT_NE(msg.find("llama: position_offset 5 with sequence length 4 gives positions [5, 9)"),
            std::string::npos)
      << msg;
  EXPECT_NO_THROW(llama->forward(idx, {.position_offset = 4}));
  // The attention checks on its own (blocks can be called without the model).
  auto& attn = static_cast<nn::LlamaBlock&>(*llama->blocks()[0]).self_attn();
  msg = error_of<ValueError>([&] { attn.rotate(randn({1, 4, 3, 4}), 6); });
  EXPECT_NE(msg.find("LlamaAttention: positions [6, 9) (position_offset 6, sequence length 3) are "
                     "not within max_position_embeddings 8"),
            std::string::npos)
      << msg;
  nn::ForwardOptionsGuard at({.position_offset = 7});
  msg = error_of<ValueError>([&] { attn(randn({1, 2, 16})); });
  EXPECT_NE(msg.find("positions [7, 9)"), std::string::npos) << msg;
}

}  // namespace
}  // namespace acc
