// Communication in a trace: a small tensor- and sequence-parallel model written with the
// differentiable collectives of acc/dist/functional.hpp, traced on meta tensors as rank 1 of a
// meta group of 4 ranks (one process, no MPI), shows every communication vertex with its kind,
// group and bytes, forward and backward; the per-group pass sums them; the dumps carry them. The
// stages of a pipeline trace their messages the same way.

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "acc/autograd/ops.hpp"
#include "acc/dist/functional.hpp"
#include "acc/nn/layers.hpp"
#include "acc/trace/dump.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

using dist::ProcessGroupPtr;

constexpr int64_t B = 2, T = 8, C = 16, F = 32, TP = 4;
constexpr int64_t kFull = B * T * C * 4;  // bytes of an f32 (B, T, C) activation
constexpr int64_t kQuarter = kFull / TP;

// An MLP split over `tp` (Megatron): fc1 column-parallel, fc2 row-parallel. With sequence
// parallelism its input and output are split along T; without, replicated.
struct TpMlp : nn::Module {
  TpMlp(ProcessGroupPtr tp, bool sequence_parallel)
      : nn::Module("TpMlp"), tp(std::move(tp)), sp(sequence_parallel) {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(C, F / TP));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(F / TP, C, /*bias=*/false));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = sp ? dist::allgather_along(x, 1, tp) : dist::copy_to_group(x, tp);
    h = (*fc2)(gelu((*fc1)(h)));
    return sp ? dist::reduce_scatter_along(h, 1, tp) : dist::reduce_from_group(h, tp);
  }
  ProcessGroupPtr tp;
  bool sp;
  std::shared_ptr<nn::Linear> fc1, fc2;
};

// A replicated projection (so that what enters the tensor-parallel block needs a gradient, as an
// embedding's output does), a tensor-parallel block, then a sequence-parallel one, then Ulysses'
// all-to-all (heads scattered, sequence gathered), then the heads gathered back.
struct ParallelModel : nn::Module {
  explicit ParallelModel(ProcessGroupPtr g) : nn::Module("ParallelModel"), tp(std::move(g)) {
    proj = register_module("proj", std::make_shared<nn::Linear>(C, C));
    tp_block = register_module("tp_block", std::make_shared<TpMlp>(tp, false));
    sp_block = register_module("sp_block", std::make_shared<TpMlp>(tp, true));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = (*tp_block)((*proj)(x));                           // (B, T, C)
    Tensor s = (*sp_block)(dist::scatter_along(y, 1, tp));        // (B, T/TP, C)
    Tensor q = s.view({B, T / TP, TP, C / TP});                   // (B, T/TP, NH, HS)
    Tensor u = dist::alltoall_along(q, 2, 1, tp);                 // (B, T, NH/TP, HS)
    return dist::gather_along(u.reshape({B, T, C / TP}), 2, tp);  // (B, T, C)
  }
  ProcessGroupPtr tp;
  std::shared_ptr<nn::Linear> proj;
  std::shared_ptr<TpMlp> tp_block, sp_block;
};

using Seen = std::tuple<std::string, trace::Phase, CommKind, int64_t>;

std::vector<Seen> comm_vertices(const trace::Trace& t, const std::string& group, int size) {
  std::vector<Seen> out;
  for (trace::VertexId v : t.graph.ops()) {
    const trace::Vertex& vx = t.graph.vertex(v);
    if (!vx.comm) continue;
    EXPECT_EQ(vx.comm->group, group) << vx.name;
    EXPECT_EQ(vx.comm->group_size, size) << vx.name;
    out.emplace_back(vx.op, vx.phase, vx.comm->kind, vx.comm->bytes);
  }
  return out;
}

