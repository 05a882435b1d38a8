// bench_kernels: micro-benchmarks of the kernels a training step of the 17M GPT spends its time
// in (B8 T256 C512 NH8 V8192), so that a kernel regression shows up by name. Ops run through the
// public differentiable API (forward, or forward + backward through autograd), which is what
// training pays for.
//
//   ACC_NUM_THREADS=1 build-bench/benchmarks/bench_kernels --benchmark_filter=Attention
//
// Rates: "FLOP/s" counters are matrix-product FLOPs (as acc::autograd::FlopCounter counts them),
// "bytes_per_second" for the bandwidth-bound ops is the bytes of their inputs and outputs.

#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "acc/acc.hpp"
#include "acc/tensor/kernels.hpp"

namespace {

constexpr int64_t kB = 8, kT = 256, kC = 512, kNH = 8, kHS = 64, kV = 8192;
constexpr int64_t kN = kB * kT;  // rows of every activation

acc::Tensor leaf(acc::Shape shape, double std = 1.0) {
  acc::Tensor t = acc::randn(std::move(shape)) * std;
  return t.detach().set_requires_grad(true);
}

void clear_grads(std::initializer_list<acc::Tensor*> ts) {
  for (acc::Tensor* t : ts) t->set_grad(acc::Tensor());
}

void flops_counter(benchmark::State& state, double flops_per_iter) {
  state.counters["FLOP/s"] =
      benchmark::Counter(flops_per_iter, benchmark::Counter::kIsIterationInvariantRate);
}

// ---- sgemm: the peak the MFU of bench_train is measured against.
void BM_Sgemm(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  std::vector<float> a(static_cast<size_t>(n) * n, 0.01f), b(a.size(), 0.02f), c(a.size());
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  flops_counter(state, 2.0 * n * n * n);
}
BENCHMARK(BM_Sgemm)->Arg(2048)->Unit(benchmark::kMillisecond);

// ---- linear layers of the 17M GPT: x (N, IN) -> (N, OUT). Args: OUT, IN.
void BM_LinearForward(benchmark::State& state) {
  const int64_t out = state.range(0), in = state.range(1);
  acc::NoGradGuard ng;
  acc::Tensor x = acc::randn({kN, in}), w = acc::randn({out, in}) * 0.02, b = acc::zeros({out});
  for (auto _ : state) benchmark::DoNotOptimize(acc::linear(x, w, b).raw_data());
  flops_counter(state, 2.0 * kN * in * out);
}
void BM_LinearForwardBackward(benchmark::State& state) {
  const int64_t out = state.range(0), in = state.range(1);
  acc::Tensor x = leaf({kN, in}), w = leaf({out, in}, 0.02), b = leaf({out});
  acc::Tensor dy = acc::randn({kN, out});
  for (auto _ : state) {
    clear_grads({&x, &w, &b});
    acc::linear(x, w, b).backward(dy);
  }
  flops_counter(state, 6.0 * kN * in * out);
}
void linear_shapes(benchmark::internal::Benchmark* bm) {
  bm->Args({3 * kC, kC})    // attn.c_attn
      ->Args({kC, kC})      // attn.c_proj
      ->Args({4 * kC, kC})  // mlp.c_fc
      ->Args({kC, 4 * kC})  // mlp.c_proj
      ->Args({kV, kC})      // tied lm head
      ->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_LinearForward)->Apply(linear_shapes);
BENCHMARK(BM_LinearForwardBackward)->Apply(linear_shapes);

// ---- the three GEMMs of a linear layer one by one, as acc::linear issues them (row-major).
// Args: OUT, IN, which (0: y = x w^T, "NT"; 1: dx = dy w, "NN"; 2: dw = dy^T x, "TN"). Compare
// each with BM_Sgemm; on this shared VM only rates measured close together in time compare
// (benchmarks/README.md, "Where the time goes").
void BM_LinearGemm(benchmark::State& state) {
  const int64_t out = state.range(0), in = state.range(1), which = state.range(2);
  std::vector<float> x(static_cast<size_t>(kN * in), 0.01f),
      w(static_cast<size_t>(out * in), 0.02f), dy(static_cast<size_t>(kN * out), 0.03f),
      c(static_cast<size_t>(std::max(kN, out) * std::max(in, out)));
  for (auto _ : state) {
    if (which == 0) {
      acc::kernels::gemm(false, true, kN, out, in, 1.f, x.data(), in, w.data(), in, 0.f, c.data(),
                         out);
    } else if (which == 1) {
      acc::kernels::gemm(false, false, kN, in, out, 1.f, dy.data(), out, w.data(), in, 0.f,
                         c.data(), in);
    } else {
      acc::kernels::gemm(true, false, out, in, kN, 1.f, dy.data(), out, x.data(), in, 0.f, c.data(),
                         in);
    }
    benchmark::DoNotOptimize(c.data());
  }
  state.SetLabel(which == 0 ? "y=x*w^T NT" : which == 1 ? "dx=dy*w NN" : "dw=dy^T*x TN");
  flops_counter(state, 2.0 * kN * in * out);
}
BENCHMARK(BM_LinearGemm)
    ->ArgsProduct({{3 * kC}, {kC}, {0, 1, 2}})
    ->ArgsProduct({{4 * kC}, {kC}, {0, 1, 2}})
    ->ArgsProduct({{kC}, {4 * kC}, {0, 1, 2}})
    ->ArgsProduct({{kV}, {kC}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond);

// ---- causal attention, q/k/v (B, NH, T, HS). Arg 1: fused flash kernel, 0: reference.
void BM_AttentionForward(benchmark::State& state) {
  const bool fused = state.range(0) != 0;
  acc::NoGradGuard ng;
  acc::Tensor q = acc::randn({kB, kNH, kT, kHS}), k = acc::randn({kB, kNH, kT, kHS}),
              v = acc::randn({kB, kNH, kT, kHS});
  for (auto _ : state) {
    acc::Tensor y =
        fused ? acc::scaled_dot_product_attention(q, k, v) : acc::attention_reference(q, k, v);
    benchmark::DoNotOptimize(y.raw_data());
  }
  flops_counter(state, 2.0 * kB * kNH * kT * kT * kHS);
}
void BM_AttentionForwardBackward(benchmark::State& state) {
  const bool fused = state.range(0) != 0;
  acc::Tensor q = leaf({kB, kNH, kT, kHS}), k = leaf({kB, kNH, kT, kHS}),
              v = leaf({kB, kNH, kT, kHS});
  acc::Tensor dy = acc::randn({kB, kNH, kT, kHS});
  for (auto _ : state) {
    clear_grads({&q, &k, &v});
    acc::Tensor y =
        fused ? acc::scaled_dot_product_attention(q, k, v) : acc::attention_reference(q, k, v);
    y.backward(dy);
  }
  flops_counter(state, 6.0 * kB * kNH * kT * kT * kHS);
}
BENCHMARK(BM_AttentionForward)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionForwardBackward)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond);

