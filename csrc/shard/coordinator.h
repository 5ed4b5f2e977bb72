// CommitCoordinator: the PS side of the sparse-gradient commit protocol for one table of
// one shard ("Sparse gradient commits" in the PS-owned BagPipe design).
//
// A session is one job on this table: session id, world size W, dim and the
// gradient-division flag, fixed by the first Open and checked on every later Open, which
// must also describe this table (TableSchema: dim, init, key bound, optimizer). Each step t,
// every rank sends this shard its chunks (chunk_index / chunk_count; a rank with no rows
// sends one empty chunk, the marker), each carrying the step's learning rate. Each chunk is
// acknowledged at once (the ACK is sent before any update work). When every rank's chunks of
// the pending step are in, the chunks are applied in the order rank 0 chunk 0, rank 0 chunk
// 1, ..., rank W-1, with ONE TableBackend::ApplyGradientsSegments(chunks, lr,
// grad_division ? W : 1) (bitwise one ApplyGradients on their concatenation, without copying
// the gradients); then committed_step becomes t, deferred reads waiting for t are served and
// every attached rank is notified.
//
// Thread safety: every public method is thread-safe; one internal mutex serializes them,
// including the backend calls, so a read never observes a half-applied step. The one
// exception is the write half of a background checkpoint (checkpoint_background), which
// runs on the coordinator's writer thread beside them (TableBackend::BeginCheckpointChain).
// Link::Send is called with that mutex held (links must not call back into the coordinator).
//
// Invariants:
//   1. Exactly once: the update of step t is applied at most once; a chunk of a step
//      <= committed_step is acknowledged (kAlreadyCommitted) without SGD.
//   2. Order: only step committed_step + 1 is accepted as new work; any later step fails the
//      session ("out-of-order step").
//   3. Conflicts: a second copy of a pending (step, rank, chunk) must be byte-identical,
//      and a rank's chunk_count must not change within a step; otherwise the session fails
//      ("conflicting retry"). Every chunk of a step carries the same lr (bitwise); otherwise
//      the session fails ("conflicting lr").
//   4. A failed session stays failed (every request answers kSessionFailed with the first
//      error) until every rank has left; the next Open starts a fresh session at the same
//      committed step. Pending chunks are dropped when the last rank leaves.
//   5. Determinism: the applied gradient depends only on the chunk payloads, never on
//      arrival order or interleaving.
//   6. Reads: Get(at_step) is served once committed_step >= at_step, with the rows of the
//      committed step current when it is served; deferred reads are served under the same
//      lock hold that advanced the step, before any later step can be applied.
//   7. Every attached rank hears of what it cannot see otherwise: each periodic checkpoint's
//      outcome (kNotifyCheckpoint, failures included) and the shard draining
//      (kNotifyShutdown).
//   8. A periodic checkpoint of step s holds exactly step s, written in the background or
//      not; at most one is being written at a time, and an explicit Checkpoint (and the
//      destructor) waits for it first.
//
// Files: coordinator.cc (sessions, reads, bulk loads), coordinator_commit.cc (SubmitChunk and
// the step's application), coordinator_checkpoint.cc (checkpoints and their writer).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/deadline.h"
#include "common/log.h"
#include "protocol/wire.h"
#include "shard/table_backend.h"
#include "transport/frame_handler.h"
#include "transport/recv_buffer.h"

