// Module::replace_module: a replaced child is the one forward runs, named_parameters() lists,
// state_dict() saves and hooks and scopes apply to; the undo leaves the model as it was (it then
// trains bitwise like a model never touched); bad names are refused by name.

#include <gtest/gtest.h>

#include "acc/models/models.hpp"
#include "acc/nn/nn.hpp"
#include "acc/optim/adam.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

using test::error_of;

models::GPTConfig tiny_gpt() {
  models::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  c.vocab_size = 32;
  c.block_size = 16;
  return c;
}

// Forwards to the module it wraps, registered as its child "inner"; notes each call and the scope
// it ran in.
struct Forwarding : nn::Module {
  explicit Forwarding(nn::ModulePtr m) : nn::Module("Forwarding") {
    inner = register_module("inner", std::move(m));
  }
  Tensor forward(const Tensor& x) override {
    scopes.push_back(current_scope());
    return inner(x);
  }
  nn::Child<nn::Module> inner;
  std::vector<std::string> scopes;
};

struct Identity : nn::Module {
  Identity() : nn::Module("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
};

std::vector<std::string> names(const nn::NamedTensors& v) {
  std::vector<std::string> out;
  for (const auto& [n, t] : v) out.push_back(n);
  return out;
}

std::vector<std::string> module_names(const nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& [path, mod] : m.named_modules()) {
    out.push_back(path + "=" + mod->qualified_name() + ":" + mod->type_name());
  }
  return out;
}

Tensor tokens(int64_t B, int64_t T, uint64_t seed) {
  Generator gen(seed);
  return randint(0, 32, {B, T}, gen);
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(ReplaceModule, ReplacedChildIsWhatForwardRunsListsSavesAndScopes) {
  manual_seed(3);
  auto model = std::make_shared<models::GPT>(tiny_gpt());
  const Tensor idx = tokens(2, 8, 1);
  const std::vector<float> before = model->forward(idx).to_vector<float>();
  const std::string path = "transformer.h.0.attn.c_attn";
  nn::ModulePtr original = model->submodule(path);

  auto wrapper = std::make_shared<Forwarding>(original);
  int hook_calls = 0;
  wrapper->register_forward_hook([&](nn::Module& m, const Tensor&, const Tensor&) {
    hook_calls += m.type_name() == "Forwarding";
  });
  std::vector<std::string> old_hook_scopes;
  const int old_hook = original->register_forward_pre_hook(
      [&](nn::Module&, const Tensor&) { old_hook_scopes.push_back(nn::Module::current_scope()); });
  nn::Undo undo = model->replace_module(path, wrapper);

  // The registry, the names and the scopes are the wrapper's; the original sits inside it.
  EXPECT_EQ(model->submodule(path).get(), wrapper.get());
  EXPECT_EQ(wrapper->qualified_name(), path);
  EXPECT_EQ(original->qualified_name(), path + ".inner");
  const auto params = names(model->named_parameters());
  EXPECT_TRUE(contains(params, path + ".inner.weight"));
  EXPECT_FALSE(contains(params, path + ".weight"));
  EXPECT_TRUE(contains(names(model->state_dict()), path + ".inner.bias"));
  EXPECT_EQ(params.size(), std::make_shared<models::GPT>(tiny_gpt())->named_parameters().size());

  // Forward runs it (through the attention's Child), with its hooks and its scope; the computation
  // is the original's, so the logits are the same.
  EXPECT_EQ(model->forward(idx).to_vector<float>(), before);
  EXPECT_EQ(wrapper->scopes, std::vector<std::string>{path});
  EXPECT_EQ(hook_calls, 1);
  EXPECT_EQ(old_hook_scopes, std::vector<std::string>{path + ".inner"})
      << "the wrapped original is called through the wrapper, under its path there";

  // A replacement that computes something else changes the output: forward runs the slot's module.
  nn::Undo undo_proj =
      model->replace_module("transformer.h.1.attn.c_proj", std::make_shared<Identity>());
  EXPECT_NE(model->forward(idx).to_vector<float>(), before);
  undo_proj();
  EXPECT_EQ(model->forward(idx).to_vector<float>(), before);

  hook_calls = 0;
  old_hook_scopes.clear();
  undo();
  EXPECT_EQ(model->submodule(path).get(), original.get());
  EXPECT_EQ(original->qualified_name(), path);
  EXPECT_EQ(wrapper->qualified_name(), "") << "the replacement no longer sits in the model";
  EXPECT_TRUE(contains(names(model->named_parameters()), path + ".weight"));
  wrapper->scopes.clear();
  EXPECT_EQ(model->forward(idx).to_vector<float>(), before);
  EXPECT_TRUE(wrapper->scopes.empty());
  EXPECT_EQ(hook_calls, 0);
  EXPECT_EQ(old_hook_scopes, std::vector<std::string>{path});
  original->remove_hook(old_hook);
}

TEST(ReplaceModule, UndoneModelTrainsBitwiseLikeAnUntouchedOne) {
  auto train = [](models::GPT& model) {
    optim::AdamW opt(model.named_parameters(),
                     {.lr = 1e-2, .betas = {0.9, 0.95}, .eps = 1e-8, .weight_decay = 0.1});
    std::vector<double> losses;
    for (int step = 0; step < 5; ++step) {
      const Tensor idx = tokens(2, 12, 100 + step);
      opt.zero_grad();
      Tensor loss = model.loss(idx, idx);
      losses.push_back(loss.item());
      loss.backward();
      opt.step();
    }
    return losses;
  };
  manual_seed(7);
  auto untouched = std::make_shared<models::GPT>(tiny_gpt());
  manual_seed(7);
  auto touched = std::make_shared<models::GPT>(tiny_gpt());
  const auto tree = module_names(*touched);

  std::vector<nn::Undo> undos;
  for (const char* path : {"transformer.h.0.attn.c_attn", "transformer.h.1", "transformer.ln_f"}) {
    undos.push_back(
        touched->replace_module(path, std::make_shared<Forwarding>(touched->submodule(path))));
  }
  // A step while replaced: gradients reach the wrapped parameters.
  touched->loss(tokens(2, 12, 5), tokens(2, 12, 6)).backward();
  EXPECT_TRUE(touched->find_tensor("transformer.h.0.attn.c_attn.inner.weight").grad().defined());
  for (auto it = undos.rbegin(); it != undos.rend(); ++it) (*it)();
  touched->zero_grad();

  EXPECT_EQ(module_names(*touched), tree);
  EXPECT_EQ(names(touched->state_dict()), names(untouched->state_dict()));
  EXPECT_EQ(train(*touched), train(*untouched));
  const auto a = untouched->named_parameters(), b = touched->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << a[i].first;
  }
}

