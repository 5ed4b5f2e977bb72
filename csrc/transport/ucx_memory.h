// Registered memory (ucp_mem_map) and remote keys (ucp_rkey_pack / ucp_ep_rkey_unpack).
// Buffers are registered once, when a connection is set up, never per operation.
//
// Thread safety: a Region may be read and written by any thread (it is plain memory); its
// registration is immutable. A RemoteKey is used only by the thread that owns the worker its
// endpoint belongs to (the endpoint's progress thread), which also destroys it.
//
// Invariants:
//   1. A Region's registration lives exactly as long as the Region; Allocate'd memory is
//      UCX-owned and freed with it, Attach'ed memory stays the caller's and must outlive it.
//   2. A RemoteKey is only ever built from a packed key whose digest matched the one its
//      owner announced (the caller checks KeyDigest first): UCX 1.13 may crash unpacking a
//      corrupted key, so a key is never unpacked on trust.
//   3. RemoteKey::Contains guards every remote address an operation targets.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "transport/ucx_context.h"

namespace bagpipe::transport::ucx {

class Region {
 public:
  // Allocates `bytes` (rounded up to a page) of registered memory, zero-filled.
  static std::unique_ptr<Region> Allocate(std::shared_ptr<Context> context, size_t bytes);
  // Registers caller-owned memory [data, data + bytes). REQUIRES: bytes > 0.
  static std::unique_ptr<Region> Attach(std::shared_ptr<Context> context, void* data,
                                        size_t bytes);
  // Deregisters (and frees what Allocate allocated). REQUIRES: no UCX operation uses it.
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // The registered bytes [data(), data() + size()) and their UCP memory handle.
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  ucp_mem_h memh() const { return memh_; }
  // The packed remote key a peer needs to write into / read from this region.
  std::vector<uint8_t> PackKey() const;

 private:
  Region(std::shared_ptr<Context> context, ucp_mem_h memh, uint8_t* data, size_t size);

  const std::shared_ptr<Context> context_;
  const ucp_mem_h memh_;
  uint8_t* const data_;
  const size_t size_;
};

class RemoteKey {
 public:
  // Unpacks `packed` on `ep` for the remote range [base, base + bytes). Throws TransportError.
  // REQUIRES: KeyDigest(packed) equals the digest the key's owner announced (invariant 2).
  static std::unique_ptr<RemoteKey> Unpack(ucp_ep_h ep, const std::vector<uint8_t>& packed,
                                           uint64_t base, uint64_t bytes);
  // ucp_rkey_destroy. REQUIRES: on the thread of the endpoint's worker; its endpoint open.
  ~RemoteKey();
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;

  // The UCP remote key, and the remote range it covers.
  ucp_rkey_h handle() const { return rkey_; }
  uint64_t base() const { return base_; }
  uint64_t size() const { return size_; }
  // True when [base + offset, base + offset + len) lies inside the remote range.
  bool Contains(uint64_t offset, uint64_t len) const {
    return offset <= size_ && len <= size_ - offset;
  }

 private:
  RemoteKey(ucp_rkey_h rkey, uint64_t base, uint64_t size)
      : rkey_(rkey), base_(base), size_(size) {}

  const ucp_rkey_h rkey_;
  const uint64_t base_;
  const uint64_t size_;
};

// 64-bit digest (common/hash.h Digest64) of a packed key or any byte string.
uint64_t KeyDigest(const uint8_t* data, size_t len);

}  // namespace bagpipe::transport::ucx
