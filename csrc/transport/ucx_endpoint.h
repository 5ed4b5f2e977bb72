// One end of a UCX connection between a PS client and a PS shard: a UCP worker, an endpoint
// to the peer's worker, the TCP control connection, and a progress thread that owns them.
//
//   client                                          shard
//   source slots (registered) --ucp_put_nbx-->      slot ring (registered, RingHeader + slots)
//   ucp_ep_flush_nbx, then doorbell AM -------->    on_ring_frame(slot, frame) in post order
//   on_message(head) -> Landing  <-------------     SendMessage(head, payload): AM, eager or
//                                                   rendezvous (received straight into Landing)
//
// Frame modes (chosen by the client per endpoint, from the lanes UCX selected):
//   * kPut: the endpoint has native RMA lanes (RC verbs, shared memory via CMA/posix): frames
//     are written one-sided into the shard's ring slots, then one flush covers every write
//     posted since the last doorbell, then one doorbell names them all.
//   * kMessage: no native RMA (TCP). UCX 1.13 would emulate RMA in software on the shard's
//     progress thread, with no bounds check against the registered ring and a fatal abort of
//     the shard when the peer dies mid-write; instead each frame travels as the payload of its
//     own doorbell and is received (eager copy, or rendezvous fetch) into the same ring slot.
//   Either way the shard sees the same thing: frame bytes in ring slot i, then on_ring_frame.
//
// Thread safety:
//   * All UCP calls on the worker, its endpoint and remote key happen on the progress thread.
//     Public methods are thread-safe and hand work to it through a command queue (an eventfd
//     wakes it); SendMessage called on the progress thread itself runs at once.
//   * Handlers run on the progress thread, outside UCX callbacks and outside any Endpoint
//     lock; they may call SendMessage / PostPut / FlushAndRing / Fail, never Close.
//
// Invariants:
//   1. Frames reach on_ring_frame in the order PostPut was called, each only once its bytes
//      are in the ring: kPut sends a doorbell only after the flush covering its writes
//      completed, doorbells go out in flush order; kMessage lands the doorbell's payload in
//      the slot first. Every active message carries a seq the receiver acts on strictly in
//      order (UCP does not promise AM ordering across protocols or lanes).
//   2. Messages reach on_message in send order (SendMessage call order, whichever threads
//      call it: invariant 7) and their Landing.done calls run in that
//      order, each after its payload landed in Landing.dst (a rendezvous payload is received
//      by UCX straight into dst, with no bounce buffer).
//   2b. A handler sees a ring slot's frame until the shard answers it; the client reuses a
//      slot only after that answer (Channel's slot ownership), so frames are never copied.
//   3. Every wait is bounded: connecting (deadline), closing (kCloseTimeout); liveness comes
//      from the control connection (EOF without Bye = torn), looked at every few
//      milliseconds however busy the worker keeps the loop, and, where the transports
//      support it, UCP peer-failure detection. An endpoint that fails or is force-closed
//      shuts its control connection down before anything else, so the peer learns of it at
//      once; one that failed or was closed before it even owned its control connection
//      (the shard's reply is out, the client already uses the connection) shuts it down
//      when it gets it (AdoptControl).
//   4. On failure (Fail, an endpoint error, a failed operation, a torn control connection):
//      the UCP endpoint is force-closed and outstanding requests get a bounded time to
//      complete BEFORE on_failure runs; then pending Landings get done(false) in order,
//      unsent messages on_sent(false), and on_failure runs exactly once. A request UCX never
//      completes (UCX 1.13 cannot cancel sends or AM receives) keeps its buffers and its
//      Landing.keepalive until the worker is destroyed, so no write lands in freed memory.
//      Later PostPut/FlushAndRing throw TransportError.
//   5. After Close() returns, no handler runs and the progress thread is joined (or the
//      progress group let go of the endpoint).
//   6. An endpoint's progress thread is its own, or (shards: AcceptLimits::progress) the
//      thread of a ProgressGroup shared with other endpoints (ucx_progress.h); either way
//      every UCP call on its worker happens on that one thread. A grouped endpoint uses the
//      group's shared UCP worker (shared_worker_): it never destroys it, unregisters its ring
//      id at teardown, and hands requests UCX never completed to the group (orphans), so
//      no callback of the shared worker reaches a torn-down endpoint.
//   7. SendMessage calls leave in call order: one made on the progress thread while commands
//      from other threads are queued (or later in the running batch) queues behind them
//      instead of sending at once (a shard's refusal never overtakes a notice sent before it).
//
// The implementation is one file per phase (ucx_endpoint_internal.h lists them).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/ucx_context.h"
#include "transport/ucx_memory.h"
#include "transport/ucx_progress.h"
#include "transport/socket.h"
#include "transport/ucx_wire.h"

