// Collectives against closed forms, at whatever world size mpirun gives (CTest runs 2 and 4).
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "acc/dist/device_mesh.hpp"
#include "acc/dist/dist.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

using dist::ProcessGroup;
using dist::ReduceOp;
using namespace std::chrono_literals;

ProcessGroup& world() {
  return *ProcessGroup::world();
}

std::vector<float> iota_from(float start, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

TEST(ProcessGroup, WorldMatchesMpi) {
  EXPECT_EQ(world().size(), dist::world_size());
  EXPECT_EQ(world().rank(), dist::rank());
  EXPECT_GE(world().size(), 1);
  EXPECT_EQ(world().members().size(), static_cast<size_t>(world().size()));
}

TEST(ProcessGroup, AllreduceSumAvgMaxMatchClosedForm) {
  const int W = world().size(), r = world().rank();
  for (int64_t n : {1, 7, 1000, 100003}) {
    Tensor t = full({n}, r + 1.0);
    world().allreduce(t, ReduceOp::kSum)->wait();
    for (float v : t.to_vector<float>()) ASSERT_EQ(v, W * (W + 1) / 2.0f) << n;
    Tensor a = full({n}, 2.0 * r);
    world().allreduce(a, ReduceOp::kAvg)->wait();
    EXPECT_FLOAT_EQ(a.to_vector<float>()[n - 1], static_cast<float>(W - 1));
    Tensor m = from_vector(iota_from(static_cast<float>(r), n), {n});
    world().allreduce(m, ReduceOp::kMax)->wait();
    EXPECT_EQ(m.to_vector<float>()[0], static_cast<float>(W - 1));
  }
}

TEST(ProcessGroup, AllreduceOtherDtypes) {
  const int W = world().size(), r = world().rank();
  Tensor b = full({33}, r + 1.0, {DType::kBFloat16});
  world().allreduce(b)->wait();
  EXPECT_EQ(b.to_vector<float>()[32], W * (W + 1) / 2.0f);  // small integers are exact in bf16
  Tensor i = from_vector(std::vector<int64_t>{int64_t{1} << 40, r}, {2});
  world().allreduce(i)->wait();
  EXPECT_EQ(i.to_vector<int64_t>(),
            (std::vector<int64_t>{W * (int64_t{1} << 40), W * (W - 1) / 2}));
}

TEST(ProcessGroup, ReduceScatterGivesEachRankItsBlock) {
  const int W = world().size(), r = world().rank();
  const int64_t n = 5;
  // Rank q contributes x_q[i] = q * 100 + i; block b of the sum is sum_q (q * 100 + b * n + j).
  Tensor in = from_vector(iota_from(r * 100.0f, n * W), {n * W});
  Tensor out = empty({n});
  world().reduce_scatter(out, in)->wait();
  auto v = out.to_vector<float>();
  for (int64_t j = 0; j < n; ++j) {
    EXPECT_EQ(v[j], 100.0f * W * (W - 1) / 2 + W * static_cast<float>(r * n + j));
  }
}

// The ring reduce-scatter with every op and dtype, several in flight at once (they are matched by
// sequence number, never by arrival), and blocks of several sizes including empty ones.
TEST(ProcessGroup, ReduceScatterOpsDtypesAndConcurrentCalls) {
  const int W = world().size(), r = world().rank();
  std::vector<Tensor> ins, outs;
  std::vector<dist::WorkPtr> works;
  std::vector<ReduceOp> ops;
  for (int64_t n : {0, 1, 3, 1000}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      // x_q[i] = q + i: integers, so every order of summation gives the same floats
      ins.push_back(from_vector(iota_from(static_cast<float>(r), n * W), {n * W}));
      outs.push_back(empty({n}));
      ops.push_back(op);
      works.push_back(world().reduce_scatter(outs.back(), ins.back(), op));
    }
  }
  for (auto& w : works) w->wait();
  for (size_t k = 0; k < outs.size(); ++k) {
    const auto v = outs[k].to_vector<float>();
    for (size_t j = 0; j < v.size(); ++j) {
      const float i = static_cast<float>(r * static_cast<int64_t>(v.size()) + j);
      const float sum = W * i + W * (W - 1) / 2.0f;
      const float want = ops[k] == ReduceOp::kSum   ? sum
                         : ops[k] == ReduceOp::kAvg ? sum / W
                                                    : i + (W - 1);
      EXPECT_FLOAT_EQ(v[j], want) << "case " << k << " element " << j;
    }
  }
  Tensor bin = from_vector(iota_from(static_cast<float>(r), 3 * W), {3 * W}).to(DType::kBFloat16);
  Tensor bout = empty({3}, {DType::kBFloat16});
  world().reduce_scatter(bout, bin)->wait();
  const auto bv = bout.to(DType::kFloat32).to_vector<float>();
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(bv[j], W * static_cast<float>(r * 3 + j) + W * (W - 1) / 2.0f);
  }
}

