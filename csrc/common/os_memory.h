// Anonymous memory mappings for large randomly accessed tables (the store's key maps and
// arena, the cache metadata's slot table and key map): zero-filled, 4 KiB aligned, and
// 2 MiB aligned with MADV_HUGEPAGE when large enough, so random accesses do not pay a TLB
// miss per key where the kernel grants transparent huge pages.
//
// Thread safety: stateless functions.
// Invariants:
//   1. A mapping MapAnonymous returns is zero-filled and 4 KiB aligned; it stays at its
//      address until UnmapMemory releases exactly it.
#pragma once

#include <cstddef>

namespace bagpipe {

inline constexpr size_t kOsPageBytes = 4096;
inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Rounds n up to a multiple of `align` (a power of two).
constexpr size_t RoundUp(size_t n, size_t align) { return (n + align - 1) & ~(align - 1); }

// Maps `bytes` (REQUIRES: multiple of kOsPageBytes, > 0) of zeroed private memory.
// Throws std::bad_alloc when the kernel refuses.
void* MapAnonymous(size_t bytes);

// REQUIRES: (p, bytes) is exactly a region returned by MapAnonymous or adopted by the arena.
void UnmapMemory(void* p, size_t bytes);

// Bytes of RAM the process may use: min(cgroup memory limit, physical memory).
size_t DetectMemoryLimit();

}  // namespace bagpipe
