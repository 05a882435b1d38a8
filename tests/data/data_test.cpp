#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "acc/data/token_data.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace acc::data {
namespace {

namespace fs = std::filesystem;

std::vector<int64_t> values(const Tensor& t) {
  EXPECT_EQ(t.dtype(), DType::kInt64);
  Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data<int64_t>(), c.data<int64_t>() + c.numel());
}

// Tokens 0, 1, ..., n-1: a token's value is its position, so windows are easy to check.
std::shared_ptr<const TokenFile> iota_tokens(int64_t n) {
  std::vector<uint32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 0u);
  return std::make_shared<const TokenFile>(std::move(t), "iota");
}

LoaderOptions options(int64_t B, int64_t T, SampleOrder order, uint64_t seed = 0, int rank = 0,
                      int world = 1) {
  return {
      .batch_size = B, .seq_len = T, .order = order, .seed = seed, .rank = rank, .world = world};
}

// Expects `fn` to throw E with `substring` in its message.
template <class E, class F>
void expect_error(F&& fn, const std::string& substring) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception containing '" << substring << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(substring), std::string::npos) << e.what();
  }
}

class TokenData : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("acc_data_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const void* data, size_t n) const {
    std::ofstream out(dir_ / name, std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    return (dir_ / name).string();
  }
  template <class T>
  std::string write(const std::string& name, const std::vector<T>& v) const {
    return write(name, v.data(), v.size() * sizeof(T));
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------
// token files

TEST_F(TokenData, U16FileRoundTrips) {
  const std::vector<uint16_t> raw = {0, 1, 50256, 65535, 7, 300};
  const std::string p = write("t.bin", raw);
  TokenFile f = TokenFile::load(p, TokenFormat::kU16);
  EXPECT_EQ(f.path(), p);
  EXPECT_EQ(f.tokens(), (std::vector<uint32_t>{0, 1, 50256, 65535, 7, 300}));
  EXPECT_EQ(f.size(), 6);
  EXPECT_EQ(f[2], 50256u);
  EXPECT_EQ(f.min_vocab_size(), 65536);
  EXPECT_NO_THROW(TokenFile::load(p, TokenFormat::kU16, 65536));
}

TEST_F(TokenData, U32FileRoundTrips) {
  const std::vector<uint32_t> raw = {70000, 0, 4000000000u, 12};
  const std::string p = write("t.u32", raw);
  EXPECT_EQ(TokenFile::load(p, TokenFormat::kU32).tokens(), raw);
  // The same bytes read as u16 are the little-endian halves.
  const std::vector<uint16_t> small = {1, 2, 3, 4};
  EXPECT_EQ(TokenFile::load(write("s.bin", small), TokenFormat::kU32).tokens(),
            (std::vector<uint32_t>{1 + (2u << 16), 3 + (4u << 16)}));
}

TEST_F(TokenData, TextIsByteLevel) {
  const std::string text("ab\n\xc3\xa9\x00z", 7);  // "é" is two tokens; NUL is one too
  const std::string p = write("t.txt", text.data(), 7);
  TokenFile f = TokenFile::load(p, TokenFormat::kText, 256);
  EXPECT_EQ(f.tokens(), (std::vector<uint32_t>{'a', 'b', '\n', 0xc3, 0xa9, 0, 'z'}));
  EXPECT_TRUE(TokenFile::load(write("e.txt", "", 0), TokenFormat::kText).tokens().empty());
}

TEST_F(TokenData, FormatNamesParse) {
  EXPECT_EQ(parse_token_format("u16"), TokenFormat::kU16);
  EXPECT_EQ(parse_token_format("u32"), TokenFormat::kU32);
  EXPECT_EQ(parse_token_format("text"), TokenFormat::kText);
  for (TokenFormat f : {TokenFormat::kU16, TokenFormat::kU32, TokenFormat::kText}) {
    EXPECT_EQ(parse_token_format(token_format_name(f)), f);
  }
  EXPECT_EQ(token_width(TokenFormat::kU32), 4u);
  expect_error<ValueError>([] { parse_token_format("uint16"); }, "unknown token format 'uint16'");
  EXPECT_EQ(parse_sample_order("random"), SampleOrder::kRandom);
  EXPECT_EQ(parse_sample_order("sequential"), SampleOrder::kSequential);
  expect_error<ValueError>([] { parse_sample_order("shuffled"); },
                           "unknown sample order 'shuffled'");
}

TEST_F(TokenData, MissingFileIsIoErrorNamingPathAndSystemError) {
  const std::string p = (dir_ / "missing.bin").string();
  expect_error<IoError>([&] { TokenFile::load(p, TokenFormat::kU16); },
                        "cannot open token file '" + p + "': No such file or directory");
}

TEST_F(TokenData, SizeNotAMultipleOfTheTokenWidth) {
  const std::string p = write("odd.bin", "abcdefg", 7);
  expect_error<IoError>([&] { TokenFile::load(p, TokenFormat::kU16); },
                        "token file '" + p +
                            "' has 7 bytes, not a multiple of the u16 token "
                            "width 2");
  const std::string q = write("six.bin", "abcdef", 6);
  expect_error<IoError>([&] { TokenFile::load(q, TokenFormat::kU32); },
                        "has 6 bytes, not a multiple of the u32 token width 4");
}

TEST_F(TokenData, TokenIdBeyondTheVocabNamesIdPositionAndVocab) {
  const std::string p = write("t.bin", std::vector<uint16_t>{1, 2, 300, 4});
  expect_error<ValueError>(
      [&] { TokenFile::load(p, TokenFormat::kU16, 256); },
      "token file '" + p + "': token id 300 at position 2 is out of range for vocab_size 256");
  expect_error<ValueError>(
      [] {
        TokenFile({5, 9}, "mem", 9);
      },
      "token id 9 at position 1 is out of range for vocab_size 9");
  expect_error<ValueError>([&] { TokenFile::load(p, TokenFormat::kU16, -1); },
                           "vocab_size must be >= 0");
}

TEST_F(TokenData, TooFewTokensForSeqLenSaysHowManyAreNeeded) {
  auto tokens = iota_tokens(8);
  expect_error<ValueError>([&] { BatchLoader(tokens, options(1, 8, SampleOrder::kSequential)); },
                           "token file 'iota' has 8 tokens, seq_len 8 needs at least 9");
  EXPECT_NO_THROW(BatchLoader(tokens, options(1, 7, SampleOrder::kSequential)));
}

TEST_F(TokenData, BadLoaderOptions) {
  auto tokens = iota_tokens(100);
  auto make = [&](LoaderOptions o) { return [tokens, o] { BatchLoader(tokens, o); }; };
  expect_error<ValueError>(make(options(0, 4, SampleOrder::kRandom)),
                           "batch_size must be >= 1, got 0");
  expect_error<ValueError>(make(options(2, 0, SampleOrder::kRandom)),
                           "seq_len must be >= 1, got 0");
  expect_error<ValueError>(make(options(2, 4, SampleOrder::kRandom, 0, 0, 0)),
                           "world must be >= 1, got 0");
  expect_error<ValueError>(make(options(2, 4, SampleOrder::kRandom, 0, 2, 2)),
                           "rank 2 is outside [0, 2)");
  expect_error<ValueError>(make(options(2, 4, SampleOrder::kRandom, 0, -1, 2)),
                           "rank -1 is outside [0, 2)");
  expect_error<ValueError>([] { BatchLoader(nullptr, options(1, 1, SampleOrder::kRandom)); },
                           "token file is null");
  BatchLoader ok(tokens, options(2, 4, SampleOrder::kRandom));
  expect_error<ValueError>([&] { ok.set_step(-1); }, "step must be >= 0, got -1");
  expect_error<ValueError>([&] { ok.batch_at(-2); }, "negative step -2");
}

// ---------------------------------------------------------------------------------------------
// sample windows

TEST_F(TokenData, SequentialWindowsFollowTheFormulaAndTargetsAreShiftedByOne) {
  const int64_t N = 50, B = 3, T = 7;  // N - T = 43: windows wrap around after a few steps
  BatchLoader loader(iota_tokens(N), options(B, T, SampleOrder::kSequential));
  for (int64_t s = 0; s < 6; ++s) {
    Batch batch = loader.next();
    EXPECT_EQ(batch.idx().shape(), (Shape{B, T}));
    EXPECT_EQ(batch.targets().shape(), (Shape{B, T}));
    const auto idx = values(batch.idx()), tgt = values(batch.targets());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = ((s * B + b) * T) % (N - T);
      EXPECT_EQ(loader.sample_start(s * B + b), p);
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(idx[b * T + t], p + t) << "step " << s << " sample " << b;
        EXPECT_EQ(tgt[b * T + t], p + t + 1) << "step " << s << " sample " << b;
      }
    }
  }
  EXPECT_EQ(loader.step(), 6);
}