TEST(ProcessGroup, AllgatherConcatenatesRanks) {
  const int W = world().size(), r = world().rank();
  Tensor in = full({3}, r);
  Tensor out = empty({3 * W});
  world().allgather(out, in)->wait();
  auto v = out.to_vector<float>();
  for (int q = 0; q < W; ++q) {
    for (int j = 0; j < 3; ++j) EXPECT_EQ(v[q * 3 + j], q);
  }
}

TEST(ProcessGroup, AllgatherInPlaceFromOwnBlock) {
  const int W = world().size(), r = world().rank();
  Tensor out = full({3 * W}, -1.0);
  Tensor mine = out.narrow(0, 3 * r, 3);
  mine.copy_(full({3}, 10.0 + r));
  world().allgather(out, mine)->wait();
  auto v = out.to_vector<float>();
  for (int q = 0; q < W; ++q) {
    for (int j = 0; j < 3; ++j) EXPECT_EQ(v[q * 3 + j], 10.0f + q);
  }
  // Overlapping the output anywhere but this rank's block is rejected before communicating.
  if (W > 1) {
    Tensor wrong = out.narrow(0, 3 * ((r + 1) % W), 3);
    EXPECT_THROW(world().allgather(out, wrong), ValueError);
  }
}

TEST(ProcessGroup, BroadcastFromEveryRoot) {
  const int W = world().size(), r = world().rank();
  for (int root = 0; root < W; ++root) {
    Tensor t = full({4}, r == root ? 42.0 + root : -1.0);
    world().broadcast(t, root)->wait();
    EXPECT_EQ(t.to_vector<float>()[3], 42.0f + root);
  }
}

TEST(ProcessGroup, AlltoallTransposesBlocks) {
  const int W = world().size(), r = world().rank();
  // Block j of rank r holds r * 10 + j; after alltoall, block j of rank r holds j * 10 + r.
  std::vector<float> v;
  for (int j = 0; j < W; ++j) v.insert(v.end(), 2, static_cast<float>(r * 10 + j));
  Tensor in = from_vector(v, {2 * W}), out = empty({2 * W});
  world().alltoall(out, in)->wait();
  auto o = out.to_vector<float>();
  for (int j = 0; j < W; ++j) EXPECT_EQ(o[2 * j], static_cast<float>(j * 10 + r));
}

TEST(ProcessGroup, SendRecvAroundARing) {
  const int W = world().size(), r = world().rank();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  Tensor out = full({10}, r), in = empty({10});
  auto s = world().send(out, (r + 1) % W, 7);
  auto q = world().recv(in, (r + W - 1) % W, 7);
  s->wait();
  q->wait();
  EXPECT_EQ(in.to_vector<float>()[9], static_cast<float>((r + W - 1) % W));
}

