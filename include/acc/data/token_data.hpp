#pragma once
// Token data for language-model training: a flat stream of token ids read from a file, cut into
// (B, T) windows of inputs and next-token targets.
//
// Sample numbering (the data-parallel contract): sample b of rank r at step s is the global
// sample g = s*B*world + r*B + b, and the window of a global sample depends only on g (and the
// seed), never on the number of ranks. So world ranks taking B samples each see, together,
// exactly the batch of B*world that a single process sees, and data-parallel training matches
// single-process training with the same global batch.
//
// Window of global sample g, with N tokens and p its first token:
//   sequential: p = (g*T) mod (N - T)
//   random:     p = (w0 | w1 << 32) mod (N - T), with w = Generator::philox(seed, counter = g)
// inputs are tokens[p, p+T) and targets tokens[p+1, p+T+1).
//
// Errors: acc::IoError when a file cannot be read as tokens (missing, unreadable, a size that is
// not a multiple of the token width); acc::ValueError when the tokens do not fit the request (a
// token id >= vocab_size, fewer than seq_len+1 tokens) and for bad options or loader state.

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "acc/data/batch.hpp"
#include "acc/data/loader.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::data {

/// How token ids are stored in a file.
///  kU16:  raw little-endian uint16 (nanoGPT's train.bin / val.bin)
///  kU32:  raw little-endian uint32 (vocabularies above 65536)
///  kText: plain bytes, each byte one token (byte-level, vocab 256)
enum class TokenFormat : uint8_t { kU16, kU32, kText };

/// Parses "u16", "u32" or "text". Throws acc::ValueError naming a bad name.
TokenFormat parse_token_format(const std::string& name);
const char* token_format_name(TokenFormat format);
/// Bytes per token on disk: 2, 4 or 1.
size_t token_width(TokenFormat format);

/// A token stream held in memory as uint32 ids. Immutable once built; share it between loaders
/// through std::shared_ptr<const TokenFile>.
class TokenFile {
 public:
  /// Reads every token of `path`. When vocab_size > 0, every id must be < vocab_size.
  /// Throws acc::IoError naming the path when the file is missing or unreadable (with the system
  /// error) or its size is not a multiple of the token width; acc::ValueError naming the id, its
  /// position and the vocab size for an id >= vocab_size, and for vocab_size < 0.
  static TokenFile load(const std::string& path, TokenFormat format, int64_t vocab_size = 0);

  /// Tokens already in memory (synthetic data, tests); `name` stands for the path in messages.
  /// Throws acc::ValueError like load() for an id >= vocab_size (when vocab_size > 0).
  explicit TokenFile(std::vector<uint32_t> tokens, std::string name = "<memory>",
                     int64_t vocab_size = 0);

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  uint32_t operator[](int64_t i) const { return tokens_[static_cast<size_t>(i)]; }
  const std::vector<uint32_t>& tokens() const { return tokens_; }
  /// The path it was loaded from, or the name given to the constructor.
  const std::string& path() const { return path_; }
  /// Largest id + 1 (0 when empty): the smallest vocabulary that covers the file.
  int64_t min_vocab_size() const;

 private:
  std::vector<uint32_t> tokens_;
  std::string path_;
};

/// Which window each global sample gets (see the top of this file).
enum class SampleOrder : uint8_t { kRandom, kSequential };

/// Parses "random" or "sequential". Throws acc::ValueError naming a bad name.
SampleOrder parse_sample_order(const std::string& name);
const char* sample_order_name(SampleOrder order);

struct LoaderOptions {
  int64_t batch_size = 1;  // B, samples per rank and step
  int64_t seq_len = 1;     // T
  SampleOrder order = SampleOrder::kRandom;
  uint64_t seed = 0;  // random order only
  int rank = 0;
  int world = 1;
};

/// Deterministic (B, T) batches from a TokenFile. The batch of a step is a pure function of
/// (tokens, options, step), so a loader resumes exactly from step() alone. Not thread-safe:
/// use one loader per thread.
class BatchLoader : public Loader {
 public:
  /// Throws acc::ValueError on batch_size < 1, seq_len < 1, world < 1, a rank outside
  /// [0, world), a null token file, or a file with fewer than seq_len+1 tokens (the message
  /// says how many are needed).
  BatchLoader(std::shared_ptr<const TokenFile> tokens, LoaderOptions options);

  /// The batch of step() for this rank ({"idx", "targets"}, (B, T) i64 each, the targets the
  /// inputs shifted by one token); then advances step() by one.
  Batch next() override;
  /// The batch next() would return, without advancing.
  Batch peek() const { return batch_at(step_); }
  /// The batch of any step for this rank. Throws acc::ValueError on a negative step.
  Batch batch_at(int64_t step) const;
  /// First token of global sample g, in [0, N - T). Throws acc::ValueError on a negative g.
  int64_t sample_start(int64_t global_sample) const;

  /// Steps taken (batches returned by next()).
  int64_t step() const { return step_; }
  /// Throws acc::ValueError on a negative step.
  void set_step(int64_t step);

  /// Everything needed to resume exactly: {"step", "seed", "order", "batch_size", "seq_len",
  /// "world", "num_tokens"}.
  nlohmann::json state() const override;
  /// Restores step() from state(). The state must describe the same sample stream: the same
  /// order, seq_len, number of tokens, seed (random order only) and global batch size
  /// batch_size*world (so a run may resume on another number of ranks when the global batch is
  /// kept: sample g is the same sample at any world size). Throws acc::ValueError
  /// naming the field and both values on a mismatch, and on a missing or mistyped field;
  /// nothing changes on error.
  void load_state(const nlohmann::json& state) override;

  const LoaderOptions& options() const { return options_; }
  const TokenFile& tokens() const { return *tokens_; }
  /// batch_size * world: samples per step over all ranks.
  int64_t global_batch_size() const { return options_.batch_size * options_.world; }

 private:
  std::shared_ptr<const TokenFile> tokens_;
  LoaderOptions options_;
  int64_t step_ = 0;
};

/// PyTorch's name for the same thing.
using DataLoader = BatchLoader;

}  // namespace acc::data
