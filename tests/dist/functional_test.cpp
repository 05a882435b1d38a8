// The differentiable collectives and messages of acc/dist/functional.hpp at whatever world size
// mpirun gives (CTest runs 1, 2 and 4): each op's forward and gradient against the same
// computation done by one process holding every rank's tensors, gradients against finite
// differences of the job's loss, sizes that do not split refused by name, and a pipeline whose
// stages send and receive, trained against the one-process model.
//
// Inputs and output gradients are multiples of 1/64 in [-1, 1]: every sum the ops make of up to
// four of them is exact in f32 and bf16 whatever the order, so the distributed results equal the
// one-process ones exactly; the tests allow 1e-6.

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "acc/autograd/engine.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/dist/device_mesh.hpp"
#include "acc/dist/dist.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "dist/dist_gradcheck.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

using dist::ProcessGroup;
using dist::ProcessGroupPtr;

constexpr double kTol = 1e-6;

ProcessGroupPtr world() {
  return ProcessGroup::world();
}

// Multiples of 1/64 in [-1, 1], the same on every rank for the same seed.
Tensor dyadic(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat32) {
  Generator gen(seed);
  std::vector<float> v(static_cast<size_t>(numel_of(shape)));
  for (float& x : v) x = static_cast<float>(static_cast<int64_t>(gen.next_u64() % 129) - 64) / 64;
  Tensor t = from_vector(v, shape);
  return dtype == DType::kFloat32 ? t : t.to(dtype);
}

// One op under test and its one-process reference.
struct Case {
  std::string name;
  Shape shape;             // this rank's input (the same on every rank)
  bool replicated_input;   // one x every rank holds (its gradient summed over the ranks' uses)
  bool replicated_output;  // one y every rank holds, whose loss counts once
  std::function<Tensor(const Tensor&, const ProcessGroupPtr&)> op;
  // Every rank's output from every rank's input (xs[q]: rank q's), with differentiable ops.
  std::function<std::vector<Tensor>(const std::vector<Tensor>& xs)> reference;
};

Tensor sum_of(const std::vector<Tensor>& xs) {
  Tensor s = xs[0];
  for (size_t q = 1; q < xs.size(); ++q) s = add(s, xs[q]);
  return s;
}