namespace bagpipe::shard {

namespace wire = protocol::wire;

struct CoordinatorOptions {
  LogFn log;                    // one line per session event; may be empty
  std::string checkpoint_dir;   // where the periodic checkpoint goes (empty: none)
  int64_t checkpoint_every = 0; // > 0: checkpoint after every step s with (s + 1) % N == 0
  std::map<std::string, std::string> checkpoint_meta;  // extra meta of every checkpoint
  // How checkpoints into checkpoint_dir chain (increments of the rows changed since the
  // previous one; store/embedding_store.h ChainPolicy). Checkpoints elsewhere are full.
  store::ChainPolicy checkpoint_chain;
  // Periodic checkpoints are written by a background thread from a snapshot of their step
  // (commits of later steps go on meanwhile); false: the step's commit writes it.
  bool checkpoint_background = false;
};

struct SessionParams {
  uint64_t session = 0;
  uint32_t world_size = 1;
  uint32_t dim = 0;
  bool grad_division = true;
  // The committed step this rank's Open declares it starts after (wire::OpenBody): -1 a new
  // job, s >= 0 a resume from step s, wire::kAnyStartStep no check. Per Open, not fixed by
  // the first one: each rank's declaration is checked against the table.
  int64_t start_step = -1;
};

struct CoordinatorStats {
  int64_t committed_step = -1;
  int64_t steps_applied = 0;
  int64_t rows_applied = 0;
  int64_t chunks_received = 0;
  int64_t duplicate_chunks = 0;
  int64_t committed_retries = 0;
  int64_t reads = 0;
  int64_t rows_read = 0;
  int64_t deferred_reads = 0;
  int64_t checkpoints = 0;              // checkpoints written (full and incremental)
  int64_t incremental_checkpoints = 0;  // of which increments
  int64_t checkpoint_bytes = 0;         // data bytes they wrote
  int64_t checkpoint_links = 0;         // links of the chain in checkpoint_dir after the last
};

class CommitCoordinator {
 public:
  // `committed_step`: -1 for a new table, the checkpoint's step for a restored one.
  CommitCoordinator(std::string table, std::unique_ptr<TableBackend> backend,
                    int64_t committed_step, CoordinatorOptions options);
  // Pending chunks and deferred reads are dropped unanswered.
  ~CommitCoordinator();
  CommitCoordinator(const CommitCoordinator&) = delete;
  CommitCoordinator& operator=(const CommitCoordinator&) = delete;

  // Fixed at construction: the table's name and its backend's schema.
  const std::string& table() const { return table_; }
  const TableSchema& schema() const { return schema_; }

  // Attaches `link` as `rank` of the session described by params. `table_schema` must be
  // this table's (SchemaDifference). The first Open (no rank attached) fixes the parameters;
  // later ones must agree. Throws ValueError naming the table and the disagreeing field
  // (dim, init, key_bound, optimizer.<field>, world_size, grad_division, session),
  // StartStepError naming the table and both steps if params.start_step is not the
  // committed step (unless wire::kAnyStartStep): the session's steps would otherwise be
  // renumbered (acknowledged, not applied), or SessionError if the session is failed.
  // Returns the committed step.
  int64_t Open(const SessionParams& params, uint32_t rank, const TableSchema& table_schema,
               const std::shared_ptr<transport::ServerLink>& link);

  // Rank `rank` (attached through `link`) leaves cleanly. If the pending step already has
  // chunks but not all of this rank's, the session fails (the step could never complete).
  // Returns the committed step.
  int64_t Close(uint32_t rank, transport::ServerLink* link);

  // The connection `link` went away without a Close: its rank leaves as in Close, and its
  // deferred reads are dropped.
  void Detach(transport::ServerLink* link);

  // Takes one commit chunk from the rank attached through `link` and replies (ACK or error)
  // through it; then applies the step if it is complete. Never throws: errors become
  // replies, and protocol violations fail the session (invariants 2, 3).
  // `owner`, if not null and holding chunk.payload, may be taken over (swapped with the
  // chunk slot's previous buffer) instead of copying the payload; otherwise it is untouched.
  // REQUIRES: chunk parsed by wire::ParseCommit, its pointers valid during the call.
  void SubmitChunk(const wire::CommitView& chunk,
                   const std::shared_ptr<transport::ServerLink>& link,
                   uint64_t tag, uint32_t slot, transport::RecvBuffer* owner = nullptr);

