// Raw TCP loopback baselines for benchmarks/ps_transport.py: the bandwidth of one plain
// socket stream and the round trip of a plain ping-pong, measured with the same socket
// helpers the tcp transport uses, so transport numbers can be reported as a ratio of what the
// machine's loopback does in the same run.
//
// Thread safety: each call owns its sockets and threads.
// Invariants:
//   1. Every socket and thread a call made is gone when it returns.
#pragma once

#include <cstddef>
#include <vector>

namespace bagpipe::testing {

// Streams total_bytes in writes of chunk_bytes from one thread to another over 127.0.0.1;
// returns the seconds from the first byte sent to the last byte received.
double RawLoopbackSeconds(size_t total_bytes, size_t chunk_bytes);

// `iterations` round trips of a msg_bytes message and a reply of the same size; returns each
// round trip in seconds.
std::vector<double> RawPingPongSeconds(size_t iterations, size_t msg_bytes);

}  // namespace bagpipe::testing