std::vector<Case> cases(int W) {
  const int64_t B = 2, T = 4 * W, C = 3;  // T divides over any group here
  std::vector<Case> out;
  out.push_back(
      {"copy_to_group",
       {B, C},
       true,
       false,
       [](const Tensor& x, const ProcessGroupPtr& g) { return dist::copy_to_group(x, g); },
       [](const std::vector<Tensor>& xs) {
         std::vector<Tensor> ys;
         for (const Tensor& x : xs) ys.push_back(x.clone());
         return ys;
       }});
  out.push_back(
      {"reduce_from_group",
       {B, C},
       false,
       true,
       [](const Tensor& x, const ProcessGroupPtr& g) { return dist::reduce_from_group(x, g); },
       [](const std::vector<Tensor>& xs) { return std::vector<Tensor>(xs.size(), sum_of(xs)); }});
  for (int64_t dim : {0, 1}) {
    const std::string d = std::to_string(dim);
    out.push_back(
        {"gather_along dim " + d,
         {B, T / W, C},
         false,
         true,
         [dim](const Tensor& x, const ProcessGroupPtr& g) { return dist::gather_along(x, dim, g); },
         [dim](const std::vector<Tensor>& xs) {
           return std::vector<Tensor>(xs.size(), cat(xs, dim));
         }});
    out.push_back({"allgather_along dim " + d,
                   {B, T / W, C},
                   false,
                   false,
                   [dim](const Tensor& x, const ProcessGroupPtr& g) {
                     return dist::allgather_along(x, dim, g);
                   },
                   [dim](const std::vector<Tensor>& xs) {
                     std::vector<Tensor> ys;
                     for (size_t q = 0; q < xs.size(); ++q) ys.push_back(cat(xs, dim));
                     return ys;
                   }});
    out.push_back({"scatter_along dim " + d,
                   {B * W, T, C},
                   true,
                   false,
                   [dim](const Tensor& x, const ProcessGroupPtr& g) {
                     return dist::scatter_along(x, dim, g);
                   },
                   [dim](const std::vector<Tensor>& xs) {
                     return chunk(xs[0], static_cast<int64_t>(xs.size()), dim);
                   }});
    out.push_back({"reduce_scatter_along dim " + d,
                   {B * W, T, C},
                   false,
                   false,
                   [dim](const Tensor& x, const ProcessGroupPtr& g) {
                     return dist::reduce_scatter_along(x, dim, g);
                   },
                   [dim](const std::vector<Tensor>& xs) {
                     return chunk(sum_of(xs), static_cast<int64_t>(xs.size()), dim);
                   }});
  }
  // Ulysses: (B, T/W, NH, HS) -> (B, T, NH/W, HS), and the same dimension both ways.
  const int64_t NH = 2 * W;
  for (auto [s, g] : {std::pair<int64_t, int64_t>{2, 1}, {1, 2}, {0, 0}, {-1, 0}}) {
    out.push_back({"alltoall_along " + std::to_string(s) + " -> " + std::to_string(g),
                   {2 * W, T / W, NH, 3 * W},
                   false,
                   false,
                   [s, g](const Tensor& x, const ProcessGroupPtr& grp) {
                     return dist::alltoall_along(x, s, g, grp);
                   },
                   [s, g](const std::vector<Tensor>& xs) {
                     const int64_t W = static_cast<int64_t>(xs.size());
                     std::vector<Tensor> ys;
                     for (int64_t j = 0; j < W; ++j) {
                       std::vector<Tensor> pieces;
                       for (const Tensor& x : xs) pieces.push_back(chunk(x, W, s)[j]);
                       ys.push_back(cat(pieces, g));
                     }
                     return ys;
                   }});
  }
  return out;
}

// Runs `c` on this rank and by one process; checks this rank's output and input gradient.
void expect_matches_one_process(const Case& c, DType dtype) {
  auto g = world();
  const int W = g->size(), r = g->rank();
  SCOPED_TRACE(c.name + " " + dtype_name(dtype));
  // Rank q's input and output gradient (one of each when replicated).
  auto input = [&](int q) { return dyadic(c.shape, 100 + (c.replicated_input ? 0 : q)); };
  auto grad_out = [&](int q, const Shape& s) {
    return dyadic(s, 200 + (c.replicated_output ? 0 : q));
  };
  // Distributed.
  Tensor x = input(r).to(dtype);
  x.set_requires_grad(true);
  Tensor y = c.op(x, g);
  ASSERT_EQ(y.dtype(), dtype);
  y.backward(grad_out(r, y.shape()).to(dtype));
  // One process, f32.
  std::vector<Tensor> xs;
  for (int q = 0; q < W; ++q) {
    if (c.replicated_input && q > 0) {
      xs.push_back(xs[0]);
      continue;
    }
    xs.push_back(input(q));
    xs.back().set_requires_grad(true);
  }
  const std::vector<Tensor> ys = c.reference(xs);
  ASSERT_EQ(ys.size(), static_cast<size_t>(W));
  Tensor loss;
  for (int q = 0; q < (c.replicated_output ? 1 : W); ++q) {
    Tensor l = sum(mul(ys[q], grad_out(q, ys[q].shape())));
    loss = loss.defined() ? add(loss, l) : l;
  }
  loss.backward();
  ASSERT_EQ(y.shape(), ys[r].shape());
  EXPECT_LE(max_abs_diff(y.to(DType::kFloat32), ys[r].detach()), kTol);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_LE(max_abs_diff(x.grad().to(DType::kFloat32), xs[r].grad()), kTol);
}

TEST(DifferentiableCollectives, ForwardAndGradientMatchOneProcessInF32) {
  for (const Case& c : cases(world()->size())) expect_matches_one_process(c, DType::kFloat32);
}