// Sends and recvs are numbered per peer and direction, apart from the group's collectives: the
// k-th message from a rank to its right neighbour is its send seq k, and the neighbour's recv seq
// k; no collective sequence number is used.
TEST(ProcessGroup, PointToPointMessagesHaveSequenceNumbersOfTheirOwn) {
  const int W = world().size(), r = world().rank();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  const int next = (r + 1) % W, prev = (r + W - 1) % W;
  world().barrier()->wait();
  const uint64_t collectives = world().sequence_number();
  const uint64_t sent = world().p2p_sequence_number(next, dist::P2PDirection::kSend);
  const uint64_t received = world().p2p_sequence_number(prev, dist::P2PDirection::kRecv);
  for (int k = 1; k <= 3; ++k) {
    Tensor out = full({4}, r * 10 + k), in = empty({4});
    auto s = world().send(out, next, 5);
    auto q = world().recv(in, prev, 5);
    EXPECT_EQ(s->seq(), sent + k);
    EXPECT_EQ(q->seq(), received + k);
    s->wait();
    q->wait();
    EXPECT_EQ(in.to_vector<float>()[3], static_cast<float>(prev * 10 + k));
  }
  EXPECT_EQ(world().sequence_number(), collectives);
  EXPECT_EQ(world().p2p_sequence_number(next, dist::P2PDirection::kSend), sent + 3);
  EXPECT_EQ(world().p2p_sequence_number(prev, dist::P2PDirection::kRecv), received + 3);
  if (W > 2) {
    EXPECT_EQ(world().p2p_sequence_number(next, dist::P2PDirection::kRecv), 0u);
  }
  const auto entries = world().flight_recorder().entries();
  ASSERT_GE(entries.size(), 6u);
  const dist::FlightRecord& last = entries.back();  // the third recv
  EXPECT_EQ(last.op, "recv");
  ASSERT_TRUE(last.p2p.has_value());
  EXPECT_EQ(*last.p2p, dist::P2PDirection::kRecv);
  EXPECT_EQ(last.seq, received + 3);
  EXPECT_EQ(last.peer, prev);
  EXPECT_EQ(last.tag, 5);
  EXPECT_EQ(last.state, dist::RecordState::kCompleted);
  const nlohmann::json j = world().flight_recorder().to_json().back();
  EXPECT_EQ(j["p2p"], "recv");
  EXPECT_EQ(j["state"], "completed");
  world().barrier()->wait();
}

