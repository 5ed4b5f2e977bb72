#include "transport/ucx_context.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "common/errors.h"

namespace bagpipe::transport::ucx {

std::string UcxConfig::Describe() const {
  return "tls=" + (tls.empty() ? std::string("<UCX_TLS>") : tls) +
         " devices=" + (net_devices.empty() ? std::string("<UCX_NET_DEVICES>") : net_devices);
}

std::string StatusText(const std::string& what, ucs_status_t status) {
  return what + ": " + ucs_status_string(status) + " (UCX " + VersionString() + ")";
}

void ThrowStatus(const std::string& what, ucs_status_t status) {
  throw TransportError(StatusText(what, status));
}

const char* VersionString() { return ucp_get_version_string(); }

Context::Context(const UcxConfig& config) : config_(config) {
  ucp_config_t* ucp_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &ucp_config);
  if (st != UCS_OK) ThrowStatus("ucp_config_read", st);
  struct ConfigGuard {
    ucp_config_t* c;
    ~ConfigGuard() { ucp_config_release(c); }
  } guard{ucp_config};
  if (!config.tls.empty()) {
    st = ucp_config_modify(ucp_config, "TLS", config.tls.c_str());
    if (st != UCS_OK) ThrowStatus("UCX transports '" + config.tls + "'", st);
  }
  if (!config.net_devices.empty()) {
    st = ucp_config_modify(ucp_config, "NET_DEVICES", config.net_devices.c_str());
    if (st != UCS_OK) ThrowStatus("UCX devices '" + config.net_devices + "'", st);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  st = ucp_init(&params, ucp_config, &context_);
  if (st != UCS_OK) ThrowStatus("ucp_init (" + config.Describe() + ")", st);
}

Context::~Context() {
  if (context_ != nullptr) ucp_cleanup(context_);
}

std::shared_ptr<Context> Context::Get(const UcxConfig& requested) {
  // Unset fields take the environment's value now, so a process that changes UCX_TLS between
  // connections gets a context per setting (the cache key is what UCX will really use).
  UcxConfig config = requested;
  if (config.tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    if (env != nullptr) config.tls = env;
  }
  if (config.net_devices.empty()) {
    const char* env = std::getenv("UCX_NET_DEVICES");
    if (env != nullptr) config.net_devices = env;
  }
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<std::string, std::string>, std::weak_ptr<Context>>();
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(config.tls, config.net_devices);
  if (auto it = cache->find(key); it != cache->end()) {
    if (auto ctx = it->second.lock()) return ctx;
  }
  std::shared_ptr<Context> ctx(new Context(config));
  (*cache)[key] = ctx;
  return ctx;
}

}  // namespace bagpipe::transport::ucx