namespace bagpipe::transport::ucx {

// A frame the client wrote into the ring, announced by a doorbell. `data` points into the
// registered ring slot and stays valid until the client reuses the slot, i.e. until the
// shard answered the frame.
struct RingFrame {
  uint32_t slot = 0;
  const uint8_t* data = nullptr;
  size_t len = 0;
  uint64_t tag = 0;
};

// Where an incoming message's payload goes. dst == nullptr drops a non-empty payload.
struct Landing {
  uint8_t* dst = nullptr;
  std::function<void(bool landed)> done;  // may be empty
  // Kept alive while UCX may still write into dst, even past done(false) (a rendezvous
  // receive UCX cannot cancel is held until it completes or the worker is destroyed).
  std::shared_ptr<void> keepalive;
};

struct Failure {
  std::string message;
  bool peer_closed = false;  // the peer said Bye (a graceful close), not a torn connection
};

struct EndpointHandlers {
  std::function<void(const RingFrame&)> on_ring_frame;  // shard side
  // Client side: head = the bytes the shard passed as `head` to SendMessage.
  std::function<Landing(const uint8_t* head, size_t head_len, size_t payload_len)> on_message;
  std::function<void(const Failure&)> on_failure;
};

enum class FrameMode : uint8_t { kPut = 0, kMessage = 1 };

struct EndpointStats {
  uint64_t frames = 0;           // frames posted (PostPut calls)
  uint64_t puts = 0;             // of which one-sided writes into the ring (kPut mode)
  uint64_t put_bytes = 0;
  uint64_t flushes = 0;          // endpoint flushes (kPut mode)
  uint64_t doorbells = 0;        // doorbell messages (kMessage mode: one per frame)
  uint64_t messages_sent = 0;    // frame messages (not doorbells)
  uint64_t message_bytes_sent = 0;
  uint64_t messages_received = 0;
  uint64_t message_bytes_received = 0;
  uint64_t rendezvous_receives = 0;  // payloads UCX fetched straight into a Landing
  uint64_t ring_frames = 0;      // frames delivered from the ring (shard side)
  uint64_t sleeps = 0;           // times the progress thread armed the worker and slept
};

struct ConnectOptions {
  std::string host;
  uint16_t port = 0;
  std::string token;
  UcxConfig config;
  uint32_t num_slots = 0;               // REQUIRES: 1..wire::kMaxSlots
  size_t slot_bytes = 0;                // REQUIRES: > 0
  std::vector<uint8_t*> source_slots;   // num_slots buffers of slot_bytes; registered here;
                                        // the caller keeps them alive past Close()
};

// Test hook: what a shard does wrong on purpose during the bootstrap.
enum class BootFault : uint8_t {
  kNone = 0,
  kWrongKey,      // announces a valid key of another region (a remote-key mismatch)
  kCorruptKey,    // flips bytes of the packed key after computing its digest
  kWrongRingId,   // announces a ring id that differs from the one in the ring
};

class Endpoint {
 public:
  enum class Role : uint8_t { kClient, kServer };

  // Client: connects to a shard's UCX listener (ucx_wire.h bootstrap). Throws TransportError
  // (refused, unauthorized, remote-key mismatch, UCX failure) or TimeoutError.
  static std::shared_ptr<Endpoint> Connect(const ConnectOptions& options,
                                           EndpointHandlers handlers, Deadline deadline);