// tests/golden/train_ref: PyTorch's reference losses were computed with this exact order.
TEST_F(TokenData, SequentialOrderMatchesTheTrainReferenceFile) {
  const std::string p = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  auto tokens = std::make_shared<const TokenFile>(TokenFile::load(p, TokenFormat::kU16, 256));
  ASSERT_EQ(tokens->size(), 20000);
  const int64_t B = 4, T = 32;
  BatchLoader loader(tokens, options(B, T, SampleOrder::kSequential));
  for (int64_t s = 0; s < 20; ++s) {
    Batch batch = loader.next();
    const auto idx = values(batch.idx()), tgt = values(batch.targets());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t start = ((s * B + b) * T) % (20000 - T);
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(idx[b * T + t], (*tokens)[start + t]);
        ASSERT_EQ(tgt[b * T + t], (*tokens)[start + t + 1]);
      }
    }
  }
}

TEST_F(TokenData, RandomWindowsComeFromPhiloxAndStayInRange) {
  const int64_t N = 1000, B = 4, T = 16;
  BatchLoader loader(iota_tokens(N), options(B, T, SampleOrder::kRandom, 1234));
  for (int64_t s = 0; s < 5; ++s) {
    Batch batch = loader.next();
    const auto idx = values(batch.idx()), tgt = values(batch.targets());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t g = s * B + b;
      uint32_t w[4];
      Generator::philox(1234, static_cast<uint64_t>(g), w);
      const int64_t p = static_cast<int64_t>((uint64_t{w[0]} | (uint64_t{w[1]} << 32)) %
                                             static_cast<uint64_t>(N - T));
      EXPECT_EQ(loader.sample_start(g), p);
      EXPECT_GE(p, 0);
      EXPECT_LT(p, N - T);
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(idx[b * T + t], p + t);
        EXPECT_EQ(tgt[b * T + t], p + t + 1);
      }
    }
  }
}

