#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "acc/autograd/engine.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

TEST(Engine, ChainRuleThroughSharedInputsSumsGradients) {
  Tensor x = from_vector({1.f, 2.f, 3.f}, {3}, {.requires_grad = true});
  // y = sum(x * x + 3 x) -> dy/dx = 2x + 3
  Tensor y = sum(add(mul(x, x), scale(x, 3.0)));
  y.backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{5.f, 7.f, 9.f}));
}

// The engine sums the gradients of a tensor used twice in place when it holds the only
// reference to the first one; a gradient that is also held elsewhere (here: kept by the backward
// function that returns it, or handed to both inputs of add) must be left untouched.
TEST(Engine, SharedGradientsAreNeverSummedInPlace) {
  Tensor x = from_vector({1.f, 2.f}, {2}, {.requires_grad = true});
  sum(add(x, x)).backward();  // add's backward hands one tensor to both inputs
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2.f, 2.f}));

  Tensor kept = from_vector({10.f, 20.f}, {2});
  Tensor w = from_vector({1.f, 1.f}, {2}, {.requires_grad = true});
  Tensor h = mul(w, w);            // h is used twice: through scale, and through PassesKeptBackward
  Tensor tripled = scale(h, 3.0);  // recorded first, so its backward runs after the other's
  Tensor out;
  {
    NoGradGuard ng;
    out = h.detach();
  }
  autograd::record_op("PassesKeptBackward", {h}, {out},
                      [kept](const std::vector<Tensor>&, const std::vector<bool>&) {
                        return std::vector<Tensor>{kept};
                      });
  sum(add(out, tripled)).backward();
  EXPECT_EQ(kept.to_vector<float>(), (std::vector<float>{10.f, 20.f}));
  // dL/dh = kept + 3, dL/dw = 2 w (kept + 3)
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{26.f, 46.f}));
}

TEST(Engine, GradientsAccumulateAcrossBackwardCalls) {
  Tensor x = from_vector({1.f, 2.f}, {2}, {.requires_grad = true});
  sum(scale(x, 2.0)).backward();
  sum(scale(x, 2.0)).backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{4.f, 4.f}));
}

TEST(Engine, SecondBackwardNeedsRetainGraph) {
  Tensor x = from_vector({1.f, 2.f}, {2}, {.requires_grad = true});
  Tensor y = sum(mul(x, x));
  y.backward(Tensor(), /*retain_graph=*/true);
  y.backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{4.f, 8.f}));
  EXPECT_THROW(y.backward(), ValueError);
}

TEST(Engine, NoGradGuardRecordsNothing) {
  Tensor x = ones({2}, {.requires_grad = true});
  Tensor y;
  {
    NoGradGuard ng;
    y = mul(x, x);
  }
  EXPECT_FALSE(y.requires_grad());
  EXPECT_THROW(y.backward(ones({2})), ValueError);
  EXPECT_TRUE(GradMode::is_enabled());
}

TEST(Engine, PostAccumulateHookFiresOncePerLeafWithFullGradient) {
  Tensor w = from_vector({1.f, 1.f}, {2}, {.requires_grad = true});
  std::vector<std::vector<float>> seen;
  w.register_post_accumulate_grad_hook(
      [&](Tensor& p) { seen.push_back(p.grad().to_vector<float>()); });
  // w used twice: the hook sees the sum of both contributions, once.
  Tensor y = sum(add(scale(w, 2.0), scale(w, 5.0)));
  y.backward();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], (std::vector<float>{7.f, 7.f}));
}

