#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/errors.h"
#include "store/page_arena.h"
#include "store/spill.h"
#include "tests/temp_dir.h"
#include "tests/test_harness.h"

using namespace bagpipe::store;
using bagpipe::testing::TempDir;

namespace {

void Fill(PageArena::Page* p, size_t bytes, unsigned char seed) {
  for (size_t i = 0; i < bytes; ++i) p->addr[i] = static_cast<char>(seed + i * 13);
}
bool Holds(const PageArena::Page* p, size_t bytes, unsigned char seed) {
  for (size_t i = 0; i < bytes; ++i) {
    if (p->addr[i] != static_cast<char>(seed + i * 13)) return false;
  }
  return true;
}
}  // namespace

TEST_CASE(store_arena_moves_keep_bytes_and_addresses) {
  TempDir dir;
  PageArena arena(128, 64);  // 8 KiB pages
  CHECK_EQ(arena.page_bytes(), 8192u);
  std::vector<PageArena::Page*> pages;
  for (int i = 0; i < 4; ++i) {
    pages.push_back(arena.Allocate(1));
    Fill(pages.back(), arena.page_bytes(), static_cast<unsigned char>(i));
  }
  const std::string path = dir.path + "/f";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, 4 * 8192) == 0);
  char* addr = pages[1]->addr;
  arena.MoveToFile(pages[1], fd, 2);
  CHECK(pages[1]->addr == addr);
  CHECK(pages[1]->spilled);
  CHECK_EQ(arena.spilled_pages(), 1u);
  CHECK_EQ(arena.resident_pages(), 3u);
  CHECK(Holds(pages[1], 8192, 1));
  // Writes through the address reach the file extent (MAP_SHARED).
  pages[1]->addr[5] = 42;
  char b = 0;
  CHECK(pread(fd, &b, 1, 2 * 8192 + 5) == 1);
  CHECK_EQ(static_cast<int>(b), 42);
  pages[1]->addr[5] = static_cast<char>(1 + 5 * 13);
  arena.MoveToMemory(pages[1]);
  CHECK(pages[1]->addr == addr);
  CHECK(!pages[1]->spilled);
  CHECK(Holds(pages[1], 8192, 1));
  for (int i = 0; i < 4; ++i) CHECK(Holds(pages[i], 8192, static_cast<unsigned char>(i)));
  close(fd);
}

TEST_CASE(store_spill_memory_only_refuses_before_allocation) {
  PageArena arena(64, 64);  // 4 KiB pages
  SpillTier tier(&arena, {3 * 4096, "", 0.8, 0.6});
  CHECK(tier.limited());
  CHECK(!tier.spilling());
  tier.MakeRoom(3);
  for (int i = 0; i < 3; ++i) arena.Allocate(1);
  CHECK_THROWS(bagpipe::MemoryBudgetError, tier.MakeRoom(1));
  CHECK_EQ(arena.num_pages(), 3u);
  tier.AfterOp(1);  // nothing to do in memory-only mode
  CHECK_EQ(arena.spilled_pages(), 0u);
}

