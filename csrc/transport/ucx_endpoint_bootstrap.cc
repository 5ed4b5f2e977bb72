// The bootstrap of a UCX endpoint (ucx_wire.h): the client's Connect (hello, reply, remote
// key check) and the shard's Accept (limits, token, slot ring, reply), over the TCP control
// connection.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

#include "common/errors.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_endpoint_internal.h"

namespace bagpipe::transport::ucx {
namespace {

const char* BootStatusName(int32_t s) {
  switch (static_cast<wire::BootStatus>(s)) {
    case wire::BootStatus::kOk: return "ok";
    case wire::BootStatus::kBadRequest: return "bad request";
    case wire::BootStatus::kUnauthorized: return "unauthorized";
    case wire::BootStatus::kTooLarge: return "too large";
    case wire::BootStatus::kInternal: return "internal error";
    case wire::BootStatus::kShuttingDown: return "shutting down";
  }
  return "unknown status";
}

// Transport names that detect a dead peer in UCX 1.13 (shared-memory transports do not: an
// endpoint asking for UCP_ERR_HANDLING_MODE_PEER over them is unreachable).
bool ListsNetworkTransport(const std::string& tls) {
  std::stringstream ss(tls);
  std::string t;
  while (std::getline(ss, t, ',')) {
    if (!t.empty() && t[0] == '^') return true;  // an exclusion list keeps network transports
    if (t == "sm" || t == "shm" || t == "posix" || t == "sysv" || t == "cma" || t == "knem" ||
        t == "xpmem" || t == "self") {
      continue;
    }
    return true;
  }
  return false;
}

// Whether UCX picked native RMA lanes for `ep` (ucp_ep_print_info lists "put[i]" protocol
// ranges only for them; UCX 1.13 has no query API for an endpoint's transports).
bool HasNativeRma(ucp_ep_h ep) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return false;
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  const bool native = buf != nullptr && std::strstr(buf, " put[") != nullptr;
  std::free(buf);
  return native;
}

std::string Hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

}  // namespace

std::vector<uint8_t> Endpoint::WorkerAddress() {
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  ucs_status_t st = ucp_worker_query(worker_, &attr);
  if (st != UCS_OK) ThrowStatus("ucp_worker_query (address)", st);
  const auto* p = reinterpret_cast<const uint8_t*>(attr.address);
  std::vector<uint8_t> out(p, p + attr.address_length);
  ucp_worker_release_address(worker_, attr.address);
  return out;
}

void Endpoint::CreateEndpoint(const std::vector<uint8_t>& remote_address) {
  const std::string& tls = context_->config().tls;  // resolved (Context::Get)
  const bool want_peer = tls.empty() || ListsNetworkTransport(tls);
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(remote_address.data());
  p.err_mode = want_peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = &Endpoint::OnEndpointError;
  p.err_handler.arg = this;
  ucs_status_t st = ucp_ep_create(worker_, &p, &ep_);
  if (st == UCS_ERR_UNREACHABLE && want_peer) {
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    st = ucp_ep_create(worker_, &p, &ep_);
  }
  if (st != UCS_OK) {
    ep_ = nullptr;
    ThrowStatus("ucp_ep_create to " + peer_ + " (" + context_->config().Describe() + ")", st);
  }
}

// ---- client bootstrap --------------------------------------------------------------------------

