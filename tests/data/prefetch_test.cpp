#include "acc/data/prefetch.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>
#include <typeinfo>

#include "acc/data/token_data.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc::data {
namespace {

using namespace std::chrono_literals;

// Tokens 0, 1, ..., n-1.
std::shared_ptr<const TokenFile> iota_tokens(int64_t n) {
  std::vector<uint32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 0u);
  return std::make_shared<const TokenFile>(std::move(t), "iota");
}

LoaderOptions options(uint64_t seed, int rank = 0, int world = 1,
                      SampleOrder order = SampleOrder::kRandom) {
  return {
      .batch_size = 3, .seq_len = 8, .order = order, .seed = seed, .rank = rank, .world = world};
}

// Every tensor of both batches has the same name, dtype, shape and bytes.
void expect_bitwise_equal(const Batch& got, const Batch& want, const std::string& where) {
  ASSERT_EQ(got.tensors().size(), want.tensors().size()) << where;
  for (size_t i = 0; i < want.tensors().size(); ++i) {
    const auto& [name, w] = want.tensors()[i];
    const auto& [got_name, g] = got.tensors()[i];
    EXPECT_EQ(got_name, name) << where;
    ASSERT_EQ(g.dtype(), w.dtype()) << where << ", " << name;
    ASSERT_EQ(g.shape(), w.shape()) << where << ", " << name;
    const Tensor gc = g.contiguous(), wc = w.contiguous();
    EXPECT_EQ(std::memcmp(gc.data<int64_t>(), wc.data<int64_t>(),
                          static_cast<size_t>(wc.numel()) * sizeof(int64_t)),
              0)
        << where << ", " << name;
  }
}

// What a ProbeLoader did, read by the test while the loader belongs to a PrefetchLoader.
struct Probe {
  std::atomic<int> started{0};   // next() calls begun
  std::atomic<int> finished{0};  // next() calls that returned a batch
  std::atomic<bool> destroyed{false};
};

// A BatchLoader that reports to a Probe, runs `before` (which may sleep or throw) with the step
// about to be built before building it, and `after` once it has advanced.
class ProbeLoader : public Loader {
 public:
  using Hook = std::function<void(int64_t)>;
  ProbeLoader(BatchLoader inner, std::shared_ptr<Probe> probe, Hook before = nullptr,
              Hook after = nullptr)
      : inner_(std::move(inner)),
        probe_(std::move(probe)),
        before_(std::move(before)),
        after_(std::move(after)) {}
  ~ProbeLoader() override { probe_->destroyed = true; }

  Batch next() override {
    ++probe_->started;
    if (before_) before_(inner_.step());
    Batch b = inner_.next();
    if (after_) after_(inner_.step());
    ++probe_->finished;
    return b;
  }
  nlohmann::json state() const override { return inner_.state(); }
  void load_state(const nlohmann::json& state) override { inner_.load_state(state); }

 private:
  BatchLoader inner_;
  std::shared_ptr<Probe> probe_;
  Hook before_, after_;
};

// Waits up to 10 s for `done`.
bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 10000 && !done(); ++i) std::this_thread::sleep_for(1ms);
  return done();
}

TEST(PrefetchLoader, BatchesAreBitwiseTheInnerLoadersForEverySeedRankAndDepth) {
  auto tokens = iota_tokens(2000);
  for (SampleOrder order : {SampleOrder::kRandom, SampleOrder::kSequential}) {
    for (uint64_t seed : {0u, 1u, 42u}) {
      for (int world : {1, 2, 4}) {
        for (int rank = 0; rank < world; ++rank) {
          for (int64_t depth : {1, 2, 5}) {
            const std::string where = std::string(sample_order_name(order)) + " seed " +
                                      std::to_string(seed) + " rank " + std::to_string(rank) + "/" +
                                      std::to_string(world) + " depth " + std::to_string(depth);
            BatchLoader plain(tokens, options(seed, rank, world, order));
            PrefetchLoader prefetch(
                std::make_unique<BatchLoader>(tokens, options(seed, rank, world, order)),
                {.depth = depth});
            EXPECT_EQ(prefetch.depth(), depth);
            for (int step = 0; step < 12; ++step) {
              expect_bitwise_equal(prefetch.next(), plain.next(),
                                   where + " step " + std::to_string(step));
            }
          }
        }
      }
    }
  }
}

