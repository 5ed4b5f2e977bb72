#include "transport/ucx_endpoint.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "common/errors.h"

namespace bagpipe::transport::ucx {
namespace {

constexpr int kIdlePollMillis = 100;    // safety net: the loop re-checks at least this often
// The control connection (liveness) is looked at least this often, also while the worker
// keeps the loop busy (completions, incoming messages, ucp_worker_arm answering BUSY).
constexpr auto kLivenessCheck = std::chrono::milliseconds(10);
constexpr auto kSpin = std::chrono::microseconds(50);  // busy-poll while requests are in flight
constexpr unsigned kProgressBurst = 64;
constexpr size_t kMaxHeldMessages = 1 << 16;

constexpr size_t kMaxDoorbellEntries = 256;  // per doorbell (fits UCX's AM header limit)

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

// A UCX request we own (flush, send, receive, get). Deleted on the progress thread once its
// completion was processed.
struct Endpoint::Op {
  enum class Kind : uint8_t { kFlush, kSend, kRecv, kGet } kind;
  explicit Op(Kind k) : kind(k) {}
  Endpoint* ep = nullptr;
  ucs_status_t status = UCS_INPROGRESS;
  bool in_flight = false;  // a UCX request whose callback has not run
  bool done = false;
  std::vector<wire::DoorbellEntry> entries;     // kFlush: frames the flush covers
  std::vector<uint8_t> header;                  // kSend: prefix + head
  std::function<void(bool)> on_sent;            // kSend
  uint64_t delivery = 0;                        // kRecv
  std::shared_ptr<void> keepalive;              // kRecv: keeps the landing buffer alive
  std::vector<uint8_t> buffer;                  // kGet
  std::function<void(Op*)> finish;              // kGet
};

struct Endpoint::Incoming {
  unsigned am_id = 0;
  std::vector<uint8_t> head;
  void* data = nullptr;   // UCX-held data or rendezvous descriptor (held == true)
  size_t length = 0;
  bool rndv = false;
  bool held = false;
  std::vector<uint8_t> copy;  // data UCX did not let us keep
};

struct Endpoint::Delivery {
  uint64_t id = 0;
  bool landed = false;
  bool ok = false;
  std::function<void(bool)> done;
};

// ---- construction --------------------------------------------------------------------------

Endpoint::Endpoint(Role role, std::shared_ptr<Context> context, std::string peer)
    : role_(role), context_(std::move(context)), peer_(std::move(peer)) {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw TransportError(std::string("eventfd: ") + std::strerror(errno));
}

Endpoint::~Endpoint() {
  Close(/*graceful=*/!failed());
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Endpoint::Start(Deadline deadline) {
  if (group_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      attached_ = true;
    }
    group_->Attach(this);
  } else {
    thread_ = std::thread([this] { Loop(); });
  }
  std::unique_lock<std::mutex> lock(mu_);
  while (!started_ && setup_error_.empty()) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !started_ &&
        setup_error_.empty()) {
      lock.unlock();
      // A group may still set it up: Close waits until the group set it up and tore it
      // down, or dropped it.
      if (group_) Close(/*graceful=*/false);
      throw TimeoutError("creating a UCX worker for " + peer_ + " timed out");
    }
  }
  if (!setup_error_.empty()) {
    const std::string err = setup_error_;
    lock.unlock();
    if (thread_.joinable()) thread_.join();
    closed_ = true;
    throw TransportError(err);
  }
}

void Endpoint::SetHandlers(EndpointHandlers handlers) {
  std::lock_guard<std::mutex> lock(mu_);
  handlers_ = std::move(handlers);
  handlers_dirty_.store(true, std::memory_order_release);
}

const EndpointHandlers& Endpoint::Handlers() {
  if (handlers_dirty_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    handlers_copy_ = handlers_;
    handlers_dirty_.store(false, std::memory_order_relaxed);
  }
  return handlers_copy_;
}