namespace {

// REQUIRES nothing; throws ValueError naming the field of `o` a connection cannot use.
void CheckConnectOptions(const ConnectOptions& o) {
  if (o.num_slots == 0 || o.num_slots > wire::kMaxSlots) {
    throw ValueError("UCX num_slots must be in [1, " + std::to_string(wire::kMaxSlots) + "], got " +
                     std::to_string(o.num_slots));
  }
  if (o.slot_bytes == 0) throw ValueError("UCX slot_bytes must be > 0");
  if (o.source_slots.size() != o.num_slots) {
    throw ValueError("UCX source_slots must hold num_slots buffers");
  }
  if (o.token.size() > wire::kMaxTokenBytes) throw ValueError("job token longer than 1024 bytes");
}

// The client's bootstrap request: BootHello, the token, the client's worker address.
void SendBootHello(int fd, const ConnectOptions& o, const std::vector<uint8_t>& my_address,
                   Deadline deadline, const std::string& peer) {
  wire::BootHello hello{};
  hello.magic = wire::kBootMagic;
  hello.version = wire::kBootVersion;
  hello.num_slots = o.num_slots;
  hello.token_len = static_cast<uint32_t>(o.token.size());
  hello.slot_bytes = o.slot_bytes;
  hello.address_len = static_cast<uint32_t>(my_address.size());
  std::vector<uint8_t> out(sizeof(hello) + o.token.size() + my_address.size());
  std::memcpy(out.data(), &hello, sizeof(hello));
  std::memcpy(out.data() + sizeof(hello), o.token.data(), o.token.size());
  std::memcpy(out.data() + sizeof(hello) + o.token.size(), my_address.data(), my_address.size());
  SendAll(fd, out.data(), out.size(), deadline, peer);
}

}  // namespace

std::shared_ptr<Endpoint> Endpoint::Connect(const ConnectOptions& o, EndpointHandlers handlers,
                                            Deadline deadline) {
  CheckConnectOptions(o);
  const std::string peer = "ucx://" + o.host + ":" + std::to_string(o.port);
  auto context = Context::Get(o.config);

  // Declared before `ep`: they outlive its progress thread (see RunOnThread).
  std::vector<uint8_t> my_address;
  std::vector<uint8_t> key;
  std::vector<uint8_t> address;
  wire::BootReply reply{};

  std::shared_ptr<Endpoint> ep(new Endpoint(Role::kClient, context, peer));
  ep->num_slots_ = o.num_slots;
  ep->slot_bytes_ = o.slot_bytes;
  ep->slot_stride_ = wire::SlotStride(o.slot_bytes);
  ep->source_ptrs_ = o.source_slots;
  for (uint8_t* p : o.source_slots) {
    if (p == nullptr) throw ValueError("UCX source slot buffer is null");
    ep->sources_.push_back(Region::Attach(context, p, o.slot_bytes));
  }
  ep->SetHandlers(std::move(handlers));
  ep->Start(deadline);

  Socket s = ConnectTcp(o.host, o.port, deadline);
  SetNonBlocking(s.fd(), true);  // the control connection's reads and writes are deadline-bounded
  ep->RunOnThread([&] { my_address = ep->WorkerAddress(); }, deadline);
  SendBootHello(s.fd(), o, my_address, deadline, peer);
  ep->ReceiveBootReply(s.fd(), deadline, &reply, &key, &address);
  ep->RunOnThread(
      [&] {
        ep->CreateEndpoint(address);
        ep->frame_mode_ = HasNativeRma(ep->ep_) ? FrameMode::kPut : FrameMode::kMessage;
        if (ep->frame_mode_ == FrameMode::kPut) {
          ep->rkey_ = RemoteKey::Unpack(ep->ep_, key, reply.ring_addr, reply.ring_bytes);
        }
      },
      deadline);
  ep->remote_ring_addr_ = reply.ring_addr;
  ep->ring_id_ = reply.ring_id;
  ep->wire_id_ = reply.ring_id;
  // kMessage never touches the ring remotely, so its key is never used (nor checked).
  if (ep->frame_mode_ == FrameMode::kPut) ep->VerifyRing(reply, deadline);
  ep->AdoptControl(std::move(s));
  return ep;
}

