// TrainingSession used from C++ as a user's program would, at whatever world size mpirun gives
// (CTest: 1 and 2 ranks): saves every N steps keeping K, a resume that continues bitwise the
// losses of a run that never stopped with the loader's position and every rank's generator
// restored, a module that is no language model with a loader whose position differs by rank, the
// step log's appends and attempt numbers, and bad options refused by name with nothing written.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "acc/accelerate.hpp"
#include "acc/checkpoint/checkpoint.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/session.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

namespace fs = std::filesystem;

const nlohmann::json kConfig = {
    {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 64}, {"block_size", 32}};
constexpr int64_t kGlobalBatch = 8;
constexpr int64_t kSeqLen = 16;

int world() {
  return dist::world_size();
}
int rank() {
  return dist::rank();
}

// A directory of the test's, the same on every rank (rank 0 names it), removed at the end once
// every rank is past it.
struct SharedDir {
  explicit SharedDir(const std::string& tag) {
    auto w = dist::ProcessGroup::world();
    const std::string mine =
        w->rank() == 0 ? testing::TempDir() + "session-" + tag + "-" + std::to_string(::getpid())
                       : std::string();
    path = dist::broadcast_text(*w, mine, 0);
    if (w->rank() == 0) fs::create_directories(path);
    w->barrier()->wait();
  }
  ~SharedDir() {
    dist::ProcessGroup::world()->barrier()->wait();
    if (rank() == 0) fs::remove_all(path);
  }
  fs::path path;
};

std::shared_ptr<const data::TokenFile> tokens() {
  std::vector<uint32_t> t(4096);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint32_t>((i * 7 + i / 13) % 64);
  return std::make_shared<data::TokenFile>(std::move(t), "synthetic", 64);
}

data::BatchLoader gpt_loader() {
  return data::BatchLoader(tokens(), {.batch_size = kGlobalBatch / world(),
                                      .seq_len = kSeqLen,
                                      .order = data::SampleOrder::kRandom,
                                      .seed = 3,
                                      .rank = rank(),
                                      .world = world()});
}

// A GPT accelerated with a given strategy (zero2 on several ranks: its optimizer state is
// sharded, and what a checkpoint holds is resharded on load), its weights drawn from `seed`.
AccelerateResult accelerate_gpt(uint64_t seed) {
  manual_seed(seed);
  auto model = models::create_model("gpt", kConfig);
  AccelerateOptions o;
  o.global_batch = kGlobalBatch;
  o.seq_len = kSeqLen;
  o.verbose = false;
  o.load_strategy = world() > 1 ? R"([{"name": "zero2"}])" : "[]";
  o.cache_dir = (fs::temp_directory_path() / "acc-session-test-cache").string();
  return auto_accelerate(model, optim::AdamW::factory({.lr = 1e-2}), o);
}

// Options that write nothing but what a test asks for: the agent's job directory inside `dir`, no
// console lines.
SessionOptions quiet(const SharedDir& dir) {
  SessionOptions o;
  o.log_every = 0;
  o.tokens_per_sample = kSeqLen;
  o.agent.job_dir = (dir.path / "job").string();
  return o;
}

std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::vector<std::string> step_names(const fs::path& root) {
  std::vector<std::string> out;
  for (const std::string& s : ckpt::committed_steps(root.string())) {
    out.push_back(fs::path(s).filename().string());
  }
  return out;
}

// The losses of `n` steps of a fresh session (no checkpoint) of accelerate_gpt(7).
std::vector<double> uninterrupted_gpt(const SharedDir& dir, int64_t n) {
  AccelerateResult acc = accelerate_gpt(7);
  data::BatchLoader loader = gpt_loader();
  TrainingSession run(acc, loader, quiet(dir));
  std::vector<double> out;
  for (int64_t s = run.first_step(); s < n; ++s) out.push_back(run.step().loss);
  run.finish();
  return out;
}