// A recv is matched with the message of its own number and tag only: posted for the second
// message of a pair of ranks (tag 2) as if it were the first, it does not take the first message
// (tag 1) nor the second (the second's number is 2), it times out naming its number and peer; the
// second recv of tag 2 then gets the second message.
TEST(ProcessGroup, ARecvMatchesOnlyTheMessageWithItsNumberAndTag) {
  const int W = world().size(), r = world().rank();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  // A group of its own, abandoned at the end: the recv that timed out stays in flight on it.
  auto g = world().split(r < 2 ? 0 : 1, r, "p2p_order");
  if (g->size() >= 2 && g->rank() == 0) {
    g->send(full({4}, 1.0), 1, 1)->wait();  // eager: completes without a matching recv
    g->send(full({4}, 2.0), 1, 2)->wait();
  } else if (g->size() >= 2 && g->rank() == 1) {
    Tensor early = empty({4});
    auto w = g->recv(early, 0, 2, {.timeout = 300ms});
    const std::string msg = test::error_of<TimeoutError>([&] { w->wait(); });
    EXPECT_NE(msg.find("recv seq 1 from rank 0 (tag 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("on group 'p2p_order'"), std::string::npos) << msg;
    Tensor second = empty({4});
    g->recv(second, 0, 2)->wait();
    EXPECT_EQ(second.to_vector<float>(), std::vector<float>(4, 2.0f));
  }
  g->barrier()->wait();
  g->abandon();
}

// MPI fails a message larger than its buffer; a smaller one it would deliver into the first
// elements and call a success.
TEST(ProcessGroup, AMessageSmallerThanItsBufferIsACommError) {
  const int W = world().size(), r = world().rank();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  if (r == 0) {
    world().send(full({5}, 1.0), 1, 4)->wait();
  } else if (r == 1) {
    Tensor big = empty({10});
    const std::string msg = test::error_of<CommError>([&] { world().recv(big, 0, 4)->wait(); });
    EXPECT_NE(msg.find("received 20 bytes, expected 40"), std::string::npos) << msg;
    EXPECT_NE(msg.find("recv seq"), std::string::npos) << msg;
  }
  world().barrier()->wait();
}

TEST(ProcessGroup, AMetaGroupRefusesEveryCollectiveByName) {
  auto m = ProcessGroup::meta(4, 1, "tp");
  EXPECT_TRUE(m->is_meta());
  EXPECT_FALSE(world().is_meta());
  EXPECT_EQ(m->size(), 4);
  EXPECT_EQ(m->rank(), 1);
  EXPECT_EQ(m->name(), "tp");
  EXPECT_EQ(m->members(), (std::vector<int>{0, 1, 2, 3}));
  Tensor t = zeros({8}), out = empty({32});
  const std::string want = "group 'tp' is a meta group (rank 1 of 4, no communicator)";
  for (const std::string& msg : {test::error_of<TypeError>([&] { m->allreduce(t); }),
                                 test::error_of<TypeError>([&] { m->allgather(out, t); }),
                                 test::error_of<TypeError>([&] { m->send(t, 2); }),
                                 test::error_of<TypeError>([&] { m->barrier(); }),
                                 test::error_of<TypeError>([&] { m->split(0, 0, "x"); })}) {
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
  EXPECT_EQ(m->sequence_number(), 0u);
  EXPECT_NE(test::error_of<ValueError>([] { ProcessGroup::meta(0, 0, "tp"); }).find("size"),
            std::string::npos);
  EXPECT_NE(test::error_of<ValueError>([] {
              ProcessGroup::meta(4, 4, "tp");
            }).find("rank 4 is not in [0, 4)"),
            std::string::npos);
  EXPECT_THROW(ProcessGroup::meta(2, 0, ""), ValueError);
  EXPECT_THROW(world().send(t, (world().rank() + 1) % world().size(), ProcessGroup::kMaxTag + 1),
               ValueError);
}

TEST(ProcessGroup, ManyOperationsInFlightCompleteInOrder) {
  const int W = world().size(), r = world().rank();
  std::vector<Tensor> ts;
  std::vector<dist::WorkPtr> works;
  for (int k = 0; k < 20; ++k) {
    ts.push_back(full({1000 + k}, r + k));
    works.push_back(world().allreduce(ts.back()));
  }
  for (int k = 0; k < 20; ++k) {
    works[k]->wait();
    EXPECT_EQ(ts[k].to_vector<float>()[0], W * (W - 1) / 2.0f + W * k);
  }
  world().barrier()->wait();
}

TEST(ProcessGroup, LargeTensorsGoInChunks) {
  const int W = world().size(), r = world().rank();
  ::setenv("ACC_MPI_MAX_COUNT", "7", 1);  // every call below is split into many MPI calls
  Tensor t = from_vector(iota_from(static_cast<float>(r), 100), {100});
  world().allreduce(t)->wait();
  EXPECT_EQ(t.to_vector<float>()[99], W * 99.0f + W * (W - 1) / 2.0f);
  Tensor in = from_vector(iota_from(0, 50 * W), {50 * W}), out = empty({50});
  world().reduce_scatter(out, in)->wait();
  EXPECT_EQ(out.to_vector<float>()[49], W * static_cast<float>(r * 50 + 49));
  Tensor g = full({50}, r), gathered = empty({50 * W});
  world().allgather(gathered, g)->wait();
  EXPECT_EQ(gathered.to_vector<float>()[50 * W - 1], static_cast<float>(W - 1));
  Tensor b = full({30}, r == 0 ? 5.0 : 0.0);
  world().broadcast(b, 0)->wait();
  EXPECT_EQ(b.to_vector<float>()[29], 5.0f);
  ::unsetenv("ACC_MPI_MAX_COUNT");
}

TEST(ProcessGroup, TimeoutNamesTheOperationAndGroup) {
  const int W = world().size(), r = world().rank();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  world().barrier()->wait();
  Tensor t = full({8}, 1.0);
  if (r == 0) {
    auto w = world().allreduce(t, ReduceOp::kSum, {.timeout = 300ms});
    try {
      w->wait();
      FAIL() << "expected a timeout";
    } catch (const TimeoutError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("allreduce.sum"), std::string::npos) << m;
      EXPECT_NE(m.find("seq " + std::to_string(w->seq())), std::string::npos) << m;
      EXPECT_NE(m.find("group 'world'"), std::string::npos) << m;
      EXPECT_NE(m.find("300 ms"), std::string::npos) << m;
    }
    bool timed_out_recorded = false;
    for (const auto& e : world().flight_recorder().entries()) {
      if (e.seq == w->seq() && e.state == dist::RecordState::kTimedOut) timed_out_recorded = true;
    }
    EXPECT_TRUE(timed_out_recorded);
    w->wait(30s);  // the late ranks arrive: it completes after all
  } else {
    std::this_thread::sleep_for(1500ms);
    world().allreduce(t)->wait();
  }
  EXPECT_EQ(t.to_vector<float>()[0], static_cast<float>(W));
}

// One text for a group in every timeout, failure and hang report: a mesh group's dimension quoted
// and its place along the other dimensions after it; any other name quoted whole.
TEST(ProcessGroup, DescribeGroupNameQuotesAMeshGroupsDimensionAndNotItsPlace) {
  struct Case {
    const char* name;
    const char* text;
  };
  for (const Case& c : {Case{"tp of dp=1", "group 'tp' of dp=1"},
                        Case{"dp of pp=0 tp=1", "group 'dp' of pp=0 tp=1"},
                        Case{"dp_cp of pp=1 tp=0", "group 'dp_cp' of pp=1 tp=0"},
                        Case{"world", "group 'world'"}, Case{"self", "group 'self'"},
                        Case{"dp_cp", "group 'dp_cp'"}, Case{"p2p_order", "group 'p2p_order'"},
                        Case{"", "group ''"}, Case{" of dp=1", "group ' of dp=1'"}}) {
    EXPECT_EQ(dist::describe_group_name(c.name), c.text) << c.name;
  }
}

TEST(ProcessGroup, MpiErrorsBecomeCommErrors) {
  const int W = world().size(), r = world().rank();
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  // A receive buffer smaller than the message: MPI reports truncation.
  if (r == 0) {
    world().send(full({10}, 1.0), 1, 3)->wait();
  } else if (r == 1) {
    Tensor small = empty({5});
    EXPECT_THROW(world().recv(small, 0, 3)->wait(), CommError);
  }
  world().barrier()->wait();
}

TEST(ProcessGroup, BadArgumentsAreRejectedBeforeCommunicating) {
  const int W = world().size();
  Tensor t = zeros({4, 4});
  Tensor out = empty({3});
  EXPECT_THROW(world().reduce_scatter(out, zeros({4 * W + 1})), ShapeError);
  EXPECT_THROW(world().allgather(out, zeros({2})), ShapeError);
  Tensor strided = t.slice(1, 0, 2);  // not contiguous
  EXPECT_THROW(world().allreduce(strided), ValueError);
  EXPECT_THROW(world().broadcast(t, W), ValueError);
  EXPECT_THROW(world().send(t, world().rank()), ValueError);
  Tensor meta = empty({2}, {DType::kFloat32, Device::kMeta});
  EXPECT_THROW(world().allreduce(meta), TypeError);
  Tensor bf = zeros({3 * W}, {DType::kBFloat16});
  EXPECT_THROW(world().reduce_scatter(out, bf), TypeError);
  world().barrier()->wait();
}

TEST(Agreement, EqualFactsPassAndTheFirstDifferenceIsNamed) {
  const int W = world().size(), r = world().rank();
  EXPECT_NO_THROW(dist::check_agreement(world(), {{"a", 1}, {"b", {{"c", "x"}}}}));
  if (W == 1) GTEST_SKIP() << "needs two ranks";
  // Rank 1 differs in a nested value (and, later in key order, in another): the first is named.
  const nlohmann::json facts = {{"model", {{"n_head", 4}, {"n_layer", r == 1 ? 3 : 2}}},
                                {"z", r == 1 ? "other" : "same"}};
  try {
    dist::check_agreement(world(), facts);
    FAIL() << "expected a disagreement";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 1 has model.n_layer = 3, rank 0 has 2"), std::string::npos) << m;
    EXPECT_EQ(m.find("rank 2"), std::string::npos) << m;  // ranks that agree are not named
  }
  // A key only one rank has.
  nlohmann::json extra = {{"x", 1}};
  if (r == W - 1) extra["y"] = true;
  try {
    dist::check_agreement(world(), extra);
    FAIL() << "expected a disagreement";
  } catch (const ValueError& e) {
    const std::string m = e.what();
    const std::string want = "rank " + std::to_string(W - 1) + " has y = true, rank 0 has (absent)";
    EXPECT_NE(m.find(want), std::string::npos) << m;
  }
  world().barrier()->wait();  // the group still works after a disagreement
}

// Texts of different lengths (one empty) reach every rank whole, in rank order.
TEST(Agreement, AllgatherTextGivesEveryRanksTextInOrder) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), r = world->rank();
  const std::string mine =
      r == 1 ? std::string()
             : std::string(static_cast<size_t>(3 * r + 1), 'a' + static_cast<char>(r));
  const std::vector<std::string> all = dist::allgather_text(*world, mine);
  ASSERT_EQ(all.size(), static_cast<size_t>(W));
  std::string want_messages;
  for (int k = 0; k < W; ++k) {
    const std::string want =
        k == 1 ? std::string()
               : std::string(static_cast<size_t>(3 * k + 1), 'a' + static_cast<char>(k));
    EXPECT_EQ(all[static_cast<size_t>(k)], want) << "rank " << k;
    if (!want.empty()) {
      want_messages += (want_messages.empty() ? "" : "; ") + std::string("rank ") +
                       std::to_string(k) + ": " + want;
    }
  }
  EXPECT_EQ(dist::rank_messages(all), want_messages);
  EXPECT_EQ(dist::rank_messages({"", ""}), "");
}

