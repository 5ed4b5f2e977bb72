// ServerStats: the counters every shard server reports (TcpShardServer over TCP,
// UcxShardServer over UCX); the bindings expose them as one dict shape.
//
// Thread safety: a plain value, copied out of the server under its own synchronization.
#pragma once

#include <cstdint>

namespace bagpipe::server {

struct ServerStats {
  uint64_t accepted = 0;
  uint64_t refused = 0;           // TCP: over max_connections; UCX: a failed bootstrap
  uint64_t active = 0;
  uint64_t frames = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t closed_by_server = 0;  // connections closed for a protocol / auth violation
};

}  // namespace bagpipe::server
