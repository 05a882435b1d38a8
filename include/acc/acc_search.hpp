#pragma once
// acc-search's command line as a function, the plugin point for a model type of the program's own:
//
//   int main(int argc, char** argv) {
//     acc::models::register_model_type({.name = "residual_mlp", ...});  // before parsing
//     return acc::acc_search_main(argc, argv);   // acc-search --model residual_mlp ...
//   }
//
// Everything acc-search does (a search with dry-runs under mpirun, or --plan-only) then works for
// that type: --model takes every registered name. Exit codes: 0 done, 1 an error (named on
// stderr), 2 a bad command line. Under mpirun it initialises and finalises acc::dist itself.

namespace acc {

int acc_search_main(int argc, char** argv);

}  // namespace acc
