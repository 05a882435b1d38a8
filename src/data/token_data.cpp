#include "acc/data/token_data.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <type_traits>

#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace acc::data {

// Token files are read as raw little-endian integers.
static_assert(std::endian::native == std::endian::little,
              "token files assume a little-endian host");

namespace {

std::string sys_error() {
  return std::strerror(errno);
}

// The whole file; throws IoError naming the path.
std::string read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ACC_CHECK_AS(IoError, fd >= 0, "cannot open token file '", path, "': ", sys_error());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  ACC_CHECK_AS(IoError, ::fstat(fd, &st) == 0, "cannot stat token file '", path,
               "': ", sys_error());
  ACC_CHECK_AS(IoError, S_ISREG(st.st_mode), "cannot read token file '", path,
               "': not a regular file");
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    ACC_CHECK_AS(IoError, r >= 0, "cannot read token file '", path, "': ", sys_error());
    ACC_CHECK_AS(IoError, r > 0, "cannot read token file '", path, "': it shrank from ",
                 bytes.size(), " to ", done, " bytes while being read");
    done += static_cast<size_t>(r);
  }
  return bytes;
}

void check_vocab(const std::vector<uint32_t>& tokens, const std::string& name, int64_t vocab_size) {
  ACC_CHECK(vocab_size >= 0, "token file '", name, "': vocab_size must be >= 0 (0: no check), got ",
            vocab_size);
  if (vocab_size == 0) return;
  for (size_t i = 0; i < tokens.size(); ++i) {
    ACC_CHECK(static_cast<int64_t>(tokens[i]) < vocab_size, "token file '", name, "': token id ",
              tokens[i], " at position ", i, " is out of range for vocab_size ", vocab_size);
  }
}

// Reads a required field of a loader state.
template <class T>
T state_field(const nlohmann::json& state, const char* key) {
  ACC_CHECK(state.contains(key), "loader state: missing field '", key, "' in ", state.dump());
  const nlohmann::json& v = state.at(key);
  bool ok;
  if constexpr (std::is_same_v<T, std::string>) {
    ok = v.is_string();
  } else if constexpr (std::is_unsigned_v<T>) {
    ok = v.is_number_unsigned();
  } else {
    ok = v.is_number_integer();
  }
  ACC_CHECK(ok, "loader state: field '", key, "' has the wrong type: ", v.dump());
  return v.get<T>();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// names

TokenFormat parse_token_format(const std::string& name) {
  if (name == "u16") return TokenFormat::kU16;
  if (name == "u32") return TokenFormat::kU32;
  if (name == "text") return TokenFormat::kText;
  ACC_THROW(ValueError, "unknown token format '", name, "' (expected u16, u32 or text)");
}

const char* token_format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::kU16:
      return "u16";
    case TokenFormat::kU32:
      return "u32";
    case TokenFormat::kText:
      return "text";
  }
  ACC_THROW(InternalError, "unhandled token format ", static_cast<int>(format));
}

size_t token_width(TokenFormat format) {
  switch (format) {
    case TokenFormat::kU16:
      return 2;
    case TokenFormat::kU32:
      return 4;
    case TokenFormat::kText:
      return 1;
  }
  ACC_THROW(InternalError, "unhandled token format ", static_cast<int>(format));
}

SampleOrder parse_sample_order(const std::string& name) {
  if (name == "random") return SampleOrder::kRandom;
  if (name == "sequential") return SampleOrder::kSequential;
  ACC_THROW(ValueError, "unknown sample order '", name, "' (expected random or sequential)");
}

const char* sample_order_name(SampleOrder order) {
  switch (order) {
    case SampleOrder::kRandom:
      return "random";
    case SampleOrder::kSequential:
      return "sequential";
  }
  ACC_THROW(InternalError, "unhandled sample order ", static_cast<int>(order));
}

// ---------------------------------------------------------------------------------------------
// TokenFile

TokenFile TokenFile::load(const std::string& path, TokenFormat format, int64_t vocab_size) {
  const std::string bytes = read_file(path);
  const size_t width = token_width(format);
  ACC_CHECK_AS(IoError, bytes.size() % width == 0, "token file '", path, "' has ", bytes.size(),
               " bytes, not a multiple of the ", token_format_name(format), " token width ", width);
  std::vector<uint32_t> tokens(bytes.size() / width);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  switch (format) {
    case TokenFormat::kText:
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = p[i];
      break;
    case TokenFormat::kU16:
      for (size_t i = 0; i < tokens.size(); ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        tokens[i] = v;
      }
      break;
    case TokenFormat::kU32:
      if (!tokens.empty()) std::memcpy(tokens.data(), p, bytes.size());
      break;
  }
  return TokenFile(std::move(tokens), path, vocab_size);
}

TokenFile::TokenFile(std::vector<uint32_t> tokens, std::string name, int64_t vocab_size)
    : tokens_(std::move(tokens)), path_(std::move(name)) {
  check_vocab(tokens_, path_, vocab_size);
}

int64_t TokenFile::min_vocab_size() const {
  int64_t m = 0;
  for (uint32_t t : tokens_) m = std::max<int64_t>(m, int64_t{t} + 1);
  return m;
}

// ---------------------------------------------------------------------------------------------
// BatchLoader

