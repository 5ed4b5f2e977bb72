// FrameMutator: the frame material of the fuzzing framework (frame_fuzzer.h, driven over TCP
// by tcp_fuzzer.h and over UCX by ucx_fuzzer.h): seeded random bytes, well-formed frames and
// bodies that a shard must still refuse (no session is ever opened with them), and headers
// broken in exactly one field.
//
// Thread safety: none; each fuzzer owns one.
// Invariants:
//   1. Every value comes from the one seeded generator, so a (seed, call sequence) pair
//      always yields the same bytes.
//   2. Frame() stores a header whose body_len equals the body's size; the defects are
//      introduced by the callers (or by BrokenHeader) on top of a well-formed frame.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "protocol/wire.h"

namespace bagpipe::testing {

class FrameMutator {
 public:
  using Bytes = std::vector<uint8_t>;

  // `token`: the server's job token (frames carry its digest unless told otherwise).
  // `random_routing`: headers get a random tag and slot (< 16); otherwise tag 0 and kNoSlot,
  // for a transport that rewrites them.
  FrameMutator(std::string token, uint64_t seed, bool random_routing)
      : token_(std::move(token)), digest_(protocol::wire::TokenDigest(token_)), rng_(seed),
        random_routing_(random_routing) {}

  // The server's job token and its digest (wire::TokenDigest).
  const std::string& token() const { return token_; }
  uint64_t digest() const { return digest_; }

  // The generator's next 64-bit value (invariant 1).
  uint64_t Next() { return rng_(); }
  // A uniform value in [0, n); 0 when n is 0.
  uint64_t U(uint64_t n) { return n ? rng_() % n : 0; }
  // n values of the generator, one byte each.
  Bytes RandomBytes(size_t n);

  // Appends v's bytes (trivially copyable T) / n bytes at p to *b.
  template <typename T>
  static void Append(Bytes* b, const T& v) {
    AppendBytes(b, &v, sizeof(T));
  }
  static void AppendBytes(Bytes* b, const void* p, size_t n) {
    const size_t at = b->size();
    b->resize(at + n);
    if (n) std::memcpy(b->data() + at, p, n);
  }

  // A frame of `type` carrying `body` under job digest `job` (default: the token's).
  Bytes Frame(protocol::wire::MsgType type, const Bytes& body, uint64_t job);
  Bytes Frame(protocol::wire::MsgType type, const Bytes& body) { return Frame(type, body, digest_); }
  // A Hello frame presenting `token` (under that token's digest).
  Bytes Hello(const std::string& token);

  // A structurally valid Commit body with random content (refused: no session is open).
  Bytes CommitBody();
  // CommitBody() with 1..8 random bits flipped.
  Bytes BitFlippedCommitBody();
  // A structurally valid Get body (its keys included) for a random session.
  Bytes GetBody();
  // A random body, at least the fixed part long, for a random one of Commit, Get, Assign.
  Bytes RandomRequest(protocol::wire::MsgType* type);
  // A Ping frame whose header is broken in one field (magic, version or type), chosen at
  // random; *what names the defect.
  Bytes BrokenHeader(std::string* what);

 private:
  const std::string token_;
  const uint64_t digest_;
  std::mt19937_64 rng_;
  const bool random_routing_;
};

}  // namespace bagpipe::testing