void Endpoint::Enqueue(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw TransportError("UCX connection to " + peer_ + " is closed");
    commands_.push_back(std::move(fn));
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Endpoint::RunOnThread(const std::function<void()>& fn, Deadline deadline) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  Enqueue([state, &fn] {
    std::exception_ptr err;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->error = err;
    state->done = true;
    state->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_until(lock, deadline, [&] { return state->done; })) {
    // The command still references fn: the caller's endpoint must be closed (joined) before
    // fn's captures go away, which Connect/Accept guarantee by declaration order.
    throw TimeoutError("UCX set-up step for " + peer_ + " timed out");
  }
  if (state->error) std::rethrow_exception(state->error);
}

void Endpoint::AdoptControl(Socket control) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    control_ = std::move(control);
    if (failed_ || closed_) {
      // The endpoint failed or was closed before it owned its control connection (the
      // client may already be using the connection): the peer learns of it now.
      ::shutdown(control_.fd(), SHUT_RDWR);
      return;
    }
    // Published with the control connection: the progress thread touches control_ only
    // once it sees monitoring_ (acquire), or under mu_.
    monitoring_.store(true, std::memory_order_release);
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Endpoint::ShutdownControl() {
  std::lock_guard<std::mutex> lock(mu_);
  if (control_.valid()) ::shutdown(control_.fd(), SHUT_RDWR);
}

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

std::shared_ptr<Endpoint> Endpoint::Connect(const ConnectOptions& o, EndpointHandlers handlers,
                                            Deadline deadline) {
  if (o.num_slots == 0 || o.num_slots > wire::kMaxSlots) {
    throw ValueError("UCX num_slots must be in [1, " + std::to_string(wire::kMaxSlots) + "], got " +
                     std::to_string(o.num_slots));
  }
  if (o.slot_bytes == 0) throw ValueError("UCX slot_bytes must be > 0");
  if (o.source_slots.size() != o.num_slots) {
    throw ValueError("UCX source_slots must hold num_slots buffers");
  }
  if (o.token.size() > wire::kMaxTokenBytes) throw ValueError("job token longer than 1024 bytes");
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
  SendAll(s.fd(), out.data(), out.size(), deadline, peer);

  RecvAll(s.fd(), &reply, sizeof(reply), deadline, peer);
  if (reply.magic != wire::kBootMagic) {
    throw TransportError(peer + " is not a torchrec_bagpipe UCX listener (bad reply magic " +
                         Hex(reply.magic) + ")");
  }
  if (reply.status != static_cast<int32_t>(wire::BootStatus::kOk)) {
    std::string text(std::min<size_t>(reply.text_len, wire::kMaxBootText), '\0');
    try {
      RecvAll(s.fd(), text.data(), text.size(), deadline, peer);
    } catch (const std::exception&) {
      text = "(no reason given)";
    }
    throw TransportError("PS shard " + peer + " refused the UCX connection (" +
                         BootStatusName(reply.status) + "): " + text);
  }
  if (reply.key_len == 0 || reply.key_len > wire::kMaxPackedKey || reply.address_len == 0 ||
      reply.address_len > wire::kMaxWorkerAddress) {
    throw TransportError("PS shard " + peer + " sent a malformed UCX bootstrap reply (key_len " +
                         std::to_string(reply.key_len) + ", address_len " +
                         std::to_string(reply.address_len) + ")");
  }
  const uint64_t need = wire::kRingHeaderBytes + uint64_t{o.num_slots} * ep->slot_stride_;
  if (reply.num_slots != o.num_slots || reply.slot_stride != ep->slot_stride_ ||
      reply.ring_bytes < need) {
    throw TransportError("PS shard " + peer + " announced a slot ring that does not fit (" +
                         std::to_string(reply.num_slots) + " slots of stride " +
                         std::to_string(reply.slot_stride) + " in " +
                         std::to_string(reply.ring_bytes) + " bytes; asked for " +
                         std::to_string(o.num_slots) + " of " + std::to_string(ep->slot_stride_) + ")");
  }
  key.resize(reply.key_len);
  address.resize(reply.address_len);
  RecvAll(s.fd(), key.data(), key.size(), deadline, peer);
  RecvAll(s.fd(), address.data(), address.size(), deadline, peer);
  if (KeyDigest(key.data(), key.size()) != reply.key_digest) {
    throw TransportError("remote key mismatch: the packed key of PS shard " + peer +
                         "'s slot ring does not match its digest (corrupted in transit); "
                         "the key was not unpacked");
  }
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
  // kMessage never touches the ring remotely, so its key is never used (nor checked).
  if (ep->frame_mode_ == FrameMode::kPut) ep->VerifyRing(reply, deadline);
  ep->AdoptControl(std::move(s));
  return ep;
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
  const std::string& token = request.token;
  const std::vector<uint8_t>& client_address = request.address;
  std::string why = "wrong job token";
  if (!authorize(token, &why)) return refuse(wire::BootStatus::kUnauthorized, why);

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
          ep->CreateEndpoint(client_address);
          my_address = ep->WorkerAddress();
        },
        deadline);
    ep->ring_ = Region::Allocate(context, ring_bytes);
  } catch (const std::exception& e) {
    refuse(wire::BootStatus::kInternal, e.what());
    throw;
  }
  std::random_device rd;
  ep->ring_id_ = (uint64_t{rd()} << 32) ^ rd() ^ reinterpret_cast<uintptr_t>(ep.get());
  wire::RingHeader rh{};
  rh.magic = wire::kRingMagic;
  rh.num_slots = h.num_slots;
  rh.ring_id = ep->ring_id_;
  rh.slot_stride = stride;
  std::memcpy(ep->ring_->data(), &rh, sizeof(rh));

  wire::BootReply r{};
  r.magic = wire::kBootMagic;
  r.status = static_cast<int32_t>(wire::BootStatus::kOk);
  r.ring_addr = reinterpret_cast<uintptr_t>(ep->ring_->data());
  r.ring_bytes = ep->ring_->size();
  r.slot_stride = stride;
  r.ring_id = ep->ring_id_;
  r.num_slots = h.num_slots;
  std::vector<uint8_t> key = ep->ring_->PackKey();
  switch (limits.fault) {
    case BootFault::kNone:
      break;
    case BootFault::kWrongKey:
      decoy = Region::Allocate(context, ring_bytes);
      key = decoy->PackKey();
      r.ring_addr = reinterpret_cast<uintptr_t>(decoy->data());
      break;
    case BootFault::kCorruptKey:
      break;
    case BootFault::kWrongRingId:
      r.ring_id ^= 1;
      break;
  }
  r.key_digest = KeyDigest(key.data(), key.size());
  if (limits.fault == BootFault::kCorruptKey) {
    for (size_t i = 0; i < key.size(); ++i) key[i] ^= 0x5a;
  }
  r.key_len = static_cast<uint32_t>(key.size());
  r.address_len = static_cast<uint32_t>(my_address.size());

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