TEST(DifferentiableCollectives, ForwardAndGradientMatchOneProcessInBf16) {
  for (const Case& c : cases(world()->size())) expect_matches_one_process(c, DType::kBFloat16);
}

// Every op is linear, so central differences have no truncation error: atol 1e-4 as the
// linear maps of ops_gradcheck_test (eps 1e-2; L in double from f32 outputs).
TEST(DifferentiableCollectives, GradientsMatchFiniteDifferencesOfTheJobsLoss) {
  auto g = world();
  for (const Case& c : cases(g->size())) {
    SCOPED_TRACE(c.name);
    test::DistGradcheckOptions opt;
    opt.base.atol = 1e-4;
    opt.base.max_checks = 24;
    opt.replicated_input = c.replicated_input;
    opt.replicated_output = c.replicated_output;
    const Tensor x = dyadic(c.shape, 300 + (c.replicated_input ? 0 : g->rank()));
    const auto res = test::dist_gradcheck([&](const Tensor& t) { return c.op(t, g); }, x, *g, opt);
    EXPECT_TRUE(res.ok) << res.report;
    EXPECT_GT(res.checked, 0);
  }
}

// The harness can fail: reduce_from_group's backward (identity) checked as if its output were
// not replicated (the loss summed over the ranks) is wrong by a factor W, and is caught.
TEST(DifferentiableCollectives, TheDistributedGradcheckCatchesAWrongGradient) {
  auto g = world();
  if (g->size() == 1) GTEST_SKIP() << "the factor is 1 on one rank";
  test::DistGradcheckOptions opt;
  opt.replicated_output = false;
  const Tensor x = dyadic({2, 3}, 7 + g->rank());
  const auto res = test::dist_gradcheck(
      [&](const Tensor& t) { return dist::reduce_from_group(t, g); }, x, *g, opt);
  EXPECT_FALSE(res.ok);
  EXPECT_GT(res.mismatches, 0);
}

