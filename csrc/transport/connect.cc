#include "transport/connect.h"

#include <utility>

#include "common/errors.h"
#include "transport/local_channel.h"
#include "transport/rdma.h"
#include "transport/tcp_channel.h"

namespace bagpipe::transport {

ShardEndpoint ShardEndpoint::Local(std::shared_ptr<FrameHandler> handler) {
  ShardEndpoint e;
  e.kind = Kind::kLocal;
  e.local = std::move(handler);
  return e;
}

ShardEndpoint ShardEndpoint::Tcp(std::string host, uint16_t port) {
  ShardEndpoint e;
  e.kind = Kind::kTcp;
  e.host = std::move(host);
  e.port = port;
  return e;
}

ShardEndpoint ShardEndpoint::Rdma(std::string host, uint16_t port) {
  ShardEndpoint e = Tcp(std::move(host), port);
  e.kind = Kind::kRdma;
  return e;
}

std::unique_ptr<Channel> ConnectChannel(const ShardEndpoint& endpoint,
                                        const ChannelOptions& options,
                                        const ConnectOptions& connect) {
  switch (endpoint.kind) {
    case ShardEndpoint::Kind::kLocal:
      return std::make_unique<LocalChannel>(endpoint.local, options);
    case ShardEndpoint::Kind::kRdma:
      return ConnectRdmaChannel(endpoint.host, endpoint.port, connect.job_token, options,
                                connect.connect_timeout);
    case ShardEndpoint::Kind::kTcp: {
      ChannelOptions o = options;
      o.keepalive_interval = connect.keepalive_interval;
      return TcpChannel::Connect(endpoint.host, endpoint.port, connect.job_token, o,
                                 connect.connect_timeout);
    }
  }
  throw ValueError("unknown shard endpoint kind");
}

}  // namespace bagpipe::transport
