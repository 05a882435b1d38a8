#include <gtest/gtest.h>

#include <cmath>

#include "acc/autograd/flops.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/tensor.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

Tensor iota(Shape shape) {
  int64_t n = numel_of(shape);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i);
  return from_vector(v, shape);
}

TEST(Tensor, FactoriesHaveShapeDtypeAndValues) {
  Tensor z = zeros({2, 3});
  EXPECT_EQ(z.shape(), (Shape{2, 3}));
  EXPECT_EQ(z.strides(), (Shape{3, 1}));
  EXPECT_EQ(z.dtype(), DType::kFloat32);
  EXPECT_EQ(z.numel(), 6);
  for (float v : z.to_vector<float>()) EXPECT_EQ(v, 0.f);
  Tensor f = full({4}, 2.5, {DType::kBFloat16});
  EXPECT_EQ(f.dtype(), DType::kBFloat16);
  for (float v : f.to_vector<float>()) EXPECT_EQ(v, 2.5f);
  Tensor a = arange(5, {DType::kInt64});
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(scalar_tensor(3.0).item(), 3.0);
}

TEST(Tensor, ElementCountsThatOverflowAreRefusedNamingTheShape) {
  EXPECT_EQ(numel_of({int64_t{1} << 31, int64_t{1} << 31}), int64_t{1} << 62);
  try {
    numel_of({int64_t{1} << 32, int64_t{1} << 32});
    ADD_FAILURE() << "2^64 elements were counted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("[4294967296, 4294967296]"), std::string::npos)
        << e.what();
  }
  DefaultDeviceGuard meta(Device::kMeta);
  EXPECT_THROW(empty({4611686018427387904, 4, 256}), ShapeError);
}

using test::error_of;