TEST(CommTrace, AParallelModelShowsEveryCommunicationWithItsBytes) {
  auto tp = dist::ProcessGroup::meta(TP, 1, "tp");
  ParallelModel model(tp);
  const trace::Trace t = trace::trace(model, {zeros({B, T, C})});
  using trace::Phase;
  const std::vector<Seen> want = {
      {"ReduceFromGroup", Phase::kForward, CommKind::kAllreduce, kFull},
      {"AllgatherAlong", Phase::kForward, CommKind::kAllgather, kFull},
      {"ReduceScatterAlong", Phase::kForward, CommKind::kReduceScatter, kFull},
      {"AlltoallAlong", Phase::kForward, CommKind::kAlltoall, kQuarter},
      {"GatherAlong", Phase::kForward, CommKind::kAllgather, kFull},
      {"AlltoallAlongBackward", Phase::kBackward, CommKind::kAlltoall, kQuarter},
      {"ReduceScatterAlongBackward", Phase::kBackward, CommKind::kAllgather, kFull},
      {"AllgatherAlongBackward", Phase::kBackward, CommKind::kReduceScatter, kFull},
      {"ScatterAlongBackward", Phase::kBackward, CommKind::kAllgather, kFull},
      {"CopyToGroupBackward", Phase::kBackward, CommKind::kAllreduce, kFull},
  };
  EXPECT_EQ(comm_vertices(t, "tp", TP), want);
  // The ops that move nothing are in the graph too, without a comm record.
  int silent = 0;
  for (trace::VertexId v : t.graph.ops()) {
    const trace::Vertex& vx = t.graph.vertex(v);
    for (const char* op :
         {"CopyToGroup", "ScatterAlong", "ReduceFromGroupBackward", "GatherAlongBackward"}) {
      if (vx.op == op) {
        EXPECT_FALSE(vx.comm.has_value()) << vx.name;
        ++silent;
      }
    }
  }
  EXPECT_EQ(silent, 4);
  // Shapes only: rank 1's parameters are its shards.
  EXPECT_EQ(model.tp_block->fc1->weight().shape(), (Shape{F / TP, C}));

  const auto stats = trace::comm_stats(t);
  ASSERT_EQ(stats.size(), 4u);
  auto at = [&](CommKind k) { return stats.at({"tp", k}); };
  EXPECT_EQ(at(CommKind::kAllreduce).ops, 2);
  EXPECT_EQ(at(CommKind::kAllreduce).forward_bytes, kFull);
  EXPECT_EQ(at(CommKind::kAllreduce).backward_bytes, kFull);
  EXPECT_EQ(at(CommKind::kAllgather).ops, 4);
  EXPECT_EQ(at(CommKind::kAllgather).forward_bytes, 2 * kFull);
  EXPECT_EQ(at(CommKind::kAllgather).backward_bytes, 2 * kFull);
  EXPECT_EQ(at(CommKind::kReduceScatter).bytes(), 2 * kFull);
  EXPECT_EQ(at(CommKind::kAlltoall).bytes(), 2 * kQuarter);
  EXPECT_EQ(at(CommKind::kAlltoall).group_size, TP);

  const nlohmann::json j = trace::to_json(t);
  int with_comm = 0;
  for (const auto& v : j["vertices"]) {
    if (!v.contains("comm")) continue;
    ++with_comm;
    EXPECT_EQ(v["comm"]["group"], "tp");
    EXPECT_EQ(v["comm"]["group_size"], TP);
  }
  EXPECT_EQ(with_comm, static_cast<int>(want.size()));
  const nlohmann::json& summary = j["summary"]["communication"];
  ASSERT_EQ(summary.size(), 4u);
  bool found = false;
  for (const auto& s : summary) {
    if (s["kind"] == "allgather") {
      found = true;
      EXPECT_EQ(s["forward_bytes"], 2 * kFull);
      EXPECT_EQ(s["backward_bytes"], 2 * kFull);
      EXPECT_EQ(s["ops"], 4);
    }
  }
  EXPECT_TRUE(found) << summary.dump();
  EXPECT_NE(trace::to_dot(t).find("allreduce 'tp' x4 " + std::to_string(kFull) + " B"),
            std::string::npos);
}