  // Shard: the server half of the bootstrap. The caller (server/ucx_acceptor.h) reads the
  // client's request off the control connection without blocking (CheckBootHello bounds it
  // as soon as its fixed part is in) and passes it here with the connection.
  struct AcceptLimits {
    uint32_t max_slots = wire::kMaxSlots;
    size_t max_slot_bytes = size_t{256} << 20;
    size_t max_ring_bytes = size_t{1} << 30;
    BootFault fault = BootFault::kNone;
    // The threads that drive accepted endpoints (ucx_progress.h); null: a thread each.
    std::shared_ptr<ProgressPool> progress;
  };
  struct BootRequest {
    wire::BootHello hello{};
    std::string token;             // hello.token_len bytes
    std::vector<uint8_t> address;  // hello.address_len bytes: the client's worker address
  };
  // Empty if a BootHello is acceptable under limits; otherwise why, with *status the
  // BootStatus to refuse it with.
  static std::string CheckBootHello(const wire::BootHello& hello, const AcceptLimits& limits,
                                    wire::BootStatus* status);
  // Sends a refusal (status + text) on a control connection, best effort, until deadline.
  static void Refuse(int fd, wire::BootStatus status, const std::string& text,
                     const std::string& peer, Deadline deadline);
  // `authorize` checks the token (false: refused, *why says why); `on_connection` returns the
  // handlers of the new endpoint (called before the client can send anything). Returns
  // nullptr when the client was refused (it got a BootReply saying why). Throws on I/O errors
  // and timeouts. REQUIRES: control is non-blocking.
  static std::shared_ptr<Endpoint> Accept(
      std::shared_ptr<Context> context, Socket control, const std::string& peer,
      const AcceptLimits& limits, const BootRequest& request,
      const std::function<bool(const std::string& token, std::string* why)>& authorize,
      const std::function<EndpointHandlers(const std::shared_ptr<Endpoint>&)>& on_connection,
      Deadline deadline);

  // Close(graceful unless failed). REQUIRES: as Close.
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Fixed by the bootstrap: which side this is, who the peer is, the ring's geometry.
  Role role() const { return role_; }
  const std::string& peer() const { return peer_; }
  uint32_t num_slots() const { return num_slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  // How this client writes frames (set by Connect; shards accept both).
  FrameMode frame_mode() const { return frame_mode_; }

  // Client. Queues the frame in source slot `slot` (len bytes) for ring slot `slot`: a
  // one-sided write (kPut) or a doorbell carrying it (kMessage). REQUIRES: slot < num_slots,
  // 0 < len <= slot_bytes, the slot's previous frame was answered, the source slot stays
  // unchanged until then. Throws TransportError once the endpoint failed.
  void PostPut(uint32_t slot, size_t len, uint64_t tag);
  // Client. kPut: queues a flush of the endpoint, then doorbells naming every frame written
  // since the previous ones. kMessage: nothing to do (frames already went out). Throws
  // TransportError once the endpoint failed.
  void FlushAndRing();
  // Sends head (copied; <= 4 KiB) and payload_len bytes at payload, which the caller keeps
  // unchanged until on_sent runs (true: sent; false: dropped because the endpoint failed).
  // Messages leave in call order across threads: on the progress thread with no command
  // queued it sends at once, otherwise it queues behind what is queued.
  void SendMessage(const void* head, size_t head_len, const void* payload, size_t payload_len,
                   std::function<void(bool sent)> on_sent);
  // Fails the endpoint (invariant 4). Thread-safe, idempotent (the first message wins).
  void Fail(const std::string& message);
  // graceful: says Bye and flushes (bounded); otherwise force-closes. Joins the progress
  // thread. Idempotent. REQUIRES: not called from a handler.
  void Close(bool graceful = true);

  // Whether the endpoint failed, and the first failure (message "" if none).
  bool failed() const;
  Failure failure() const;
  // Waits (bounded) until a failed endpoint finished its failure handling (invariant 4):
  // after it, UCX writes nothing more into Landing buffers. Returns at once if not failed.
  void WaitFailureHandled(Deadline deadline);
  // Counters since construction; whether the caller is the endpoint's progress thread.
  EndpointStats stats() const;
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_id_; }

  static constexpr double kCloseTimeout = 2.0;  // seconds
  static constexpr size_t kMaxHeadBytes = 4096;