// ---- public operations ---------------------------------------------------------------------------

bool Endpoint::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

Failure Endpoint::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void Endpoint::WaitFailureHandled(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return !failed_ || failure_done_; });
}

EndpointStats Endpoint::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Endpoint::Fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return;
    failed_ = true;
    failure_.message = message;
    monitoring_.store(false, std::memory_order_release);  // under mu_: see AdoptControl
  }
  failed_flag_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Endpoint::PostPut(uint32_t slot, size_t len, uint64_t tag) {
  if (role_ != Role::kClient) throw std::logic_error("PostPut on a shard endpoint");
  if (slot >= num_slots_ || len == 0 || len > slot_bytes_) {
    throw ValueError("UCX put of " + std::to_string(len) + " bytes into slot " +
                     std::to_string(slot) + " does not fit the ring (" + std::to_string(num_slots_) +
                     " slots of " + std::to_string(slot_bytes_) + " bytes)");
  }
  if (failed_flag_.load(std::memory_order_acquire)) throw TransportError(failure().message);
  Enqueue([this, slot, len, tag] { DoPut(slot, len, tag); });
}

void Endpoint::FlushAndRing() {
  if (role_ != Role::kClient) throw std::logic_error("FlushAndRing on a shard endpoint");
  if (failed_flag_.load(std::memory_order_acquire)) throw TransportError(failure().message);
  if (frame_mode_ == FrameMode::kMessage) return;
  Enqueue([this] { DoFlush(); });
}

void Endpoint::SendMessage(const void* head, size_t head_len, const void* payload,
                           size_t payload_len, std::function<void(bool)> on_sent) {
  if (head_len > kMaxHeadBytes) throw ValueError("UCX message head larger than 4 KiB");
  if (OnProgressThread()) {
    DoSend(wire::kAmFrame, head, head_len, payload, payload_len, nullptr, std::move(on_sent));
    return;
  }
  std::vector<uint8_t> head_copy(static_cast<const uint8_t*>(head),
                                 static_cast<const uint8_t*>(head) + head_len);
  auto cb = std::make_shared<std::function<void(bool)>>(std::move(on_sent));
  try {
    Enqueue([this, head_copy = std::move(head_copy), payload, payload_len, cb]() mutable {
      DoSend(wire::kAmFrame, head_copy.data(), head_copy.size(), payload, payload_len, nullptr,
             std::move(*cb));
    });
  } catch (const TransportError&) {
    if (*cb) (*cb)(false);
  }
}

void Endpoint::Close(bool graceful) {
  if ((thread_.joinable() || group_) && OnProgressThread()) {
    throw std::logic_error("Endpoint::Close called from its own progress thread");
  }
  bool in_group;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_group = attached_ && !torn_down_ && !dropped_ && setup_error_.empty();
    if (closed_ && !thread_.joinable() && !in_group) {
      control_.Close();
      return;
    }
    closed_ = true;
    stop_requested_ = true;
    graceful_stop_ = graceful && !failed_;
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  std::unique_lock<std::mutex> lock(mu_);
  if (in_group) {
    // The group tears it down on its thread (invariant 5); unbounded like a join.
    cv_.wait(lock, [&] { return torn_down_ || dropped_ || !setup_error_.empty(); });
  }
  control_.Close();
}

