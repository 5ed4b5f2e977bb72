// The TCP transport of the frame-fuzzing framework (frame_fuzzer.h): frames written to a
// live TCP shard server (tcp_server.h), answers read off the socket. Besides the shared
// catalogue it sends truncated streams and headers announcing an oversized body, and half of
// its closing violations go to connections that never said Hello.
//
// Thread safety: FuzzTcpServer uses only its own sockets.
//
// Invariants:
//   1. Every read has a 5 s receive timeout: a server that neither answers nor closes shows
//      up in timeouts, never as a hang.
//   2. Headers carry a random tag and slot (FrameMutator random_routing): the server must not
//      rely on them before it has checked the frame.
#pragma once

#include <cstdint>
#include <string>

#include "testing/frame_fuzzer.h"

namespace bagpipe::testing {

// Sends `frames` invalid frames to the TCP server at host:port (whose job token is
// `job_token`). Throws TransportError if the server cannot be reached at all.
FuzzStats FuzzTcpServer(const std::string& host, uint16_t port, const std::string& job_token,
                        uint64_t frames, uint64_t seed);

}  // namespace bagpipe::testing