TEST_F(TokenData, RandomOrderIsReproducibleBySeedAndDiffersAcrossSeeds) {
  auto tokens = iota_tokens(10000);
  BatchLoader a(tokens, options(8, 32, SampleOrder::kRandom, 7));
  BatchLoader b(tokens, options(8, 32, SampleOrder::kRandom, 7));
  BatchLoader c(tokens, options(8, 32, SampleOrder::kRandom, 8));
  std::set<int64_t> starts;
  for (int s = 0; s < 4; ++s) {
    Batch ba = a.next(), bb = b.next(), bc = c.next();
    EXPECT_EQ(values(ba.idx()), values(bb.idx()));
    EXPECT_EQ(values(ba.targets()), values(bb.targets()));
    EXPECT_NE(values(ba.idx()), values(bc.idx()));
    for (int64_t i = 0; i < 8; ++i) starts.insert(values(ba.idx())[i * 32]);
  }
  EXPECT_GT(starts.size(), 28u);  // 32 draws from 9968 starts: collisions are rare
}

// Ranks 0..world-1 together see exactly the batch a single process with B*world sees.
TEST_F(TokenData, RankSlicesConcatenateToTheSingleProcessBatch) {
  auto tokens = iota_tokens(997);
  const int64_t B = 3, T = 5;
  for (SampleOrder order : {SampleOrder::kSequential, SampleOrder::kRandom}) {
    for (int world : {2, 4}) {
      SCOPED_TRACE(std::string(sample_order_name(order)) + " world " + std::to_string(world));
      BatchLoader single(tokens, options(B * world, T, order, 99));
      std::vector<BatchLoader> ranks;
      for (int r = 0; r < world; ++r)
        ranks.emplace_back(tokens, options(B, T, order, 99, r, world));
      for (int s = 0; s < 6; ++s) {
        Batch want = single.next();
        std::vector<int64_t> idx, tgt;
        for (auto& loader : ranks) {
          Batch got = loader.next();
          EXPECT_EQ(got.idx().shape(), (Shape{B, T}));
          for (int64_t v : values(got.idx())) idx.push_back(v);
          for (int64_t v : values(got.targets())) tgt.push_back(v);
        }
        EXPECT_EQ(idx, values(want.idx())) << "step " << s;
        EXPECT_EQ(tgt, values(want.targets())) << "step " << s;
      }
    }
  }
}

TEST_F(TokenData, PeekBatchAtAndSetStepAgreeWithNext) {
  BatchLoader loader(iota_tokens(500), options(2, 8, SampleOrder::kRandom, 3));
  EXPECT_EQ(values(loader.peek().idx()), values(loader.batch_at(0).idx()));
  EXPECT_EQ(loader.step(), 0);
  EXPECT_EQ(values(loader.next().idx()), values(loader.batch_at(0).idx()));
  loader.set_step(5);
  EXPECT_EQ(values(loader.next().idx()), values(loader.batch_at(5).idx()));
  EXPECT_EQ(loader.step(), 6);
}

// ---------------------------------------------------------------------------------------------
// resume

