// HugeArray<T>: a fixed-size array of trivially copyable T in an anonymous mapping (2 MiB
// aligned with MADV_HUGEPAGE once large, common/os_memory.h), for the cache metadata's
// randomly accessed tables: with 4 KiB pages every random access to a table of tens of MiB
// also pays a TLB miss.
//
// Thread safety: none; the owner serializes access.
//
// Invariants:
//   1. size() elements, zero-filled at construction; the memory never moves.
//   2. Move-only; the mapping is released exactly once.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "common/os_memory.h"

namespace bagpipe::cache {

template <typename T>
class HugeArray {
  static_assert(std::is_trivially_copyable_v<T>, "HugeArray holds trivially copyable types");

 public:
  HugeArray() = default;
  // n zero-filled elements (invariant 1); throws std::bad_alloc if the mapping fails.
  explicit HugeArray(size_t n) : size_(n), bytes_(RoundUp(n * sizeof(T), kOsPageBytes)) {
    if (bytes_ > 0) data_ = static_cast<T*>(MapAnonymous(bytes_));
  }
  // Releases the mapping (invariant 2).
  ~HugeArray() { UnmapMemory(data_, bytes_); }
  HugeArray(const HugeArray&) = delete;
  HugeArray& operator=(const HugeArray&) = delete;
  // Takes o's mapping; o is left empty.
  HugeArray(HugeArray&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        bytes_(std::exchange(o.bytes_, 0)) {}
  // Releases this mapping, then takes o's; o is left empty.
  HugeArray& operator=(HugeArray&& o) noexcept {
    if (this != &o) {
      UnmapMemory(data_, bytes_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }

  // The elements (nullptr when empty), their count, and the mapping's bytes.
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t memory_bytes() const { return bytes_; }
  // REQUIRES: i < size().
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
  size_t bytes_ = 0;
};

}  // namespace bagpipe::cache