  // Serves a read of n keys now or once committed_step >= at_step, replying through `link`
  // (kGetOk with the rows, or an error). `state_dim` 0 reads weights only; the table's
  // state_dim reads rows with their optimizer state (table_backend.h invariant 4); any other
  // value is refused. Never throws. REQUIRES: keys holds n keys (copied when deferred).
  void Get(int64_t at_step, const int64_t* keys, size_t n, uint32_t dim, uint32_t state_dim,
           const std::shared_ptr<transport::ServerLink>& link, uint64_t tag, uint32_t slot);

  // Bulk load (outside the step protocol); rows with their state when with_state.
  // Throws ValueError for a key out of range. REQUIRES: rows n x (dim [+ state_dim]).
  void Assign(const int64_t* keys, size_t n, const float* rows, bool with_state = false);

  // Reads rows (with their state when with_state) at the current committed step
  // (in-process use); returns that step. Throws ValueError. REQUIRES: out n x (dim
  // [+ state_dim]).
  int64_t Read(const int64_t* keys, size_t n, float* out, bool with_state = false);

  // Waits until committed_step >= at_step or the deadline, then reads. Throws TimeoutError /
  // SessionError / ValueError.
  int64_t ReadAt(int64_t at_step, const int64_t* keys, size_t n, float* out,
                 Deadline deadline, bool with_state = false);

  // Saves the table at its committed step into dir (meta: options' checkpoint_meta plus
  // committed_step and table): into options' checkpoint_dir as a chained checkpoint (an
  // increment when checkpoint_chain allows), elsewhere a full one. Returns the step saved.
  // Throws IOError / ValueError.
  int64_t Checkpoint(const std::string& dir);

  // Drain: fails every deferred read (kShuttingDown), tells every attached rank
  // (wire::kNotifyShutdown with `why`), and refuses new work, every refusal carrying `why`.
  // Idempotent (the first reason stays).
  void Shutdown(const std::string& why);

  // Snapshots under the mutex: the committed step, whether the session failed and why (the
  // first error, "" if none), the ranks attached now, the counters since construction.
  int64_t committed_step() const;
  bool failed() const;
  std::string failure() const;
  int attached_ranks() const;
  CoordinatorStats stats() const;
  // The backend's own counters (TableBackend::Stats), read under the mutex.
  std::map<std::string, int64_t> backend_stats();

 private:
  struct Chunk {
    bool present = false;
    // The payload, keys (nrows x int64) then grads (nrows x dim x fp32), is
    // buf.data[offset, offset + len): a copy, or the receive buffer it arrived in. buf
    // outlives the step and is reused (or handed back to a reader) by the next one.
    transport::RecvBuffer buf;
    size_t offset = 0;
    size_t len = 0;
    uint32_t nrows = 0;
    uint32_t nevict = 0;  // virtual tables: evicted keys after the grads (erased after apply)
    const uint8_t* payload() const { return buf.data.get() + offset; }
  };
  std::vector<int64_t> evict_scratch_;  // ApplyLocked: the step's evicted keys
  struct RankPending {
    uint32_t chunk_count = 0;  // 0: no chunk of this rank yet
    uint32_t received = 0;
    std::vector<Chunk> chunks;
  };
  struct Waiter {
    int64_t at_step;
    std::vector<int64_t> keys;
    uint32_t state_dim;  // 0 or the table's
    std::shared_ptr<transport::ServerLink> link;
    uint64_t tag;
    uint32_t slot;
  };