// ---- progress thread -------------------------------------------------------------------------------

void Endpoint::Setup() {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t st = ucp_worker_create(context_->handle(), &wp, &worker_);
  if (st != UCS_OK) ThrowStatus("ucp_worker_create (" + context_->config().Describe() + ")", st);
  for (unsigned id : {wire::kAmDoorbell, wire::kAmFrame}) {
    ucp_am_handler_param_t ap{};
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ap.id = id;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    ap.cb = id == wire::kAmDoorbell ? &Endpoint::OnDoorbellAm : &Endpoint::OnFrameAm;
    ap.arg = this;
    st = ucp_worker_set_am_recv_handler(worker_, &ap);
    if (st != UCS_OK) ThrowStatus("ucp_worker_set_am_recv_handler", st);
  }
  if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;
}

bool Endpoint::SetUpOnGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      dropped_ = true;
      cv_.notify_all();
      return false;
    }
  }
  return SetupOnThisThread();
}

bool Endpoint::SetupOnThisThread() {
  try {
    Setup();
  } catch (const std::exception& e) {
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    worker_ = nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    setup_error_ = e.what();
    cv_.notify_all();
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  thread_id_ = std::this_thread::get_id();
  started_ = true;
  cv_.notify_all();
  return true;
}

Endpoint::StepResult Endpoint::Step(bool control_ready) {
  if (monitoring_.load(std::memory_order_acquire) && control_.valid()) {
    // A busy worker must not hide a torn connection: the wait that watches the control
    // connection is skipped for as long as the loop finds work.
    const auto now = Clock::now();
    if (control_ready || now >= next_liveness_check_) {
      next_liveness_check_ = now + kLivenessCheck;
      pollfd c{control_.fd(), POLLIN, 0};
      if (::poll(&c, 1, 0) > 0 && c.revents != 0) CheckControl(c.revents);
    }
  }
  bool busy = RunCommands();
  for (unsigned i = 0; i < kProgressBurst && ucp_worker_progress(worker_) != 0; ++i) busy = true;
  ProcessCompleted();
  ProcessIncoming();
  if (failed_flag_.load(std::memory_order_acquire) && !failure_handled_) {
    HandleFailure();
    busy = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_requested_ && commands_.empty()) return StepResult::kStop;
  }
  if (busy || !completed_.empty()) {
    spinning_ = false;
    return StepResult::kBusy;
  }
  if (outstanding_ > 0) {
    // Completions of requests in flight come within microseconds: poll briefly before
    // paying for a sleep and a wake-up.
    const auto now = Clock::now();
    if (!spinning_) {
      spinning_ = true;
      spin_until_ = now + kSpin;
    }
    if (now < spin_until_) return StepResult::kBusy;
  }
  spinning_ = false;
  return StepResult::kIdle;
}

bool Endpoint::ArmForWait() {
  if (efd_ >= 0 && ucp_worker_arm(worker_) == UCS_ERR_BUSY) return false;
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.sleeps;
  return true;
}

void Endpoint::DrainWake() {
  uint64_t v;
  [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof(v));
}

int Endpoint::WatchedControlFd() const {
  return monitoring_.load(std::memory_order_acquire) && control_.valid() ? control_.fd() : -1;
}

void Endpoint::FinishOnGroup() {
  Teardown();
  std::lock_guard<std::mutex> lock(mu_);
  torn_down_ = true;
  cv_.notify_all();
}

void Endpoint::Loop() {
  if (!SetupOnThisThread()) return;
  for (;;) {
    const StepResult r = Step(false);
    if (r == StepResult::kStop) break;
    if (r == StepResult::kBusy || !ArmForWait()) continue;
    pollfd fds[3];
    nfds_t n = 0;
    fds[n++] = {wake_fd_, POLLIN, 0};
    if (efd_ >= 0) fds[n++] = {efd_, POLLIN, 0};
    const int control = WatchedControlFd();
    if (control >= 0) fds[n++] = {control, POLLIN, 0};
    const int rc = ::poll(fds, n, efd_ >= 0 ? kIdlePollMillis : 1);
    if (rc > 0) {
      if (fds[0].revents & POLLIN) DrainWake();
      if (control >= 0 && fds[n - 1].revents != 0) CheckControl(fds[n - 1].revents);
    }
  }
  Teardown();
}

