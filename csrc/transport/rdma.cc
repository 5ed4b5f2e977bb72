#include "transport/rdma.h"

#include <stdexcept>

#ifdef BAGPIPE_HAVE_UCX
#include "transport/ucx_context.h"
#include "transport/ucx_channel.h"
#endif

namespace bagpipe::transport {

#ifdef BAGPIPE_HAVE_UCX

bool RdmaAvailable() { return true; }
std::string RdmaLibraryVersion() { return ucx::VersionString(); }
std::string RdmaUnavailableReason() { return ""; }

std::unique_ptr<Channel> ConnectRdmaChannel(const std::string& host, uint16_t port,
                                            const std::string& job_token,
                                            const ChannelOptions& options,
                                            double connect_timeout) {
  return UcxChannel::Connect(host, port, job_token, options, connect_timeout);
}

#else

bool RdmaAvailable() { return false; }
std::string RdmaLibraryVersion() { return ""; }
std::string RdmaUnavailableReason() {
  return "ps_type='rdma' needs UCX (the ucx library, Debian/Ubuntu package libucx-dev, found "
         "through pkg-config 'ucx'), and this build of torchrec_bagpipe was compiled without "
         "it: install libucx-dev and rebuild (make build / pip install .), or use ps_type='tcp' "
         "or the single-node local backend";
}

std::unique_ptr<Channel> ConnectRdmaChannel(const std::string&, uint16_t, const std::string&,
                                            const ChannelOptions&, double) {
  throw std::runtime_error(RdmaUnavailableReason());
}

#endif

}  // namespace bagpipe::transport