TEST(ProcessGroup, FlightRecorderKeepsSequenceAndState) {
  Tensor t = ones({16});
  const uint64_t before = world().sequence_number();
  world().allreduce(t)->wait();
  world().barrier()->wait();
  auto entries = world().flight_recorder().entries();
  ASSERT_GE(entries.size(), 2u);
  const auto& last = entries.back();
  EXPECT_EQ(last.op, "barrier");
  EXPECT_EQ(last.seq, before + 2);
  EXPECT_EQ(last.state, dist::RecordState::kCompleted);
  EXPECT_GE(last.end_ms, last.start_ms);
  EXPECT_EQ(world().flight_recorder().last_finished_ms(), last.end_ms);
  const auto& prev = entries[entries.size() - 2];
  EXPECT_EQ(prev.op, "allreduce.sum");
  EXPECT_EQ(prev.bytes, 64);
  EXPECT_EQ(prev.dtype, "f32");
  EXPECT_TRUE(world().flight_recorder().to_json().is_array());
}

TEST(DeviceMesh, RanksAreLaidOutTpInnermostThenCpDpPp) {
  const dist::DeviceMesh mesh{.pp = 2, .dp = 3, .cp = 2, .tp = 2};
  // rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp
  EXPECT_EQ(mesh.rank_of({.pp = 0, .dp = 0, .cp = 0, .tp = 1}), 1);
  EXPECT_EQ(mesh.rank_of({.pp = 0, .dp = 0, .cp = 1, .tp = 0}), 2);
  EXPECT_EQ(mesh.rank_of({.pp = 0, .dp = 1, .cp = 0, .tp = 0}), 4);
  EXPECT_EQ(mesh.rank_of({.pp = 1, .dp = 0, .cp = 0, .tp = 0}), 12);
  for (int r = 0; r < mesh.product(); ++r) EXPECT_EQ(mesh.rank_of(mesh.coordinate_of(r)), r);
  // Neighbours along each dimension (what a cluster plan places its groups by).
  for (const dist::MeshDim d : dist::kMeshDims) {
    dist::MeshCoord next;
    next.at(d) = 1;
    EXPECT_EQ(mesh.stride(d), mesh.rank_of(next)) << dist::mesh_dim_name(d);
  }
  EXPECT_EQ(mesh.stride(dist::MeshDim::kPp), 12);
  EXPECT_THROW(mesh.coordinate_of(24), ValueError);
  EXPECT_THROW(mesh.rank_of({.pp = 0, .dp = 3, .cp = 0, .tp = 0}), ValueError);
  EXPECT_EQ(mesh.to_string(), "pp=2 dp=3 cp=2 tp=2");
  EXPECT_EQ(dist::parse_mesh_dim("cp"), dist::MeshDim::kCp);
  EXPECT_THROW(dist::parse_mesh_dim("ep"), ValueError);
}

