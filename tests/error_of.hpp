#pragma once
// The message of the exception a call throws, for tests that check what an error says.

#include <string>

namespace acc::test {

/// The what() of the Exc that f() throws, or "(no error)" when it returns (another exception
/// type propagates and fails the test).
template <class Exc, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Exc& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace acc::test
