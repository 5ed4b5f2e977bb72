#include "transport/ucx_memory.h"

#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/hash.h"

namespace bagpipe::transport::ucx {

uint64_t KeyDigest(const uint8_t* data, size_t len) { return Digest64(data, len); }

Region::Region(std::shared_ptr<Context> context, ucp_mem_h memh, uint8_t* data, size_t size)
    : context_(std::move(context)), memh_(memh), data_(data), size_(size) {}

std::unique_ptr<Region> Region::Allocate(std::shared_ptr<Context> context, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (bytes == 0) bytes = 1;
  bytes = (bytes + page - 1) / page * page;
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context->handle(), &params, &memh);
  if (st != UCS_OK) ThrowStatus("ucp_mem_map (allocate " + std::to_string(bytes) + " bytes)", st);
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(memh, &attr);
  if (st != UCS_OK) {
    ucp_mem_unmap(context->handle(), memh);
    ThrowStatus("ucp_mem_query", st);
  }
  auto* data = static_cast<uint8_t*>(attr.address);
  std::memset(data, 0, bytes);
  return std::unique_ptr<Region>(new Region(std::move(context), memh, data, bytes));
}

std::unique_ptr<Region> Region::Attach(std::shared_ptr<Context> context, void* data,
                                       size_t bytes) {
  if (data == nullptr || bytes == 0) throw ValueError("Region::Attach needs a non-empty buffer");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data;
  params.length = bytes;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context->handle(), &params, &memh);
  if (st != UCS_OK) ThrowStatus("ucp_mem_map (register " + std::to_string(bytes) + " bytes)", st);
  return std::unique_ptr<Region>(
      new Region(std::move(context), memh, static_cast<uint8_t*>(data), bytes));
}

Region::~Region() { ucp_mem_unmap(context_->handle(), memh_); }

std::vector<uint8_t> Region::PackKey() const {
  void* buf = nullptr;
  size_t len = 0;
  ucs_status_t st = ucp_rkey_pack(context_->handle(), memh_, &buf, &len);
  if (st != UCS_OK) ThrowStatus("ucp_rkey_pack", st);
  std::vector<uint8_t> out(static_cast<uint8_t*>(buf), static_cast<uint8_t*>(buf) + len);
  ucp_rkey_buffer_release(buf);
  return out;
}

std::unique_ptr<RemoteKey> RemoteKey::Unpack(ucp_ep_h ep, const std::vector<uint8_t>& packed,
                                             uint64_t base, uint64_t bytes) {
  if (packed.empty()) throw TransportError("the PS shard sent an empty remote key");
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(ep, packed.data(), &rkey);
  if (st != UCS_OK) ThrowStatus("ucp_ep_rkey_unpack (remote key of the PS shard's slot ring)", st);
  return std::unique_ptr<RemoteKey>(new RemoteKey(rkey, base, bytes));
}

RemoteKey::~RemoteKey() { ucp_rkey_destroy(rkey_); }

}  // namespace bagpipe::transport::ucx