 private:
  friend class ProgressGroup;
  struct Op;
  struct Incoming;
  struct Delivery;
  enum class StepResult : uint8_t { kIdle, kBusy, kStop };

  Endpoint(Role role, std::shared_ptr<Context> context, std::string peer);

  // Starts the progress thread and waits until it created the worker.
  void Start(Deadline deadline);
  // Runs fn on the progress thread and waits for it (deadline); rethrows its exception.
  void RunOnThread(const std::function<void()>& fn, Deadline deadline);
  void Enqueue(std::function<void()> fn);
  // Progress thread: whether commands queued earlier have not run yet (queued, or later in
  // the batch RunCommands is running).
  bool CommandsPending();
  // Hands the control connection to the endpoint and starts watching it (liveness). If the
  // endpoint already failed or was closed, shuts it down instead so the peer learns of it.
  void AdoptControl(Socket control);
  // Shuts the control connection down (the peer sees EOF at once), if there is one.
  void ShutdownControl();
  void SetHandlers(EndpointHandlers handlers);
  // The current handlers (progress thread): refreshed whenever SetHandlers ran since.
  const EndpointHandlers& Handlers();
  std::vector<uint8_t> WorkerAddress();        // progress thread
  void CreateEndpoint(const std::vector<uint8_t>& remote_address);  // progress thread
  // Client: reads the shard's BootReply, its packed key and worker address off the control
  // connection and checks them against this endpoint's ring (slots, stride, key digest).
  // Throws TransportError (a refusal names the shard's reason) or TimeoutError.
  void ReceiveBootReply(int fd, Deadline deadline, wire::BootReply* reply,
                        std::vector<uint8_t>* key, std::vector<uint8_t>* address);
  // Client: reads the RingHeader back through the remote key and compares it.
  void VerifyRing(const wire::BootReply& reply, Deadline deadline);
  // Shard: picks a random ring id and writes the RingHeader at the start of ring_.
  void WriteRingHeader();
  // Shard: the BootReply announcing ring_ and *key, its packed remote key, with `fault`
  // injected (a kWrongKey decoy ring of ring_bytes is allocated into *decoy).
  wire::BootReply MakeBootReply(BootFault fault, uint64_t ring_bytes,
                                const std::vector<uint8_t>& my_address, std::vector<uint8_t>* key,
                                std::unique_ptr<Region>* decoy);

  // ---- progress thread ---------------------------------------------------------------------
  void Loop();  // an endpoint's own thread: Step, arm, poll, until stopped; then Teardown
  // Creates the worker on the calling thread (the progress thread from now on); false if the
  // set-up failed (setup_error_ set).
  bool SetupOnThisThread();
  // A group's thread: SetupOnThisThread unless the endpoint was closed first (then it is
  // dropped). False: not set up (Start / Close are told).
  bool SetUpOnGroup();
  // One iteration: commands, worker progress, completions, incoming messages, failure
  // handling. kBusy: step again without waiting; kStop: Close asked to stop.
  StepResult Step(bool control_ready);
  // Arms the worker's event fd before a wait; false if events are pending (step again).
  bool ArmForWait();
  void DrainWake();
  // The control connection's fd while it is watched (liveness), else -1.
  int WatchedControlFd() const;
  // A group's thread: Teardown, then lets Close return.
  void FinishOnGroup();
  void Setup();
  void Teardown();
  bool RunCommands();
  void ProcessCompleted();
  void ProcessIncoming();
  void FinishDeliveries();
  void HandleFailure();
  void CheckControl(short revents);
  void DoPut(uint32_t slot, size_t len, uint64_t tag);
  void DoFlush();
  void SendDoorbells();
  void DoSend(unsigned am_id, const void* head, size_t head_len, const void* payload,
              size_t payload_len, ucp_mem_h memh, std::function<void(bool)> on_sent);
  void Track(Op* op, ucs_status_ptr_t st);
  Op* NewOp(int kind);
  void DeleteOp(Op* op);
  void DispatchRingFrames(const std::vector<wire::DoorbellEntry>& entries);
  void HandleDoorbell(Incoming& in);
  void HandleFrameMessage(Incoming& in);
  // Lands an incoming payload in dst (copy or rendezvous receive) and queues `done` to run in
  // message order once it landed.
  void Land(Incoming& in, uint8_t* dst, std::function<void(bool)> done,
            std::shared_ptr<void> keepalive);
  void CloseEndpoint(bool force);
  void WaitOutstanding(Deadline deadline);

