// A minimal self-registering unit-test harness (no third-party dependency), so the native
// tests build anywhere the core builds, including under ASan/UBSan.
#pragma once

#include <cstdio>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bagpipe::testing {

struct TestCase {
  const char* name;
  std::function<void()> fn;
};

std::vector<TestCase>& Registry();

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { Registry().push_back({name, std::move(fn)}); }
};

class CheckFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace bagpipe::testing

#define BAGPIPE_CAT2(a, b) a##b
#define BAGPIPE_CAT(a, b) BAGPIPE_CAT2(a, b)

#define TEST_CASE(name)                                                                  \
  static void BAGPIPE_CAT(test_fn_, name)();                                             \
  static ::bagpipe::testing::Registrar BAGPIPE_CAT(test_reg_, name)(#name,               \
                                                                    BAGPIPE_CAT(test_fn_, name)); \
  static void BAGPIPE_CAT(test_fn_, name)()

#define CHECK(cond)                                                                       \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::ostringstream os_;                                                             \
      os_ << __FILE__ << ":" << __LINE__ << ": CHECK(" #cond ") failed";                  \
      throw ::bagpipe::testing::CheckFailure(os_.str());                                  \
    }                                                                                     \
  } while (0)

#define CHECK_EQ(a, b)                                                                    \
  do {                                                                                    \
    auto va_ = (a);                                                                       \
    auto vb_ = (b);                                                                       \
    if (!(va_ == vb_)) {                                                                  \
      std::ostringstream os_;                                                             \
      os_ << __FILE__ << ":" << __LINE__ << ": CHECK_EQ(" #a ", " #b ") failed: " << va_ \
          << " vs " << vb_;                                                               \
      throw ::bagpipe::testing::CheckFailure(os_.str());                                  \
    }                                                                                     \
  } while (0)

// Checks that `stmt` throws an exception of type `ex`.
#define CHECK_THROWS(ex, stmt)                                                            \
  do {                                                                                    \
    bool thrown_ = false;                                                                 \
    try {                                                                                 \
      stmt;                                                                               \
    } catch (const ex&) {                                                                 \
      thrown_ = true;                                                                     \
    }                                                                                     \
    if (!thrown_) {                                                                       \
      std::ostringstream os_;                                                             \
      os_ << __FILE__ << ":" << __LINE__ << ": expected " #ex " from " #stmt;             \
      throw ::bagpipe::testing::CheckFailure(os_.str());                                  \
    }                                                                                     \
  } while (0)
