// UCP context: the per-process UCX state (transports, devices, memory domains) that workers,
// endpoints and memory registrations are built on. One Context per UcxConfig per process,
// shared by every connection that asks for the same configuration.
//
// Thread safety: Context::Get is thread-safe. A Context is immutable after creation and is
// created with mt_workers_shared, so workers built on it may live on different threads.
//
// Invariants:
//   1. A Context outlives every worker, registration and remote key built on it (holders
//      keep a shared_ptr).
//   2. The transports a Context uses are fixed at creation: config.tls / config.net_devices
//      when set, otherwise UCX_TLS / UCX_NET_DEVICES as they are when Get is called, otherwise
//      UCX's defaults; config() reports the resolved values.
//   3. Every UCX status that is not UCS_OK reaches callers as TransportError, with the
//      operation and ucs_status_string in the message (ThrowStatus).
#pragma once

#include <ucp/api/ucp.h>

#include <memory>
#include <string>

#include "common/deadline.h"

namespace bagpipe::transport::ucx {

struct UcxConfig {
  std::string tls;          // UCX_TLS for this context ("sm", "tcp", "rc,sm,self"); empty: env
  std::string net_devices;  // UCX_NET_DEVICES ("mlx5_0:1", "eth0"); empty: env

  // "tls=sm devices=<env>", for messages.
  std::string Describe() const;
  bool operator==(const UcxConfig&) const = default;
};

class Context {
 public:
  // The shared context for `config` (unset fields resolved from UCX_TLS / UCX_NET_DEVICES at
  // this call), created on first use. Throws TransportError when UCX cannot initialise
  // (e.g. an unknown transport name in config.tls).
  static std::shared_ptr<Context> Get(const UcxConfig& config);

  // ucp_cleanup. REQUIRES: every worker and registration of the context is gone (each holds
  // the context by shared_ptr).
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // The UCP context, and the configuration it was made with (every field resolved).
  ucp_context_h handle() const { return context_; }
  const UcxConfig& config() const { return config_; }

 private:
  explicit Context(const UcxConfig& config);

  const UcxConfig config_;
  ucp_context_h context_ = nullptr;  // set by the constructor, released by the destructor
};

// "<what>: <ucs_status_string> (UCX <version>)".
std::string StatusText(const std::string& what, ucs_status_t status);
// REQUIRES: status != UCS_OK. Throws TransportError(StatusText(what, status)).
[[noreturn]] void ThrowStatus(const std::string& what, ucs_status_t status);
// The UCX library version this process runs ("1.13.1").
const char* VersionString();

}  // namespace bagpipe::transport::ucx
