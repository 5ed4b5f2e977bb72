#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/errors.h"
#include "store/checksum.h"
#include "store/splitmix64.h"
#include "store/init.h"
#include "tests/test_harness.h"

using namespace bagpipe::store;

TEST_CASE(store_init_uniform_is_deterministic_and_in_range) {
  InitSpec spec;
  spec.bound = 0.25f;
  spec.seed = 9;
  std::vector<float> a(64), b(64);
  double sum = 0;
  int n = 0;
  for (int64_t key = -500; key < 500; ++key) {
    InitRow(spec, 64, key, KeyHash(key), a.data());
    InitRow(spec, 64, key, KeyHash(key), b.data());
    CHECK(std::memcmp(a.data(), b.data(), 64 * sizeof(float)) == 0);
    for (float v : a) {
      CHECK(v >= -0.25f && v < 0.25f);
      sum += v;
      ++n;
    }
  }
  CHECK(std::fabs(sum / n) < 0.005);
  // Another seed gives other values; a prefix of the columns does not depend on dim.
  InitSpec other = spec;
  other.seed = 10;
  std::vector<float> c(64), d(8);
  InitRow(other, 64, 7, KeyHash(7), c.data());
  InitRow(spec, 64, 7, KeyHash(7), a.data());
  CHECK(std::memcmp(a.data(), c.data(), 64 * sizeof(float)) != 0);
  InitRow(spec, 8, 7, KeyHash(7), d.data());
  CHECK(std::memcmp(a.data(), d.data(), 8 * sizeof(float)) == 0);
}

TEST_CASE(store_init_kinds_and_ranges) {
  InitSpec zeros;
  zeros.kind = InitKind::kZeros;
  InitSpec constant;
  constant.kind = InitKind::kConstant;
  constant.value = -2.5f;
  float row[5];
  InitRow(zeros, 5, 3, KeyHash(3), row);
  for (float v : row) CHECK_EQ(v, 0.0f);
  InitRow(constant, 5, 3, KeyHash(3), row);
  for (float v : row) CHECK_EQ(v, -2.5f);

  InitSpec ranged;
  ranged.bound_starts = {0, 100, 1000};
  ranged.bound_values = {1.0f, 0.5f, 0.01f};
  CHECK_EQ(InitBound(ranged, -5), 1.0f);  // below every start: the first range
  CHECK_EQ(InitBound(ranged, 0), 1.0f);
  CHECK_EQ(InitBound(ranged, 99), 1.0f);
  CHECK_EQ(InitBound(ranged, 100), 0.5f);
  CHECK_EQ(InitBound(ranged, 999), 0.5f);
  CHECK_EQ(InitBound(ranged, 1000), 0.01f);
  CHECK_EQ(InitBound(ranged, INT64_MAX), 0.01f);
  for (int64_t key = 1000; key < 1100; ++key) {
    InitRow(ranged, 5, key, KeyHash(key), row);
    for (float v : row) CHECK(v >= -0.01f && v < 0.01f);
  }
}

TEST_CASE(store_init_validation_names_the_field) {
  InitSpec s;
  s.bound = -1.0f;
  CHECK_THROWS(bagpipe::ValueError, ValidateInitSpec(s));
  s.bound = NAN;
  CHECK_THROWS(bagpipe::ValueError, ValidateInitSpec(s));
  s.bound = 1.0f;
  ValidateInitSpec(s);
  s.bound_starts = {1, 1};
  s.bound_values = {1.0f, 2.0f};
  CHECK_THROWS(bagpipe::ValueError, ValidateInitSpec(s));
  s.bound_starts = {1};
  CHECK_THROWS(bagpipe::ValueError, ValidateInitSpec(s));
  InitSpec c;
  c.kind = InitKind::kConstant;
  c.value = INFINITY;
  CHECK_THROWS(bagpipe::ValueError, ValidateInitSpec(c));
  try {
    s.bound_starts = {0};
    s.bound_values = {-3.0f};
    ValidateInitSpec(s);
    CHECK(false);
  } catch (const bagpipe::ValueError& e) {
    CHECK(std::string(e.what()).find("init_bound") != std::string::npos);
  }
}

static uint64_t Xxh(const std::string& s) {
  Checksum c;
  c.Update(s.data(), s.size());
  return c.Digest();
}

TEST_CASE(store_checksum_matches_xxh64_and_ignores_chunking) {
  CHECK_EQ(Xxh(""), 0xEF46DB3751D8E999ULL);
  CHECK_EQ(Xxh("a"), 0xD24EC4F1A98C6E5BULL);
  CHECK_EQ(Xxh("abc"), 0x44BC2CF5AD770999ULL);
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 7 + 3));
  const uint64_t whole = Xxh(data);
  for (size_t step : {1u, 3u, 31u, 32u, 33u, 64u, 999u}) {
    Checksum c;
    for (size_t i = 0; i < data.size(); i += step) c.Update(data.data() + i, std::min(step, data.size() - i));
    CHECK_EQ(c.Digest(), whole);
  }
  CHECK_EQ(Checksum::Hex(0x0123456789abcdefULL), std::string("0123456789abcdef"));
}
