// Issue 29's table: what a hostile probe of train_gpt's checkpoints and acc-ckpt found, and what
// each case gets now. One row per case: the command, its exit code, the words its output must
// contain and those it must not. Every row failed on the code before issue 29 (a second job
// trained into a root another job writes, a tool wrote into its own input, an import replaced a
// run's state, a message named the wrong thing or printed a raw JSON exception). Then the
// scenarios the table cannot hold: two jobs started on one root (1 and 2 ranks, sync and async
// saves), a killed job that must not block the next, and a dead save's leftover.
//
// Exit codes: 2 a bad command line, 1 an error while running, 0 done.

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/util/system.hpp"
#include "command.hpp"
#include "flip_bit.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using acc::test::run_command;

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// metadata.json of a checkpoint's only step, edited.
void edit_metadata(const fs::path& root, const std::function<void(nlohmann::json&)>& edit) {
  const fs::path md = fs::path(*acc::ckpt::resolve(root.string())) / "metadata.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(md));
  edit(m);
  write(md, m.dump());
}

struct Case {
  std::string item;     // issue 29 item
  std::string command;  // a shell command, see expand(); "(a; b)" captures both outputs
  int exit_code;
  std::vector<std::string> words;
  std::vector<std::string> absent = {"| loss", "json.exception", "Signal:", "Aborted"};
};

class CkptSafety : public testing::Test {
 protected:
  static fs::path dir;
  static std::optional<acc::ckpt::RootLock> held;  // a root this test process writes: "another job"

  static void SetUpTestSuite() {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);  // as scripts/setup.sh, for a run outside CTest
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
    dir = fs::temp_directory_path() / ("acc_ckpt_safety_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::string text;
    for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog. ";
    write(dir / "text.txt", text);
    const nlohmann::json a = {
        {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 256}, {"block_size", 64}};
    write(dir / "a.json", a.dump());
    nlohmann::json a4 = a;
    a4["n_head"] = 4;
    write(dir / "a_nhead4.json", a4.dump());

    // A run's checkpoint at step 2 and its weights; one at steps 2 and 4.
    const auto ck = run_command(tg() + " --steps 2 --sync-save --ckpt-dir " +
                                (dir / "ck").string() + " --save " + (dir / "w.st").string());
    ASSERT_EQ(ck.exit_code, 0) << ck.output;
    const auto two = run_command(tg() + " --steps 4 --save-every 2 --sync-save --ckpt-dir " +
                                 (dir / "ck_two").string());
    ASSERT_EQ(two.exit_code, 0) << two.output;
    acc::test::flip_bit(dir / "ck_two" / "step-00000004" / "shard-00000.bin", 64, 0x01);

    // Copies of the first, each damaged or used once.
    for (const char* name :
         {"ck_run", "ck_over", "ck_export", "ck_imp", "ck_force", "ck_shardlink", "ck_steplink",
          "ck_renamed", "ck_world", "ck_dirshard", "ck_noperm", "ck_rng", "ck_rng_pair",
          "ck_loader", "ck_loader_field", "ck_config", "ck_model_type", "ck_huge_meta"}) {
      fs::copy(dir / "ck", dir / name, fs::copy_options::recursive);
    }
    const fs::path step = "step-00000002";
    fs::create_directories(dir / "outside");
    fs::rename(dir / "ck_shardlink" / step / "shard-00000.bin",
               dir / "outside" / "shard-00000.bin");
    fs::create_symlink(dir / "outside" / "shard-00000.bin",
                       dir / "ck_shardlink" / step / "shard-00000.bin");
    fs::rename(dir / "ck_steplink" / step, dir / "outside" / "step");
    fs::create_directory_symlink(dir / "outside" / "step", dir / "ck_steplink" / step);
    fs::rename(dir / "ck_renamed" / step, dir / "ck_renamed" / "step-00000005");
    edit_metadata(dir / "ck_world", [](nlohmann::json& m) { m["world"] = 2; });
    fs::remove(dir / "ck_dirshard" / step / "shard-00000.bin");
    fs::create_directories(dir / "ck_dirshard" / step / "shard-00000.bin");
    fs::permissions(dir / "ck_noperm" / step / "shard-00000.bin", fs::perms::none);
    edit_metadata(dir / "ck_rng", [](nlohmann::json& m) { m["extra"]["rng"] = "oops"; });
    edit_metadata(dir / "ck_rng_pair", [](nlohmann::json& m) { m["extra"]["rng"] = {{1}}; });
    edit_metadata(dir / "ck_loader", [](nlohmann::json& m) { m["extra"]["loader"] = 5; });
    edit_metadata(dir / "ck_loader_field",
                  [](nlohmann::json& m) { m["extra"]["loader"]["step"] = "three"; });
    edit_metadata(dir / "ck_config", [](nlohmann::json& m) { m["extra"]["config"] = "small"; });
    edit_metadata(dir / "ck_model_type", [](nlohmann::json& m) { m["extra"]["model_type"] = 7; });
    // A metadata.json past kMaxMetadataBytes (256 MiB), sparse: refused by its size, unread.
    fs::resize_file(dir / "ck_huge_meta" / step / "metadata.json", (int64_t{256} << 20) + 1);
    // `latest` cannot be replaced (a directory there): moving it fails after the commit, as it
    // does on a full disk.
    for (const char* name : {"latest_sync", "latest_async"}) {
      fs::create_directories(dir / name / "latest" / "in-the-way");
    }
    held = acc::ckpt::RootLock::acquire((dir / "held").string());
  }
  static void TearDownTestSuite() {
    held.reset();
    fs::remove_all(dir);
  }