TEST_F(TokenData, ResumeFromStateGivesTheSameNextBatches) {
  auto tokens = iota_tokens(3000);
  for (SampleOrder order : {SampleOrder::kSequential, SampleOrder::kRandom}) {
    SCOPED_TRACE(sample_order_name(order));
    BatchLoader a(tokens, options(4, 16, order, 42));
    for (int i = 0; i < 3; ++i) a.next();
    const nlohmann::json saved = nlohmann::json::parse(a.state().dump());  // through text
    EXPECT_EQ(saved.at("step"), 3);
    EXPECT_EQ(saved.at("seed"), 42);
    EXPECT_EQ(saved.at("order"), sample_order_name(order));
    EXPECT_EQ(saved.at("batch_size"), 4);
    EXPECT_EQ(saved.at("seq_len"), 16);

    BatchLoader b(tokens, options(4, 16, order, 42));
    b.load_state(saved);
    EXPECT_EQ(b.step(), 3);
    for (int i = 0; i < 4; ++i) {
      Batch ba = a.next(), bb = b.next();
      EXPECT_EQ(values(ba.idx()), values(bb.idx()));
      EXPECT_EQ(values(ba.targets()), values(bb.targets()));
    }
  }
}

// A run saved on 1 rank resumes on 2 ranks with the same global batch and sees the same data.
TEST_F(TokenData, ResumeOnAnotherWorldSizeKeepsTheGlobalBatch) {
  auto tokens = iota_tokens(3000);
  BatchLoader single(tokens, options(8, 16, SampleOrder::kRandom, 5));
  for (int i = 0; i < 3; ++i) single.next();
  const nlohmann::json saved = single.state();
  BatchLoader r0(tokens, options(4, 16, SampleOrder::kRandom, 5, 0, 2));
  BatchLoader r1(tokens, options(4, 16, SampleOrder::kRandom, 5, 1, 2));
  r0.load_state(saved);
  r1.load_state(saved);
  std::vector<int64_t> both = values(r0.next().idx());
  for (int64_t v : values(r1.next().idx())) both.push_back(v);
  EXPECT_EQ(both, values(single.next().idx()));
}

TEST_F(TokenData, LoadStateRejectsAMismatchNamingBothValues) {
  auto tokens = iota_tokens(3000);
  BatchLoader src(tokens, options(4, 16, SampleOrder::kRandom, 42));
  src.set_step(7);
  const nlohmann::json saved = src.state();

  BatchLoader bs(tokens, options(8, 16, SampleOrder::kRandom, 42));
  expect_error<ValueError>([&] { bs.load_state(saved); },
                           "global batch 4 (batch_size 4 x world 1) does not match this "
                           "loader's 8 (batch_size 8 x world 1)");
  BatchLoader sl(tokens, options(4, 32, SampleOrder::kRandom, 42));
  expect_error<ValueError>([&] { sl.load_state(saved); },
                           "seq_len 16 does not match this loader's 32");
  BatchLoader od(tokens, options(4, 16, SampleOrder::kSequential, 42));
  expect_error<ValueError>([&] { od.load_state(saved); },
                           "order 'random' does not match this loader's 'sequential'");
  BatchLoader sd(tokens, options(4, 16, SampleOrder::kRandom, 43));
  expect_error<ValueError>([&] { sd.load_state(saved); },
                           "seed 42 does not match this loader's 43");
  BatchLoader nt(iota_tokens(2000), options(4, 16, SampleOrder::kRandom, 42));
  expect_error<ValueError>([&] { nt.load_state(saved); },
                           "num_tokens 3000 does not match this loader's 2000");

  BatchLoader ok(tokens, options(4, 16, SampleOrder::kRandom, 42));
  nlohmann::json missing = saved;
  missing.erase("step");
  expect_error<ValueError>([&] { ok.load_state(missing); }, "missing field 'step'");
  nlohmann::json mistyped = saved;
  mistyped["seq_len"] = "16";
  expect_error<ValueError>([&] { ok.load_state(mistyped); }, "field 'seq_len' has the wrong type");
  nlohmann::json negative = saved;
  negative["step"] = -1;
  expect_error<ValueError>([&] { ok.load_state(negative); }, "step must be >= 0, got -1");
  expect_error<ValueError>([&] { ok.load_state(nlohmann::json::array()); },
                           "loader state must be a JSON object");
  EXPECT_EQ(ok.step(), 0);  // nothing changed by the failed loads

  // The seed does not matter in sequential order.
  BatchLoader seq_a(tokens, options(4, 16, SampleOrder::kSequential, 1));
  BatchLoader seq_b(tokens, options(4, 16, SampleOrder::kSequential, 2));
  seq_a.set_step(3);
  seq_b.load_state(seq_a.state());
  EXPECT_EQ(seq_b.step(), 3);
}

}  // namespace
}  // namespace acc::data