void Endpoint::ReceiveBootReply(int fd, Deadline deadline, wire::BootReply* reply,
                                std::vector<uint8_t>* key, std::vector<uint8_t>* address) {
  const std::string& peer = peer_;
  RecvAll(fd, reply, sizeof(*reply), deadline, peer);
  if (reply->magic != wire::kBootMagic) {
    throw TransportError(peer + " is not a torchrec_bagpipe UCX listener (bad reply magic " +
                         Hex(reply->magic) + ")");
  }
  if (reply->status != static_cast<int32_t>(wire::BootStatus::kOk)) {
    std::string text(std::min<size_t>(reply->text_len, wire::kMaxBootText), '\0');
    try {
      RecvAll(fd, text.data(), text.size(), deadline, peer);
    } catch (const std::exception&) {
      text = "(no reason given)";
    }
    throw TransportError("PS shard " + peer + " refused the UCX connection (" +
                         BootStatusName(reply->status) + "): " + text);
  }
  if (reply->key_len == 0 || reply->key_len > wire::kMaxPackedKey || reply->address_len == 0 ||
      reply->address_len > wire::kMaxWorkerAddress) {
    throw TransportError("PS shard " + peer + " sent a malformed UCX bootstrap reply (key_len " +
                         std::to_string(reply->key_len) + ", address_len " +
                         std::to_string(reply->address_len) + ")");
  }
  const uint64_t need = wire::kRingHeaderBytes + uint64_t{num_slots_} * slot_stride_;
  if (reply->num_slots != num_slots_ || reply->slot_stride != slot_stride_ ||
      reply->ring_bytes < need) {
    throw TransportError("PS shard " + peer + " announced a slot ring that does not fit (" +
                         std::to_string(reply->num_slots) + " slots of stride " +
                         std::to_string(reply->slot_stride) + " in " +
                         std::to_string(reply->ring_bytes) + " bytes; asked for " +
                         std::to_string(num_slots_) + " of " + std::to_string(slot_stride_) + ")");
  }
  key->resize(reply->key_len);
  address->resize(reply->address_len);
  RecvAll(fd, key->data(), key->size(), deadline, peer);
  RecvAll(fd, address->data(), address->size(), deadline, peer);
  if (KeyDigest(key->data(), key->size()) != reply->key_digest) {
    throw TransportError("remote key mismatch: the packed key of PS shard " + peer +
                         "'s slot ring does not match its digest (corrupted in transit); "
                         "the key was not unpacked");
  }
}

void Endpoint::VerifyRing(const wire::BootReply& reply, Deadline deadline) {
  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    ucs_status_t status = UCS_INPROGRESS;
    wire::RingHeader header{};
  };
  auto result = std::make_shared<Result>();
  RunOnThread(
      [&] {
        Op* op = NewOp(static_cast<int>(Op::Kind::kGet));
        op->buffer.resize(sizeof(wire::RingHeader));
        op->finish = [result](Op* o) {
          std::lock_guard<std::mutex> lock(result->mu);
          result->status = o->status;
          std::memcpy(&result->header, o->buffer.data(), sizeof(wire::RingHeader));
          result->done = true;
          result->cv.notify_all();
        };
        ucp_request_param_t prm{};
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        prm.cb.send = &Endpoint::OnSendDone;
        prm.user_data = op;
        Track(op, ucp_get_nbx(ep_, op->buffer.data(), op->buffer.size(), remote_ring_addr_,
                              rkey_->handle(), &prm));
      },
      deadline);
  std::unique_lock<std::mutex> lock(result->mu);
  if (!result->cv.wait_until(lock, deadline, [&] { return result->done; })) {
    throw TimeoutError("PS shard " + peer_ +
                       ": a one-sided read of its slot ring did not complete within the timeout "
                       "(remote key check)");
  }
  if (result->status != UCS_OK) {
    ThrowStatus("PS shard " + peer_ + ": one-sided read of its slot ring (remote key check)",
                result->status);
  }
  const wire::RingHeader& h = result->header;
  if (h.magic != wire::kRingMagic || h.ring_id != reply.ring_id || h.num_slots != reply.num_slots ||
      h.slot_stride != reply.slot_stride) {
    throw TransportError(
        "remote key mismatch: PS shard " + peer_ + "'s slot ring at " + Hex(reply.ring_addr) +
        " reads back magic " + Hex(h.magic) + ", ring id " + Hex(h.ring_id) + ", " +
        std::to_string(h.num_slots) + " slots (expected " + Hex(wire::kRingMagic) + ", " +
        Hex(reply.ring_id) + ", " + std::to_string(reply.num_slots) +
        "): the remote key does not belong to the announced ring");
  }
}

// ---- shard bootstrap ----------------------------------------------------------------------------