  static std::string tg() {
    return std::string(TRAIN_GPT_BIN) + " --config " + (dir / "a.json").string() + " --data " +
           (dir / "text.txt").string() + " --data-format text --seq-len 32 --batch-size 4";
  }
  static std::string expand(std::string s) {
    // As root a file without permissions is readable all the same: read it as nobody then.
    const std::string as_nobody =
        ::geteuid() == 0 ? "setpriv --reuid=65534 --regid=65534 --clear-groups " : "";
    const std::vector<std::pair<std::string, std::string>> vars = {
        {"{tg}", tg()},
        {"{ck}", ACC_CKPT_BIN},
        {"{nobody}", as_nobody},
        {"{mpi}", std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none"},
        {"{mpi_default}", MPIEXEC_BIN},  // mpirun's own binding: a core per rank at 2 ranks
        {"{ddp}", "--strategy '[{\"name\": \"ddp\"}]'"},
        {"{dir}", dir.string()},
        {"{pid}", std::to_string(::getpid())},
        {"{host}", host_name()}};
    for (const auto& [k, v] : vars) {
      for (size_t at; (at = s.find(k)) != std::string::npos;) s.replace(at, k.size(), v);
    }
    return s;
  }
  static void check(const Case& c) {
    const std::string cmd = expand(c.command);
    const auto r = run_command(cmd);
    SCOPED_TRACE("item " + c.item + ": " + cmd + "\n" + r.output);
    EXPECT_EQ(r.exit_code, c.exit_code);
    for (const auto& w : c.words) {
      EXPECT_NE(r.output.find(expand(w)), std::string::npos) << "missing: " << expand(w);
    }
    for (const auto& w : c.absent) EXPECT_EQ(r.output.find(w), std::string::npos) << "found: " << w;
  }
};

fs::path CkptSafety::dir;
std::optional<acc::ckpt::RootLock> CkptSafety::held;

// Item 1: a root has one writing job, and a job that does not continue a root's run does not
// write into it. The root "held" is locked by this test process, standing for a live job.
TEST_F(CkptSafety, ARootHasOneWritingJob) {
  const std::vector<Case> cases = {
      {"1",
       "{tg} --steps 2 --ckpt-dir {dir}/held",
       1,
       {"checkpoint root '{dir}/held' is in use by another job: pid {pid} on host {host}, since ",
        "one writing job at a time"}},
      {"1",
       "{mpi} -np 2 {tg} --steps 2 {ddp} --ckpt-dir {dir}/held",
       1,
       {"is in use by another job: pid {pid} on host {host}"}},
      {"1",
       "{ck} import-safetensors {dir}/w.st {dir}/held --config {dir}/a.json",
       1,
       {"is in use by another job: pid {pid} on host {host}"},
       {"wrote "}},
      {"1",
       "{tg} --steps 4 --ckpt-dir {dir}/ck_run",
       1,
       {"--ckpt-dir '{dir}/ck_run' holds 1 committed step(s) of another run (the newest: "
        "step-00000002)",
        "Continue that run with --resume auto, or give --ckpt-start-over"}},
      {"1",
       "{tg} --steps 4 --ckpt-dir {dir}/ck_run --resume {dir}/ck",
       1,
       {"holds 1 committed step(s) of another run", "and --resume '{dir}/ck' is not one of them",
        "--ckpt-start-over"}},
      {"1",
       "{tg} --steps 4 --ckpt-dir {dir}/ck_run --resume auto --ckpt-start-over",
       1,
       {"--ckpt-start-over deletes the committed steps of --ckpt-dir '{dir}/ck_run', which "
        "--resume auto would continue"}},
      {"1", "{tg} --steps 1 --ckpt-start-over", 1, {"--ckpt-start-over needs --ckpt-dir"}},
      // The flag deletes the old run's step and this run's take its place (ls shows the root).
      {"1",
       "{tg} --steps 3 --sync-save --ckpt-dir {dir}/ck_over --ckpt-start-over > /dev/null 2>&1; "
       "echo train_gpt=$?; ls {dir}/ck_over",
       0,
       {"train_gpt=0", "step-00000003"},
       {"step-00000002"}},
  };
  for (const auto& c : cases) check(c);
}

// Item 2: no tool writes inside a checkpoint (its own input above all); verify then still passes.
TEST_F(CkptSafety, NoToolWritesIntoACheckpoint) {
  const std::vector<Case> cases = {
      {"2",
       "({ck} export-safetensors {dir}/ck_export {dir}/ck_export/step-00000002/shard-00000.bin; "
       "echo export=$?; {ck} verify {dir}/ck_export)",
       0,
       {"export=1", "lies inside the checkpoint '{dir}/ck_export/step-00000002'", ": ok, "}},
      {"2",
       "({ck} export-safetensors {dir}/ck_export/step-00000002 "
       "{dir}/ck_export/step-00000002/metadata.json; echo export=$?; {ck} verify {dir}/ck_export)",
       0,
       {"export=1", "lies inside the checkpoint", ": ok, "}},
      {"2",
       "{ck} export-safetensors {dir}/ck_export {dir}/ck_export/w.safetensors",
       1,
       {"export-safetensors OUT '{dir}/ck_export/w.safetensors' lies inside the checkpoint "
        "'{dir}/ck_export'"}},
      {"2",
       "{ck} import-safetensors {dir}/w.st {dir}/ck_export/step-00000002/nested --config "
       "{dir}/a.json",
       1,
       {"lies inside the checkpoint '{dir}/ck_export/step-00000002'"}},
  };
  for (const auto& c : cases) check(c);
}

// Item 3: an import never replaces a run's training state unasked, takes only steps readers find,
// and only weights of the config it is given.
TEST_F(CkptSafety, ImportKeepsARunsStateAndTheFilesConfig) {
  const std::string imp = "{ck} import-safetensors {dir}/w.st ";
  const std::vector<Case> cases = {
      {"3",
       imp + "{dir}/ck_imp --config {dir}/a.json --step 2",
       1,
       {"'{dir}/ck_imp' holds 1 committed step(s) of a run (the newest: step-00000002), "
        "step-00000002 among them: importing there would replace its training state",
        "--force"}},
      {"3",
       imp + "{dir}/ck_imp --config {dir}/a.json --step 0",
       1,
       {"holds 1 committed step(s) of a run (the newest: step-00000002): importing there would "
        "mix with its training state",
        "--force"}},
      {"3",
       imp + "{dir}/imp_huge --config {dir}/a.json --step 99999999999999999999",
       2,
       {"--step: '99999999999999999999' does not fit in a signed 64-bit integer"}},
      {"3",
       imp + "{dir}/imp_wide --config {dir}/a.json --step 1000000000000000000",
       2,
       {"--step: must be <= 999999999999999999, got 1000000000000000000"}},
      {"3",
       imp + "{dir}/imp_nhead --config {dir}/a_nhead4.json",
       1,
       {"import-safetensors '{dir}/w.st' was saved with n_head = 2, --config has n_head = 4"}},
      {"3",
       imp + "{dir}/ck_force --config {dir}/a.json --step 2 --force",
       0,
       {"--force: deleted 1 committed step(s) of {dir}/ck_force (step-00000002",
        "wrote {dir}/ck_force/step-00000002"}},
  };
  for (const auto& c : cases) check(c);
}

// Item 4: a checkpoint is read only from its own root, and its names agree with its metadata.
TEST_F(CkptSafety, ACheckpointIsReadOnlyFromItsRootAsItsNamesSay) {
  const std::vector<Case> cases = {
      {"4",
       "{ck} verify {dir}/ck_shardlink",
       1,
       {"'shard-00000.bin' leads out of the checkpoint root '{dir}/ck_shardlink' through a "
        "symlink (to '{dir}/outside/shard-00000.bin')"}},
      {"4",
       "{tg} --steps 4 --resume {dir}/ck_shardlink",
       1,
       {"leads out of the checkpoint root", "outside/shard-00000.bin"}},
      {"4",
       "{ck} verify {dir}/ck_steplink",
       1,
       {"checkpoint '{dir}/ck_steplink/step-00000002' leads out of its checkpoint root "
        "'{dir}/ck_steplink' through a symlink (to '{dir}/outside/step')"}},
      {"4",
       "{ck} verify {dir}/ck_renamed",
       1,
       {"is named step-00000005 but its metadata says step 2"}},
      {"4",
       "{ck} verify {dir}/ck_world",
       1,
       {"field 'files' lists 1 shard file(s), but 'world' is 2 (one file per rank)"}},
      {"issue 29.6",
       "{ck} inspect {dir}/ck_huge_meta",
       1,
       {"metadata.json': 268435457 bytes is over the limit of 268435456 bytes for a "
        "metadata.json"}},
      {"4",
       "{tg} --steps 4 --resume {dir}/ck_world",
       1,
       {"field 'files' lists 1 shard file(s), but 'world' is 2"}},
  };
  for (const auto& c : cases) check(c);
}

// Item 5: messages say what is true and name what is wrong.
TEST_F(CkptSafety, MessagesSayWhatIsTrue) {
  const std::vector<std::string> no_crash = {"json.exception", "Signal:", "Aborted"};
  const std::vector<Case> cases = {
      {"5",
       "{tg} --steps 2 --sync-save --ckpt-dir {dir}/latest_sync",
       1,
       {"checkpoint: step 2 is committed ('{dir}/latest_sync/step-00000002'), but the latest "
        "pointer was not moved",
        "still names nothing; readers find step 2 all the same, as the newest committed step"},
       {"committing step 2 failed", "Signal:"}},
      {"5",
       "{tg} --steps 2 --ckpt-dir {dir}/latest_async",
       1,
       {"checkpoint: step 2 is committed", "readers find step 2 all the same"},
       {"committing step 2 failed", "Signal:"}},
      {"5",
       "{tg} --steps 6 --resume {dir}/ck_two",
       1,
       {"--resume '{dir}/ck_two': its newest committed step does not load: "
        "{dir}/ck_two/step-00000004 (",
        "checksum mismatch",
        "The older '{dir}/ck_two/step-00000002' does: give --resume "
        "{dir}/ck_two/step-00000002"}},
      {"5",
       "{ck} verify {dir}/ck_dirshard",
       1,
       {"'shard-00000.bin' cannot be read: it is a directory, not a file"},
       {"missing"}},
      {"5",
       "{ck} inspect {dir}/ck_dirshard",
       0,
       {"shard-00000.bin:", "cannot be read: it is a directory"},
       {"missing"}},
      {"5",
       "{tg} --steps 4 --resume {dir}/ck_dirshard",
       1,
       {"'shard-00000.bin' cannot be read: it is a directory"},
       {"missing", "| loss"}},
      {"5",
       "{nobody}{ck} verify {dir}/ck_noperm",
       1,
       {"'shard-00000.bin' cannot be read (Permission denied)"},
       {"missing"}},
      {"5",
       "{tg} --steps 4 --resume {dir}/ck_rng",
       1,
       {"checkpoint metadata '{dir}/ck_rng/step-00000002/metadata.json': field 'extra.rng' must "
        "be a list of [seed, offset] pairs of unsigned integers, one per rank, got \"oops\""}},
      {"5",
       "{tg} --steps 4 --resume {dir}/ck_rng_pair",
       1,
       {"field 'extra.rng' must be a list of [seed, offset] pairs", "got [[1]]"}},
      {"5",
       "{tg} --steps 4 --resume {dir}/ck_loader",
       1,
       {"'{dir}/ck_loader/step-00000002/metadata.json': field 'extra.loader' must be an object"}},
      {"5",
       "{tg} --steps 4 --resume {dir}/ck_loader_field",
       1,
       {"'{dir}/ck_loader_field/step-00000002/metadata.json': field 'extra.loader': loader "
        "state"}},
      {"5",
       "{tg} --steps 4 --resume {dir}/ck_config",
       1,
       {"'{dir}/ck_config/step-00000002/metadata.json': field 'extra.config' must be an object"}},
      {"5",
       "{tg} --steps 4 --resume {dir}/ck_model_type",
       1,
       {"field 'extra.model_type' must be a string (gpt or llama), got 7"}},
  };
  for (const auto& c : cases) check(c);
}

// Item 5: under mpirun's default binding each of 2 ranks runs on a core of its own; 1 thread per
// rank is then no oversubscription, 2 are (4 threads on the 2 cores the ranks have together).
TEST_F(CkptSafety, ThreadsAreCountedOverTheNodesRanks) {
  if (acc::machine_cores() < 2) GTEST_SKIP() << "needs 2 cores (one per rank)";
  const std::vector<Case> cases = {
      {"5",
       "{mpi_default} -np 2 {tg} --steps 1 {ddp}",
       0,
       {"done: loss"},
       {"usable core(s)", "time-slice", "error"}},
      {"5",
       "{mpi_default} -np 2 {tg} --steps 1 {ddp} --threads 2",
       0,
       {"--threads 2 x 2 rank(s) on this node = 4 threads on 2 usable core(s)"},
       {"error"}},
  };
  for (const auto& c : cases) check(c);
}

// ---- scenarios ----

// The parent of `pid` (from /proc), or 0 when it is gone.
pid_t parent_of(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(s.substr(close + 2));
  char state = 0;
  pid_t parent = 0;
  rest >> state >> parent;
  return state == 'Z' ? 0 : parent;
}

// Whether `pid` is `ancestor` or one of its descendants.
bool descends_from(pid_t pid, pid_t ancestor) {
  for (int i = 0; i < 64 && pid > 1; ++i, pid = parent_of(pid)) {
    if (pid == ancestor) return true;
  }
  return false;
}

// The live processes descended from `ancestor` (not itself).
std::vector<pid_t> descendants(pid_t ancestor) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string n = e.path().filename().string();
    if (n.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(n);
    if (pid != ancestor && descends_from(pid, ancestor)) out.push_back(pid);
  }
  return out;
}