// The thread is let fill the queue before each state(): the inner loader is then `depth`
// batches ahead of the caller.
TEST(PrefetchLoader, StateAfterKBatchesIsThePlainLoadersState) {
  auto tokens = iota_tokens(2000);
  auto probe = std::make_shared<Probe>();
  BatchLoader plain(tokens, options(7, 1, 2));
  PrefetchLoader prefetch(
      std::make_unique<ProbeLoader>(BatchLoader(tokens, options(7, 1, 2)), probe), {.depth = 3});
  ASSERT_TRUE(eventually([&] { return probe->finished.load() == 3; }));
  EXPECT_EQ(prefetch.state(), plain.state());
  for (int k = 1; k <= 10; ++k) {
    prefetch.next();
    plain.next();
    ASSERT_TRUE(eventually([&] { return probe->finished.load() == k + 3; }));
    EXPECT_EQ(prefetch.state(), plain.state()) << "after " << k << " batches";
    EXPECT_EQ(prefetch.state().at("step"), k);
  }
}

// The queue is mostly empty here and the thread in the middle of a batch when state() is asked,
// after the inner loader has advanced: it is then one batch ahead of the caller, which state()
// must not report.
TEST(PrefetchLoader, StateIsTheCallersPositionWhileTheThreadBuildsAhead) {
  auto tokens = iota_tokens(2000);
  auto probe = std::make_shared<Probe>();
  PrefetchLoader prefetch(
      std::make_unique<ProbeLoader>(BatchLoader(tokens, options(3)), probe, nullptr,
                                    [](int64_t) { std::this_thread::sleep_for(2ms); }),
      {.depth = 2});
  BatchLoader plain(tokens, options(3));
  for (int k = 1; k <= 15; ++k) {
    prefetch.next();
    plain.next();
    EXPECT_EQ(prefetch.state(), plain.state()) << "after " << k << " batches";
  }
}

TEST(PrefetchLoader, ResumeMidEpochContinuesTheSameSequence) {
  auto tokens = iota_tokens(2000);
  for (int world : {1, 2}) {
    for (int rank = 0; rank < world; ++rank) {
      SCOPED_TRACE("rank " + std::to_string(rank) + "/" + std::to_string(world));
      PrefetchLoader first(std::make_unique<BatchLoader>(tokens, options(11, rank, world)));
      for (int i = 0; i < 5; ++i) first.next();
      const nlohmann::json saved = nlohmann::json::parse(first.state().dump());  // as a checkpoint
      EXPECT_EQ(saved.at("step"), 5);

      // A new job: a fresh loader at step 0, restored from the checkpoint.
      PrefetchLoader resumed(std::make_unique<BatchLoader>(tokens, options(11, rank, world)));
      resumed.next();  // prefetched and consumed before the restore: dropped by load_state
      resumed.load_state(saved);
      EXPECT_EQ(resumed.state(), saved);
      BatchLoader plain(tokens, options(11, rank, world));
      plain.set_step(5);
      for (int i = 0; i < 8; ++i) {
        const Batch want = plain.next();
        expect_bitwise_equal(resumed.next(), want, "resumed step " + std::to_string(5 + i));
        expect_bitwise_equal(first.next(), want, "first step " + std::to_string(5 + i));
      }
      // Back to the checkpoint on the same loader: the same batches again.
      first.load_state(saved);
      plain.set_step(5);
      for (int i = 0; i < 4; ++i) {
        expect_bitwise_equal(first.next(), plain.next(), "rewound step " + std::to_string(5 + i));
      }
      // And a plain loader resumes from a prefetcher's state.
      BatchLoader from_prefetch(tokens, options(11, rank, world));
      from_prefetch.load_state(first.state());
      EXPECT_EQ(from_prefetch.step(), 9);
      expect_bitwise_equal(from_prefetch.next(), first.next(), "plain from prefetch state");
    }
  }
}

TEST(PrefetchLoader, FailedLoadStateChangesNothing) {
  auto tokens = iota_tokens(2000);
  auto probe = std::make_shared<Probe>();
  PrefetchLoader prefetch(std::make_unique<ProbeLoader>(BatchLoader(tokens, options(5)), probe),
                          {.depth = 3});
  for (int i = 0; i < 2; ++i) prefetch.next();
  // Batches 2-4 queued, the inner loader at 5.
  ASSERT_TRUE(eventually([&] { return probe->finished.load() == 5; }));
  BatchLoader other_seed(tokens, options(6));
  other_seed.set_step(20);
  EXPECT_EQ(test::error_of<ValueError>([&] { prefetch.load_state(other_seed.state()); }),
            "loader state: seed 6 does not match this loader's 5");
  EXPECT_EQ(prefetch.state().at("step"), 2);
  BatchLoader plain(tokens, options(5));
  plain.set_step(2);
  for (int i = 0; i < 6; ++i) {
    expect_bitwise_equal(prefetch.next(), plain.next(), "step " + std::to_string(2 + i));
  }
}