TEST(DifferentiableCollectives, SizesThatDoNotSplitAreRefusedByName) {
  auto g = world();
  const int W = g->size();
  if (W == 1) GTEST_SKIP() << "every size splits over one rank";
  const Tensor x = zeros({2, W + 1, 4});
  const std::string want = "dimension 1 of size " + std::to_string(W + 1) +
                           " does not split evenly over group 'world' of " + std::to_string(W) +
                           " ranks";
  for (const std::string& msg : {
           test::error_of<ShapeError>([&] { dist::scatter_along(x, 1, g); }),
           test::error_of<ShapeError>([&] { dist::reduce_scatter_along(x, 1, g); }),
           test::error_of<ShapeError>([&] { dist::alltoall_along(x, 1, 2, g); }),
       }) {
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
  EXPECT_NE(
      test::error_of<ShapeError>([&] { dist::scatter_along(x, -2, g); }).find("scatter_along"),
      std::string::npos);
  EXPECT_NE(test::error_of<TypeError>([&] {
              dist::copy_to_group(zeros({2}, {DType::kInt64}), g);
            }).find("must be f32 or bf16, got i64"),
            std::string::npos);
  g->barrier()->wait();  // nothing was communicated: the group is still in step
}

// ---- pipeline ----

// A toy pipeline of `stages` linear maps y_i = W_i y_{i-1} (no bias), the loss mean(y^2) on the
// last, run over micro-batches GPipe-style (every forward, then every backward, last first), so
// that several messages are in flight on each pair of ranks.
struct Toy {
  int stages;
  int64_t M = 3, D = 4;  // micro-batch rows, width
  int micro_batches = 2;
  Tensor weight(int stage) const { return dyadic({D, D}, 500 + stage); }
  Tensor input(int mb, int replica) const { return dyadic({M, D}, 600 + 10 * replica + mb); }
};

// The one-process model: every stage's weight gradient for replica `replica`'s data.
std::vector<Tensor> one_process_grads(const Toy& t, int replica) {
  std::vector<Tensor> w;
  for (int s = 0; s < t.stages; ++s) {
    w.push_back(t.weight(s));
    w.back().set_requires_grad(true);
  }
  for (int mb = 0; mb < t.micro_batches; ++mb) {
    Tensor y = t.input(mb, replica);
    for (int s = 0; s < t.stages; ++s) y = linear(y, w[s]);
    mean(square(y)).backward();
  }
  std::vector<Tensor> grads;
  for (const Tensor& p : w) grads.push_back(p.grad());
  return grads;
}

// This rank's stage of the toy over `pp` (stage = pp rank); returns its weight's gradient.
Tensor run_stage(const Toy& t, const ProcessGroupPtr& pp, int replica) {
  const int s = pp->rank(), last = t.stages - 1;
  Tensor w = t.weight(s);
  w.set_requires_grad(true);
  std::vector<Tensor> roots;  // what each micro-batch's backward starts from
  for (int mb = 0; mb < t.micro_batches; ++mb) {
    Tensor x = s == 0 ? t.input(mb, replica)
                      : dist::recv_from({t.M, t.D}, {.requires_grad = true}, s - 1, pp);
    Tensor y = linear(x, w);
    roots.push_back(s == last ? mean(square(y)) : dist::send_to(y, s + 1, pp));
  }
  for (int mb = t.micro_batches - 1; mb >= 0; --mb) roots[mb].backward();
  return w.grad();
}

// The same stage with every message's receive posted before anything runs: the activations with
// dist::post_recv in micro-batch order, the gradients with dist::PostedGradients in the order the
// backwards run (the next stage sends them in that order too).
Tensor run_stage_posted_ahead(const Toy& t, const ProcessGroupPtr& pp, int replica) {
  const int s = pp->rank(), last = t.stages - 1;
  Tensor w = t.weight(s);
  w.set_requires_grad(true);
  std::vector<dist::PostedRecv> inputs;
  for (int mb = 0; s > 0 && mb < t.micro_batches; ++mb) {
    inputs.push_back(dist::post_recv({t.M, t.D}, {.requires_grad = true}, s - 1, pp));
  }
  dist::PostedGradients gradients;
  for (int mb = t.micro_batches - 1; s < last && mb >= 0; --mb) {
    gradients.post({t.M, t.D}, {}, s + 1, pp);
  }
  std::vector<Tensor> roots;
  for (int mb = 0; mb < t.micro_batches; ++mb) {
    Tensor x = s == 0 ? t.input(mb, replica) : dist::recv_from(std::move(inputs[mb]));
    Tensor y = linear(x, w);
    roots.push_back(s == last ? mean(square(y)) : dist::send_to(y, s + 1, pp));
  }
  for (int mb = t.micro_batches - 1; mb >= 0; --mb) roots[mb].backward();
  EXPECT_EQ(gradients.pending(), 0u) << "every posted gradient was taken";
  return w.grad();
}

TEST(Pipeline, ReceivesPostedAheadMatchOneProcess) {
  if (world()->size() < 2) GTEST_SKIP() << "needs two ranks";
  const int W = world()->size();
  const dist::ParallelContext mesh(dist::DeviceMesh{.pp = W}, world());
  auto pp = mesh.group(dist::MeshDim::kPp);
  const Toy toy{W};
  const Tensor grad = run_stage_posted_ahead(toy, pp, 0);
  EXPECT_LE(max_abs_diff(grad, one_process_grads(toy, 0)[pp->rank()]), kTol);
  world()->barrier()->wait();
}

// Stages over a mesh's pp group (pp = `stages`, the rest data parallel, each replica its own
// data): every stage's weight gradient equals the one-process value, and the messages were
// numbered per peer and direction (2 activations out and 2 gradients in per neighbour).
void expect_pipeline_matches(int stages) {
  const int W = world()->size();
  const dist::ParallelContext mesh(dist::DeviceMesh{.pp = stages, .dp = W / stages}, world());
  auto pp = mesh.group(dist::MeshDim::kPp);
  const int replica = mesh.coordinate(dist::MeshDim::kDp), s = pp->rank();
  const Toy toy{stages};
  // Counted from here: a mesh dimension as large as the world is the world group itself, whose
  // counts earlier tests have advanced.
  using dist::P2PDirection;
  auto count = [&](int peer, P2PDirection d) {
    return peer >= 0 && peer < stages ? pp->p2p_sequence_number(peer, d) : 0;
  };
  const uint64_t sent_up = count(s + 1, P2PDirection::kSend),
                 got_up = count(s + 1, P2PDirection::kRecv);
  const uint64_t sent_down = count(s - 1, P2PDirection::kSend),
                 got_down = count(s - 1, P2PDirection::kRecv);
  const Tensor grad = run_stage(toy, pp, replica);
  const std::vector<Tensor> want = one_process_grads(toy, replica);
  ASSERT_TRUE(grad.defined());
  EXPECT_LE(max_abs_diff(grad, want[s]), kTol) << "stage " << s;
  const uint64_t n = static_cast<uint64_t>(toy.micro_batches);
  if (s + 1 < stages) {
    EXPECT_EQ(count(s + 1, P2PDirection::kSend) - sent_up, n);
    EXPECT_EQ(count(s + 1, P2PDirection::kRecv) - got_up, n);
  }
  if (s > 0) {
    EXPECT_EQ(count(s - 1, P2PDirection::kRecv) - got_down, n);
    EXPECT_EQ(count(s - 1, P2PDirection::kSend) - sent_down, n);
  }
  world()->barrier()->wait();
}

TEST(Pipeline, TwoStagesMatchOneProcess) {
  if (world()->size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  expect_pipeline_matches(2);
}

TEST(Pipeline, AStagePerRankMatchesOneProcess) {
  if (world()->size() < 2) GTEST_SKIP() << "needs two ranks";
  expect_pipeline_matches(world()->size());  // middle stages receive and send
}

// Without a gradient to come back, a send waits for its message and a recv carries no backward.
TEST(Pipeline, WithoutGradientsMessagesStillArrive) {
  auto g = world();
  const int W = g->size(), r = g->rank();
  if (W < 2) GTEST_SKIP() << "needs two ranks";
  NoGradGuard no_grad;
  const Tensor x = dyadic({5}, 42);
  if (r == 0) {
    Tensor h = dist::send_to(x, 1, g, 3);
    EXPECT_FALSE(h.requires_grad());
    EXPECT_EQ(h.dim(), 0);
  } else if (r == 1) {
    Tensor y = dist::recv_from({5}, {.requires_grad = true}, 0, g, 3);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(max_abs_diff(y, x), 0.0);
  }
  g->barrier()->wait();
}

TEST(Pipeline, BadPeersTagsAndDtypesAreRefusedByName) {
  auto g = world();
  const int W = g->size(), r = g->rank();
  const Tensor x = zeros({2});
  EXPECT_NE(test::error_of<ValueError>([&] {
              dist::send_to(x, r, g);
            }).find("destination " + std::to_string(r) + " is not another rank of group 'world'"),
            std::string::npos);
  EXPECT_NE(test::error_of<ValueError>([&] {
              dist::recv_from({2}, {}, W, g);
            }).find("source " + std::to_string(W) + " is not another rank"),
            std::string::npos);
  if (W > 1) {
    EXPECT_NE(test::error_of<ValueError>([&] {
                dist::send_to(x, (r + 1) % W, g, 512);
              }).find("tag 512 is not in [0, 511]"),
              std::string::npos);
    EXPECT_NE(test::error_of<TypeError>([&] {
                dist::recv_from({2}, {.dtype = DType::kInt32}, (r + 1) % W, g);
              }).find("dtype must be f32 or bf16, got i32"),
              std::string::npos);
  }
  g->barrier()->wait();
}

}  // namespace
}  // namespace acc