// A job started in the background and killed with SIGKILL, mpirun and every rank at once (mpirun
// puts each rank in a process group of its own, so they are found as its descendants): what a
// crashed node does to a job.
class Background {
 public:
  explicit Background(const std::string& command, const fs::path& log) {
    const std::string sh = "exec " + command + " > " + log.string() + " 2>&1";
    const char* argv[] = {"/bin/sh", "-c", sh.c_str(), nullptr};
    spawned_ =
        posix_spawn(&pid_, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) == 0;
  }
  ~Background() { kill(); }
  pid_t pid() const { return pid_; }
  bool spawned() const { return spawned_; }
  bool running() {
    if (!spawned_ || reaped_) return false;
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) reaped_ = true;
    return !reaped_;
  }
  // Kills the job and waits until none of its processes runs (an orphaned rank may stay a zombie
  // under a PID 1 that does not reap: it holds no file, and so no lock, any more).
  void kill() {
    if (!spawned_ || reaped_) return;
    std::vector<pid_t> all = descendants(pid_);
    all.push_back(pid_);
    for (pid_t p : all) ::kill(p, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    reaped_ = true;
    for (pid_t p : all) {
      for (int i = 0; i < 500 && parent_of(p) != 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }

 private:
  pid_t pid_ = -1;
  bool spawned_ = false, reaped_ = false;
};

std::vector<std::string> leftovers(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".tmp-step-", 0) == 0 || n.rfind(".replaced-step-", 0) == 0) out.push_back(n);
  }
  return out;
}

