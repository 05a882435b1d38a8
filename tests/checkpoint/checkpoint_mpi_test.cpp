// The N -> M matrix under mpirun (CTest: 1, 2 and 4 ranks). With W ranks, sub-groups of the first
// n ranks stand for jobs of n ranks: a checkpoint saved by {1, 2, 4} ranks (those <= W) with each
// data-parallel method is loaded into {1, ..., W} ranks with each method. After the load every
// parameter and optimizer-state region a rank holds equals the saved tensor's bitwise, and one
// more step gives the saving run's next loss: bitwise in the same layout, within 1e-5 (the
// reductions add in another order) in another.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "flip_bit.hpp"
#include "helpers.hpp"

namespace acc::ckpt {
namespace {

namespace fs = std::filesystem;
using test::expect_holds;
using test::first;
using test::job_dir;
using test::read_whole;
using test::remove_job_dir;
constexpr int64_t kGlobalBatch = 12, kSeq = 16;  // 12 splits over 1, 2, 3 and 4 ranks
const char* const kHash = "test-model";

models::LanguageModelPtr make_model(uint64_t seed) {
  manual_seed(seed);
  return models::create_model("gpt", {{"n_layer", 2},
                                      {"n_head", 2},
                                      {"n_embd", 32},
                                      {"vocab_size", 64},
                                      {"block_size", kSeq},
                                      {"bias", false}});
}

// Step s's global batch, rank r's share of it among n ranks.
data::Batch batch(int64_t step, int n, int r) {
  return test::batch_share(step, n, r, kGlobalBatch, kSeq, 64);
}

std::unique_ptr<strategies::Trainer> trainer(models::LanguageModelPtr m, const std::string& method,
                                             dist::ProcessGroupPtr g) {
  const std::string s = method.empty() ? "[]" : R"([{"name": ")" + method + R"("}])";
  return strategies::apply(m, optim::AdamW::factory({.lr = 1e-2, .weight_decay = 0.1}),
                           strategies::parse_strategy(nlohmann::json::parse(s)),
                           {.group = g, .grad_clip = 1.0});
}

double exchange(double v, int root) {  // bit-exact, over the world
  Tensor t = from_vector(std::vector<int64_t>{std::bit_cast<int64_t>(v)}, {1});
  dist::ProcessGroup::world()->broadcast(t, root)->wait();
  return std::bit_cast<double>(t.to_vector<int64_t>()[0]);
}

TEST(Checkpoint, EveryLayoutLoadsIntoEveryOtherAndTrainsOn) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), rank = world->rank();
  const std::string base = job_dir("matrix");
  for (int n = 1; n <= W; ++n) first(n);  // collective: made by every rank before the loops
  const std::vector<std::string> methods = {"ddp", "zero1", "zero2", "fsdp"};
  int loads = 0;
  for (int src : {1, 2, 4}) {
    if (src > W) continue;
    for (const std::string& a : methods) {
      const std::string root = base + "/" + std::to_string(src) + "-" + a;
      double next_loss = 0;
      if (rank < src) {
        auto t = trainer(make_model(7), a, first(src));
        for (int64_t s = 0; s < 2; ++s) t->train_step(batch(s, src, rank));
        save_trainer(root, 2, *t, kHash, {{"note", "matrix"}});
        next_loss = t->train_step(batch(2, src, rank));
      }
      next_loss = exchange(next_loss, 0);
      const std::string dir = *resolve(root);
      const std::map<std::string, Tensor> saved = read_whole(dir);
      if (a == "ddp") {  // replicas are written once, by replica 0's holder
        for (const TensorInfo& t : read_metadata(dir).tensors) {
          for (const ChunkInfo& c : t.chunks) EXPECT_EQ(c.file, 0) << t.name;
        }
      }
      for (int dst = 1; dst <= W; ++dst) {
        for (const std::string& b : methods) {
          if (rank >= dst) continue;
          const std::string what =
              std::to_string(src) + " x " + a + " -> " + std::to_string(dst) + " x " + b;
          auto t = trainer(make_model(99), b, first(dst));  // another init: all must be loaded
          const Metadata meta = load_trainer(dir, *t, kHash);
          EXPECT_EQ(meta.step, 2) << what;
          EXPECT_EQ(meta.extra.at("note"), "matrix") << what;
          expect_holds(*t, saved, what);
          const double loss = t->train_step(batch(2, dst, rank));
          if (dst == src && b == a) {
            EXPECT_EQ(loss, next_loss) << what;
          } else {
            EXPECT_NEAR(loss, next_loss, 1e-5 * std::abs(next_loss)) << what;
          }
          ++loads;
        }
      }
      world->barrier()->wait();
    }
  }
  if (rank == 0) std::printf("%d loads checked on rank 0 (world %d)\n", loads, W);
  remove_job_dir(base);
}

