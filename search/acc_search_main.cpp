// acc-search: the strategy search offline (src/accelerate/acc_search_cli.cpp). A program with a
// model type of its own registers it (acc/models/registry.hpp) and calls acc::acc_search_main
// itself: examples/custom_model.cpp's `search` subcommand.
#include "acc/acc_search.hpp"

int main(int argc, char** argv) {
  return acc::acc_search_main(argc, argv);
}
