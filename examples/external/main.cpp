// A program outside AutoAcc's tree, linked against the installed package (CMakeLists.txt beside
// it): lets auto_accelerate choose how to train a small GPT, then trains it on random tokens and
// prints each step's loss. tests/package builds it
// against `cmake --install` and checks the losses are finite.
#include <acc/acc.hpp>

#include <cmath>
#include <cstdio>

int main() {
  acc::manual_seed(0);
  const int64_t batch = 4, seq_len = 32, vocab = 256;
  auto model = acc::models::create_model("gpt", {{"n_layer", 2},
                                                 {"n_head", 2},
                                                 {"n_embd", 32},
                                                 {"vocab_size", vocab},
                                                 {"block_size", seq_len}});
  auto optimizer = acc::optim::AdamW::factory({.lr = 3e-3, .weight_decay = 0.1});

  // The search picks the strategy (on one process: activation recomputation and micro-batching;
  // under mpirun also the data-parallel methods) and applies it to the model.
  acc::AccelerateOptions opts;
  opts.global_batch = batch;
  opts.seq_len = seq_len;
  auto trainer = acc::auto_accelerate(model, optimizer, opts);
  std::printf("strategy %s\n", trainer.report.at("chosen_name").get<std::string>().c_str());

  for (int step = 0; step < 5; ++step) {
    acc::data::Batch b{acc::randint(0, vocab, {batch, seq_len}),
                       acc::randint(0, vocab, {batch, seq_len})};
    double loss = trainer.train_step(b);
    std::printf("step %d loss %.6f\n", step, loss);
    if (!std::isfinite(loss)) return 1;
  }
  return 0;
}