bool Endpoint::RunCommands() {
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
  return !cmds.empty();
}

void Endpoint::CheckControl(short revents) {
  if (!(revents & (POLLIN | POLLHUP | POLLERR))) return;
  uint8_t b = 0;
  const ssize_t n = ::recv(control_.fd(), &b, 1, MSG_DONTWAIT);
  const std::string who = role_ == Role::kClient ? "PS shard " + peer_ : peer_;
  if (n == 1 && b == wire::kByeByte) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) failure_.peer_closed = true;
    }
    Fail(who + " closed the connection");
  } else if (n == 1) {
    Fail(who + " sent an unexpected byte on the control connection");
  } else if (n == 0) {
    Fail("connection to " + who +
         " torn: control connection closed without a goodbye (peer process gone?)");
  } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    Fail("connection to " + who + " torn: " + std::strerror(errno));
  }
}

Endpoint::Op* Endpoint::NewOp(int kind) {
  Op* op = new Op(static_cast<Op::Kind>(kind));
  op->ep = this;
  live_ops_.push_back(op);
  return op;
}

void Endpoint::DeleteOp(Op* op) {
  auto it = std::find(live_ops_.begin(), live_ops_.end(), op);
  if (it != live_ops_.end()) {
    *it = live_ops_.back();
    live_ops_.pop_back();
  }
  delete op;
}

void Endpoint::Track(Op* op, ucs_status_ptr_t st) {
  if (st == nullptr) {
    op->status = UCS_OK;
    completed_.push_back(op);
  } else if (UCS_PTR_IS_ERR(st)) {
    op->status = UCS_PTR_STATUS(st);
    completed_.push_back(op);
  } else {
    op->in_flight = true;
    ++outstanding_;
  }
}

void Endpoint::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->status = status;
  op->in_flight = false;
  --op->ep->outstanding_;
  op->ep->completed_.push_back(op);
  ucp_request_free(request);
}

void Endpoint::OnRecvDone(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  OnSendDone(request, status, user_data);
}

void Endpoint::OnEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* self = static_cast<Endpoint*>(arg);
  // A peer that said goodbye and then closed its endpoint is a graceful close, whichever of
  // the two this side notices first.
  if (self->monitoring_.load(std::memory_order_acquire) && self->control_.valid()) {
    uint8_t b = 0;
    if (::recv(self->control_.fd(), &b, 1, MSG_PEEK | MSG_DONTWAIT) == 1 && b == wire::kByeByte) {
      self->CheckControl(POLLIN);
      return;
    }
  }
  const std::string who = self->role_ == Role::kClient ? "PS shard " + self->peer_ : self->peer_;
  self->Fail(StatusText("connection to " + who + " torn: UCX endpoint failed", status));
}

ucs_status_t Endpoint::OnDoorbellAm(void* arg, const void* header, size_t header_len, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<Endpoint*>(arg)->ReceiveAm(wire::kAmDoorbell, header, header_len, data,
                                                length, param);
}

ucs_status_t Endpoint::OnFrameAm(void* arg, const void* header, size_t header_len, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<Endpoint*>(arg)->ReceiveAm(wire::kAmFrame, header, header_len, data, length,
                                                param);
}

ucs_status_t Endpoint::ReceiveAm(unsigned am_id, const void* header, size_t header_len,
                                 void* data, size_t length, const ucp_am_recv_param_t* param) {
  if (failed_flag_.load(std::memory_order_acquire)) return UCS_OK;  // dropped
  // Doorbells only flow to shards, frame messages only to clients.
  const unsigned expected = role_ == Role::kServer ? wire::kAmDoorbell : wire::kAmFrame;
  if (am_id != expected) {
    Fail("UCX message of the wrong kind (" + std::to_string(am_id) + ") from " + peer_);
    return UCS_OK;
  }
  if (header_len < sizeof(wire::MessagePrefix)) {
    Fail("malformed UCX message from " + peer_ + " (no sequence prefix)");
    return UCS_OK;
  }
  wire::MessagePrefix prefix;
  std::memcpy(&prefix, header, sizeof(prefix));
  if (prefix.seq < next_recv_seq_ || incoming_.count(prefix.seq) != 0 ||
      incoming_.size() >= kMaxHeldMessages) {
    Fail("UCX message from " + peer_ + " out of sequence (seq " + std::to_string(prefix.seq) +
         ", expected " + std::to_string(next_recv_seq_) + ")");
    return UCS_OK;
  }
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const bool persistent = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
  Incoming in;
  in.am_id = am_id;
  const auto* h = static_cast<const uint8_t*>(header);
  in.head.assign(h + sizeof(prefix), h + header_len);
  in.length = length;
  ucs_status_t ret = UCS_OK;
  if (length > 0) {
    if (rndv || persistent) {
      in.data = data;
      in.rndv = rndv;
      in.held = true;
      ret = UCS_INPROGRESS;
    } else {
      const auto* d = static_cast<const uint8_t*>(data);
      in.copy.assign(d, d + length);
    }
  }
  incoming_.emplace(prefix.seq, std::move(in));
  return ret;
}