void Endpoint::Refuse(int fd, wire::BootStatus status, const std::string& text,
                      const std::string& peer, Deadline deadline) {
  wire::BootReply r{};
  r.magic = wire::kBootMagic;
  r.status = static_cast<int32_t>(status);
  r.text_len = static_cast<uint32_t>(std::min(text.size(), wire::kMaxBootText));
  std::vector<uint8_t> out(sizeof(r) + r.text_len);
  std::memcpy(out.data(), &r, sizeof(r));
  std::memcpy(out.data() + sizeof(r), text.data(), r.text_len);
  try {
    SendAll(fd, out.data(), out.size(), deadline, peer);
  } catch (const std::exception&) {
    // The client is gone or stuck; it is refused either way.
  }
}

std::string Endpoint::CheckBootHello(const wire::BootHello& h, const AcceptLimits& limits,
                                     wire::BootStatus* status) {
  *status = wire::BootStatus::kBadRequest;
  if (h.magic != wire::kBootMagic) return "not a torchrec_bagpipe UCX client (bad magic)";
  if (h.version != wire::kBootVersion) {
    return "UCX bootstrap version " + std::to_string(h.version) + ", this shard speaks " +
           std::to_string(wire::kBootVersion);
  }
  *status = wire::BootStatus::kTooLarge;
  if (h.num_slots == 0 || h.num_slots > std::min(limits.max_slots, wire::kMaxSlots)) {
    return "num_slots " + std::to_string(h.num_slots) + " outside [1, " +
           std::to_string(std::min(limits.max_slots, wire::kMaxSlots)) + "]";
  }
  if (h.slot_bytes == 0 || h.slot_bytes > limits.max_slot_bytes) {
    return "slot_bytes " + std::to_string(h.slot_bytes) + " outside [1, " +
           std::to_string(limits.max_slot_bytes) + "]";
  }
  *status = wire::BootStatus::kBadRequest;
  if (h.token_len > wire::kMaxTokenBytes || h.address_len == 0 ||
      h.address_len > wire::kMaxWorkerAddress) {
    return "token or worker address length out of bounds";
  }
  const uint64_t ring_bytes =
      wire::kRingHeaderBytes + uint64_t{h.num_slots} * wire::SlotStride(h.slot_bytes);
  if (ring_bytes > limits.max_ring_bytes) {
    *status = wire::BootStatus::kTooLarge;
    return "a slot ring of " + std::to_string(ring_bytes) + " bytes exceeds this shard's " +
           std::to_string(limits.max_ring_bytes);
  }
  *status = wire::BootStatus::kOk;
  return {};
}

