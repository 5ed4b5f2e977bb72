// A frame fuzzer for a live PS shard server: random and mutated frames, each constructed to
// be invalid (a malformed header or body, a request that needs a session the fuzzer never
// opens, a stranger's token, a truncated stream). Used by the robustness test: every frame
// must be rejected (an error reply or the connection closed), none accepted, and the server
// must keep serving.
//
// Thread safety: FuzzServer is a free function using only its own sockets.
#pragma once

#include <cstdint>
#include <string>

namespace bagpipe::server {

struct FuzzStats {
  uint64_t frames = 0;            // frames (or frame fragments) sent
  uint64_t connections = 0;
  uint64_t error_replies = 0;     // frames answered with an error status
  uint64_t closed_by_server = 0;  // connections the server closed after a violation
  uint64_t accepted_replies = 0;  // frames answered with status ok (must stay 0)
  uint64_t timeouts = 0;          // frames neither answered nor closed within 5 s (must stay 0)
  std::string first_accepted;     // what the first accepted frame was, for the test's message
};

// Sends `frames` fuzzed frames to host:port. `job_token` is the server's token (so that
// post-handshake parsing is fuzzed too). Throws TransportError if the server cannot be
// reached at all.
FuzzStats FuzzServer(const std::string& host, uint16_t port, const std::string& job_token,
                     uint64_t frames, uint64_t seed);

}  // namespace bagpipe::server