TEST(TrainingSession, SavesEveryNKeepsKAndResumesBitwise) {
  SharedDir dir("resume");
  const fs::path ck = dir.path / "ck", log = dir.path / "log.jsonl";
  const std::vector<double> want = uninterrupted_gpt(dir, 8);
  SessionOptions o = quiet(dir);
  o.ckpt_dir = ck.string();
  o.save_every = 2;
  o.keep = 2;
  o.resume = Resume::kAuto;  // nothing there yet: from step 0
  o.log_json = log.string();
  o.steps = 8;
  // 5 steps, saved after 2 and 4 in the background and after 5 by finish(); 2 steps kept.
  std::pair<uint64_t, uint64_t> rng_at_5;
  {
    AccelerateResult acc = accelerate_gpt(7);
    data::BatchLoader loader = gpt_loader();
    TrainingSession run(acc, loader, o);
    EXPECT_EQ(run.first_step(), 0);
    EXPECT_FALSE(run.resumed_from().has_value());
    for (int64_t s = run.first_step(); s < 5; ++s) {
      const StepResult r = run.step();
      EXPECT_EQ(r.step, s);
      EXPECT_EQ(r.loss, want[static_cast<size_t>(s)]) << "step " << s;
    }
    run.finish();
    rng_at_5 = {default_generator().seed(), default_generator().offset()};
  }
  EXPECT_EQ(step_names(ck), (std::vector<std::string>{"step-00000004", "step-00000005"}));
  // Resumed into other weights, a loader at its start and a generator elsewhere: the checkpoint
  // puts all three back, and the losses go on as if the run had never stopped.
  {
    AccelerateResult acc = accelerate_gpt(123);
    data::BatchLoader loader = gpt_loader();
    manual_seed(999);
    TrainingSession run(acc, loader, o);
    EXPECT_EQ(run.first_step(), 5);
    ASSERT_TRUE(run.resumed_from().has_value());
    EXPECT_EQ(fs::path(*run.resumed_from()).filename(), "step-00000005");
    EXPECT_EQ(loader.step(), 5);
    EXPECT_EQ(default_generator().seed(), rng_at_5.first);
    EXPECT_EQ(default_generator().offset(), rng_at_5.second);
    for (int64_t s = run.first_step(); s < 8; ++s) {
      EXPECT_EQ(run.step().loss, want[static_cast<size_t>(s)]) << "step " << s;
    }
    run.finish();
  }
  EXPECT_EQ(step_names(ck), (std::vector<std::string>{"step-00000006", "step-00000008"}));
  // The log holds every step once: the resumed run appended to it.
  if (rank() == 0) {
    const auto lines = read_jsonl(log);
    ASSERT_EQ(lines.size(), 8u);
    for (size_t i = 0; i < lines.size(); ++i) {
      EXPECT_EQ(lines[i].at("step"), i);
      EXPECT_EQ(lines[i].at("attempt"), 0);
      EXPECT_EQ(lines[i].at("loss").get<double>(), want[i]);
      EXPECT_TRUE(lines[i].contains("tokens_per_s")) << lines[i].dump();
    }
  }
}

// The step log of a restarted attempt (ACC_RUN_ATTEMPT > 0, as acc-run sets it) appends, each
// line with its attempt, also when the attempt found no checkpoint and redoes steps; a fresh run
// of attempt 0 starts the file anew.
TEST(TrainingSession, TheStepLogAppendsForARestartedAttemptAndStartsAnewOtherwise) {
  SharedDir dir("log");
  const fs::path log = dir.path / "log.jsonl";
  auto run_steps = [&](int64_t n) {
    AccelerateResult acc = accelerate_gpt(7);
    data::BatchLoader loader = gpt_loader();
    SessionOptions o = quiet(dir);
    o.log_json = log.string();
    TrainingSession run(acc, loader, o);
    for (int64_t s = 0; s < n; ++s) run.step();
  };
  auto attempts_and_steps = [&] {
    std::vector<std::pair<int, int64_t>> out;
    for (const auto& l : read_jsonl(log)) out.emplace_back(l.at("attempt"), l.at("step"));
    return out;
  };
  using Lines = std::vector<std::pair<int, int64_t>>;
  run_steps(2);
  if (rank() == 0) {
    EXPECT_EQ(attempts_and_steps(), (Lines{{0, 0}, {0, 1}}));
  }
  ::setenv("ACC_RUN_ATTEMPT", "2", 1);
  run_steps(3);
  ::unsetenv("ACC_RUN_ATTEMPT");
  if (rank() == 0) {
    EXPECT_EQ(attempts_and_steps(), (Lines{{0, 0}, {0, 1}, {2, 0}, {2, 1}, {2, 2}}));
  }
  run_steps(1);
  if (rank() == 0) {
    EXPECT_EQ(attempts_and_steps(), (Lines{{0, 0}}));
  }
}