TEST(Checked, ProductsAndSumsThatOverflowNameTheirOperands) {
  const int64_t big = int64_t{1} << 62;
  EXPECT_EQ(checked_mul(int64_t{1} << 31, int64_t{1} << 31, "x"), big);
  EXPECT_EQ(checked_add(big - 1, big, "x"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(checked_product({2, 3, 4}, "x"), 24);
  EXPECT_EQ(checked_product({}, "x"), 1);
  EXPECT_EQ(error_of<ValueError>([&] { checked_mul(big, 2, "bytes of ", "w"); }),
            "bytes of w: 4611686018427387904 * 2 overflows 64 bits");
  EXPECT_EQ(
      error_of<ValueError>([&] { checked_mul(std::numeric_limits<int64_t>::min(), -1, "n"); }),
      "n: -9223372036854775808 * -1 overflows 64 bits");
  EXPECT_EQ(error_of<ValueError>([&] { checked_add(big, big, "sum"); }),
            "sum: 4611686018427387904 + 4611686018427387904 overflows 64 bits");
  EXPECT_EQ(error_of<ValueError>([&] {
              checked_product({2, big, 0}, "flops");
            }),
            "flops: the product of [2, 4611686018427387904, 0] overflows 64 bits");
  EXPECT_NE(error_of<ShapeError>([&] { checked_mul<ShapeError>(big, 4, "s"); }), "(no error)");
}

TEST(Tensor, BytesStridesAndViewsThatOverflowAreRefusedNamingTheShape) {
  EXPECT_EQ(nbytes_of({int64_t{1} << 60}, DType::kBFloat16), int64_t{1} << 61);
  DefaultDeviceGuard meta(Device::kMeta);
  // 3e18 elements fit in 64 bits, their 1.2e19 bytes do not (the old nbytes() wrapped them).
  const std::string msg = error_of<ShapeError>([] { empty({3000000000, 1000000000}); });
  EXPECT_NE(msg.find("bytes of shape [3000000000, 1000000000] (f32)"), std::string::npos) << msg;
  EXPECT_NO_THROW(empty({3000000000, 1000000000}, {DType::kBFloat16}));
  // A zero-size dimension keeps numel at 0 while the strides of the others multiply.
  EXPECT_NE(error_of<ShapeError>([] {
              empty({0, int64_t{1} << 40, int64_t{1} << 40});
            }).find("strides of shape [0, 1099511627776, 1099511627776]"),
            std::string::npos);
  Tensor x = empty({0, 4});
  EXPECT_NE(error_of<ShapeError>([&] {
              x.view({int64_t{1} << 40, int64_t{1} << 40, -1});
            }).find("shape [1099511627776, 1099511627776, -1]"),
            std::string::npos);
  Tensor base = empty({16});
  EXPECT_NE(error_of<ShapeError>([&] {
              make_view(base, {4, 4}, {int64_t{1} << 62, 1}, 0);
            }).find("view of shape [4, 4]"),
            std::string::npos);
}

TEST(Flops, ProductsThatOverflowNameTheOperandsInsteadOfWrapping) {
  EXPECT_EQ(autograd::matmul_flops("linear", 2, 3, 4, 5), 2 * 2 * 3 * 4 * 5);
  EXPECT_EQ(autograd::attention_flops(1, 2, 8, 4, /*causal=*/true), 2 * 2 * 8 * 8 * 4);
  DefaultDeviceGuard meta(Device::kMeta);
  // Both operands fit; 2 * 1024 * 1e8 * 3e8 FLOPs do not (they used to wrap to a negative count).
  Tensor x = empty({1, 1024, 100000000}), w = empty({300000000, 100000000});
  const std::string msg = error_of<ValueError>([&] { linear(x, w); });
  EXPECT_NE(msg.find("linear: FLOPs of 1 x (1024, 100000000) @ (100000000, 300000000)"),
            std::string::npos)
      << msg;
  Tensor q = empty({1, 1, int64_t{1} << 30, 1 << 10});
  EXPECT_NE(error_of<ValueError>([&] {
              scaled_dot_product_attention(q, q, q, true);
            }).find("attention: FLOPs of q (B, NH, T, HS) [1, 1, 1073741824, 1024]"),
            std::string::npos);
}

TEST(Tensor, CopiesAreShallowAndCloneIsDeep) {
  Tensor a = zeros({3});
  Tensor b = a;
  b.fill_(1.0);
  EXPECT_EQ(a.to_vector<float>()[0], 1.f);
  Tensor c = a.clone();
  c.fill_(2.0);
  EXPECT_EQ(a.to_vector<float>()[0], 1.f);
}

TEST(Tensor, TransposeAndPermuteShareStorage) {
  Tensor x = iota({2, 3});
  Tensor t = x.transpose(0, 1);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(t.storage(), x.storage());
  Tensor p = iota({2, 3, 4}).permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.contiguous().to_vector<float>()[1], 4.f);  // p[0,0,1] = x[0,1,0]
}

TEST(Tensor, SliceNarrowExpand) {
  Tensor x = iota({4, 3});
  Tensor s = x.slice(0, 1, 4, 2);
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.to_vector<float>(), (std::vector<float>{3, 4, 5, 9, 10, 11}));
  Tensor n = x.narrow(1, 1, 2);
  EXPECT_EQ(n.to_vector<float>(), (std::vector<float>{1, 2, 4, 5, 7, 8, 10, 11}));
  Tensor e = from_vector({1.f, 2.f}, {2, 1}).expand({2, 3});
  EXPECT_EQ(e.to_vector<float>(), (std::vector<float>{1, 1, 1, 2, 2, 2}));
  EXPECT_EQ(e.strides()[1], 0);
}

TEST(Tensor, ViewNeedsCompatibleStridesReshapeCopies) {
  Tensor x = iota({2, 3, 4});
  EXPECT_EQ(x.view({6, 4}).shape(), (Shape{6, 4}));
  EXPECT_EQ(x.view({-1}).shape(), (Shape{24}));
  Tensor t = x.transpose(1, 2);
  EXPECT_THROW(t.view({24}), ShapeError);
  Tensor r = t.reshape({24});
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(r.to_vector<float>()[1], 4.f);
  EXPECT_THROW(x.view({5, -1}), ShapeError);
  EXPECT_THROW(x.view({-1, -1}), ShapeError);
}

TEST(Tensor, CopyConvertsDtypesAndBroadcasts) {
  Tensor x = from_vector({1.5f, -2.25f, 3.f}, {3});
  Tensor b = x.to(DType::kBFloat16);
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{1.5f, -2.25f, 3.f}));
  Tensor i = x.to(DType::kInt64);
  EXPECT_EQ(i.to_vector<int64_t>(), (std::vector<int64_t>{1, -2, 3}));
  Tensor m = zeros({2, 3});
  m.copy_(x);
  EXPECT_EQ(m.to_vector<float>(), (std::vector<float>{1.5f, -2.25f, 3.f, 1.5f, -2.25f, 3.f}));
  EXPECT_THROW(m.copy_(zeros({2})), ShapeError);
}

