// Streaming XXH64 checksum of checkpoint files: the digest depends only on the bytes, not
// on how they were split across Update() calls.
//
// Thread safety: one Checksum object per thread.
// Invariants:
//   1. 0 <= buffered_ < 32; total_ counts every byte passed to Update.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace bagpipe::store {

class Checksum {
 public:
  // XXH64 with `seed`, over no bytes yet.
  explicit Checksum(uint64_t seed = 0);
  // Adds n bytes (any split of a byte string gives the same digest).
  void Update(const void* data, size_t n);
  // XXH64 of every byte added so far; Update may continue afterwards.
  uint64_t Digest() const;

  // 16 lowercase hex digits.
  static std::string Hex(uint64_t v);

 private:
  uint64_t v_[4];
  uint64_t seed_;
  uint64_t total_ = 0;
  unsigned char buf_[32];
  size_t buffered_ = 0;
};

}  // namespace bagpipe::store
