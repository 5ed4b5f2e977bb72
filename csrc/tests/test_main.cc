#include <cstdio>
#include <cstring>
#include <exception>

#include "tests/test_harness.h"

namespace bagpipe::testing {
std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}
}  // namespace bagpipe::testing

// Usage: bagpipe_native_tests [substring]   (runs the tests whose name contains it)
int main(int argc, char** argv) {
  const char* filter = argc > 1 ? argv[1] : nullptr;
  // Line-buffered even into a CI log, so a test that hangs is named by the last line.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int run = 0, failed = 0;
  for (const auto& t : bagpipe::testing::Registry()) {
    if (filter && std::strstr(t.name, filter) == nullptr) continue;
    ++run;
    try {
      t.fn();
      std::printf("[ ok ] %s\n", t.name);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("[FAIL] %s: %s\n", t.name, e.what());
    }
  }
  std::printf("%d tests, %d failed\n", run, failed);
  return failed == 0 ? 0 : 1;
}