  // What SubmitChunk does with a chunk once it is checked.
  struct ChunkVerdict {
    enum Kind : uint8_t { kStore, kAck, kRefuse } kind = kStore;
    wire::Disposition disposition = wire::Disposition::kStored;  // kAck
    wire::Status status = wire::Status::kOk;                      // kRefuse
    std::string text;                                             // kRefuse
    static ChunkVerdict Store() { return {}; }
    static ChunkVerdict Ack(wire::Disposition d) { return {kAck, d, wire::Status::kOk, {}}; }
    static ChunkVerdict Refuse(wire::Status s, std::string t) {
      return {kRefuse, wire::Disposition::kStored, s, std::move(t)};
    }
  };
  // SubmitChunk's steps: the session's checks, the step protocol's (they may fail the
  // session), keeping the chunk, and its acknowledgement.
  ChunkVerdict AdmitChunkLocked(const wire::CommitBody& b, const transport::ServerLink* link,
                                const std::string& what);
  ChunkVerdict SequenceChunkLocked(const wire::CommitView& chunk, const std::string& what);
  void StoreChunkLocked(const wire::CommitView& chunk, transport::RecvBuffer* owner);
  void AckChunkLocked(const wire::CommitBody& b, transport::ServerLink& link, uint64_t tag,
                      uint32_t slot, wire::Disposition d);
  void FailLocked(const std::string& why);
  // Checkpoints (coordinator_checkpoint.cc): the meta of one of committed_, a blocking one,
  // the counters and log line of a chained one, and the periodic one after ApplyLocked.
  std::map<std::string, std::string> CheckpointMetaLocked() const;
  void CheckpointLocked(const std::string& dir);
  void RecordChainLocked(int64_t step, const store::CheckpointResult& r);
  void PeriodicCheckpointLocked();
  // Tells every attached rank how the periodic checkpoint of `step` went (error "": ok).
  void ReportCheckpointLocked(int64_t step, const std::string& error);
  // The background writer: waits (holding mu_) until no write is queued or running, and
  // reports a finished one not yet reported; the thread's loop.
  void WaitForWriterLocked();
  void ReapWriterLocked();
  void WriterLoop();
  void ApplyLocked();
  void ServeLocked(const Waiter& w);
  void ServeReadyWaitersLocked();
  void LeaveLocked(uint32_t rank, const char* how);
  void ResetIfEmptyLocked();
  bool PendingHasChunksLocked() const;
  std::string CheckKeysLocked(const int64_t* keys, size_t n) const;
  int AttachedLocked() const;

  const std::string table_;
  const std::unique_ptr<TableBackend> backend_;
  const TableSchema schema_;
  const CoordinatorOptions options_;
  const LogFn& log_ = options_.log;

  mutable std::mutex mu_;  // guards everything below and every backend_ call
  int64_t committed_ = -1;
  bool has_session_ = false;  // parameters fixed by the first Open
  SessionParams params_;
  bool failed_ = false;
  std::string failure_;
  bool shutting_down_ = false;
  std::string shutdown_why_;  // set with shutting_down_: every refusal after it names it
  std::vector<std::shared_ptr<transport::ServerLink>> attached_;  // by rank; null: absent
  std::vector<RankPending> pending_;  // by rank, for step committed_ + 1
  uint32_t ranks_complete_ = 0;
  bool pending_has_lr_ = false;  // a chunk of the pending step arrived: pending_lr_ is its lr
  float pending_lr_ = 0.0f;
  std::deque<Waiter> waiters_;
  std::vector<store::GradSegment> apply_segments_;  // the step's chunks in order (reused)
  std::condition_variable committed_cv_;
  CoordinatorStats stats_;

  // The background checkpoint writer (running iff options_.checkpoint_background).
  struct Job {
    int64_t step = -1;
    TableBackend::PendingWrite write;
  };
  struct Outcome {
    int64_t step = -1;
    store::CheckpointResult result;
    std::string error;  // "" : written
  };
  std::mutex ckpt_mu_;  // guards the ckpt_ fields; taken after mu_, never before it
  std::condition_variable ckpt_cv_;
  std::optional<Job> ckpt_job_;      // set under mu_ for the writer, taken by it
  bool ckpt_busy_ = false;           // a job is queued or being written
  int64_t ckpt_writing_ = -1;        // the step of the job being written
  std::optional<Outcome> ckpt_done_; // a written job not yet reported
  bool ckpt_stop_ = false;           // set by the destructor
  std::thread writer_;               // last member: started when every other one exists
};

}  // namespace bagpipe::shard
