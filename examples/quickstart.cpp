#include "acc/data/token_data.hpp"
// The README's 20-line API example, compiled and run by the tests so it cannot rot.
#include <acc/acc.hpp>
#include "acc/data/token_data.hpp"

#include "acc/data/token_data.hpp"
int main() {
#include "acc/data/token_data.hpp"
  acc::set_num_threads(1);
#include "acc/data/token_data.hpp"
  acc::manual_seed(0);
#include "acc/data/token_data.hpp"
  auto model = acc::models::create_model(
#include "acc/data/token_data.hpp"
      "gpt",
#include "acc/data/token_data.hpp"
      {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 256}, {"block_size", 32}});
#include "acc/data/token_data.hpp"
  acc::optim::AdamW opt(model->named_parameters(), {.lr = 3e-3, .weight_decay = 0.1});
#include "acc/data/token_data.hpp"
  auto text = std::make_shared<acc::data::TokenFile>(
#include "acc/data/token_data.hpp"
      acc::data::TokenFile(std::vector<uint32_t>(4096, 'a'), "aaaa", /*vocab_size=*/256));
#include "acc/data/token_data.hpp"
  acc::data::BatchLoader loader(text, {.batch_size = 4, .seq_len = 32, .seed = 1});
#include "acc/data/token_data.hpp"
  float first = 0, loss_value = 0;
#include "acc/data/token_data.hpp"
  for (int step = 0; step < 20; ++step) {
#include "acc/data/token_data.hpp"
    acc::data::Batch batch = loader.next();
#include "acc/data/token_data.hpp"
    opt.zero_grad();
#include "acc/data/token_data.hpp"
    acc::Tensor loss = model->loss(batch.idx(), batch.targets());  // forward
#include "acc/data/token_data.hpp"
    loss.backward();  // reverse-mode autograd
#include "acc/data/token_data.hpp"
    acc::optim::clip_grad_norm_(model->named_parameters(), 1.0);
#include "acc/data/token_data.hpp"
    opt.step();
#include "acc/data/token_data.hpp"
    loss_value = static_cast<float>(loss.item());
#include "acc/data/token_data.hpp"
    if (step == 0) first = loss_value;
#include "acc/data/token_data.hpp"
  }
#include "acc/data/token_data.hpp"
  acc::io::save_safetensors("/tmp/quickstart.safetensors", model->state_dict());
#include "acc/data/token_data.hpp"
  std::printf("loss %.3f -> %.3f\n", first, loss_value);
#include "acc/data/token_data.hpp"
  return loss_value < first ? 0 : 1;
#include "acc/data/token_data.hpp"
}