void Endpoint::ProcessCompleted() {
  while (!completed_.empty()) {
    std::vector<Op*> ops;
    ops.swap(completed_);
    for (Op* op : ops) {
      const bool ok = op->status == UCS_OK;
      switch (op->kind) {
        case Op::Kind::kFlush:
          op->done = true;  // deleted by SendDoorbells, in flush order
          if (!ok) Fail(StatusText("flushing writes to PS shard " + peer_, op->status));
          break;
        case Op::Kind::kSend:
          if (!ok) Fail(StatusText("sending to " + peer_, op->status));
          if (op->on_sent) op->on_sent(ok);
          DeleteOp(op);
          break;
        case Op::Kind::kRecv:
          if (!ok) Fail(StatusText("receiving a payload from " + peer_, op->status));
          if (!deliveries_.empty() && op->delivery >= deliveries_.front().id &&
              op->delivery - deliveries_.front().id < deliveries_.size()) {
            Delivery& d = deliveries_[op->delivery - deliveries_.front().id];
            d.landed = true;
            d.ok = ok;
          }
          DeleteOp(op);
          break;
        case Op::Kind::kGet:
          if (op->finish) op->finish(op);
          DeleteOp(op);
          break;
      }
    }
    SendDoorbells();
    FinishDeliveries();
  }
}

void Endpoint::SendDoorbells() {
  while (!flushes_.empty() && flushes_.front()->done) {
    Op* f = flushes_.front();
    flushes_.pop_front();
    if (f->status == UCS_OK && !failed_flag_.load(std::memory_order_acquire)) {
      // The flush completed: every write it covers is visible in the ring. Name them.
      for (size_t i = 0; i < f->entries.size(); i += kMaxDoorbellEntries) {
        const size_t n = std::min(kMaxDoorbellEntries, f->entries.size() - i);
        DoSend(wire::kAmDoorbell, f->entries.data() + i, n * sizeof(wire::DoorbellEntry), nullptr,
               0, nullptr, nullptr);
      }
    }
    DeleteOp(f);
  }
}

void Endpoint::DoPut(uint32_t slot, size_t len, uint64_t tag) {
  if (failed_flag_.load(std::memory_order_acquire) || ep_ == nullptr) return;
  const wire::DoorbellEntry entry{slot, 0, len, tag};
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.frames;
    if (frame_mode_ == FrameMode::kPut) {
      ++stats_.puts;
      stats_.put_bytes += len;
    }
  }
  if (frame_mode_ == FrameMode::kMessage) {
    // The frame is the doorbell's payload, sent zero-copy from the registered source slot.
    DoSend(wire::kAmDoorbell, &entry, sizeof(entry), source_ptrs_[slot], len,
           sources_[slot]->memh(), nullptr);
    return;
  }
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  prm.memh = sources_[slot]->memh();
  const uint64_t remote = remote_ring_addr_ + wire::kRingHeaderBytes + uint64_t{slot} * slot_stride_;
  ucs_status_ptr_t st = ucp_put_nbx(ep_, source_ptrs_[slot], len, remote, rkey_->handle(), &prm);
  if (UCS_PTR_IS_ERR(st)) {
    Fail(StatusText("one-sided write into PS shard " + peer_ + "'s slot " + std::to_string(slot),
                    UCS_PTR_STATUS(st)));
    return;
  }
  // The write's completion is observed through the flush that covers it.
  if (st != nullptr) ucp_request_free(st);
  unrung_.push_back(entry);
}

void Endpoint::DoFlush() {
  if (failed_flag_.load(std::memory_order_acquire) || ep_ == nullptr || unrung_.empty()) return;
  Op* op = NewOp(static_cast<int>(Op::Kind::kFlush));
  op->entries.swap(unrung_);
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = &Endpoint::OnSendDone;
  prm.user_data = op;
  flushes_.push_back(op);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.flushes;
  }
  Track(op, ucp_ep_flush_nbx(ep_, &prm));
}

