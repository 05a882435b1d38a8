// The root's lock (root_lock.hpp) and the checkpoint layout's path checks (layout.hpp), in one
// process and with a forked holder: another open file description of the lock file is another
// job, the owner is named from the file, and the lock dies with its holder.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>

#include "acc/checkpoint/layout.hpp"
#include "acc/checkpoint/root_lock.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc::ckpt {
namespace {

namespace fs = std::filesystem;

fs::path fresh(const std::string& name) {
  const fs::path d =
      fs::path(testing::TempDir()) / ("acc_root_lock_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

TEST(RootLock, TheHolderIsWrittenIntoTheLockFileAndClearedOnRelease) {
  const fs::path root = fresh("owner") / "ck";  // created by acquire
  {
    const RootLock lock = RootLock::acquire(root.string());
    EXPECT_TRUE(RootLock::held_here(root.string()));
    const std::optional<LockOwner> o = RootLock::last_owner(root.string());
    ASSERT_TRUE(o.has_value());
    EXPECT_EQ(o->pid, ::getpid());
    EXPECT_EQ(o->host, host_name());
    EXPECT_TRUE(
        std::regex_match(o->started, std::regex("\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\dZ")))
        << o->started;
    EXPECT_NE(o->command.find("checkpoint_test"), std::string::npos) << o->command;
    EXPECT_EQ(o->describe().rfind("pid " + std::to_string(::getpid()) + " on host " + host_name() +
                                      ", since " + o->started + " (",
                                  0),
              0u)
        << o->describe();
    // Held by this process: a save takes no second lock (it would conflict with this one).
    EXPECT_FALSE(lock_for_write(root.string()).has_value());
    const std::string twice = test::error_of<IoError>([&] { RootLock::acquire(root.string()); });
    EXPECT_NE(twice.find("is already locked by this process"), std::string::npos) << twice;
  }
  EXPECT_FALSE(RootLock::held_here(root.string()));
  EXPECT_FALSE(RootLock::last_owner(root.string()).has_value());  // the entry is cleared
  EXPECT_TRUE(lock_for_write(root.string()).has_value());         // and the lock free again
  fs::remove_all(root.parent_path());
}

// Another open file description of ROOT/.lock holding the lock is another job, even in this
// process: refused, naming what its entry says.
TEST(RootLock, AnotherHolderIsRefusedByName) {
  const fs::path root = fresh("other");
  const int fd = ::open((root / ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  ASSERT_EQ(::fcntl(fd, F_OFD_SETLK, &fl), 0);
  const std::string entry =
      R"({"host": "node9", "pid": 4242, "started": "2025-01-31T12:00:00Z", "command": "job B"})";
  ASSERT_EQ(::write(fd, entry.data(), entry.size()), static_cast<ssize_t>(entry.size()));
  const std::string msg = test::error_of<IoError>([&] { RootLock::acquire(root.string()); });
  EXPECT_NE(msg.find("checkpoint root '" + root.string() +
                     "' is in use by another job: pid 4242 "
                     "on host node9, since 2025-01-31T12:00:00Z (job B) holds its lock"),
            std::string::npos)
      << msg;
  EXPECT_FALSE(RootLock::held_here(root.string()));
  const std::string save = test::error_of<IoError>([&] { lock_for_write(root.string()); });
  EXPECT_NE(save.find("pid 4242 on host node9"), std::string::npos) << save;
  ::close(fd);  // the other job ends
  EXPECT_TRUE(lock_for_write(root.string()).has_value());
  fs::remove_all(root);
}

// A holder killed with SIGKILL leaves no lock behind: the kernel drops it with the process.
TEST(RootLock, TheLockDiesWithItsHolder) {
  const fs::path root = fresh("dies");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    try {
      const RootLock lock = RootLock::acquire(root.string());
      const char ok = 1;
      (void)::write(ready[1], &ok, 1);
      ::pause();
    } catch (...) {
    }
    ::_exit(1);
  }
  ::close(ready[1]);
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  ::close(ready[0]);
  const std::string msg = test::error_of<IoError>([&] { RootLock::acquire(root.string()); });
  EXPECT_NE(msg.find("pid " + std::to_string(child) + " on host " + host_name()), std::string::npos)
      << msg;
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const RootLock mine = RootLock::acquire(root.string());
  EXPECT_EQ(RootLock::last_owner(root.string())->pid, ::getpid());
  fs::remove_all(root);
}

// A .lock planted as a symlink is not followed: the owner's entry would be written over its
// target.
TEST(RootLock, ALockFileThatIsASymlinkIsRefused) {
  const fs::path root = fresh("symlink");
  std::ofstream(root / "precious") << "keep me";
  fs::create_symlink(root / "precious", root / ".lock");
  const std::string msg = test::error_of<IoError>([&] { RootLock::acquire(root.string()); });
  EXPECT_NE(msg.find("cannot open its lock file"), std::string::npos) << msg;
  std::ifstream in(root / "precious");
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "keep me");
  fs::remove_all(root);
}

TEST(Layout, RemovingStepsNeedsTheLock) {
  const fs::path root = fresh("remove");
  fs::create_directories(root / "step-00000002");
  std::ofstream(root / "step-00000002" / "metadata.json") << "{}";
  std::ofstream(root / "latest") << "step-00000002\n";
  const std::string msg =
      test::error_of<ValueError>([&] { remove_committed_steps(root.string()); });
  EXPECT_NE(msg.find("needs its lock"), std::string::npos) << msg;
  EXPECT_TRUE(fs::exists(root / "step-00000002"));
  const RootLock lock = RootLock::acquire(root.string());
  EXPECT_EQ(remove_committed_steps(root.string()), std::vector<std::string>{"step-00000002"});
  EXPECT_FALSE(fs::exists(root / "step-00000002"));
  EXPECT_FALSE(fs::exists(root / "latest"));
  EXPECT_TRUE(fs::exists(root / ".lock"));  // never removed
  fs::remove_all(root);
}

TEST(Layout, OutputsInsideACheckpointAreFound) {
  const fs::path d = fresh("inside");
  fs::create_directories(d / "ck" / "step-00000002");
  std::ofstream(d / "ck" / "step-00000002" / "metadata.json") << "{}";
  fs::create_directories(d / "other");
  std::ofstream(d / "other" / "metadata.json") << "{}";  // another tool's file of that name
  EXPECT_EQ(enclosing_checkpoint((d / "ck" / "step-00000002" / "x.bin").string()),
            (d / "ck" / "step-00000002").string());
  EXPECT_EQ(enclosing_checkpoint((d / "ck" / "w.safetensors").string()), (d / "ck").string());
  EXPECT_EQ(enclosing_checkpoint((d / "w.safetensors").string()), std::nullopt);
  EXPECT_EQ(enclosing_checkpoint((d / "other" / "w.safetensors").string()), std::nullopt);
  fs::create_directory_symlink(d / "ck", d / "link");  // through a symlink: the same checkpoint
  EXPECT_EQ(enclosing_checkpoint((d / "link" / "w.safetensors").string()), (d / "ck").string());
  EXPECT_TRUE(path_within((d / "link" / "step-00000002").string(), (d / "ck").string()));
  EXPECT_FALSE(path_within((d / "ck2").string(), (d / "ck").string()));
  const std::string msg = test::error_of<IoError>(
      [&] { check_outside_checkpoints((d / "ck" / "w.st").string(), "OUT"); });
  EXPECT_NE(msg.find("OUT '" + (d / "ck" / "w.st").string() + "' lies inside the checkpoint '" +
                     (d / "ck").string() + "'"),
            std::string::npos)
      << msg;
  fs::remove_all(d);
}

}  // namespace
}  // namespace acc::ckpt
