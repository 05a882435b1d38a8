// main() for test binaries run under mpirun: every rank runs every test; only rank 0 prints the
// usual report (other ranks print their failures), and the failure count is all-reduced so that a
// failure on any rank fails every rank's exit code.
#include <gtest/gtest.h>

#include <cstdio>

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
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int total = failed;
  try {
    acc::Tensor t = acc::from_vector(std::vector<int32_t>{failed}, {1});
    acc::dist::ProcessGroup::world()
        ->allreduce(t, acc::dist::ReduceOp::kSum)
        ->wait(std::chrono::seconds(120));
    total = static_cast<int>(t.item());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] failure count not reduced: %s\n", rank, e.what());
    total = 1;
  }
  if (rank == 0 && total > 0) std::fprintf(stderr, "%d rank(s) failed\n", total);
  acc::dist::finalize();
  return total > 0 ? 1 : 0;
}