// ---- the GPT block's layout: q, k, v are strided views of the (B, T, 3C) output of c_attn and
// the gradient of the output arrives as (B, T, C) from c_proj, so every row is 3C or C floats
// from the next (fused kernel only, forward + backward through split).
void BM_AttentionPackedQkvForwardBackward(benchmark::State& state) {
  acc::Tensor qkv = leaf({kB, kT, 3 * kC});
  acc::Tensor dy = acc::randn({kB, kT, kC});
  for (auto _ : state) {
    clear_grads({&qkv});
    auto parts = acc::split(qkv, {kC, kC, kC}, 2);
    auto heads = [](const acc::Tensor& t) { return t.view({kB, kT, kNH, kHS}).transpose(1, 2); };
    acc::Tensor y =
        acc::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]));
    y.transpose(1, 2).reshape({kB, kT, kC}).backward(dy);
  }
  flops_counter(state, 6.0 * kB * kNH * kT * kT * kHS);
}
BENCHMARK(BM_AttentionPackedQkvForwardBackward)->Unit(benchmark::kMillisecond);

// ---- bandwidth-bound ops on (N, C) activations.
void BM_LayerNormForwardBackward(benchmark::State& state) {
  acc::Tensor x = leaf({kN, kC}), w = leaf({kC}), b = leaf({kC});
  acc::Tensor dy = acc::randn({kN, kC});
  for (auto _ : state) {
    clear_grads({&x, &w, &b});
    acc::layer_norm(x, w, b).backward(dy);
  }
  state.SetBytesProcessed(state.iterations() * kN * kC * 4 * 4);  // x, y, dy, dx
}
BENCHMARK(BM_LayerNormForwardBackward)->Unit(benchmark::kMicrosecond);