// A classifier's data: each rank reads a stream of its own (sample i of rank r's stream), so its
// position differs by rank and load_state refuses another rank's.
class ClassifierLoader : public data::Loader {
 public:
  ClassifierLoader(int rank, int64_t batch) : rank_(rank), batch_(batch) {}
  data::Batch next() override {
    std::vector<float> x(static_cast<size_t>(batch_ * 16));
    std::vector<int64_t> labels(static_cast<size_t>(batch_));
    for (int64_t b = 0; b < batch_; ++b) {
      const int64_t i = step_ * batch_ + b;
      labels[static_cast<size_t>(b)] = (i * 3 + rank_) % 4;
      for (int64_t f = 0; f < 16; ++f) {
        x[static_cast<size_t>(b * 16 + f)] =
            static_cast<float>(((i * 7 + f * 5 + rank_ * 11) % 17) - 8) / 8.0f +
            (f % 4 == labels[static_cast<size_t>(b)] ? 1.0f : 0.0f);
      }
    }
    ++step_;
    return data::Batch(
        {{"x", from_vector(x, {batch_, 16})}, {"labels", from_vector(labels, {batch_})}});
  }
  nlohmann::json state() const override { return {{"rank", rank_}, {"step", step_}}; }
  void load_state(const nlohmann::json& state) override {
    ACC_CHECK(state.at("rank") == rank_, "classifier loader: a state of rank ", state.at("rank"),
              ", this is rank ", rank_);
    step_ = state.at("step").get<int64_t>();
  }

 private:
  int rank_;
  int64_t batch_;
  int64_t step_ = 0;
};

// An MLP (no language model) with the user's loss, accelerated by hand as a program of its own
// would: ddp on several ranks.
AccelerateResult accelerate_mlp(uint64_t seed) {
  manual_seed(seed);
  auto model = std::make_shared<models::MLP>(models::MLPConfig{});
  AccelerateResult r;
  r.model = model;
  r.strategy = world() > 1
                   ? strategies::parse_strategy(nlohmann::json::parse(R"([{"name": "ddp"}])"))
                   : strategies::Strategy{};
  strategies::ApplyOptions ao;
  ao.loss = [](nn::Module& m, const data::Batch& b) {
    return dynamic_cast<models::MLP&>(m).loss(b.at("x"), b.at("labels"));
  };
  r.trainer = strategies::apply(model, optim::AdamW::factory({.lr = 1e-2}), r.strategy, ao);
  r.data = {.rank = rank(), .ranks = world(), .global_batch = kGlobalBatch};
  r.model_hash = "00000000000000aa";
  return r;
}

