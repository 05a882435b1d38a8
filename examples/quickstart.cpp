// The README's API example, compiled and run by the tests so it cannot rot: a model of your own,
// your own loss, and auto_accelerate choosing how to train it (here on one process; under mpirun
// examples/custom_model.cpp is the same at any rank count).
#include <acc/acc.hpp>

struct Net : acc::nn::Module {
  Net() : Module("Net") {
    fc1 = register_module("fc1", std::make_shared<acc::nn::Linear>(16, 64));
    fc2 = register_module("fc2", std::make_shared<acc::nn::Linear>(64, 4));
  }
  acc::Tensor forward(const acc::Tensor& x) override { return fc2(acc::relu(fc1(x))); }
  acc::nn::Child<acc::nn::Linear> fc1, fc2;
};

// A batch of n samples: 16 features, and as label which of the first 4 is largest.
acc::data::Batch batch_of(int64_t n, acc::Generator& gen) {
  acc::Tensor x = acc::randn({n, 16}, gen);
  std::vector<int64_t> label(static_cast<size_t>(n));
  const auto v = x.to_vector<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = &v[static_cast<size_t>(i * 16)];
    label[static_cast<size_t>(i)] = std::max_element(row, row + 4) - row;
  }
  return acc::data::Batch({{"x", x}, {"label", acc::from_vector(label, {n})}});
}

int main() {
  acc::set_num_threads(1);  // one policy: sizes OpenBLAS and TBB together
  acc::manual_seed(0);
  auto model = std::make_shared<Net>();
  acc::Generator data(1);
  acc::AccelerateOptions opts;
  opts.global_batch = 32;
  opts.sample_batch = batch_of(32, data);  // what the search traces and dry-runs
  opts.loss = [](acc::nn::Module& m, const acc::data::Batch& b) {
    return acc::cross_entropy(m(b["x"]), b["label"]);  // your loss: a mean over the batch
  };
  auto acc = acc::auto_accelerate(model, acc::optim::AdamW::factory({.lr = 1e-2}), opts);
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    last = acc.train_step(batch_of(32, data));  // forward, backward, update
    if (step == 0) first = last;
  }
  acc::io::save_safetensors("/tmp/quickstart.safetensors", model->state_dict());
  std::printf("%s: loss %.3f -> %.3f\n", acc.report["chosen_name"].get<std::string>().c_str(),
              first, last);
  return last < first ? 0 : 1;
}