TEST(Checkpoint, ADifferentModelOrAMissingTensorIsRefusedByName) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  const std::string root = job_dir("refuse");
  auto t = trainer(make_model(7), W > 1 ? "ddp" : "", world);
  t->train_step(batch(0, W, world->rank()));
  const std::string dir = save_trainer(root, 1, *t, kHash);
  try {
    load_trainer(dir, *t, "another-model");
    ADD_FAILURE() << "another model's checkpoint loaded";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("is of another model: its trace hash is test-model"),
              std::string::npos)
        << e.what();
  }
  // A model with another shape: named with both shapes.
  auto wider = strategies::apply(
      models::create_model("gpt", {{"n_layer", 2},
                                   {"n_head", 2},
                                   {"n_embd", 48},
                                   {"vocab_size", 64},
                                   {"block_size", kSeq},
                                   {"bias", false}}),
      optim::AdamW::factory({}),
      strategies::parse_strategy(nlohmann::json::parse(W > 1 ? R"([{"name": "ddp"}])" : "[]")),
      {.group = world});
  EXPECT_THROW(load_trainer(dir, *wider, kHash), ShapeError);
  remove_job_dir(root);
}

// amp on or off: bf16 communication and activations change nothing saved (the parameters and
// AdamW state stay f32), so a checkpoint of an amp run loads into a run without amp and back.
TEST(Checkpoint, AmpOnOrOffLoadsEitherWay) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), rank = world->rank();
  const std::string root = job_dir("amp");
  const std::string dp = W > 1 ? R"({"name": "zero2"}, )" : "";
  const std::string dp2 = W > 1 ? R"({"name": "fsdp"}, )" : "";
  auto make = [&](uint64_t seed, const std::string& json) {
    return strategies::apply(make_model(seed), optim::AdamW::factory({.lr = 1e-2}),
                             strategies::parse_strategy(nlohmann::json::parse(json)),
                             {.group = world, .grad_clip = 1.0});
  };
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"[" + dp + R"({"name": "amp"}])", "[" + (W > 1 ? dp2.substr(0, dp2.size() - 2) : "") + "]"},
      {"[" + (W > 1 ? dp.substr(0, dp.size() - 2) : "") + "]", "[" + dp2 + R"({"name": "amp"}])"}};
  int n = 0;
  for (const auto& [from, to] : pairs) {
    auto a = make(7, from);
    a->train_step(batch(0, W, rank));
    const std::string dir = save_trainer(root + "/" + std::to_string(n++), 1, *a, kHash);
    const auto saved = read_whole(dir);
    auto b = make(99, to);
    load_trainer(dir, *b, kHash);
    expect_holds(*b, saved, from + " -> " + to);
  }
  remove_job_dir(root);
}

// An async save holds the state of its step, whatever training does meanwhile: it equals a
// synchronous save taken at the same step, bitwise, and is committed by a poll at a later step
// boundary or by finish().
TEST(Checkpoint, AnAsyncSaveHoldsTheStateOfItsStep) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), rank = world->rank();
  const std::string root = job_dir("async");
  // zero2 with many small buckets. (A snapshot cloned with grad mode on recorded autograd nodes
  // on rank 0's parameters only; with the 17M GPT at 2 ranks the ranks' reduce-scatters then
  // failed with mismatched messages. This small model did not show it; bench_checkpoint at 2
  // ranks with zero2 is the reproducer. The snapshot is taken under NoGradGuard.)
  auto t = strategies::apply(
      make_model(7), optim::AdamW::factory({.lr = 1e-2}),
      strategies::parse_strategy(nlohmann::json::parse(
          W > 1 ? R"([{"name": "zero2", "config": {"bucket_mb": 0.01}}])" : "[]")),
      {.group = world, .grad_clip = 1.0});
  t->train_step(batch(0, W, rank));
  const std::string sync_dir = save_trainer(root + "/sync", 1, *t, kHash);
  AsyncSaver saver(root + "/async", {.keep_last = 2});
  saver.save(1, *t, kHash, {{"note", "async"}});
  EXPECT_TRUE(saver.pending());
  std::optional<std::string> committed;
  for (int64_t s = 1; s < 4; ++s) {
    t->train_step(batch(s, W, rank));  // changes every parameter the save is writing
    if (!committed) committed = saver.poll();
  }
  if (!committed) committed = saver.finish();
  ASSERT_TRUE(committed.has_value());
  EXPECT_FALSE(saver.pending());
  EXPECT_EQ(read_metadata(*committed).extra.at("note"), "async");
  const auto want = read_whole(sync_dir), got = read_whole(*committed);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, tensor] : want) {
    const Tensor& other = got.at(name);
    ASSERT_EQ(other.nbytes(), tensor.nbytes()) << name;
    EXPECT_EQ(std::memcmp(other.raw_data(), tensor.raw_data(), tensor.nbytes()), 0) << name;
  }
  // A second save while none is pending, then finish: committed at once; keep_last holds 2.
  saver.save(4, *t, kHash);
  saver.save(5, *t, kHash);  // finishes step 4's first
  EXPECT_EQ(saver.finish(), root + "/async/" + step_dir_name(5));
  EXPECT_EQ(saver.finish(), std::nullopt);
  EXPECT_EQ(committed_steps(root + "/async").size(), 2u);
  remove_job_dir(root);
}