TEST(ReplaceModule, BlocksAndTypedAccessSeeTheSlot) {
  auto model = std::make_shared<models::GPT>(tiny_gpt());
  auto block = std::make_shared<Forwarding>(model->submodule("transformer.h.1"));
  nn::Undo undo = model->replace_module("transformer.h.1", block);
  EXPECT_EQ(model->blocks()[1].get(), block.get());
  std::vector<std::string> types;
  for (const auto& b : model->blocks()) types.push_back(b->type_name());
  EXPECT_EQ(types, (std::vector<std::string>{"GPTBlock", "Forwarding"}));
  model->forward(tokens(1, 4, 2));
  EXPECT_EQ(block->scopes, std::vector<std::string>{"transformer.h.1"});
  undo();

  // A parent's typed accessor refuses a replacement of another type, by name.
  auto& gpt_block = static_cast<nn::GPTBlock&>(*model->blocks()[0]);
  nn::Undo undo_attn =
      model->replace_module("transformer.h.0.attn",
                            std::make_shared<Forwarding>(model->submodule("transformer.h.0.attn")));
  const std::string msg = error_of<TypeError>([&] { gpt_block.attn(); });
  EXPECT_NE(msg.find("module 'transformer.h.0.attn' is a Forwarding"), std::string::npos) << msg;
  EXPECT_NE(msg.find("CausalSelfAttention"), std::string::npos) << msg;
  // set_fused_attention still finds the attention inside the wrapper.
  model->set_fused_attention(false);
  model->forward(tokens(1, 4, 2));
  undo_attn();
  EXPECT_NO_THROW(gpt_block.attn());
}

template <class P>
concept Replaceable = requires(nn::Module& m, P p) {
  m.replace_module("x", p);
};

