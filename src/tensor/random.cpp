#include "acc/tensor/random.hpp"

#include <cmath>

#include "acc/tensor/node.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline float u32_to_unit(uint32_t x) {  // [0, 1) with 24 bits
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

void check_fill_target(const Tensor& t, const char* what) {
  ACC_CHECK_TYPE(t.dtype() == DType::kFloat32 || t.dtype() == DType::kBFloat16, what,
                 ": expects a floating tensor, got ", t.dtype());
  ACC_CHECK(!(GradMode::is_enabled() && t.requires_grad()), what,
            ": in-place fill of a tensor that requires grad; use acc::NoGradGuard");
}

// Fills a contiguous f32 buffer of n values: value i from block (base + i/4), word i%4.
template <class F>
void fill_blocks(float* out, int64_t n, uint64_t seed, uint64_t base, F&& transform) {
  const int64_t blocks = (n + 3) / 4;
  parallel_for(blocks, 4096, [&](int64_t b0, int64_t b1) {
    uint32_t w[4];
    for (int64_t blk = b0; blk < b1; ++blk) {
      Generator::philox(seed, base + static_cast<uint64_t>(blk), w);
      transform(out, blk * 4, std::min<int64_t>(4, n - blk * 4), w);
    }
  });
}

Tensor& fill_with(Tensor& t, const char* what, Generator& gen,
                  const std::function<void(float*, int64_t, uint64_t, uint64_t)>& fill) {
  check_fill_target(t, what);
  if (t.is_meta() || t.numel() == 0) return t;
  const int64_t n = t.numel();
  const uint64_t base = gen.advance(static_cast<uint64_t>((n + 3) / 4));
  Tensor buf = t.dtype() == DType::kFloat32 && t.is_contiguous()
                   ? t
                   : empty(t.shape(), {DType::kFloat32, Device::kCPU, false});
  fill(buf.data<float>(), n, gen.seed(), base);
  if (!buf.is_same(t)) {
    NoGradGuard ng;
    t.copy_(buf);
  }
  return t;
}

}  // namespace

void Generator::philox(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

Generator Generator::for_rank(int rank) const {
  return Generator(splitmix64(seed_ ^ splitmix64(static_cast<uint64_t>(rank) + 1)));
}

uint64_t Generator::next_u64() {
  uint32_t w[4];
  philox(seed_, advance(1), w);
  return (static_cast<uint64_t>(w[0]) << 32) | w[1];
}

double Generator::next_double() {
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
}

Generator& default_generator() {
  static Generator gen(0);
  return gen;
}

void manual_seed(uint64_t seed) {
  default_generator().set_state(seed, 0);
}

Tensor& uniform_(Tensor& t, double low, double high, Generator& gen) {
  ACC_CHECK(low <= high, "uniform_: low ", low, " > high ", high);
  const float lo = static_cast<float>(low), span = static_cast<float>(high - low);
  return fill_with(t, "uniform_", gen, [&](float* out, int64_t n, uint64_t seed, uint64_t base) {
    fill_blocks(out, n, seed, base, [&](float* o, int64_t i, int64_t cnt, const uint32_t* w) {
      for (int64_t j = 0; j < cnt; ++j) o[i + j] = lo + span * u32_to_unit(w[j]);
    });
  });
}

Tensor& uniform_(Tensor& t, double low, double high, const TensorChunk& chunk, Generator& gen) {
  if (!chunk.active()) return uniform_(t, low, high, gen);
  ACC_CHECK(low <= high, "uniform_: low ", low, " > high ", high);
  ACC_CHECK_SHAPE(chunk.dim >= 0 && chunk.dim < t.dim() && chunk.offset >= 0 &&
                      chunk.offset + t.size(chunk.dim) <= chunk.full,
                  "uniform_: a chunk [", chunk.offset, ", ",
                  chunk.offset + (t.dim() > chunk.dim && chunk.dim >= 0 ? t.size(chunk.dim) : 0),
                  ") of ", chunk.full, " along dimension ", chunk.dim, " does not fit ", t.shape());
  const float lo = static_cast<float>(low), span = static_cast<float>(high - low);
  const int64_t rows = t.size(chunk.dim);
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < chunk.dim; ++d) outer *= t.size(d);
  for (int64_t d = chunk.dim + 1; d < t.dim(); ++d) inner *= t.size(d);
  const int64_t whole = outer * chunk.full * inner;
  return fill_with(t, "uniform_", gen, [&](float* out, int64_t n, uint64_t seed, uint64_t base) {
    // fill_with reserved the chunk's blocks from `base`; the rest of the whole's follow them.
    gen.advance(static_cast<uint64_t>((whole + 3) / 4 - (n + 3) / 4));
    parallel_for(outer * rows, 64, [&](int64_t r0, int64_t r1) {
      uint32_t w[4];
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t o = r / rows, d = r % rows;
        const int64_t g0 = (o * chunk.full + chunk.offset + d) * inner;
        float* dst = out + r * inner;
        int64_t block = -1;
        for (int64_t j = 0; j < inner; ++j) {
          const int64_t g = g0 + j;
          if (g / 4 != block) {
            block = g / 4;
            Generator::philox(seed, base + static_cast<uint64_t>(block), w);
          }
          dst[j] = lo + span * u32_to_unit(w[g % 4]);
        }
      }
    });
  });
}

Tensor& normal_(Tensor& t, double mean, double std, Generator& gen) {
  ACC_CHECK(std >= 0, "normal_: std must be >= 0, got ", std);
  const float mu = static_cast<float>(mean), sd = static_cast<float>(std);
  return fill_with(t, "normal_", gen, [&](float* out, int64_t n, uint64_t seed, uint64_t base) {
    fill_blocks(out, n, seed, base, [&](float* o, int64_t i, int64_t cnt, const uint32_t* w) {
      // Box-Muller on two pairs of words.
      float z[4];
      for (int p = 0; p < 2; ++p) {
        float u1 = (static_cast<float>(w[2 * p] >> 8) + 1.0f) * (1.0f / 16777216.0f);  // (0,1]
        float u2 = u32_to_unit(w[2 * p + 1]);
        float r = std::sqrt(-2.0f * std::log(u1));
        z[2 * p] = r * std::cos(6.2831853071795864f * u2);
        z[2 * p + 1] = r * std::sin(6.2831853071795864f * u2);
      }
      for (int64_t j = 0; j < cnt; ++j) o[i + j] = mu + sd * z[j];
    });
  });
}

Tensor rand(Shape shape, Generator& gen, TensorOptions options) {
  bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(std::move(shape), options);
  uniform_(t, 0.0, 1.0, gen);
  if (rg) t.set_requires_grad(true);
  return t;
}

Tensor randn(Shape shape, Generator& gen, TensorOptions options) {
  bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(std::move(shape), options);
  normal_(t, 0.0, 1.0, gen);
  if (rg) t.set_requires_grad(true);
  return t;
}

Tensor randint(int64_t low, int64_t high, Shape shape, Generator& gen) {
  ACC_CHECK(low < high, "randint: empty range [", low, ", ", high, ")");
  Tensor t = empty(std::move(shape), {DType::kInt64, Device::kCPU, false});
  const uint64_t span = static_cast<uint64_t>(high - low);
  int64_t* p = t.data<int64_t>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = low + static_cast<int64_t>(gen.next_u64() % span);
  return t;
}

}  // namespace acc