TEST(TrainingSession, AnyModuleAndALoaderWhosePositionDiffersByRankResumeExactly) {
  SharedDir dir("module");
  const int64_t per_rank = kGlobalBatch / world();
  std::vector<double> want;
  {
    AccelerateResult acc = accelerate_mlp(5);
    ClassifierLoader loader(rank(), per_rank);
    TrainingSession run(acc, loader, quiet(dir));
    for (int64_t s = 0; s < 6; ++s) want.push_back(run.step().loss);
  }
  const fs::path ck = dir.path / "ck";
  {
    AccelerateResult acc = accelerate_mlp(5);
    ClassifierLoader loader(rank(), per_rank);
    SessionOptions o = quiet(dir);
    o.ckpt_dir = ck.string();
    o.sync_save = true;
    o.keep = std::nullopt;
    TrainingSession run(acc, loader, o);
    for (int64_t s = 0; s < 3; ++s) EXPECT_EQ(run.step().loss, want[static_cast<size_t>(s)]);
  }  // the destructor finishes: step 3 saved
  const fs::path step3 = ck / "step-00000003";
  const nlohmann::json extra = ckpt::read_metadata(step3.string()).extra;
  EXPECT_EQ(extra.value("module_type", ""), "MLP") << extra.dump();
  EXPECT_FALSE(extra.contains("model_type")) << extra.dump();
  EXPECT_EQ(extra.at("loader"), (nlohmann::json{{"rank", 0}, {"step", 3}}));
  if (world() > 1) {
    ASSERT_TRUE(extra.contains("loader_ranks")) << extra.dump();
    for (int r = 0; r < world(); ++r) {
      EXPECT_EQ(extra.at("loader_ranks").at(static_cast<size_t>(r)),
                (nlohmann::json{{"rank", r}, {"step", 3}}));
    }
  } else {
    EXPECT_FALSE(extra.contains("loader_ranks")) << extra.dump();
  }
  // From the step directory, into a root of its own: each rank's loader where it was.
  {
    AccelerateResult acc = accelerate_mlp(77);
    ClassifierLoader loader(rank(), per_rank);
    SessionOptions o = quiet(dir);
    o.ckpt_dir = (dir.path / "ck2").string();
    o.resume = Resume::kPath;
    o.resume_path = step3.string();
    TrainingSession run(acc, loader, o);
    EXPECT_EQ(run.first_step(), 3);
    EXPECT_EQ(loader.state(), (nlohmann::json{{"rank", rank()}, {"step", 3}}));
    for (int64_t s = 3; s < 6; ++s) {
      EXPECT_EQ(run.step().loss, want[static_cast<size_t>(s)]) << "step " << s;
    }
    run.finish();
  }
  // A loader that refuses its position on one rank only: every rank refuses, naming that rank
  // (the others must not go on into the first step's collectives).
  if (world() > 1) {
    AccelerateResult acc = accelerate_mlp(77);
    ClassifierLoader loader(rank() == world() - 1 ? 99 : rank(), per_rank);
    SessionOptions o = quiet(dir);
    o.resume = Resume::kPath;
    o.resume_path = step3.string();
    const std::string error = test::error_of<ValueError>([&] { TrainingSession(acc, loader, o); });
    EXPECT_NE(
        error.find("rank " + std::to_string(world() - 1) + ": classifier loader: a state of rank " +
                   std::to_string(world() - 1) + ", this is rank 99"),
        std::string::npos)
        << error;
  }
  // A language model does not resume the MLP's checkpoint: refused by type, before its hash.
  AccelerateResult gpt = accelerate_gpt(7);
  data::BatchLoader loader = gpt_loader();
  SessionOptions o = quiet(dir);
  o.resume = Resume::kPath;
  o.resume_path = step3.string();
  const std::string error = test::error_of<ValueError>([&] { TrainingSession(gpt, loader, o); });
  EXPECT_NE(error.find("resume '" + step3.string() +
                       "' holds a MLP model, this run's is a gpt "
                       "language model"),
            std::string::npos)
      << error;
}

