// RecvBuffer: a buffer a server backend reads request bodies into, which the request's
// handler may take over instead of copying the body (the commit coordinator keeps a chunk's
// payload this way). Taking it means swapping in another RecvBuffer (typically the one the
// taker held before, so buffers circulate between a connection and the chunks it fills and
// nothing is allocated in steady state).
//
// Thread safety: none; a RecvBuffer belongs to one reader thread or to the holder that took
// it (under that holder's lock).
//
// Invariants:
//   1. data holds cap bytes (data is null iff cap == 0); Reserve never shrinks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace bagpipe::transport {

struct RecvBuffer {
  std::unique_ptr<uint8_t[]> data;  // changed by its owner only
  size_t cap = 0;

  // Ensures cap >= n; the contents are unspecified afterwards.
  void Reserve(size_t n) {
    if (n <= cap) return;
    data.reset(new uint8_t[n]);
    cap = n;
  }
  // True if [p, p + n) lies inside the buffer.
  bool Holds(const uint8_t* p, size_t n) const {
    const uint8_t* b = data.get();
    return b != nullptr && p >= b && n <= cap && static_cast<size_t>(p - b) <= cap - n;
  }
};

}  // namespace bagpipe::transport
