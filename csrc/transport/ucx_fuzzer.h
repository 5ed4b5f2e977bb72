// A fuzzer for a live UCX shard server (ucx_server.h): malformed bootstraps on the control
// port, then, over a correctly bootstrapped and authenticated UCX connection, frames written
// into the slot ring that are each constructed to be invalid (a malformed header, a frame
// that does not match its doorbell, a request that needs a session the fuzzer never opens, a
// stranger's token). Every one must be refused — an error reply, or the connection closed —
// none accepted, and the server must keep serving.
//
// Thread safety: FuzzUcxServer uses only its own connections.
#pragma once

#include <cstdint>
#include <string>

namespace bagpipe::transport {

struct UcxFuzzStats {
  uint64_t bootstraps = 0;          // malformed bootstrap attempts
  uint64_t bootstraps_refused = 0;  // answered with an error status or closed
  uint64_t frames = 0;              // invalid frames written into the ring
  uint64_t connections = 0;         // UCX connections opened
  uint64_t error_replies = 0;       // frames answered with an error status
  uint64_t closed_by_server = 0;    // connections the server closed after a violation
  uint64_t accepted = 0;            // bootstraps or frames answered with ok (must stay 0)
  uint64_t timeouts = 0;            // neither answered nor closed within 5 s (must stay 0)
  std::string first_accepted;       // what the first accepted input was, for the message
};

// Sends `bootstraps` malformed bootstraps and `frames` invalid frames to the UCX listener at
// host:port (whose job token is `job_token`). Throws TransportError if the server cannot be
// reached at all or refuses the fuzzer's own well-formed connection.
UcxFuzzStats FuzzUcxServer(const std::string& host, uint16_t port, const std::string& job_token,
                           uint64_t bootstraps, uint64_t frames, uint64_t seed);

}  // namespace bagpipe::transport