// Each kind of damage to the newest step is found, named, and resume falls back to the step
// before it (or, told not to, refuses).
TEST(Checkpoint, DamageIsNamedAndResumeFallsBackToThePreviousStep) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), rank = world->rank();
  const std::string root = job_dir("damage");
  const std::string method = W > 1 ? "ddp" : "";
  auto t = trainer(make_model(7), method, world);
  t->train_step(batch(0, W, rank));
  const std::string step1 = save_trainer(root, 1, *t, kHash);
  t->train_step(batch(1, W, rank));
  struct Damage {
    std::string name, words;
    std::function<void(const fs::path&)> apply;
  };
  const std::vector<Damage> damages = {
      {"flipped bit", "checksum mismatch",
       [](const fs::path& dir) { test::flip_bit(dir / shard_file_name(0), 100, 0x10); }},
      {"truncated shard", "is truncated",
       [](const fs::path& dir) {
         fs::resize_file(dir / shard_file_name(0), fs::file_size(dir / shard_file_name(0)) / 2);
       }},
      {"missing shard", "is missing",
       [](const fs::path& dir) { fs::remove(dir / shard_file_name(0)); }},
      {"corrupt metadata", "checkpoint metadata",
       [](const fs::path& dir) {
         std::ofstream(dir / "metadata.json", std::ios::trunc) << "{\"format\": \"autoacc-chec";
       }},
  };
  for (const Damage& d : damages) {
    const std::string step2 = save_trainer(root, 2, *t, kHash);
    if (rank == 0) d.apply(step2);
    world->barrier()->wait();
    auto fresh = trainer(make_model(99), method, world);
    try {
      resume(root, *fresh, kHash, /*fall_back=*/false);
      ADD_FAILURE() << d.name << ": a damaged step loaded without fallback";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(d.words), std::string::npos)
          << d.name << ": " << e.what();
    }
    const std::optional<Resumed> r = resume(root, *fresh, kHash);
    ASSERT_TRUE(r.has_value()) << d.name;
    EXPECT_EQ(r->dir, step1) << d.name;
    EXPECT_EQ(r->metadata.step, 1) << d.name;
    ASSERT_EQ(r->skipped.size(), 1u) << d.name;
    EXPECT_NE(r->skipped[0].find(d.words), std::string::npos) << d.name << ": " << r->skipped[0];
  }
  // Undamaged, the newest step loads; an empty root has nothing to resume.
  save_trainer(root, 2, *t, kHash);
  auto fresh = trainer(make_model(99), method, world);
  EXPECT_EQ(resume(root, *fresh, kHash)->metadata.step, 2);
  EXPECT_FALSE(resume(root + "/nothing-here", *fresh, kHash).has_value());
  remove_job_dir(root);
}

// A program that never took a root's lock is protected too: while another job holds it (here
// another open file description of ROOT/.lock, as another process's would be), save_trainer and
// AsyncSaver fail on every rank naming the holder, and its save in progress (a .tmp-step
// directory) is left alone; once it is gone, the next save removes that leftover and commits,
// and releases the lock it took for itself.
TEST(Checkpoint, ASaveIntoARootAnotherJobWritesIsRefusedOnEveryRank) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), rank = world->rank();
  const std::string root = job_dir("locked");
  const fs::path theirs = fs::path(root) / ".tmp-step-00000001-4242-0";
  int fd = -1;
  if (rank == 0) {
    fs::create_directories(theirs);
    fd = ::open((fs::path(root) / ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    ASSERT_EQ(::fcntl(fd, F_OFD_SETLK, &fl), 0);
    const std::string entry = R"({"host": "node9", "pid": 4242, "started": "", "command": ""})";
    ASSERT_EQ(::write(fd, entry.data(), entry.size()), static_cast<ssize_t>(entry.size()));
  }
  world->barrier()->wait();
  auto t = trainer(make_model(7), W > 1 ? "ddp" : "", world);
  t->train_step(batch(0, W, rank));
  const std::string want = "is in use by another job: pid 4242 on host node9";
  try {
    save_trainer(root, 1, *t, kHash);
    ADD_FAILURE() << "saved into a root another job holds";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  AsyncSaver saver(root);
  try {
    saver.save(1, *t, kHash);
    ADD_FAILURE() << "an async save began in a root another job holds";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  EXPECT_FALSE(saver.pending());
  if (rank == 0) {
    EXPECT_TRUE(fs::exists(theirs)) << "a live job's save in progress was removed";
    EXPECT_TRUE(committed_steps(root).empty());
    ::close(fd);  // that job ends
  }
  world->barrier()->wait();
  EXPECT_EQ(save_trainer(root, 1, *t, kHash), root + "/" + step_dir_name(1));
  if (rank == 0) {
    EXPECT_FALSE(fs::exists(theirs)) << "the dead job's leftover was kept";
    EXPECT_FALSE(RootLock::held_here(root)) << "the save kept the lock it took";
    EXPECT_TRUE(RootLock::acquire(root).owner().pid == ::getpid());
  }
  remove_job_dir(root);
}

}  // namespace
}  // namespace acc::ckpt