// A pipeline's stages, traced as ranks 0 and 1 of a meta group of 2: the activation's message
// forward and its gradient's backward, each with its peer.
TEST(CommTrace, PipelineStagesTraceTheirMessages) {
  nn::Linear layer(C, C);
  auto stage0 = dist::ProcessGroup::meta(2, 0, "pp");
  const trace::Trace t0 = trace::trace(layer,
                                       [&](nn::Module& m, const std::vector<Tensor>& in) {
                                         return dist::send_to(m(in[0]), 1, stage0);
                                       },
                                       {zeros({B, T, C})});
  using trace::Phase;
  EXPECT_EQ(comm_vertices(t0, "pp", 2),
            (std::vector<Seen>{{"SendTo", Phase::kForward, CommKind::kSend, kFull},
                               {"SendToBackward", Phase::kBackward, CommKind::kRecv, kFull}}));
  auto stage1 = dist::ProcessGroup::meta(2, 1, "pp");
  const trace::Trace t1 = trace::trace(
      layer,
      [&](nn::Module& m, const std::vector<Tensor>&) {
        Tensor x = dist::recv_from({B, T, C}, {DType::kFloat32, Device::kMeta, true}, 0, stage1);
        return sum(m(x));
      },
      {zeros({B, T, C})});
  EXPECT_EQ(comm_vertices(t1, "pp", 2),
            (std::vector<Seen>{{"RecvFrom", Phase::kForward, CommKind::kRecv, kFull},
                               {"RecvFromBackward", Phase::kBackward, CommKind::kSend, kFull}}));
  for (trace::VertexId v : t1.graph.ops()) {
    if (t1.graph.vertex(v).comm) {
      EXPECT_EQ(t1.graph.vertex(v).comm->peer, 0);
    }
  }
  const auto stats = trace::comm_stats(t1);
  EXPECT_EQ(stats.at({"pp", CommKind::kRecv}).forward_bytes, kFull);
  EXPECT_EQ(stats.at({"pp", CommKind::kSend}).backward_bytes, kFull);
}

TEST(CommTrace, AMetaGroupTakesMetaTensorsOnlyAndRefusesUnevenSizesByName) {
  auto tp = dist::ProcessGroup::meta(4, 3, "tp");
  const std::string cpu_msg = test::error_of<TypeError>([&] {
    dist::copy_to_group(zeros({2, 4}), tp);
  });
  EXPECT_NE(cpu_msg.find("copy_to_group: x is a cpu tensor but group 'tp' is a meta group (rank 3 "
                         "of 4"),
            std::string::npos)
      << cpu_msg;
  EXPECT_NE(test::error_of<TypeError>([&] {
              dist::recv_from({2}, {}, 0, tp);
            }).find("cannot be received on group 'tp', a meta group"),
            std::string::npos);
  const Tensor x = empty({2, 6, 8}, {DType::kFloat32, Device::kMeta});
  for (const std::string& msg : {
           test::error_of<ShapeError>([&] { dist::scatter_along(x, 1, tp); }),
           test::error_of<ShapeError>([&] { dist::reduce_scatter_along(x, 1, tp); }),
           test::error_of<ShapeError>([&] { dist::alltoall_along(x, 1, 2, tp); }),
       }) {
    EXPECT_NE(msg.find("dimension 1 of size 6 does not split evenly over group 'tp' of 4 ranks"),
              std::string::npos)
        << msg;
  }
  // Dimensions that divide give the shapes of rank 3's pieces, with nothing moved.
  EXPECT_EQ(dist::scatter_along(x, 2, tp).shape(), (Shape{2, 6, 2}));
  EXPECT_EQ(dist::gather_along(x, 0, tp).shape(), (Shape{8, 6, 8}));
  EXPECT_EQ(dist::alltoall_along(x, 2, 1, tp).shape(), (Shape{2, 24, 2}));
  EXPECT_TRUE(dist::reduce_from_group(x, tp).is_meta());
}

}  // namespace
}  // namespace acc
