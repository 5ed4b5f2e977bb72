// ServerStats: the counters every shard server reports (TcpShardServer over TCP,
// UcxShardServer over UCX); the bindings expose them as one dict shape.
//
// Thread safety: a plain value, copied out of the server under its own synchronization.
// Invariants:
//   1. accepted .. idle_timeouts, frames, bytes_* and closed_by_server count since the
//      server started; active, unauthenticated and threads are the values at the copy, with
//      unauthenticated <= active; ucx_workers is too (0 over TCP), at most
//      UcxServerOptions::progress_threads however many connections are open.
#pragma once

#include <cstdint>

namespace bagpipe::server {

struct ServerStats {
  uint64_t accepted = 0;
  uint64_t refused = 0;           // over max_connections (every slot authenticated); UCX: a failed bootstrap
  uint64_t shed = 0;              // unauthenticated connections closed to admit newer ones
  uint64_t handshake_timeouts = 0;  // connections that did not authenticate in time
  uint64_t idle_timeouts = 0;     // authenticated connections closed after idle_timeout
  uint64_t active = 0;            // open connections (any state)
  uint64_t unauthenticated = 0;   // of which not authenticated yet
  uint64_t frames = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t closed_by_server = 0;  // connections closed for a protocol / auth violation
  uint64_t threads = 0;           // threads serving connections (loop threads)
  uint64_t ucx_workers = 0;       // UCX: UCP workers alive (shared by established endpoints)
  uint64_t ucx_stray = 0;         // UCX: messages dropped for naming no live connection
};

}  // namespace bagpipe::server
