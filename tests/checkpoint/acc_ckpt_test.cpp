// acc-ckpt end to end on a checkpoint train_gpt writes: inspect, verify (a flipped bit is a
// fault, exit 1), export-safetensors (the weights, whole, which train_gpt --init-from takes),
// import-safetensors (a checkpoint train_gpt --resume takes), and bad command lines (exit 2).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/io/safetensors.hpp"
#include "command.hpp"
#include "flip_bit.hpp"

namespace {

namespace fs = std::filesystem;
using acc::test::run_command;

std::string ckpt(const std::string& args) {
  return std::string(ACC_CKPT_BIN) + " " + args;
}

TEST(AccCkpt, InspectsVerifiesExportsAndImports) {
  const fs::path dir = fs::path(testing::TempDir()) / ("acc_ckpt_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  const std::string tg = std::string(TRAIN_GPT_BIN) + " --model gpt --data " + data +
                         " --data-format u16 --seq-len 16 --batch-size 2 --threads 1";
  const std::string ck = (dir / "ck").string();
  ASSERT_EQ(run_command(tg + " --steps 2 --ckpt-dir " + ck).exit_code, 0);

  const auto inspect = run_command(ckpt("inspect " + ck));
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("step 2, written by 1 rank(s)"), std::string::npos)
      << inspect.output;
  EXPECT_NE(inspect.output.find("transformer.wte.weight"), std::string::npos);
  EXPECT_NE(inspect.output.find("state.transformer.wte.weight.exp_avg"), std::string::npos);

  const auto ok = run_command(ckpt("verify " + ck));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find(": ok, "), std::string::npos) << ok.output;

  // Export: every parameter whole, equal to what the checkpoint holds; train_gpt starts from it.
  const std::string st = (dir / "w.safetensors").string();
  const auto exported = run_command(ckpt("export-safetensors " + ck + " " + st));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const acc::io::SafetensorsFile w = acc::io::load_safetensors(st);
  const auto meta = acc::ckpt::read_metadata(*acc::ckpt::resolve(ck));
  size_t params = 0;
  for (const auto& t : meta.tensors) params += t.kind == acc::dist::TensorKind::kParameter;
  EXPECT_EQ(w.tensors.size(), params);
  EXPECT_EQ(w.metadata.at("model_type"), "gpt");
  EXPECT_EQ(run_command(tg + " --steps 1 --init-from " + st).exit_code, 0);

  // Import: a checkpoint of those weights that train_gpt resumes (its data from the start).
  const std::string imported = (dir / "imported").string();
  const std::string config = (dir / "config.json").string();
  std::ofstream(config) << acc::io::load_safetensors(st).metadata.at("config");
  const auto imp = run_command(ckpt("import-safetensors " + st + " " + imported +
                                    " --model gpt --config " + config + " --step 2"));
  ASSERT_EQ(imp.exit_code, 0) << imp.output;
  EXPECT_EQ(run_command(ckpt("verify " + imported)).exit_code, 0);
  const auto resumed = run_command(tg + " --steps 3 --config " + config + " --resume " + imported);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("no data position"), std::string::npos) << resumed.output;

  // One flipped bit: verify names the file and tensor, exit 1.
  acc::test::flip_bit(fs::path(*acc::ckpt::resolve(ck)) / "shard-00000.bin", 64, 0x01);
  const auto bad = run_command(ckpt("verify " + ck));
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("checksum mismatch"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("1 of "), std::string::npos) << bad.output;

  // Bad command lines and a directory without a checkpoint.
  EXPECT_EQ(run_command(ckpt("")).exit_code, 2);
  EXPECT_EQ(run_command(ckpt("verify")).exit_code, 2);
  EXPECT_EQ(run_command(ckpt("import-safetensors " + st + " " + imported +
                             " --model bert --config " + config))
                .exit_code,
            2);
  const auto none = run_command(ckpt("inspect " + dir.string()));
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.output.find("holds no committed checkpoint"), std::string::npos) << none.output;
  fs::remove_all(dir);
}

}  // namespace
