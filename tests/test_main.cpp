// Shared main for single-process test binaries: one thread (ACC_NUM_THREADS, default 1) so tests
// never oversubscribe the machine when CTest runs them side by side.
#include <gtest/gtest.h>

#include "acc/tensor/threading.hpp"
#include "skip_exit.hpp"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  acc::init_threads_from_env();
  return acc::test::exit_code_of(RUN_ALL_TESTS());
}
