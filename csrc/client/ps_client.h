// PSClient: the trainer side of the commit protocol for one (rank, fused table). It
// partitions keys over shards, packs rows into bounded packets, submits them round-robin
// across shards with up to `inflight_packets` packets per shard in flight before waiting for
// ACKs (the Channel's slot window), and tracks every shard's committed step. Staging
// (partitioning, gathering rows into slot buffers, sending) runs on the client's own native
// worker thread; the caller only enqueues and later waits on a handle.
//
// Thread safety: every public method is thread-safe. Handles (ClientOp) may be waited on
// from any thread. Inputs passed to the *Async methods are borrowed: the caller keeps them
// alive and unmodified until the handle is done.
//
// Invariants:
//   1. Commit order: a commit starts staging only after the previous commit of this client
//      completed (all shards committed its step), so a shard never sees this rank's step
//      t+1 before it committed step t. A commit handle completes when every shard reports
//      committed_step >= step.
//   2. Reads never wait on unsent work: a get(at_step) starts only once at_step <= the last
//      step this client has fully submitted (or every shard already committed it); a get for
//      a step this client never submits fails with TimeoutError when its deadline passes.
//   3. Every rank sends every shard a packet every step: a shard without rows gets one
//      empty chunk (the marker).
//   4. Barriers: assign and checkpoint start only when nothing else is queued before them or
//      in flight, and nothing queued after them starts before they complete.
//   5. Failure is sticky: a transport failure, a failed session or an error reply to a
//      commit fails every pending and later operation of this client with that error.
//   6. Every operation has ONE deadline, its submission + options.timeout, bounding every
//      wait of it (queueing, slots, replies, the commit): past it a queued operation fails
//      with TimeoutError and a started one fails the client (a shard hangs or a rank is
//      lost; every pending and later operation then fails at once). Close drains (bounded),
//      closes the session on every reachable shard (a failed client: for at most 1 s) and
//      joins every thread; after it no callback runs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/deadline.h"
#include "protocol/partitioner.h"
#include "protocol/wire.h"
#include "store/init.h"
#include "store/optimizer.h"
#include "transport/channel.h"
#include "transport/connect.h"

namespace bagpipe::client {

namespace wire = protocol::wire;

struct ClientOptions {
  std::string table;
  uint64_t session = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t dim = 0;
  float lr = 0.0f;               // the learning rate of a commit that names none
  bool grad_division = true;
  store::InitSpec init;          // how the shards initialise never-written rows
  int64_t key_bound = -1;        // >= 0: keys must lie in [0, key_bound)
  store::OptimizerSpec optimizer;  // the table's optimizer (its rows' state layout)
  protocol::PartitionKind partition = protocol::PartitionKind::kModulo;
  uint32_t max_packet_rows = 4096;
  uint32_t inflight_packets = 8; // slots per shard channel (the in-flight window)
  double timeout = 120.0;        // seconds: bound on every internal wait
  // The committed step the session starts after, checked by every shard at Open
  // (wire::OpenBody::start_step): -1 a new job, s >= 0 a resume, wire::kAnyStartStep none.
  int64_t start_step = -1;
};

// Bytes of the largest frame a client with these options sends (the slot size).
size_t SlotBytesFor(const ClientOptions& options);
// The channel options such a client needs: one slot per in-flight packet
// (inflight_packets), each SlotBytesFor(options) bytes; io_timeout = options.timeout.
transport::ChannelOptions ChannelOptionsFor(const ClientOptions& options);

enum class OpKind : uint8_t { kCommit = 0, kGet = 1, kAssign = 2, kCheckpoint = 3 };

// An asynchronous operation's handle.
class ClientOp {
 public:
  // What the operation is (fixed at submission).
  OpKind kind() const { return kind_; }
  int64_t step() const { return step_; }  // commit step / get at_step; -1 otherwise
  // True once the operation succeeded or failed (Wait then returns or throws at once).
  bool Done() const;
  // Waits until done; throws TimeoutError at the deadline (the operation continues), or the
  // operation's error (TransportError, SessionError, ValueError, TimeoutError).
  void Wait(Deadline deadline) const;
  // kCheckpoint: the step each shard saved, in shard order. Valid after a successful Wait.
  const std::vector<int64_t>& shard_steps() const { return shard_steps_; }

 private:
  friend class PSClient;
  ClientOp(OpKind kind, int64_t step) : kind_(kind), step_(step) {}
  void Finish(const std::optional<transport::Error>& error);

  const OpKind kind_;
  const int64_t step_;

  mutable std::mutex mu_;  // guards done_ and error_
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::optional<transport::Error> error_;

