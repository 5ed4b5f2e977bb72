#include "common/os_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <new>
#include <string>

namespace bagpipe {

void* MapAnonymous(size_t bytes) {
  if (bytes < kHugePageBytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }
  // Over-map by one huge page and trim both ends so the region starts on a 2 MiB boundary.
  const size_t span = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  if (aligned > base) munmap(raw, aligned - base);
  const uintptr_t end = base + span;
  if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, bytes, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  return p;
}

void UnmapMemory(void* p, size_t bytes) {
  if (p != nullptr && bytes > 0) munmap(p, bytes);
}

namespace {
int64_t ReadLimitFile(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    return std::stoll(text);
  } catch (...) {
    return -1;
  }
}
}  // namespace

size_t DetectMemoryLimit() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  size_t limit = (pages > 0 && page_size > 0) ? static_cast<size_t>(pages) * page_size
                                              : (size_t{8} << 30);
  for (const char* path : {"/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    const int64_t v = ReadLimitFile(path);
    // cgroup v1 reports "no limit" as a huge number; min() handles it.
    if (v > 0 && static_cast<size_t>(v) < limit) limit = static_cast<size_t>(v);
  }
  return limit;
}

}  // namespace bagpipe