TEST(Tensor, BFloat16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1).
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
}

TEST(Tensor, MetaTensorsHaveShapesAndNoMemory) {
  int64_t before = memory::current_bytes();
  Tensor m = empty({1 << 20, 1 << 10}, {DType::kFloat32, Device::kMeta});
  EXPECT_EQ(memory::current_bytes(), before);
  EXPECT_TRUE(m.is_meta());
  EXPECT_EQ(m.numel(), int64_t{1} << 30);
  EXPECT_THROW(m.data<float>(), TypeError);
  Tensor v = m.view({1024, 1024, 1024}).transpose(0, 2);
  EXPECT_TRUE(v.is_meta());
  Tensor w = empty({16, 1 << 10}, {DType::kFloat32, Device::kMeta});
  Tensor y = matmul(v.slice(0, 0, 16).reshape({-1, 1024}), w.transpose(0, 1));
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.shape(), (Shape{16 * 1024, 16}));
  EXPECT_EQ(memory::current_bytes(), before);
}

TEST(Allocator, TracksCurrentAndPeakBytes) {
  memory::reset_peak();
  const int64_t base = memory::current_bytes();
  {
    Tensor a = empty({1000});  // 4000 bytes
    EXPECT_EQ(memory::current_bytes(), base + 4000);
    {
      Tensor b = empty({500}, {DType::kInt64});  // 4000 bytes
      EXPECT_EQ(memory::current_bytes(), base + 8000);
    }
    EXPECT_EQ(memory::current_bytes(), base + 4000);
  }
  EXPECT_EQ(memory::current_bytes(), base);
  EXPECT_EQ(memory::peak_bytes(), base + 8000);
  Tensor v = empty({10, 10});
  Tensor view = v.transpose(0, 1);  // views allocate nothing
  EXPECT_EQ(memory::current_bytes(), base + 400);
}

// A cached block serves a request of its own size bin or of the bin below (a tensor of exactly
// 4 MiB reuses the block of one just over it, such as the same tensor with padded rows), not of
// bins further down. Sizes in floats.
TEST(Allocator, ReusesACachedBlockOfTheNextBinUp) {
  if (env::get_string("ACC_ALLOCATOR", "caching") == "malloc") GTEST_SKIP() << "cache off";
  constexpr int64_t kMiB = int64_t{1} << 20;
  memory::empty_cache();
  const int64_t r0 = memory::reserved_bytes();
  { Tensor over = empty({kMiB + 1024}); }  // 4 MiB + 4 KiB: the 5 MiB bin, then cached
  EXPECT_EQ(memory::reserved_bytes(), r0 + 5 * kMiB);
  {
    Tensor exact = empty({kMiB});  // 4 MiB: takes the cached 5 MiB block
    EXPECT_EQ(memory::reserved_bytes(), r0 + 5 * kMiB);
    Tensor second = empty({kMiB});  // nothing cached any more: a 4 MiB block of its own
    EXPECT_EQ(memory::reserved_bytes(), r0 + 9 * kMiB);
  }
  {
    Tensor smaller = empty({3 * kMiB / 4});  // 3 MiB: two bins below 5 MiB, a new block
    EXPECT_EQ(memory::reserved_bytes(), r0 + 12 * kMiB);
  }
  memory::empty_cache();
  EXPECT_EQ(memory::reserved_bytes(), r0);
}

// A budget makes running out of memory real (the search's dry-runs): the allocation that would
// pass it throws OutOfMemoryError, takes nothing, and the budget is restored after the scope.
TEST(Allocator, LimitRefusesTheAllocationThatWouldPassIt) {
  const int64_t base = memory::current_bytes();
  {
    memory::LimitGuard budget(base + (1 << 20));
    Tensor fits = empty({128 * 1024});  // 512 KiB
    try {
      Tensor over = empty({256 * 1024});  // 1 MiB more
      FAIL() << "allocated past the budget";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(
          std::string(e.what()).find("over the budget of " + std::to_string(base + (1 << 20))),
          std::string::npos)
          << e.what();
    }
    EXPECT_EQ(memory::current_bytes(), base + 512 * 1024);  // the refused one took nothing
  }
  EXPECT_EQ(memory::limit(), 0);
  Tensor after = empty({1024 * 1024});  // 4 MiB: no budget any more
  EXPECT_THROW(memory::set_limit(-1), ValueError);
}

