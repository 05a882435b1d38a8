// Tracing GPT-3 175B on the meta device: a separate binary so that its max RSS is its own.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include "acc/models/models.hpp"
#include "acc/trace/passes.hpp"

namespace acc {
namespace {

TEST(Gpt3, TracesWithoutMemoryAndCountsParameters) {
  DefaultDeviceGuard meta(Device::kMeta);
  auto model = models::create_model(
      "gpt",
      models::read_json_file(std::string(ACC_SOURCE_DIR) + "/examples/configs/gpt3_175b.json"));
  Tensor idx = empty({1, 2048}, {DType::kInt64, Device::kMeta});
  trace::Trace t = trace::trace(*model, {idx, idx});
  // GPT-3 175B: 174.6B parameters (Brown et al. 2020); within 0.5%.
  EXPECT_NEAR(static_cast<double>(t.num_parameters), 174.6e9, 0.005 * 174.6e9);
  auto blocks = trace::find_blocks(*model);
  ASSERT_FALSE(blocks.empty());
  EXPECT_EQ(blocks[0].blocks.size(), 96u);
  // 6 N tokens dominates; attention adds 2 * 3 * 96 layers * T^2 * C / 2 per sequence.
  const double six_n_t = 6.0 * static_cast<double>(t.num_parameters) * 2048;
  EXPECT_GT(static_cast<double>(trace::estimate_compute(t).total()), 0.95 * six_n_t);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  EXPECT_LT(ru.ru_maxrss * 1024.0, 1024.0 * 1024 * 1024) << "max RSS " << ru.ru_maxrss << " KiB";
}

}  // namespace
}  // namespace acc