// Waits up to two minutes for `root` to hold at least `n` committed steps while `job` runs.
bool wait_for_steps(Background& job, const fs::path& root, size_t n) {
  for (int i = 0; i < 1200; ++i) {
    if (acc::ckpt::committed_steps(root.string()).size() >= n) return true;
    if (!job.running()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// Job A writes a root (saving every 10 steps, sync or async, on 1 or 2 ranks); job B, started on
// the same root while A runs, is refused before training with A's rank 0 named (host and pid),
// and A goes on committing. A is then killed (SIGKILL, the whole job): every step it committed
// verifies, and job C resumes the root at once, its save removing what A's death left behind.
TEST_F(CkptSafety, ASecondJobOnARootIsRefusedAndTheFirstLosesNothing) {
  const std::string mpi = std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np 2 ";
  const std::string ddp = " --strategy '[{\"name\": \"ddp\"}]'";
  struct Setup {
    std::string name, a, b;
  };
  const std::vector<Setup> setups = {
      {"1 rank async vs 2 ranks", tg(), mpi + tg() + ddp + " --sync-save"},
      {"1 rank sync vs 2 ranks", tg() + " --sync-save", mpi + tg() + ddp},
      {"2 ranks async vs 1 rank", mpi + tg() + ddp, tg() + " --sync-save"},
      {"2 ranks sync vs 1 rank", mpi + tg() + ddp + " --sync-save", tg()},
  };
  int n = 0;
  for (const Setup& s : setups) {
    SCOPED_TRACE(s.name);
    const fs::path root = dir / ("two_jobs_" + std::to_string(n++));
    Background a(s.a + " --steps 100000 --save-every 10 --keep 0 --ckpt-dir " + root.string(),
                 root.string() + ".a.log");
    ASSERT_TRUE(a.spawned());
    ASSERT_TRUE(wait_for_steps(a, root, 2)) << "A committed no 2 steps";
    const auto b = run_command(s.b + " --steps 4 --ckpt-dir " + root.string());
    EXPECT_EQ(b.exit_code, 1) << b.output;
    EXPECT_EQ(b.output.find("| loss"), std::string::npos) << "B trained:\n" << b.output;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        b.output, m, std::regex("is in use by another job: pid ([0-9]+) on host (\\S+),")))
        << b.output;
    EXPECT_TRUE(descends_from(std::stoi(m[1]), a.pid())) << "pid " << m[1] << " is not A's";
    EXPECT_EQ(m[2].str(), host_name());
    // A saves on after B's attempt.
    const size_t after_b = acc::ckpt::committed_steps(root.string()).size();
    EXPECT_TRUE(wait_for_steps(a, root, after_b + 1)) << "A committed nothing after B";
    a.kill();
    const std::vector<std::string> steps = acc::ckpt::committed_steps(root.string());
    ASSERT_GE(steps.size(), 3u);
    for (const std::string& step : steps) {
      const auto v = run_command(std::string(ACC_CKPT_BIN) + " verify " + step);
      EXPECT_EQ(v.exit_code, 0) << v.output;
    }
    // The killed job does not block the next (A's command again: the same global batch), whose
    // save removes the leftovers of A's.
    const int64_t newest = acc::ckpt::read_metadata(steps.back()).step;
    const auto c = run_command(s.a + " --resume auto --steps " + std::to_string(newest + 2) +
                               " --ckpt-dir " + root.string());
    EXPECT_EQ(c.exit_code, 0) << c.output;
    EXPECT_NE(c.output.find("resumed from " + steps.back()), std::string::npos) << c.output;
    EXPECT_TRUE(leftovers(root).empty()) << leftovers(root).front();
    fs::remove_all(root);
  }
}

// A save killed in the middle of its shard leaves its temporary directory; the next job's save
// removes it (its owner is dead: the next job holds the lock) and commits its own step.
TEST_F(CkptSafety, ADeadSavesLeftoverIsRemovedByTheNextSave) {
  const fs::path root = dir / "dead_save";
  const auto killed =
      run_command("ACC_FAULT=kill:rank=0:step=2:point=mid_write ACC_JOB_DIR=" +
                  (dir / "dead_save_job").string() + " " + tg() +
                  " --steps 4 --save-every 2 --sync-save --ckpt-dir " + root.string());
  EXPECT_NE(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("ACC_FAULT 'kill:rank=0:step=2:point=mid_write': kill rank 0 at "
                               "mid_write of the save of step 2"),
            std::string::npos)
      << killed.output;
  ASSERT_EQ(leftovers(root).size(), 1u);
  EXPECT_EQ(leftovers(root)[0].rfind(".tmp-step-00000002-", 0), 0u) << leftovers(root)[0];
  EXPECT_TRUE(acc::ckpt::committed_steps(root.string()).empty());
  const auto next =
      run_command(tg() + " --steps 2 --sync-save --resume auto --ckpt-dir " + root.string());
  EXPECT_EQ(next.exit_code, 0) << next.output;
  EXPECT_TRUE(leftovers(root).empty()) << leftovers(root).front();
  EXPECT_EQ(acc::ckpt::committed_steps(root.string()).size(), 1u);
  fs::remove_all(root);
}

// What stays allowed: resuming from a step inside the job's own --ckpt-dir, and starting over.
TEST_F(CkptSafety, ResumingFromItsOwnRootOrStartingOverIsAllowed) {
  const fs::path root = dir / "own";
  fs::copy(dir / "ck_two", root, fs::copy_options::recursive);
  const auto from_step = run_command(tg() + " --steps 3 --sync-save --ckpt-dir " + root.string() +
                                     " --resume " + (root / "step-00000002").string());
  EXPECT_EQ(from_step.exit_code, 0) << from_step.output;
  EXPECT_NE(from_step.output.find("at step 2"), std::string::npos) << from_step.output;
  const auto over =
      run_command(tg() + " --steps 1 --sync-save --ckpt-start-over --ckpt-dir " + root.string());
  EXPECT_EQ(over.exit_code, 0) << over.output;
  std::vector<std::string> names;
  for (const auto& s : acc::ckpt::committed_steps(root.string())) {
    names.push_back(fs::path(s).filename().string());
  }
  EXPECT_EQ(names, std::vector<std::string>{"step-00000001"});
  EXPECT_EQ(run_command(std::string(ACC_CKPT_BIN) + " verify " + root.string()).exit_code, 0);
  fs::remove_all(root);
}

}  // namespace