  // ---- owned by PSClient (its mutex, or the worker while staging) ----------------------
  const int64_t* keys_ = nullptr;
  size_t n_ = 0;
  const float* rows_ = nullptr;  // commit grads / assign rows
  std::function<void()> ready_;   // runs on the worker before the inputs are read
  float* out_ = nullptr;         // get output (n x width)
  float lr_ = 0.0f;              // commit: the step's learning rate
  const int64_t* evict_ = nullptr;  // commit: keys evicted at the step's boundary (virtual
  size_t nevict_ = 0;               // tables), sent after the rows, each to its shard
  uint32_t state_dim_ = 0;       // get / assign: 0, or the table's state floats per row
  Deadline deadline_;
  std::vector<int64_t> order_;    // get: positions grouped by shard (owned for the replies)
  int outstanding_ = 0;           // replies not yet received
  bool staged_ = false;           // every packet posted
  bool finished_ = false;
  std::vector<int64_t> shard_steps_;
  std::string label_;             // checkpoint: the subdirectory ("" : the shard's directory)
};

struct ClientStats {
  uint64_t commits = 0;
  uint64_t gets = 0;
  uint64_t packets = 0;      // request frames sent, all shards
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t slot_waits = 0;   // times staging waited for an ACK because a window was full
  uint64_t rows_committed = 0;
  uint64_t rows_read = 0;
};

// What the shards reported about their periodic checkpoints of this table
// (wire::kNotifyCheckpoint), counted since the client opened.
struct CheckpointReport {
  uint64_t succeeded = 0;
  uint64_t failed = 0;
  uint32_t consecutive_failures = 0;  // the largest run of failures on one shard, up to now
  std::vector<int64_t> last_step;     // per shard: the last step checkpointed (-1: none)
  std::string last_error;             // the latest failure ("" if none)
};

class PSClient {
 public:
  // Opens the session on every shard (channels[s] reaches shard s) within options.timeout.
  // Throws ValueError (a field the shards refuse, naming it; a shard id out of order),
  // SessionError, TransportError, TimeoutError; on failure every channel is closed.
  PSClient(const ClientOptions& options, std::vector<std::unique_ptr<transport::Channel>> channels);
  // Connects a channel (ChannelOptionsFor(options)) to every endpoint, in shard order, then
  // opens the session as the constructor does. Throws as the constructor and
  // transport::ConnectChannel; on failure every channel is closed.
  static std::unique_ptr<PSClient> Connect(const ClientOptions& options,
                                           const std::vector<transport::ShardEndpoint>& endpoints,
                                           const transport::ConnectOptions& connect);
  ~PSClient();  // Close(options.timeout), errors swallowed
  PSClient(const PSClient&) = delete;
  PSClient& operator=(const PSClient&) = delete;

  // The options as given to the constructor.
  const ClientOptions& options() const { return options_; }
  // Optimizer state floats per row of the table (StateDim of options().optimizer).
  uint32_t state_dim() const { return state_dim_; }
  uint32_t num_shards() const { return static_cast<uint32_t>(channels_.size()); }
  const protocol::Partitioner& partitioner() const { return partitioner_; }

  // Commits this rank's gradient rows of `step` (keys n, grads n x dim; n may be 0) with the
  // step's learning rate `lr` (options().lr when unset; every rank must send the same).
  // `ready`, if set, runs on the worker thread before it reads keys/grads (e.g. waiting for
  // the CUDA event of the stream that produced them); if it throws, the commit fails.
  // REQUIRES: step >= 0, lr finite and >= 0, keys within key_bound (ValueError naming the
  // argument otherwise).
  std::shared_ptr<ClientOp> CommitAsync(int64_t step, const int64_t* keys, size_t n,
                                        const float* grads,
                                        std::function<void()> ready = nullptr,
                                        std::optional<float> lr = std::nullopt,
                                        const int64_t* evict = nullptr, size_t nevict = 0);
  // (evict: virtual tables, the keys evicted at this step's boundary, erased by their shards
  // once the step is applied; borrowed like keys. REQUIRES: within key_bound.)
  // Reads n rows into out once every shard committed at_step (-1: now): n x dim, or with
  // their optimizer state n x (dim + state_dim()) when with_state (wire.h invariant 5).
  std::shared_ptr<ClientOp> GetAsync(const int64_t* keys, size_t n, int64_t at_step, float* out,
                                     bool with_state = false);
  // Writes rows for keys on their shards (bulk load; last duplicate wins): n x dim (stored
  // rows keep their optimizer state), or n x (dim + state_dim()) with their state.
  std::shared_ptr<ClientOp> AssignAsync(const int64_t* keys, size_t n, const float* rows,
                                        bool with_state = false);
  // Checkpoints this table on every shard at its committed step, into the shard's checkpoint
  // directory, or its subdirectory `label` when not empty.
  // REQUIRES: label empty or a valid table name (wire::ValidTableName); else ValueError.
  std::shared_ptr<ClientOp> CheckpointAsync(const std::string& label = "");

  // Minimum over shards of the committed step this client knows (-1 before any commit).
  int64_t CommittedStep();
  std::vector<int64_t> ShardCommittedSteps();
  // The first fatal error, if the client failed.
  std::optional<transport::Error> failure();
  // The shards' periodic checkpoints of this table so far.
  CheckpointReport checkpoint_report();
  ClientStats stats();
  std::vector<transport::ChannelStats> channel_stats();
  std::vector<std::string> shard_peers() const;