TEST(ReplaceModule, RefusesBadNamesAndReplacements) {
  auto model = std::make_shared<models::GPT>(tiny_gpt());
  auto id = std::make_shared<Identity>();
  struct Row {
    std::string path;
    nn::ModulePtr replacement;
    std::string expect;
  };
  const std::vector<Row> rows = {
      {"", id,
       "GPT: replace_module: the name is empty, which names this module itself; a root has "
       "no parent slot to be replaced in"},
      {"transformer.h.0.attn.c_atn", id,
       "GPT: replace_module('transformer.h.0.attn.c_atn'): no child 'c_atn' in "
       "'transformer.h.0.attn' (children: c_attn, c_proj)"},
      {"decoder", id, "no child 'decoder' in the root (children: transformer)"},
      {"transformer.h.7.attn", id, "no child '7' in 'transformer.h' (children: 0, 1)"},
      {"transformer.wte.weight", id, "no child 'weight' in 'transformer.wte' (it has no children)"},
      {"transformer..h", id, "replace_module('transformer..h'): the name has an empty component"},
      {"transformer.h.", id, "the name has an empty component"},
      {"transformer.h.0", nullptr, "replace_module('transformer.h.0'): the replacement is null"},
      {"transformer.h.0", model,
       "the replacement GPT is or contains GPT '', which is on the path to the slot; the tree "
       "would contain itself"},
      {"transformer.h.0.attn", model->submodule("transformer.h"),
       "the replacement ModuleList is or contains ModuleList 'transformer.h'"},
      {"transformer.h.0.attn", std::make_shared<Forwarding>(model->submodule("transformer.h.0")),
       "the replacement Forwarding is or contains GPTBlock 'transformer.h.0'"},
  };
  const auto tree = module_names(*model);
  for (const auto& row : rows) {
    const std::string msg =
        error_of<ValueError>([&] { model->replace_module(row.path, row.replacement); });
    EXPECT_NE(msg.find(row.expect), std::string::npos) << "'" << row.path << "': " << msg;
    EXPECT_EQ(module_names(*model), tree) << "a refused replacement changed the model";
  }
  // A replacement that is not an nn::Module does not compile.
  static_assert(!Replaceable<std::shared_ptr<int>>);
  static_assert(!Replaceable<std::shared_ptr<std::string>>);
  static_assert(Replaceable<std::shared_ptr<Identity>>);
}

TEST(ReplaceModule, UndoIsOnceInOrderAndSafeAfterTheModel) {
  auto model = std::make_shared<models::GPT>(tiny_gpt());
  const auto tree = module_names(*model);
  const std::string path = "transformer.h.0.mlp";
  nn::Undo first = model->replace_module(path, std::make_shared<Identity>());
  nn::Undo second = model->replace_module(path, std::make_shared<Identity>());
  const std::string msg = error_of<ValueError>([&] { first(); });
  EXPECT_NE(msg.find("replace_module undo: 'transformer.h.0.mlp' holds Identity, not the Identity "
                     "this replacement put there; undo the later replacement first"),
            std::string::npos)
      << msg;
  second();
  second();  // once: the second call does nothing
  first();
  first();
  EXPECT_EQ(module_names(*model), tree);

  // Dropping an undo keeps the replacement; an undo that outlives the model does nothing.
  { nn::Undo dropped = model->replace_module(path, std::make_shared<Identity>()); }
  EXPECT_EQ(model->submodule(path)->type_name(), "Identity");
  nn::Undo late = model->replace_module("transformer.h.1.mlp", std::make_shared<Identity>());
  model.reset();
  EXPECT_NO_THROW(late());
}

// A user's module that keeps Child handles sees replacements; the TwoLayer idiom of keeping a
// shared_ptr still compiles (it keeps calling what it registered).
TEST(ReplaceModule, ChildHandlesOfAUserModule) {
  struct Net : nn::Module {
    Net() : nn::Module("Net") {
      fc = register_module("fc", std::make_shared<nn::Linear>(4, 4));
      kept = register_module("kept", std::make_shared<nn::Linear>(4, 4));
    }
    Tensor forward(const Tensor& x) override { return fc(x); }
    nn::Child<nn::Linear> fc;
    std::shared_ptr<nn::Linear> kept;
  };
  auto net = std::make_shared<Net>();
  const Tensor x = ones({2, 4});
  nn::Undo undo = net->replace_module("fc", std::make_shared<Identity>());
  EXPECT_EQ((*net)(x).to_vector<float>(), x.to_vector<float>());
  EXPECT_THROW(net->fc->weight(), TypeError);
  undo();
  EXPECT_EQ((*net)(x).to_vector<float>(), net->fc->forward(x).to_vector<float>());
  EXPECT_EQ(net->kept.get(), net->submodule("kept").get());
}

}  // namespace
}  // namespace acc