void BM_RmsNormForwardBackward(benchmark::State& state) {
  acc::Tensor x = leaf({kN, kC}), w = leaf({kC});
  acc::Tensor dy = acc::randn({kN, kC});
  for (auto _ : state) {
    clear_grads({&x, &w});
    acc::rms_norm(x, w, 1e-5).backward(dy);
  }
  state.SetBytesProcessed(state.iterations() * kN * kC * 4 * 4);
}
BENCHMARK(BM_RmsNormForwardBackward)->Unit(benchmark::kMicrosecond);

void BM_GeluForwardBackward(benchmark::State& state) {
  acc::Tensor x = leaf({kN, 4 * kC});
  acc::Tensor dy = acc::randn({kN, 4 * kC});
  for (auto _ : state) {
    clear_grads({&x});
    acc::gelu(x, acc::GeluApprox::kTanh).backward(dy);
  }
  state.SetBytesProcessed(state.iterations() * kN * 4 * kC * 4 * 4);
}
BENCHMARK(BM_GeluForwardBackward)->Unit(benchmark::kMicrosecond);

void BM_SwigluForwardBackward(benchmark::State& state) {
  const int64_t H = 1376;  // the Llama config's intermediate size
  acc::Tensor g = leaf({kN, H}), u = leaf({kN, H});
  acc::Tensor dy = acc::randn({kN, H});
  for (auto _ : state) {
    clear_grads({&g, &u});
    acc::swiglu(g, u).backward(dy);
  }
  state.SetBytesProcessed(state.iterations() * kN * H * 4 * 6);
}
BENCHMARK(BM_SwigluForwardBackward)->Unit(benchmark::kMicrosecond);

void BM_ResidualAddForwardBackward(benchmark::State& state) {
  acc::Tensor x = leaf({kN, kC}), y = leaf({kN, kC});
  acc::Tensor dy = acc::randn({kN, kC});
  for (auto _ : state) {
    clear_grads({&x, &y});
    (x + y).backward(dy);
  }
  state.SetBytesProcessed(state.iterations() * kN * kC * 4 * 6);
}
BENCHMARK(BM_ResidualAddForwardBackward)->Unit(benchmark::kMicrosecond);

// ---- fused cross-entropy over logits (N, V).
void BM_CrossEntropyForward(benchmark::State& state) {
  acc::NoGradGuard ng;
  acc::Tensor logits = acc::randn({kN, kV});
  std::vector<int64_t> t(static_cast<size_t>(kN));
  for (int64_t i = 0; i < kN; ++i) t[static_cast<size_t>(i)] = (i * 7919) % kV;
  acc::Tensor targets = acc::from_vector(t, {kN});
  for (auto _ : state) benchmark::DoNotOptimize(acc::cross_entropy(logits, targets).item());
  state.SetBytesProcessed(state.iterations() * kN * kV * 4);
}
void BM_CrossEntropyForwardBackward(benchmark::State& state) {
  acc::Tensor logits = leaf({kN, kV});
  std::vector<int64_t> t(static_cast<size_t>(kN));
  for (int64_t i = 0; i < kN; ++i) t[static_cast<size_t>(i)] = (i * 7919) % kV;
  acc::Tensor targets = acc::from_vector(t, {kN});
  for (auto _ : state) {
    clear_grads({&logits});
    acc::cross_entropy(logits, targets).backward();
  }
  state.SetBytesProcessed(state.iterations() * kN * kV * 4 * 3);
}
// The LM head and the loss as one step runs them: logits = x w^T (N, V), cross-entropy, and the
// backward through both, so that a change in how cross-entropy writes its gradient is timed
// together with the two GEMMs that read that gradient next.
void BM_LmHeadCrossEntropyForwardBackward(benchmark::State& state) {
  acc::Tensor x = leaf({kN, kC}), w = leaf({kV, kC}, 0.02);
  std::vector<int64_t> t(static_cast<size_t>(kN));
  for (int64_t i = 0; i < kN; ++i) t[static_cast<size_t>(i)] = (i * 7919) % kV;
  acc::Tensor targets = acc::from_vector(t, {kN});
  for (auto _ : state) {
    clear_grads({&x, &w});
    acc::cross_entropy(acc::linear(x, w, acc::Tensor()), targets).backward();
  }
  flops_counter(state, 6.0 * kN * kC * kV);
}
BENCHMARK(BM_CrossEntropyForward)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CrossEntropyForwardBackward)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LmHeadCrossEntropyForwardBackward)->Unit(benchmark::kMillisecond);