  // Drains pending work (bounded by timeout seconds), closes the session on every shard
  // that is still reachable (a failed client tries for at most 1 s), closes the channels
  // and joins the worker. Idempotent. Throws TimeoutError if draining timed out, or the
  // error that broke a healthy drain; a client that had already failed does not throw.
  void Close(double timeout);

 private:
  class AckRequest;
  class GetRequest;
  class SyncRequest;

  std::shared_ptr<ClientOp> Enqueue(std::shared_ptr<ClientOp> op);
  void WorkerLoop();
  std::shared_ptr<ClientOp> PickReadyLocked();
  void ExpireQueuedLocked();
  // Fails the client when a started operation outlived its deadline (invariant 6).
  void ExpireActiveLocked();
  // How long staging `op` may wait for a slot: its deadline, or an earlier one of a started
  // operation (so a hung shard is reported at the first deadline, not the last).
  Deadline StagingDeadline(const std::shared_ptr<ClientOp>& op);
  void Stage(const std::shared_ptr<ClientOp>& op);
  // Commit / assign: keys and rows (gradients or weights) in chunks per shard.
  void StageRows(const std::shared_ptr<ClientOp>& op);
  // Get: keys in chunks per shard; the replies land in op->out_.
  void StageGet(const std::shared_ptr<ClientOp>& op);
  void StageCheckpoint(const std::shared_ptr<ClientOp>& op);
  // The one chunk planner and sender: the positions of shard j are off[j]..off[j+1] (of a
  // Partitioner::Split order); each shard gets ceil(rows / max_packet_rows) chunks (at least
  // one with `marker`), sent round-robin (chunk 0 of every shard, then chunk 1, ...) so the
  // shards' windows fill evenly; post_chunk stages and posts one chunk into an acquired slot.
  // `extra` (commits with evicted keys): per shard, ceil(extra rows / max_packet_rows) more
  // chunks after its row chunks, posted with begin = count = 0 (post_chunk finds them).
  template <typename PostChunk>
  void SendChunks(const std::shared_ptr<ClientOp>& op, const std::vector<size_t>& off,
                  bool marker, PostChunk&& post_chunk,
                  const std::vector<size_t>* extra = nullptr);
  void OnAckReply(const std::shared_ptr<ClientOp>& op, uint32_t shard, const transport::Reply& r);
  void OnGetReply(const std::shared_ptr<ClientOp>& op, uint32_t shard, const transport::Reply& r,
                  const int64_t* positions, size_t count, bool direct);
  void OnRequestFailure(const std::shared_ptr<ClientOp>& op, uint32_t shard,
                        const transport::Error& error, bool fatal);
  std::string ShardName(uint32_t shard) const;
  void OnNotify(uint32_t shard, const transport::Reply& r);
  void OnChannelFailure(uint32_t shard, const transport::Error& error);
  void FinishLocked(const std::shared_ptr<ClientOp>& op, const std::optional<transport::Error>& e);
  void MaybeFinishLocked(const std::shared_ptr<ClientOp>& op);
  void FailClientLocked(const transport::Error& error);
  int64_t MinCommittedLocked() const;
  void CheckKeys(const int64_t* keys, size_t n, const char* what) const;
  void OpenSessions();
  void CloseSessions(Deadline deadline, std::optional<transport::Error>* err);
  void WriteHeader(uint8_t* frame, wire::MsgType type, size_t frame_len) const;

  const ClientOptions options_;
  const uint32_t state_dim_;
  const protocol::Partitioner partitioner_;
  std::vector<std::unique_ptr<transport::Channel>> channels_;

  // Worker-owned scratch (reused across operations).
  std::vector<uint32_t> scratch_shards_;
  std::vector<int64_t> scratch_order_;
  std::vector<size_t> scratch_offsets_;
  std::vector<uint32_t> evict_shards_;  // a commit's evicted keys split by shard
  std::vector<int64_t> evict_order_;
  std::vector<size_t> evict_offsets_;

  std::mutex mu_;  // guards everything below and the ClientOp fields it owns
  std::condition_variable work_cv_;   // the worker waits here for work / readiness
  std::condition_variable idle_cv_;   // Close waits here for the drain
  std::deque<std::shared_ptr<ClientOp>> queue_;   // not started, in submission order
  std::vector<std::shared_ptr<ClientOp>> active_; // started, not finished
  std::shared_ptr<ClientOp> last_commit_;         // the latest commit that started
  int64_t last_staged_commit_ = -1;               // highest step whose packets all went out
  std::vector<int64_t> committed_;                // per shard
  struct {
    uint64_t succeeded = 0;
    uint64_t failed = 0;
    std::vector<uint32_t> consecutive_failures;   // per shard
    std::vector<int64_t> last_step;               // per shard
    std::string last_error;
  } checkpoints_;
  std::optional<transport::Error> failed_;
  bool stop_worker_ = false;
  std::atomic<bool> abort_{false};  // set when the client fails or gives up: staging stops
  bool closing_ = false;  // Close started: no new operations
  bool quiet_ = false;    // channels are being closed on purpose: their failures are not errors
  bool closed_ = false;
  ClientStats stats_;
  std::thread worker_;
};

}  // namespace bagpipe::client