std::shared_ptr<Endpoint> Endpoint::Accept(
    std::shared_ptr<Context> context, Socket control, const std::string& peer,
    const AcceptLimits& limits, const BootRequest& request,
    const std::function<bool(const std::string& token, std::string* why)>& authorize,
    const std::function<EndpointHandlers(const std::shared_ptr<Endpoint>&)>& on_connection,
    Deadline deadline) {
  const int fd = control.fd();
  auto refuse = [&](wire::BootStatus status, const std::string& text) {
    Refuse(fd, status, text, peer, deadline);
    return std::shared_ptr<Endpoint>();
  };
  const wire::BootHello& h = request.hello;
  wire::BootStatus bad;
  if (std::string why = CheckBootHello(h, limits, &bad); !why.empty()) return refuse(bad, why);
  if (request.token.size() != h.token_len || request.address.size() != h.address_len) {
    return refuse(wire::BootStatus::kBadRequest, "token or worker address length mismatch");
  }
  const uint64_t stride = wire::SlotStride(h.slot_bytes);
  const uint64_t ring_bytes = wire::kRingHeaderBytes + uint64_t{h.num_slots} * stride;
  std::string why = "wrong job token";
  if (!authorize(request.token, &why)) return refuse(wire::BootStatus::kUnauthorized, why);

  // Declared before `ep`: they outlive its progress thread (see RunOnThread).
  std::vector<uint8_t> my_address;
  std::unique_ptr<Region> decoy;
  std::shared_ptr<Endpoint> ep(new Endpoint(Role::kServer, context, "ucx client " + peer));
  if (limits.progress) ep->group_ = limits.progress->Pick();
  ep->num_slots_ = h.num_slots;
  ep->slot_bytes_ = h.slot_bytes;
  ep->slot_stride_ = stride;
  try {
    ep->Start(deadline);
    ep->RunOnThread(
        [&] {
          ep->CreateEndpoint(request.address);
          my_address = ep->WorkerAddress();
        },
        deadline);
    ep->ring_ = Region::Allocate(context, ring_bytes);
  } catch (const std::exception& e) {
    refuse(wire::BootStatus::kInternal, e.what());
    throw;
  }
  ep->WriteRingHeader();
  std::vector<uint8_t> key;
  const wire::BootReply r = ep->MakeBootReply(limits.fault, ring_bytes, my_address, &key, &decoy);
  ep->SetHandlers(on_connection(ep));
  std::vector<uint8_t> out(sizeof(r) + key.size() + my_address.size());
  std::memcpy(out.data(), &r, sizeof(r));
  std::memcpy(out.data() + sizeof(r), key.data(), key.size());
  std::memcpy(out.data() + sizeof(r) + key.size(), my_address.data(), my_address.size());
  try {
    SendAll(fd, out.data(), out.size(), deadline, peer);
  } catch (const std::exception& e) {
    // The owner already holds the endpoint: fail it so its on_failure cleans up.
    ep->Fail(std::string("UCX bootstrap with ") + peer + " failed: " + e.what());
    throw;
  }
  // The decoy must stay registered until the client finished its check; keep it with the
  // endpoint (it is only ever set in fault-injection tests).
  if (decoy) ep->sources_.push_back(std::move(decoy));
  // The client may use the connection from the moment it has the reply, and the endpoint
  // may fail or be closed from then on (even before this line): AdoptControl passes that on
  // to the client whenever it happened (invariant 3).
  ep->AdoptControl(std::move(control));
  return ep;
}

void Endpoint::WriteRingHeader() {
  std::random_device rd;
  ring_id_ = (uint64_t{rd()} << 32) ^ rd() ^ reinterpret_cast<uintptr_t>(this);
  wire::RingHeader rh{};
  rh.magic = wire::kRingMagic;
  rh.num_slots = num_slots_;
  rh.ring_id = ring_id_;
  rh.slot_stride = slot_stride_;
  std::memcpy(ring_->data(), &rh, sizeof(rh));
}

wire::BootReply Endpoint::MakeBootReply(BootFault fault, uint64_t ring_bytes,
                                        const std::vector<uint8_t>& my_address,
                                        std::vector<uint8_t>* key,
                                        std::unique_ptr<Region>* decoy) {
  wire::BootReply r{};
  r.magic = wire::kBootMagic;
  r.status = static_cast<int32_t>(wire::BootStatus::kOk);
  r.ring_addr = reinterpret_cast<uintptr_t>(ring_->data());
  r.ring_bytes = ring_->size();
  r.slot_stride = slot_stride_;
  r.ring_id = ring_id_;
  r.num_slots = num_slots_;
  *key = ring_->PackKey();
  switch (fault) {
    case BootFault::kNone:
      break;
    case BootFault::kWrongKey:
      *decoy = Region::Allocate(context_, ring_bytes);
      *key = (*decoy)->PackKey();
      r.ring_addr = reinterpret_cast<uintptr_t>((*decoy)->data());
      break;
    case BootFault::kCorruptKey:
      break;
    case BootFault::kWrongRingId:
      r.ring_id ^= 1;
      break;
  }
  // The id messages name the connection by is the one announced (with a kWrongRingId fault
  // too: message mode never reads the ring header, so that connection must still work).
  // Messages naming it reach this endpoint from now on, before the BootReply is out.
  wire_id_ = r.ring_id;
  if (group_ != nullptr) group_->Register(wire_id_, this);
  r.key_digest = KeyDigest(key->data(), key->size());
  if (fault == BootFault::kCorruptKey) {
    for (auto& b : *key) b ^= 0x5a;
  }
  r.key_len = static_cast<uint32_t>(key->size());
  r.address_len = static_cast<uint32_t>(my_address.size());
  return r;
}

}  // namespace bagpipe::transport::ucx
