// The UCX transport of the frame-fuzzing framework (frame_fuzzer.h), for a live UCX shard
// server (ucx_server.h): first malformed bootstraps on the control port, then, over a
// correctly bootstrapped and authenticated UCX connection, invalid frames written into the
// slot ring. Besides the shared catalogue it sends frames that do not match their doorbell
// (another tag, more bytes announced than written).
//
// Thread safety: FuzzUcxServer uses only its own connections (each answer is recorded by the
// connection's progress thread under a mutex the fuzzer waits on).
//
// Invariants:
//   1. Every bootstrap and every frame waits at most 5 s for its answer: a server that
//      neither answers nor closes shows up in timeouts, never as a hang.
//   2. A frame's header names the slot and tag its doorbell announces unless the defect is
//      exactly that mismatch, so every other defect reaches the shard's parser.
#pragma once

#include <cstdint>
#include <string>

#include "testing/frame_fuzzer.h"

namespace bagpipe::testing {

// Sends `bootstraps` malformed bootstraps and `frames` invalid frames to the UCX listener at
// host:port (whose job token is `job_token`). Throws TransportError if the server cannot be
// reached at all or refuses the fuzzer's own well-formed connection.
FuzzStats FuzzUcxServer(const std::string& host, uint16_t port, const std::string& job_token,
                        uint64_t bootstraps, uint64_t frames, uint64_t seed);

}  // namespace bagpipe::testing