// Every entry of the directory, recursively.
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(TrainingSession, BadOptionsAreNamedAndNothingIsWritten) {
  SharedDir dir("bad");
  const fs::path ck = dir.path / "ck", file = dir.path / "file";
  if (rank() == 0) std::ofstream(file) << "x";
  dist::ProcessGroup::world()->barrier()->wait();
  const std::vector<std::string> before = listing(dir.path);
  struct Case {
    std::string name;
    std::function<void(SessionOptions&)> set;
    std::string error;
    bool io = false;
  };
  const std::string c = ck.string(), f = file.string(), d = dir.path.string(), x = "x";
  const std::vector<Case> cases = {
      {"save_every < 0", [&](auto& o) { o.save_every = -1; },
       "save_every must be >= 0 (0: save at the end only), got -1"},
      {"keep < 1", [&](auto& o) { o.ckpt_dir = c, o.keep = 0; },
       "keep must be >= 1 (the newest steps kept; std::nullopt keeps every one), got 0"},
      {"kPath without a path", [&](auto& o) { o.resume = Resume::kPath; },
       "resume is Resume::kPath but resume_path is empty"},
      {"a path without kPath",
       [&](auto& o) {
         o.ckpt_dir = c;
         o.resume = Resume::kAuto;
         o.resume_path = x;
       },
       "resume_path 'x' is given but resume is Resume::kAuto: set resume = Resume::kPath"},
      {"save_every without ckpt_dir", [&](auto& o) { o.save_every = 2; },
       "save_every needs ckpt_dir"},
      {"start_over without ckpt_dir", [&](auto& o) { o.start_over = true; },
       "start_over needs ckpt_dir"},
      {"kAuto without ckpt_dir", [&](auto& o) { o.resume = Resume::kAuto; },
       "resume auto resumes from ckpt_dir: give ckpt_dir"},
      {"start_over with kAuto",
       [&](auto& o) { o.ckpt_dir = c, o.start_over = true, o.resume = Resume::kAuto; },
       "start_over deletes the committed steps of ckpt_dir '" + c +
           "', which resume auto would continue: give one or the other"},
      {"log_every < 0", [&](auto& o) { o.log_every = -1; }, "log_every must be >= 0"},
      {"steps < 0", [&](auto& o) { o.steps = -3; }, "steps must be >= 0 (0: unknown), got -3"},
      {"tokens_per_sample < 0", [&](auto& o) { o.tokens_per_sample = -1; },
       "tokens_per_sample must be >= 0"},
      {"a log in a missing directory", [&](auto& o) { o.log_json = d + "/none/log.jsonl"; },
       "log_json '" + d + "/none/log.jsonl': directory '" + d + "/none' does not exist", true},
      {"a log that is a directory", [&](auto& o) { o.log_json = d; }, "log_json '" + d + "'", true},
      {"ckpt_dir in a missing directory", [&](auto& o) { o.ckpt_dir = d + "/none/ck"; },
       "ckpt_dir '" + d + "/none/ck': directory '" + d + "/none' does not exist", true},
      {"ckpt_dir a file", [&](auto& o) { o.ckpt_dir = f; },
       "ckpt_dir '" + f + "' is a file, not a directory", true},
      {"resume_path no directory", [&](auto& o) { o.resume = Resume::kPath, o.resume_path = f; },
       "resume '" + f + "' is not a checkpoint directory", true},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    SessionOptions o = quiet(dir);
    k.set(o);
    const std::string error =
        k.io ? test::error_of<IoError>([&] { TrainingSession::prepare(o); })
             : test::error_of<ValueError>([&] { TrainingSession::prepare(o); });
    EXPECT_NE(error.find(k.error), std::string::npos) << error;
    EXPECT_EQ(listing(dir.path), before) << "something was written";
  }
  // acc-run's attempt number, when it is not one.
  for (const char* bad : {"abc", "-1"}) {
    ::setenv("ACC_RUN_ATTEMPT", bad, 1);
    const std::string error =
        test::error_of<ValueError>([&] { TrainingSession::prepare(quiet(dir)); });
    ::unsetenv("ACC_RUN_ATTEMPT");
    EXPECT_NE(error.find("ACC_RUN_ATTEMPT"), std::string::npos) << error;
    EXPECT_NE(error.find(bad), std::string::npos) << error;
    EXPECT_EQ(listing(dir.path), before) << "something was written";
  }
  // What the session needs of the AccelerateResult: a trainer, and a model hash to name
  // checkpoints by.
  AccelerateResult acc = accelerate_gpt(7);
  data::BatchLoader loader = gpt_loader();
  SessionOptions o = quiet(dir);
  o.ckpt_dir = c;
  acc.model_hash.clear();
  EXPECT_NE(test::error_of<ValueError>([&] {
              TrainingSession(acc, loader, o);
            }).find("AccelerateResult::model_hash is empty"),
            std::string::npos);
  acc.trainer.reset();
  EXPECT_NE(test::error_of<ValueError>([&] {
              TrainingSession(acc, loader, o);
            }).find("the AccelerateResult has no trainer"),
            std::string::npos);
  EXPECT_EQ(listing(dir.path), before) << "something was written";
}

// A trainer dropped before finish() (a program handing the model back early) is named by step()
// and finish(), and the destructor logs it instead of saving from a trainer that is gone.
TEST(TrainingSession, ATrainerDroppedBeforeFinishIsNamed) {
  SharedDir dir("dropped");
  AccelerateResult acc = accelerate_gpt(7);
  data::BatchLoader loader = gpt_loader();
  SessionOptions o = quiet(dir);
  o.ckpt_dir = (dir.path / "ck").string();
  auto run = std::make_unique<TrainingSession>(acc, loader, o);
  run->step();
  acc.trainer.reset();
  EXPECT_NE(test::error_of<ValueError>([&] {
              run->step();
            }).find("TrainingSession::step: the AccelerateResult's trainer was reset"),
            std::string::npos);
  EXPECT_NO_THROW(run.reset());  // finish() fails inside: logged
  EXPECT_TRUE(ckpt::committed_steps((dir.path / "ck").string()).empty());
}

}  // namespace
}  // namespace acc