TEST(Random, SameSeedSameNumbersAnyThreadCount) {
  Generator g1(42), g2(42);
  set_num_threads(1);
  Tensor a = randn({10000}, g1);
  set_num_threads(2);
  Tensor b = randn({10000}, g2);
  set_num_threads(1);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
  Tensor c = randn({10000}, g1);  // the stream moves on
  EXPECT_NE(a.to_vector<float>(), c.to_vector<float>());
  // Mean ~0, std ~1.
  auto v = a.to_vector<double>();
  double m = 0, s = 0;
  for (double x : v) m += x;
  m /= v.size();
  for (double x : v) s += (x - m) * (x - m);
  s = std::sqrt(s / v.size());
  EXPECT_NEAR(m, 0.0, 0.05);
  EXPECT_NEAR(s, 1.0, 0.05);
}

TEST(Random, RanksGetDifferentReproducibleStreams) {
  Generator base(7);
  Generator r0 = base.for_rank(0), r1 = base.for_rank(1), r1b = base.for_rank(1);
  Tensor a = rand({100}, r0), b = rand({100}, r1), c = rand({100}, r1b);
  EXPECT_NE(a.to_vector<float>(), b.to_vector<float>());
  EXPECT_EQ(b.to_vector<float>(), c.to_vector<float>());
  for (float x : a.to_vector<float>()) {
    EXPECT_GE(x, 0.f);
    EXPECT_LT(x, 1.f);
  }
}

TEST(Tensor, BadInputsGetErrors) {
  EXPECT_THROW(empty({2, -1}), ShapeError);
  EXPECT_THROW(zeros({2, 3}).transpose(0, 2), ShapeError);
  EXPECT_THROW(zeros({2, 3}).permute({0, 0}), ShapeError);
  EXPECT_THROW(zeros({2, 3}).expand({3, 3}), ShapeError);
  EXPECT_THROW(zeros({2, 3}).narrow(1, 2, 2), ShapeError);
  EXPECT_THROW(zeros({2}).data<int64_t>(), TypeError);
  EXPECT_THROW(zeros({2}).item(), ShapeError);
  EXPECT_THROW(from_vector(std::vector<float>{1, 2, 3}, {2}), ShapeError);
  EXPECT_THROW(Tensor().shape(), ValueError);
  EXPECT_THROW(zeros({2}, {DType::kInt64}).set_requires_grad(true), TypeError);
  try {
    zeros({2, 3}).view({4, 2});
    FAIL() << "view should throw";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 2]"), std::string::npos) << e.what();
  }
}

// kernels::gemm zeroes a large C with streaming stores and accumulates (beta = 1) where BLAS
// would clear it itself; fill_rows broadcasts a bias the same way. Both must equal the plain
// definition: C's old contents (NaN here) never leak, rows of a strided C outside the N
// columns stay untouched, at one and two threads.
TEST(Kernels, LargeGemmWithBetaZeroAndFillRowsIgnoreOldContents) {
  const int64_t M = 600, N = 520, K = 24, ldc = N + 3;  // M * N above the streaming threshold
  Generator gen(7);
  const std::vector<float> a = randn({M, K}, gen).to_vector<float>();
  const std::vector<float> b = randn({K, N}, gen).to_vector<float>();
  const std::vector<float> bias = randn({N}, gen).to_vector<float>();
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    std::vector<float> c(static_cast<size_t>(M * ldc), std::nanf(""));
    kernels::gemm(false, false, M, N, K, 1.f, a.data(), K, b.data(), N, 0.f, c.data(), ldc);
    std::vector<float> f(static_cast<size_t>(M * ldc), -7.f);
    kernels::fill_rows(f.data(), M, N, ldc, bias.data());
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k) ref += double{a[i * K + k]} * b[k * N + j];
        ASSERT_NEAR(c[i * ldc + j], ref, 1e-4) << "C[" << i << "][" << j << "], " << threads;
        ASSERT_EQ(f[i * ldc + j], bias[j]) << "fill[" << i << "][" << j << "]";
      }
      for (int64_t j = N; j < ldc; ++j) {
        ASSERT_TRUE(std::isnan(c[i * ldc + j])) << "gemm wrote past column N in row " << i;
        ASSERT_EQ(f[i * ldc + j], -7.f) << "fill_rows wrote past column N in row " << i;
      }
    }
  }
  set_num_threads(1);
}