  static ucs_status_t OnDoorbellAm(void* arg, const void* header, size_t header_len, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnFrameAm(void* arg, const void* header, size_t header_len, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  ucs_status_t ReceiveAm(unsigned am_id, const void* header, size_t header_len, void* data,
                         size_t length, const ucp_am_recv_param_t* param);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

  // ---- immutable after the bootstrap ---------------------------------------------------------
  const Role role_;
  const std::shared_ptr<Context> context_;
  const std::string peer_;
  uint32_t num_slots_ = 0;
  size_t slot_bytes_ = 0;
  size_t slot_stride_ = 0;
  uint64_t ring_id_ = 0;
  uint64_t wire_id_ = 0;  // the ring id the BootReply announced: every MessagePrefix names it
  uint64_t remote_ring_addr_ = 0;                 // client: remote RingHeader address
  std::unique_ptr<Region> ring_;                  // shard: RingHeader + slots
  std::vector<std::unique_ptr<Region>> sources_;  // client: one registration per source slot
  std::vector<uint8_t*> source_ptrs_;
  FrameMode frame_mode_ = FrameMode::kPut;
  // Set by AdoptControl under mu_; the progress thread reads it once monitoring_ is set
  // (acquire) or under mu_; closed by Close under mu_ after the thread is joined.
  Socket control_;
  int wake_fd_ = -1;
  std::thread thread_;                   // the endpoint's own progress thread, or
  std::shared_ptr<ProgressGroup> group_;  // the group whose thread drives it (set before Start)
  std::thread::id thread_id_;

  // ---- progress thread only -------------------------------------------------------------------
  ucp_worker_h worker_ = nullptr;
  bool shared_worker_ = false;  // worker_ is group_'s (ucx_progress.h), not this endpoint's
  ucp_ep_h ep_ = nullptr;
  int efd_ = -1;
  std::unique_ptr<RemoteKey> rkey_;
  std::vector<wire::DoorbellEntry> unrung_;  // puts not yet covered by a flush
  std::deque<Op*> flushes_;                  // in issue order; doorbell sent when done
  std::vector<Op*> completed_;               // ops completed inside UCX callbacks
  std::map<uint64_t, Incoming> incoming_;    // received, not yet acted on, by seq
  std::deque<Delivery> deliveries_;          // messages whose done has not run yet
  uint64_t next_send_seq_ = 0;
  uint64_t next_recv_seq_ = 0;
  uint64_t next_delivery_id_ = 0;
  size_t outstanding_ = 0;                   // UCX requests whose callback has not run
  std::vector<Op*> live_ops_;                // every Op not yet deleted (freed at teardown)
  bool failure_handled_ = false;
  size_t batch_left_ = 0;  // commands of the running RunCommands batch not yet started
  bool spinning_ = false;
  Clock::time_point spin_until_{};
  Clock::time_point next_liveness_check_{};
  EndpointHandlers handlers_copy_;           // refreshed from handlers_ by Handlers()

  // ---- shared ------------------------------------------------------------------------------------
  mutable std::mutex mu_;  // guards every field below
  std::condition_variable cv_;
  std::vector<std::function<void()>> commands_;
  EndpointHandlers handlers_;
  bool failed_ = false;
  Failure failure_;
  bool stop_requested_ = false;
  bool graceful_stop_ = false;
  bool closed_ = false;
  bool started_ = false;
  bool attached_ = false;    // handed to group_ (Start)
  bool dropped_ = false;     // group_ dropped it unstarted (closed first)
  bool torn_down_ = false;   // group_ finished its teardown
  bool failure_done_ = false;  // HandleFailure (or the teardown) finished
  std::string setup_error_;
  EndpointStats stats_;
  std::atomic<bool> failed_flag_{false};
  std::atomic<bool> monitoring_{false};
  std::atomic<bool> handlers_dirty_{false};  // handlers_ changed since handlers_copy_ was taken
};

}  // namespace bagpipe::transport::ucx
