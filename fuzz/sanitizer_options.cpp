// Linked into every fuzz target: UBSan's defaults, so a run by hand stops on undefined behaviour as
// scripts/test's does (UBSan recovers by default and libFuzzer would go on). Suppressions for
// findings known and not yet fixed: fuzz/ubsan.supp.
extern "C" const char* __ubsan_default_options() {
  return "halt_on_error=1:print_stacktrace=1:suppressions=" ACC_FUZZ_DIR "/ubsan.supp";
}