BatchLoader::BatchLoader(std::shared_ptr<const TokenFile> tokens, LoaderOptions options)
    : tokens_(std::move(tokens)), options_(options) {
  ACC_CHECK(tokens_ != nullptr, "batch loader: token file is null");
  ACC_CHECK(options_.batch_size >= 1, "batch loader: batch_size must be >= 1, got ",
            options_.batch_size);
  ACC_CHECK(options_.seq_len >= 1, "batch loader: seq_len must be >= 1, got ", options_.seq_len);
  ACC_CHECK(options_.world >= 1, "batch loader: world must be >= 1, got ", options_.world);
  ACC_CHECK(options_.rank >= 0 && options_.rank < options_.world, "batch loader: rank ",
            options_.rank, " is outside [0, ", options_.world, ")");
  ACC_CHECK(tokens_->size() >= options_.seq_len + 1, "batch loader: token file '", tokens_->path(),
            "' has ", tokens_->size(), " tokens, seq_len ", options_.seq_len, " needs at least ",
            options_.seq_len + 1);
}

int64_t BatchLoader::sample_start(int64_t global_sample) const {
  ACC_CHECK(global_sample >= 0, "batch loader: negative sample index ", global_sample);
  const uint64_t span = static_cast<uint64_t>(tokens_->size() - options_.seq_len);  // N - T >= 1
  const uint64_t g = static_cast<uint64_t>(global_sample);
  if (options_.order == SampleOrder::kSequential) {
    // (g*T) mod (N-T) without overflow for any g.
    const unsigned __int128 prod =
        static_cast<unsigned __int128>(g) * static_cast<uint64_t>(options_.seq_len);
    return static_cast<int64_t>(static_cast<uint64_t>(prod % span));
  }
  uint32_t w[4];
  Generator::philox(options_.seed, g, w);
  const uint64_t r = static_cast<uint64_t>(w[0]) | (static_cast<uint64_t>(w[1]) << 32);
  return static_cast<int64_t>(r % span);
}

Batch BatchLoader::batch_at(int64_t step) const {
  ACC_CHECK(step >= 0, "batch loader: negative step ", step);
  const int64_t B = options_.batch_size, T = options_.seq_len;
  Tensor inputs = empty({B, T}, {DType::kInt64}), targets = empty({B, T}, {DType::kInt64});
  int64_t* idx = inputs.data<int64_t>();   // (B, T)
  int64_t* tgt = targets.data<int64_t>();  // (B, T)
  const std::vector<uint32_t>& tok = tokens_->tokens();
  const int64_t first = step * global_batch_size() + int64_t{options_.rank} * B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = sample_start(first + b);
    for (int64_t t = 0; t < T; ++t) {
      idx[b * T + t] = tok[static_cast<size_t>(p + t)];
      tgt[b * T + t] = tok[static_cast<size_t>(p + t + 1)];
    }
  }
  return Batch(std::move(inputs), std::move(targets));
}

Batch BatchLoader::next() {
  Batch b = batch_at(step_);
  ++step_;
  return b;
}

void BatchLoader::set_step(int64_t step) {
  ACC_CHECK(step >= 0, "batch loader: step must be >= 0, got ", step);
  step_ = step;
}

nlohmann::json BatchLoader::state() const {
  return {{"step", step_},
          {"seed", options_.seed},
          {"order", sample_order_name(options_.order)},
          {"batch_size", options_.batch_size},
          {"seq_len", options_.seq_len},
          {"world", options_.world},
          {"num_tokens", tokens_->size()}};
}

void BatchLoader::load_state(const nlohmann::json& state) {
  ACC_CHECK(state.is_object(), "loader state must be a JSON object, got ", state.dump());
  const auto step = state_field<int64_t>(state, "step");
  const auto seed = state_field<uint64_t>(state, "seed");
  const auto order = state_field<std::string>(state, "order");
  const auto batch_size = state_field<int64_t>(state, "batch_size");
  const auto seq_len = state_field<int64_t>(state, "seq_len");
  const auto world = state_field<int64_t>(state, "world");
  const auto num_tokens = state_field<int64_t>(state, "num_tokens");

  ACC_CHECK(step >= 0, "loader state: step must be >= 0, got ", step);
  const char* mine = sample_order_name(options_.order);
  ACC_CHECK(order == mine, "loader state: order '", order, "' does not match this loader's '", mine,
            "'");
  ACC_CHECK(seq_len == options_.seq_len, "loader state: seq_len ", seq_len,
            " does not match this loader's ", options_.seq_len);
  ACC_CHECK(batch_size * world == global_batch_size(), "loader state: global batch ",
            batch_size * world, " (batch_size ", batch_size, " x world ", world,
            ") does not match this loader's ", global_batch_size(), " (batch_size ",
            options_.batch_size, " x world ", options_.world, ")");
  ACC_CHECK(num_tokens == tokens_->size(), "loader state: num_tokens ", num_tokens,
            " does not match this loader's ", tokens_->size(), " (token file '", tokens_->path(),
            "')");
  if (options_.order == SampleOrder::kRandom) {
    ACC_CHECK(seed == options_.seed, "loader state: seed ", seed, " does not match this loader's ",
              options_.seed);
  }
  step_ = step;
}

}  // namespace acc::data
