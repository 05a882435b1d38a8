// main() for test binaries run under mpirun: every rank runs every test; only rank 0 prints the
// usual report (other ranks print their failures), and the failure count is all-reduced so that a
// failure on any rank fails every rank's exit code. A run in which every test skipped on every rank
// exits with acc::test::kAllSkippedExitCode (CTest: Skipped).
#include <gtest/gtest.h>

#include <cstdio>

#include "../skip_exit.hpp"
#include "acc/dist/dist.hpp"

namespace {

// Prints only failed assertions (for ranks other than 0).
class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  acc::dist::init(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  const int rank = acc::dist::rank();
  if (rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  const int code = acc::test::exit_code_of(RUN_ALL_TESTS());
  const int failed = code != 0 && code != acc::test::kAllSkippedExitCode ? 1 : 0;
  const int ran = code == 0 ? 1 : 0;  // some test passed here
  int total = failed, ran_somewhere = 1;
  try {
    acc::Tensor t = acc::from_vector(std::vector<int32_t>{failed, ran}, {2});
    acc::dist::ProcessGroup::world()
        ->allreduce(t, acc::dist::ReduceOp::kSum)
        ->wait(std::chrono::seconds(120));
    const auto counts = t.to_vector<int32_t>();
    total = counts[0];
    ran_somewhere = counts[1];
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] failure count not reduced: %s\n", rank, e.what());
    total = 1;
  }
  if (rank == 0 && total > 0) std::fprintf(stderr, "%d rank(s) failed\n", total);
  acc::dist::finalize();
  if (total > 0) return 1;
  return ran_somewhere > 0 ? 0 : acc::test::kAllSkippedExitCode;
}