// The inner loader throws Exc at batch 3: batches 0-2 arrive, then Exc with its message, from
// this next() and the ones after; state() is where the plain loader stands after its failure;
// load_state() prefetches again.
template <class Exc>
void expect_error_after_three_batches() {
  auto tokens = iota_tokens(2000);
  const std::string message = "batch 3 cannot be read: test fault";
  auto fail_at_3 = [message](int64_t step) {
    if (step == 3) throw Exc(message);
  };
  auto probe = std::make_shared<Probe>();
  // Depth 4: the thread builds batches 0-2 and fails at 3 before the caller takes any.
  PrefetchLoader prefetch(
      std::make_unique<ProbeLoader>(BatchLoader(tokens, options(9)), probe, fail_at_3),
      {.depth = 4});
  ProbeLoader plain(BatchLoader(tokens, options(9)), std::make_shared<Probe>(), fail_at_3);
  ASSERT_TRUE(eventually([&] { return probe->started.load() == 4; }));
  for (int i = 0; i < 3; ++i) {
    expect_bitwise_equal(prefetch.next(), plain.next(), "batch " + std::to_string(i));
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      prefetch.next();
      ADD_FAILURE() << "expected " << typeid(Exc).name() << " at batch 3, attempt " << attempt;
    } catch (const std::exception& e) {
      EXPECT_EQ(typeid(e), typeid(Exc)) << e.what();
      EXPECT_EQ(std::string(e.what()), message);
    }
  }
  EXPECT_THROW(plain.next(), Exc);
  EXPECT_EQ(prefetch.state(), plain.state());
  EXPECT_EQ(probe->started.load(), 4);  // prefetching stopped at the failure

  BatchLoader restart(tokens, options(9));
  restart.set_step(1);
  prefetch.load_state(restart.state());
  for (int i = 0; i < 2; ++i) {
    expect_bitwise_equal(prefetch.next(), restart.next(),
                         "after load_state, batch " + std::to_string(1 + i));
  }
  EXPECT_THROW(prefetch.next(), Exc);
}

TEST(PrefetchLoader, ValueErrorAtBatch3ArrivesAfterTheFirst3Batches) {
  expect_error_after_three_batches<ValueError>();
}

TEST(PrefetchLoader, IoErrorAtBatch3ArrivesAfterTheFirst3Batches) {
  expect_error_after_three_batches<IoError>();
}

TEST(PrefetchLoader, NonAccExceptionArrivesAsItsOwnType) {
  expect_error_after_three_batches<std::out_of_range>();
}

TEST(PrefetchLoader, QueueHoldsAtMostDepthBatchesAndTheDestructorStopsAFullQueue) {
  auto tokens = iota_tokens(2000);
  auto probe = std::make_shared<Probe>();
  {
    PrefetchLoader prefetch(std::make_unique<ProbeLoader>(BatchLoader(tokens, options(1)), probe),
                            {.depth = 3});
    ASSERT_TRUE(eventually([&] { return probe->finished.load() == 3; }));
    std::this_thread::sleep_for(50ms);  // room for a fourth batch, were the queue unbounded
    EXPECT_EQ(probe->started.load(), 3);
    prefetch.next();
    ASSERT_TRUE(eventually([&] { return probe->finished.load() == 4; }));
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(probe->started.load(), 4);
    EXPECT_FALSE(probe->destroyed.load());
  }  // the thread waits on the full queue here
  EXPECT_TRUE(probe->destroyed.load());
  EXPECT_EQ(probe->started.load(), 4);
}

TEST(PrefetchLoader, DestructorWaitsForTheBatchInHandOnly) {
  auto tokens = iota_tokens(2000);
  auto probe = std::make_shared<Probe>();
  {
    PrefetchLoader prefetch(
        std::make_unique<ProbeLoader>(BatchLoader(tokens, options(1)), probe,
                                      [](int64_t) { std::this_thread::sleep_for(100ms); }),
        {.depth = 4});
    ASSERT_TRUE(eventually([&] { return probe->started.load() == 1; }));
  }
  // The batch in hand was finished, not cut off, and no other was begun (unless this thread was
  // held up for the whole 100 ms after seeing the first begin).
  EXPECT_TRUE(probe->destroyed.load());
  EXPECT_EQ(probe->finished.load(), probe->started.load());
  EXPECT_LE(probe->started.load(), 2);
}

TEST(PrefetchLoader, BadDepthAndNullLoaderAreRefusedByName) {
  auto tokens = iota_tokens(2000);
  for (int64_t depth : {0, -3}) {
    EXPECT_EQ(test::error_of<ValueError>([&] {
                PrefetchLoader(std::make_unique<BatchLoader>(tokens, options(1)), {.depth = depth});
              }),
              "prefetch loader: depth must be >= 1, got " + std::to_string(depth));
  }
  EXPECT_EQ(test::error_of<ValueError>([&] { PrefetchLoader(nullptr); }),
            "prefetch loader: the inner loader is null");
}

}  // namespace
}  // namespace acc::data