// A gradient hook sees each gradient as it reaches the leaf, before accumulation: what it returns
// is added in (an undefined result keeps the gradient); hooks chain in order; a removed one no
// longer runs; a result of another shape fails the backward; a non-leaf refuses one.
TEST(Engine, GradHookTransformsEachIncomingGradientBeforeAccumulation) {
  Tensor w = from_vector({1.f, 1.f}, {2}, {.requires_grad = true});
  std::vector<std::vector<float>> seen;
  const int doubled = w.register_grad_hook([&](const Tensor& g) {
    seen.push_back(g.to_vector<float>());
    return scale(g, 2.0);
  });
  w.register_grad_hook([&](const Tensor& g) {
    seen.push_back(g.to_vector<float>());
    return Tensor();
  });
  std::vector<float> after_hooks;
  w.register_post_accumulate_grad_hook(
      [&](Tensor& p) { after_hooks = p.grad().to_vector<float>(); });
  sum(scale(w, 3.0)).backward();
  EXPECT_EQ(seen, (std::vector<std::vector<float>>{{3.f, 3.f}, {6.f, 6.f}}));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{6.f, 6.f}));
  EXPECT_EQ(after_hooks, (std::vector<float>{6.f, 6.f}));
  // A second backward: its gradient is transformed alone, then added to the held one.
  sum(scale(w, 5.0)).backward();
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{16.f, 16.f}));
  w.remove_grad_hook(doubled);
  w.remove_grad_hook(doubled);  // already gone: ignored
  seen.clear();
  sum(w).backward();
  EXPECT_EQ(seen, (std::vector<std::vector<float>>{{1.f, 1.f}}));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{17.f, 17.f}));

  Tensor u = from_vector({1.f, 2.f}, {2}, {.requires_grad = true});
  u.register_grad_hook([](const Tensor&) { return zeros({3}); });
  EXPECT_THROW(sum(u).backward(), ShapeError);
  EXPECT_THROW(scale(u, 2.0).register_grad_hook([](const Tensor& g) { return g; }), ValueError);
}

// A leaf's accumulator lives as long as a graph that reads the leaf, so a later graph (a pipeline
// stage's next micro-batch while the one before is in flight) reuses it, with the sequence number
// of the earlier graph. It still runs as soon as its gradient is complete, before the later
// graph's other nodes (PyTorch's rule), so the leaf's new gradient is added in at once instead of
// waiting beside the activations for the end of the backward.
TEST(Engine, AnAccumulatorFromAnEarlierGraphRunsAsSoonAsItsGradientIsComplete) {
  Tensor w = from_vector({1.f, 2.f}, {2}, {.requires_grad = true});
  Tensor u = from_vector({3.f, 4.f}, {2}, {.requires_grad = true});
  Tensor earlier = sum(scale(w, 2.0));  // makes w's accumulator, kept alive by this graph
  std::vector<std::string> order;
  w.register_post_accumulate_grad_hook([&](Tensor&) { order.push_back("w"); });
  u.register_post_accumulate_grad_hook([&](Tensor&) { order.push_back("u"); });
  Tensor s = sum(scale(u, 3.0));  // recorded before t: its backward runs after t's
  Tensor t = sum(scale(w, 5.0));  // reuses w's accumulator from `earlier`
  add(s, t).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w", "u"}));
  earlier.backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w", "u", "w"}));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{7.f, 7.f}));
  EXPECT_EQ(u.grad().to_vector<float>(), (std::vector<float>{3.f, 3.f}));
}

TEST(Engine, RetainGradKeepsNonLeafGradient) {
  Tensor x = from_vector({1.f, 2.f}, {2}, {.requires_grad = true});
  Tensor h = scale(x, 3.0);
  h.retain_grad();
  sum(mul(h, h)).backward();
  EXPECT_EQ(h.grad().to_vector<float>(), (std::vector<float>{6.f, 12.f}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{18.f, 36.f}));
}

TEST(Engine, ViewsPropagateGradients) {
  Tensor x = from_vector({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3}, {.requires_grad = true});
  Tensor w = from_vector({1.f, 10.f}, {2, 1});
  Tensor y = sum(mul(x.transpose(0, 1).slice(0, 1, 3), w.transpose(0, 1).expand({2, 2})));
  y.backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{0, 1, 1, 0, 10, 10}));
}

TEST(Engine, NonScalarRootNeedsGradient) {
  Tensor x = ones({3}, {.requires_grad = true});
  Tensor y = scale(x, 2.0);
  EXPECT_THROW(y.backward(), ValueError);
  y.backward(from_vector({1.f, 2.f, 3.f}, {3}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2.f, 4.f, 6.f}));
}

TEST(Engine, InPlaceOnLeafRequiringGradIsRejected) {
  Tensor x = ones({2}, {.requires_grad = true});
  EXPECT_THROW(x.add_(ones({2})), ValueError);
  NoGradGuard ng;
  x.add_(ones({2}));
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{2.f, 2.f}));
}

}  // namespace
}  // namespace acc