// A meta context: any rank of any mesh in one process, its groups meta groups of the sizes, ranks
// and names a real context gives them (what the search traces a candidate's rank over).
TEST(ParallelContext, AMetaContextIsAnyRankOfAnyMeshWithoutCommunicators) {
  const dist::DeviceMesh mesh{.dp = 2, .cp = 2, .tp = 2};
  const auto ctx = dist::ParallelContext::meta(mesh, 5);  // dp 1, cp 0, tp 1
  EXPECT_TRUE(ctx->world()->is_meta());
  EXPECT_EQ(ctx->world_size(), 8);
  EXPECT_EQ(ctx->rank(), 5);
  const auto& tp = ctx->group(dist::MeshDim::kTp);
  EXPECT_TRUE(tp->is_meta());
  EXPECT_EQ(tp->size(), 2);
  EXPECT_EQ(tp->rank(), 1);
  EXPECT_EQ(tp->name(), "tp of dp=1 cp=0");
  EXPECT_EQ(ctx->group(dist::MeshDim::kCp)->name(), "cp of dp=1 tp=1");
  EXPECT_EQ(ctx->group(dist::MeshDim::kPp)->size(), 1);
  EXPECT_TRUE(ctx->group(dist::MeshDim::kPp)->is_meta());
  EXPECT_EQ(ctx->dp_cp_group()->size(), 4);
  EXPECT_EQ(ctx->dp_cp_group()->rank(), 2);  // dp 1 x cp 2 + cp 0
  EXPECT_EQ(ctx->data_rank(), 1);
  EXPECT_THROW(dist::ParallelContext::meta(mesh, 8), ValueError);
  EXPECT_THROW(dist::ParallelContext::meta(dist::DeviceMesh{.dp = 0}, 0), ValueError);
}