// The bias gradient of a linear: column sums added to what `out` holds, bit-identical at one
// and two threads (by construction: fixed 256-row chunks combined in chunk order, whatever the
// thread count), over more rows than one chunk (and a last chunk whose rows are not a multiple
// of 4) and a row stride wider than the row (the padding is never read).
TEST(Kernels, AddColumnSumsMatchesDoubleSumAnyThreadCount) {
  const int64_t M = 2 * 256 + 37, N = 600, ld = 616;
  Generator gen(11);
  std::vector<float> x = randn({M, ld}, gen).to_vector<float>();
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = N; j < ld; ++j) x[i * ld + j] = std::nanf("");
  }
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    std::vector<float> out(static_cast<size_t>(N), 0.5f);
    kernels::add_column_sums(out.data(), x.data(), M, N, ld);
    for (int64_t j = 0; j < N; ++j) {
      double ref = 0.5;
      for (int64_t i = 0; i < M; ++i) ref += x[i * ld + j];
      ASSERT_NEAR(out[j], ref, 1e-3) << "column " << j << ", " << threads << " thread(s)";
    }
    results.push_back(out);
  }
  set_num_threads(1);
  EXPECT_EQ(results[0], results[1]);
}

// sum_to reduces a gradient to a broadcast operand's shape. Leading dimensions only (a bias over
// rows) go through add_column_sums; the result equals a double sum to float rounding, and a
// reduction of an inner dimension still takes the general path.
TEST(Kernels, SumToLeadingAndInnerDimensions) {
  Generator gen(5);
  const Tensor g = randn({3, 5, 7}, gen);
  const std::vector<float> v = g.to_vector<float>();
  for (const Shape& shape : {Shape{7}, Shape{5, 7}}) {
    const int64_t n = numel_of(shape);
    std::vector<double> ref(static_cast<size_t>(n), 0.0);
    for (int64_t r = 0; r < 105 / n; ++r) {
      for (int64_t i = 0; i < n; ++i) ref[i] += v[r * n + i];
    }
    const std::vector<float> got = kernels::sum_to(g, shape).to_vector<float>();
    ASSERT_EQ(got.size(), ref.size());
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(got[i], ref[i], 1e-5) << shape.size() << " dims, element " << i;
    }
  }
  const std::vector<float> inner = kernels::sum_to(g, {3, 1, 7}).to_vector<float>();
  ASSERT_EQ(inner.size(), 21u);
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t c = 0; c < 7; ++c) {
      double ref = 0;
      for (int64_t t = 0; t < 5; ++t) ref += v[(b * 5 + t) * 7 + c];
      EXPECT_NEAR(inner[b * 7 + c], ref, 1e-5) << b << ", " << c;
    }
  }
}

}  // namespace
}  // namespace acc

namespace acc {
namespace {

// Sequence parallelism's dropout: the chunks of a tensor along a dimension, each drawn from a
// generator in the same state, are the whole tensor's values bitwise, and the generators end in
// the state the whole's draw leaves.
TEST(Random, UniformOverChunksIsTheWholeBitwise) {
  const Shape whole_shape{3, 8, 5};
  Generator ref(99);
  ref.advance(7);
  Tensor whole = empty(whole_shape);
  uniform_(whole, 0.0, 1.0, ref);
  for (int parts : {2, 4}) {
    std::vector<Tensor> chunks;
    for (int r = 0; r < parts; ++r) {
      Generator g(99);
      g.advance(7);
      Tensor c = empty({3, 8 / parts, 5});
      uniform_(c, 0.0, 1.0, TensorChunk{1, r * (8 / parts), 8}, g);
      EXPECT_EQ(g.offset(), ref.offset()) << parts << " parts, rank " << r;
      chunks.push_back(c);
    }
    const Tensor joined = cat(chunks, 1);
    EXPECT_EQ(joined.to_vector<float>(), whole.to_vector<float>()) << parts << " parts";
  }
  Tensor bad = empty({3, 4, 5});
  EXPECT_THROW(uniform_(bad, 0.0, 1.0, TensorChunk{1, 6, 8}, ref), ShapeError);
}

}  // namespace
}  // namespace acc