void Endpoint::DoSend(unsigned am_id, const void* head, size_t head_len, const void* payload,
                      size_t payload_len, ucp_mem_h memh, std::function<void(bool)> on_sent) {
  if (failed_flag_.load(std::memory_order_acquire) || ep_ == nullptr) {
    if (on_sent) on_sent(false);
    return;
  }
  Op* op = NewOp(static_cast<int>(Op::Kind::kSend));
  const wire::MessagePrefix prefix{next_send_seq_++};
  op->header.resize(sizeof(prefix) + head_len);
  std::memcpy(op->header.data(), &prefix, sizeof(prefix));
  if (head_len > 0) std::memcpy(op->header.data() + sizeof(prefix), head, head_len);
  op->on_sent = std::move(on_sent);
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = &Endpoint::OnSendDone;
  prm.user_data = op;
  if (memh != nullptr) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = memh;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (am_id == wire::kAmFrame) {
      ++stats_.messages_sent;
      stats_.message_bytes_sent += head_len + payload_len;
    } else {
      ++stats_.doorbells;
    }
  }
  Track(op, ucp_am_send_nbx(ep_, am_id, op->header.data(), op->header.size(), payload,
                            payload_len, &prm));
}

void Endpoint::Land(Incoming& in, uint8_t* dst, std::function<void(bool)> done,
                    std::shared_ptr<void> keepalive) {
  const uint64_t id = next_delivery_id_++;
  deliveries_.push_back(Delivery{id, false, false, std::move(done)});
  Delivery& d = deliveries_.back();
  const uint8_t* bytes = in.held ? static_cast<const uint8_t*>(in.data) : in.copy.data();
  if (in.length == 0) {
    d.landed = true;
    d.ok = true;
  } else if (dst == nullptr || failed_flag_.load(std::memory_order_acquire)) {
    if (in.held) ucp_am_data_release(worker_, in.data);
    d.landed = true;
    d.ok = false;
  } else if (!in.rndv) {
    std::memcpy(dst, bytes, in.length);
    if (in.held) ucp_am_data_release(worker_, in.data);
    d.landed = true;
    d.ok = true;
  } else {
    Op* op = NewOp(static_cast<int>(Op::Kind::kRecv));
    op->delivery = id;
    op->keepalive = std::move(keepalive);
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.recv_am = &Endpoint::OnRecvDone;
    prm.user_data = op;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.rendezvous_receives;
    }
    Track(op, ucp_am_recv_data_nbx(worker_, in.data, dst, in.length, &prm));
  }
  in.held = false;
  FinishDeliveries();
}

void Endpoint::DispatchRingFrames(const std::vector<wire::DoorbellEntry>& entries) {
  for (const auto& e : entries) {
    if (failed_flag_.load(std::memory_order_acquire)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.ring_frames;
    }
    if (Handlers().on_ring_frame) {
      RingFrame f;
      f.slot = e.slot;
      f.data = ring_->data() + wire::kRingHeaderBytes + uint64_t{e.slot} * slot_stride_;
      f.len = e.len;
      f.tag = e.tag;
      Handlers().on_ring_frame(f);
    }
  }
}

void Endpoint::HandleDoorbell(Incoming& in) {
  const size_t n = in.head.size() / sizeof(wire::DoorbellEntry);
  std::vector<wire::DoorbellEntry> entries(n);
  bool ok = in.head.size() % sizeof(wire::DoorbellEntry) == 0 && n > 0 && n <= kMaxDoorbellEntries;
  if (ok) std::memcpy(entries.data(), in.head.data(), in.head.size());
  std::string why;
  for (size_t i = 0; ok && i < n; ++i) {
    const auto& e = entries[i];
    if (e.slot >= num_slots_ || e.len == 0 || e.len > slot_bytes_) {
      ok = false;
      why = "names slot " + std::to_string(e.slot) + " with " + std::to_string(e.len) +
            " bytes, outside the ring (" + std::to_string(num_slots_) + " slots of " +
            std::to_string(slot_bytes_) + " bytes)";
    }
  }
  // A doorbell with a payload carries exactly one frame (kMessage mode).
  if (ok && in.length > 0 && (n != 1 || in.length != entries[0].len)) {
    ok = false;
    why = "carries " + std::to_string(in.length) + " payload bytes for " + std::to_string(n) +
          " frames";
  }
  if (!ok) {
    if (in.held) ucp_am_data_release(worker_, in.data);
    in.held = false;
    Fail("malformed doorbell from " + peer_ + (why.empty() ? std::string() : ": " + why));
    return;
  }
  uint8_t* dst = in.length > 0 ? ring_->data() + wire::kRingHeaderBytes +
                                     uint64_t{entries[0].slot} * slot_stride_
                               : nullptr;
  Land(in, dst,
       [this, entries = std::move(entries)](bool landed) {
         if (landed) DispatchRingFrames(entries);
       },
       nullptr);
}