TEST(ParallelContext, GroupsFollowTheLayout) {
  const int W = world().size(), r = world().rank();
  // dp x tp with tp = 2 when possible.
  const int tp = W % 2 == 0 ? 2 : 1;
  const dist::ParallelContext ctx(dist::DeviceMesh{.dp = W / tp, .tp = tp},
                                  dist::ProcessGroup::world());
  EXPECT_EQ(ctx.coordinate(dist::MeshDim::kTp), r % tp);
  EXPECT_EQ(ctx.coordinate(dist::MeshDim::kDp), r / tp);
  EXPECT_EQ(ctx.group(dist::MeshDim::kTp)->size(), tp);
  EXPECT_EQ(ctx.group(dist::MeshDim::kDp)->size(), W / tp);
  EXPECT_EQ(ctx.group(dist::MeshDim::kPp)->size(), 1);
  EXPECT_EQ(ctx.dp_cp_group()->size(), W / tp);  // cp = 1: the dp group
  EXPECT_EQ(ctx.data_rank(), r / tp);
  EXPECT_EQ(ctx.data_world(), W / tp);
  // A sum inside the tp group adds only the tp peers: ranks (r / tp) * tp .. + tp - 1.
  Tensor t = full({1}, r);
  ctx.group(dist::MeshDim::kTp)->allreduce(t)->wait();
  float expect = 0;
  for (int q = (r / tp) * tp; q < (r / tp) * tp + tp; ++q) expect += q;
  EXPECT_EQ(t.item(), expect);
  EXPECT_EQ(ctx.group(dist::MeshDim::kDp)->members()[ctx.coordinate(dist::MeshDim::kDp)], r);
  // Named by dimension and place, so hang reports and dumps say which group along tp stalled.
  if (W == 4) {
    EXPECT_EQ(ctx.group(dist::MeshDim::kTp)->name(), "tp of dp=" + std::to_string(r / 2));
    EXPECT_EQ(ctx.group(dist::MeshDim::kDp)->name(), "dp of tp=" + std::to_string(r % 2));
  }
  // A data-parallel context: the world along dp, named as before the mesh.
  const auto dp = dist::ParallelContext::data_parallel(dist::ProcessGroup::world());
  EXPECT_EQ(dp->group(dist::MeshDim::kDp).get(), dist::ProcessGroup::world().get());
  EXPECT_EQ(dp->dp_cp_group()->name(), dist::ProcessGroup::world()->name());
  EXPECT_EQ(dp->group(dist::MeshDim::kTp)->size(), 1);
}