TEST_CASE(store_spill_keeps_residency_under_the_watermark) {
  TempDir dir;
  PageArena arena(64, 64);  // 4 KiB pages
  const int64_t budget = 10 * 4096;
  SpillTier tier(&arena, {budget, dir.path + "/spill", 0.8, 0.5});
  int warnings = 0;
  std::string message;
  tier.set_callback([&](const std::string& m) {
    ++warnings;
    message = m;
  });
  uint32_t epoch = 0;
  std::vector<PageArena::Page*> pages;
  for (int i = 0; i < 30; ++i) {
    ++epoch;
    tier.MakeRoom(1);
    pages.push_back(arena.Allocate(epoch));
    Fill(pages.back(), 4096, static_cast<unsigned char>(i));
    // Page 0 is hot: touched by every op.
    pages[0]->Touch(epoch);
    tier.AfterOp(epoch);
    CHECK(static_cast<int64_t>(arena.resident_pages() * 4096) <= budget * 8 / 10);
  }
  CHECK_EQ(warnings, 1);
  CHECK(message.find("spill") != std::string::npos);
  CHECK(tier.swap_outs() > 0);
  CHECK(!pages[0]->spilled);  // the hot page stayed in memory
  for (int i = 0; i < 30; ++i) CHECK(Holds(pages[i], 4096, static_cast<unsigned char>(i)));

  // A spilled page that becomes hot comes back.
  PageArena::Page* cold = nullptr;
  for (auto* p : pages) {
    if (p->spilled) cold = p;
  }
  CHECK(cold != nullptr);
  for (int i = 0; i < 8 && cold->spilled; ++i) {
    ++epoch;
    cold->Touch(epoch);
    tier.AfterOp(epoch);
  }
  CHECK(!cold->spilled);
  CHECK(tier.swap_ins() > 0);
  CHECK(static_cast<int64_t>(arena.resident_pages() * 4096) <= budget * 8 / 10);
  for (int i = 0; i < 30; ++i) CHECK(Holds(pages[i], 4096, static_cast<unsigned char>(i)));
}

TEST_CASE(store_spill_callback_set_late_still_fires_once) {
  TempDir dir;
  PageArena arena(64, 64);
  SpillTier tier(&arena, {4096, dir.path, 1.0, 0.5});
  for (uint32_t e = 1; e <= 4; ++e) {
    tier.MakeRoom(1);
    arena.Allocate(e);
    tier.AfterOp(e);
  }
  CHECK(arena.spilled_pages() > 0);
  int calls = 0;
  tier.set_callback([&](const std::string&) { ++calls; });
  CHECK_EQ(calls, 1);
  tier.MakeRoom(1);
  arena.Allocate(5);
  tier.AfterOp(5);
  CHECK_EQ(calls, 1);
}

TEST_CASE(store_spill_dir_errors_name_the_field) {
  PageArena arena(64, 64);
  try {
    SpillTier tier(&arena, {4096, "/proc/definitely/not/here", 0.8, 0.6});
    CHECK(false);
  } catch (const bagpipe::ValueError& e) {
    CHECK(std::string(e.what()).find("spill_dir") != std::string::npos);
  }
}

TEST_CASE(store_arena_page_index_divides_exactly) {
  std::mt19937_64 rng(3);
  std::vector<uint32_t> divisors = {1, 2, 3, 7, 16, 100, 4096, 15887, 5461, 65535, 1u << 24,
                                    (1u << 24) - 1};
  for (int i = 0; i < 40; ++i) divisors.push_back(1 + static_cast<uint32_t>(rng() % (1u << 24)));
  for (uint32_t d : divisors) {
    const PageIndex index(d);
    std::vector<uint32_t> slots = {0, 1, d - 1, d, d + 1, 0xFFFFFFFFu, 0xFFFFFFFEu, 0xFFFFFFFDu};
    for (int i = 0; i < 2000; ++i) slots.push_back(static_cast<uint32_t>(rng()));
    for (uint32_t k = 1; k < 50; ++k) {  // around multiples of d, up to the largest slot
      const uint64_t m = static_cast<uint64_t>(d) * (rng() % (0xFFFFFFFFull / d + 1));
      for (int64_t off = -1; off <= 1; ++off) {
        const int64_t v = static_cast<int64_t>(m) + off;
        if (v >= 0 && v <= 0xFFFFFFFFll) slots.push_back(static_cast<uint32_t>(v));
      }
    }
    for (uint32_t s : slots) {
      const uint32_t page = index.Page(s);
      CHECK_EQ(page, s / d);
      CHECK_EQ(index.RowIn(s, page), s % d);
    }
    CHECK_EQ(index.PagesFor(0), 0u);
    CHECK_EQ(index.PagesFor(d), 1u);
    CHECK_EQ(index.PagesFor(static_cast<size_t>(d) + 1), 2u);
  }
}