void Endpoint::HandleFrameMessage(Incoming& in) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.messages_received;
    stats_.message_bytes_received += in.head.size() + in.length;
  }
  Landing landing;
  if (Handlers().on_message) {
    landing = Handlers().on_message(in.head.data(), in.head.size(), in.length);
  } else {
    Fail("unexpected UCX message from " + peer_);
  }
  Land(in, landing.dst, std::move(landing.done), std::move(landing.keepalive));
}

void Endpoint::ProcessIncoming() {
  while (!incoming_.empty() && incoming_.begin()->first == next_recv_seq_ &&
         !failed_flag_.load(std::memory_order_acquire)) {
    Incoming in = std::move(incoming_.begin()->second);
    incoming_.erase(incoming_.begin());
    ++next_recv_seq_;
    if (in.am_id == wire::kAmDoorbell) {
      HandleDoorbell(in);
    } else {
      HandleFrameMessage(in);
    }
    if (in.held) ucp_am_data_release(worker_, in.data);
  }
}

void Endpoint::FinishDeliveries() {
  while (!deliveries_.empty() && deliveries_.front().landed) {
    Delivery d = std::move(deliveries_.front());
    deliveries_.pop_front();
    if (d.done) d.done(d.ok);
  }
}

void Endpoint::CloseEndpoint(bool force) {
  if (ep_ == nullptr) return;
  rkey_.reset();
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &prm);
  ep_ = nullptr;
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  const Deadline deadline = DeadlineAfter(kCloseTimeout);
  while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < deadline) {
    ucp_worker_progress(worker_);
    ProcessCompleted();
  }
  ucp_request_free(req);
}

void Endpoint::WaitOutstanding(Deadline deadline) {
  while (outstanding_ > 0 && Clock::now() < deadline) {
    ucp_worker_progress(worker_);
    ProcessCompleted();
  }
  ProcessCompleted();
}

void Endpoint::HandleFailure() {
  failure_handled_ = true;
  // Tell the peer first: it sees the tear on its control connection now, not after the
  // bounded waits below (up to 2 x kCloseTimeout) and this endpoint's owner closing it.
  ShutdownControl();
  CloseEndpoint(/*force=*/true);
  WaitOutstanding(DeadlineAfter(kCloseTimeout));
  for (auto& [seq, in] : incoming_) {
    if (in.held) ucp_am_data_release(worker_, in.data);
  }
  incoming_.clear();
  unrung_.clear();
  // Flushes that never completed name frames the shard will never see.
  while (!flushes_.empty() && flushes_.front()->done) SendDoorbells();
  // Sends UCX never completed keep their buffers (on_sent is not called: the buffer may
  // still be read); their callers learn of the failure from on_failure.
  for (auto& d : deliveries_) {
    if (!d.landed) {
      d.landed = true;
      d.ok = false;
    }
  }
  FinishDeliveries();
  Failure failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure = failure_;
    failure_done_ = true;
    cv_.notify_all();
  }
  if (Handlers().on_failure) Handlers().on_failure(failure);
}

void Endpoint::Teardown() {
  bool graceful;
  {
    std::lock_guard<std::mutex> lock(mu_);
    graceful = graceful_stop_ && !failed_;
  }
  if (graceful && ep_ != nullptr) WaitOutstanding(DeadlineAfter(kCloseTimeout));
  // Goodbye first: the peer then reads our endpoint closing as the graceful close it is.
  if (graceful && monitoring_.load() && control_.valid()) {
    const uint8_t bye = wire::kByeByte;
    [[maybe_unused]] ssize_t n = ::send(control_.fd(), &bye, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  monitoring_.store(false);
  // A forced close tells the peer first (see HandleFailure); a graceful one said Bye.
  if (!graceful) ShutdownControl();
  CloseEndpoint(/*force=*/!graceful);
  WaitOutstanding(DeadlineAfter(kCloseTimeout));
  for (auto& [seq, in] : incoming_) {
    if (in.held) ucp_am_data_release(worker_, in.data);
  }
  incoming_.clear();
  flushes_.clear();   // their ops are in live_ops_
  deliveries_.clear();
  completed_.clear();
  rkey_.reset();
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  // No callback can run after the worker is gone: free what UCX never completed.
  for (Op* op : live_ops_) delete op;
  live_ops_.clear();
  outstanding_ = 0;
  std::lock_guard<std::mutex> lock(mu_);
  failure_done_ = true;
  cv_.notify_all();
}

}  // namespace bagpipe::transport::ucx