// ---- one GPT block (LayerNorm, qkv, fused attention, projection, LayerNorm, GELU MLP, two
// residual adds), forward + backward, as a step runs each of the 17M GPT's four blocks.
void BM_GptBlockForwardBackward(benchmark::State& state) {
  acc::nn::GPTBlock block(kC, kNH, /*bias=*/true, acc::nn::Activation::kGeluTanh);
  acc::Tensor x = leaf({kB, kT, kC}), dy = acc::randn({kB, kT, kC});
  for (auto _ : state) {
    clear_grads({&x});
    for (auto& [name, p] : block.named_parameters()) p.set_grad(acc::Tensor());
    block.forward(x).backward(dy);
  }
  // The block's matrix products: four linears (3 GEMMs each) and causal attention (half the
  // score and value products, forward + 2x backward).
  const double linears = 2.0 * kN * kC * (3 * kC + kC + 4 * kC + 4 * kC);
  const double attention = 2.0 * kB * kNH * kT * kT * kHS;
  flops_counter(state, 3 * (linears + attention));
}
BENCHMARK(BM_GptBlockForwardBackward)->Unit(benchmark::kMillisecond);

// ---- embedding lookup + backward scatter (tokens (N,), table (V, C)).
void BM_EmbeddingForwardBackward(benchmark::State& state) {
  acc::Tensor w = leaf({kV, kC});
  std::vector<int64_t> t(static_cast<size_t>(kN));
  for (int64_t i = 0; i < kN; ++i) t[static_cast<size_t>(i)] = (i * 7919) % kV;
  acc::Tensor idx = acc::from_vector(t, {kN});
  acc::Tensor dy = acc::randn({kN, kC});
  for (auto _ : state) {
    clear_grads({&w});
    acc::embedding(idx, w).backward(dy);
  }
}
BENCHMARK(BM_EmbeddingForwardBackward)->Unit(benchmark::kMicrosecond);

// ---- optimizer: AdamW over the 17M GPT's parameters with gradient clipping to norm 1, as in
// bench_train. Arg 0: clip_grad_norm_ (norm pass + scaling pass) then step(); 1: the norm pass
// then step_scaled(clip_coefficient) (scaling fused into the update).
void BM_AdamWClipStep(benchmark::State& state) {
  const bool fused = state.range(0) != 0;
  acc::optim::NamedParams params;
  auto add = [&](const std::string& name, acc::Shape shape) {
    acc::Tensor p = acc::randn(shape) * 0.02;
    p = p.detach().set_requires_grad(true);
    p.set_grad(acc::randn(std::move(shape)));
    params.emplace_back(name, p);
  };
  add("wte", {kV, kC});
  add("wpe", {kT, kC});
  for (int l = 0; l < 4; ++l) {
    const std::string b = "h." + std::to_string(l) + ".";
    add(b + "attn.c_attn.weight", {3 * kC, kC});
    add(b + "attn.c_attn.bias", {3 * kC});
    add(b + "attn.c_proj.weight", {kC, kC});
    add(b + "attn.c_proj.bias", {kC});
    add(b + "mlp.c_fc.weight", {4 * kC, kC});
    add(b + "mlp.c_fc.bias", {4 * kC});
    add(b + "mlp.c_proj.weight", {kC, 4 * kC});
    add(b + "mlp.c_proj.bias", {kC});
    for (const char* ln : {"ln_1", "ln_2"}) {
      add(b + ln + ".weight", {kC});
      add(b + ln + ".bias", {kC});
    }
  }
  acc::optim::AdamW opt(params, {.lr = 1e-3, .betas = {0.9, 0.95}, .weight_decay = 0.1});
  for (auto _ : state) {
    if (fused) {
      opt.step_scaled(acc::optim::clip_coefficient(1.0, acc::optim::get_total_norm(params)));
    } else {
      acc::optim::clip_grad_norm_(params, 1.0);
      opt.step();
    }
  }
}
BENCHMARK(BM_AdamWClipStep)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  acc::init_threads_from_env();
  benchmark::AddCustomContext("acc_threads", std::to_string(acc::get_num_threads()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