TEST(ParallelContext, TheDpCpGroupJoinsBothDimensions) {
  const int W = world().size(), r = world().rank();
  if (W != 4) GTEST_SKIP() << "needs 4 ranks";
  // dp 2 x cp 2: gradients are reduced over all four.
  const dist::ParallelContext both(dist::DeviceMesh{.dp = 2, .cp = 2}, dist::ProcessGroup::world());
  EXPECT_EQ(both.dp_cp_group()->size(), 4);
  EXPECT_EQ(both.coordinate(dist::MeshDim::kCp), r % 2);
  // cp 2 x tp 2: over the two cp peers of each tp rank (ranks r % 2, r % 2 + 2).
  const dist::ParallelContext cp_tp(dist::DeviceMesh{.cp = 2, .tp = 2},
                                    dist::ProcessGroup::world());
  EXPECT_EQ(cp_tp.dp_cp_group()->size(), 2);
  Tensor t = full({1}, r);
  cp_tp.dp_cp_group()->allreduce(t)->wait();
  EXPECT_EQ(t.item(), (r % 2) + (r % 2 + 2));
}

// Rank 3 joins its tp all-reduce late: rank 2, its one peer, times out naming the group by its
// dimension and place (the tp group of dp=1, not that of ranks 0 and 1, which completes), the
// collective and its sequence number; the all-reduce then completes after all.
TEST(ParallelContext, ATimeoutNamesTheMeshGroupByItsDimensionAndPlace) {
  const int W = world().size(), r = world().rank();
  if (W != 4) GTEST_SKIP() << "needs 4 ranks";
  const dist::ParallelContext ctx(dist::DeviceMesh{.dp = 2, .tp = 2}, dist::ProcessGroup::world());
  ProcessGroup& tp = *ctx.group(dist::MeshDim::kTp);
  Tensor t = full({8}, r);
  if (r == 2) {
    auto w = tp.allreduce(t, ReduceOp::kSum, {.timeout = 300ms});
    const std::string msg = test::error_of<TimeoutError>([&] { w->wait(); });
    const std::string want = "allreduce.sum (seq " + std::to_string(w->seq()) +
                             ") on group 'tp' of dp=1 did not complete within 300 ms on rank 0 "
                             "of 2 (";
    EXPECT_EQ(msg.rfind(want, 0), 0u) << msg;
    w->wait(30s);
  } else {
    if (r == 3) std::this_thread::sleep_for(1500ms);
    tp.allreduce(t)->wait();
  }
  EXPECT_EQ(t.to_vector<float>()[0], r < 2 ? 0.0f + 1.0f : 2.0f + 3.0f);
  world().barrier()->wait();
}

TEST(ParallelContext, ImpossibleMeshesAreRejected) {
  const int W = world().size();
  try {
    dist::ParallelContext ctx(dist::DeviceMesh{.tp = W + 1}, dist::ProcessGroup::world());
    FAIL();
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("tp=" + std::to_string(W + 1)), std::string::npos) << m;
    EXPECT_NE(m.find("the world has " + std::to_string(W)), std::string::npos) << m;
  }
  EXPECT_THROW(
      dist::ParallelContext(dist::DeviceMesh{.pp = 0, .dp = W}, dist::ProcessGroup::world()),
      ValueError);
  EXPECT_THROW(
      dist::ParallelContext(dist::DeviceMesh{.dp = -W, .tp = -1}, dist::ProcessGroup::world()),
      ValueError);
}

}  // namespace
}  // namespace acc
