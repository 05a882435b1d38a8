// The README's 20-line API example, compiled and run by the tests so it cannot rot.
#include <acc/acc.hpp>

int main() {
  acc::set_num_threads(1);
  acc::manual_seed(0);
  auto model = acc::models::create_model(
      "gpt",
      {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 256}, {"block_size", 32}});
  acc::optim::AdamW opt(model->named_parameters(), {.lr = 3e-3, .weight_decay = 0.1});
  auto text = std::make_shared<acc::data::TokenFile>(
      acc::data::TokenFile(std::vector<uint32_t>(4096, 'a'), "aaaa", /*vocab_size=*/256));
  acc::data::BatchLoader loader(text, {.batch_size = 4, .seq_len = 32, .seed = 1});
  float first = 0, loss_value = 0;
  for (int step = 0; step < 20; ++step) {
    acc::data::Batch batch = loader.next();
    opt.zero_grad();
    acc::Tensor loss = model->loss(batch.idx, batch.targets);  // forward
    loss.backward();                                           // reverse-mode autograd
    acc::optim::clip_grad_norm_(model->named_parameters(), 1.0);
    opt.step();
    loss_value = static_cast<float>(loss.item());
    if (step == 0) first = loss_value;
  }
  acc::io::save_safetensors("/tmp/quickstart.safetensors", model->state_dict());
  std::printf("loss %.3f -> %.3f\n", first, loss_value);
  return loss_value < first ? 0 : 1;
}
