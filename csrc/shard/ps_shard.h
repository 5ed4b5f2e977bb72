// PSShard: one parameter-server shard hosting named tables, each a TableBackend plus a
// CommitCoordinator (tables may have different dims). It is the transport layer's
// FrameHandler (transport/frame_handler.h): a backend (the local channel, the TCP and UCX
// servers of server/) delivers each request frame to HandleFrame together with the
// ServerLink the reply goes back through. Each message type has its own handler function.
//
// Thread safety: every public method is thread-safe. Requests of one link are delivered by
// one thread at a time (the link's session state, kept in ServerLink::state, is touched only
// there and in LinkClosed); different links run concurrently and meet in the table's
// coordinator.
//
// Invariants:
//   1. A link must authenticate (Hello with the expected job token) before any other
//      request; then every frame must carry the job's digest. Violations are answered with
//      kUnauthorized and HandleFrame returns false (the backend closes the connection).
//   2. A well-framed request that fails to parse is answered with kProtocolError and the
//      link stays usable; nothing is changed by it.
//   3. Tables are never removed while the shard lives, so coordinator pointers held by
//      links stay valid.
//   4. A table checkpoint lives in <dir>/table-<name>/ with meta committed_step, table,
//      shard_id and num_shards; Restore refuses a checkpoint of another shard id/count,
//      RestoreResharded re-partitions a whole set of another count.
//      Those into checkpoint_dir (periodic, drain, unlabelled requests) are chains
//      (store/embedding_store_incremental.cc); labelled ones are full.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/log.h"
#include "protocol/partitioner.h"
#include "protocol/wire.h"
#include "shard/coordinator.h"
#include "shard/table_backend.h"
#include "transport/frame_handler.h"
#include "transport/recv_buffer.h"

namespace bagpipe::shard {

struct ShardOptions {
  uint32_t shard_id = 0;
  uint32_t num_shards = 1;
  uint32_t expected_dim = 0;          // > 0: refuse tables of another dim
  std::string checkpoint_dir;         // default directory of Checkpoint() and periodic saves
  int64_t checkpoint_every = 0;       // > 0: checkpoint each table every N committed steps
  // Checkpoints into checkpoint_dir chain (store/embedding_store.h ChainPolicy): an increment
  // of the rows changed since the previous one, a full base every checkpoint_full_every
  // increments or once the increments pass checkpoint_chain_fraction of the base's bytes.
  bool checkpoint_incremental = true;
  int checkpoint_full_every = 8;             // REQUIRES: >= 1
  double checkpoint_chain_fraction = 0.5;    // REQUIRES: > 0, finite
  // Periodic checkpoints are written in the background from a snapshot of their step, while
  // later steps commit (CoordinatorOptions::checkpoint_background).
  bool checkpoint_background = false;
  size_t max_frame_bytes = wire::kDefaultMaxFrameBytes;  // announced in HelloOk
};

struct ShardStats {
  uint64_t frames = 0;          // request frames handled
  uint64_t rejected = 0;        // frames answered with an error status (any reason)
  uint64_t unauthorized = 0;    // frames refused for a token / digest / ordering problem
};

class PSShard : public transport::FrameHandler {
 public:
  // `log`: one line per session event; may be empty.
  // REQUIRES: shard_id < num_shards, checkpoint_every >= 0, checkpoint_full_every >= 1,
  // checkpoint_chain_fraction > 0, max_frame_bytes >= 4096
  // (ValueError naming the field).
  PSShard(ShardOptions options, TableBackendFactory factory, TableBackendLoader loader,
          LogFn log = nullptr);
  // Destroys the tables (pending work dropped unanswered). Servers and links hold the shard
  // by shared_ptr, so no frame is delivered to it any more.
  ~PSShard() override;
  PSShard(const PSShard&) = delete;
  PSShard& operator=(const PSShard&) = delete;

  // The options as given; a random id drawn at construction and announced in HelloOk (a
  // restarted shard has another).
  const ShardOptions& options() const { return options_; }
  uint64_t instance_id() const { return instance_id_; }

  // ---- transport::FrameHandler ---------------------------------------------------------
  Identity identity() const override;
  const LogFn& log() const override { return log_; }
  // Handles one request frame from `link`; replies through it. Returns false when the
  // connection must be closed (invariant 1). Never throws.
  // `owner`, if not null, is the buffer that holds body: a commit chunk may take it over
  // (swapping in another buffer) instead of copying its payload.
  bool HandleFrame(const std::shared_ptr<transport::ServerLink>& link,
                   const wire::FrameHeader& header, const uint8_t* body, size_t body_len,
                   transport::RecvBuffer* owner = nullptr) override;
  // The connection behind `link` is gone: its rank leaves its session.
  void LinkClosed(transport::ServerLink* link) override;

  // Creates table `name`, or returns the existing one if its schema matches (ValueError
  // naming the field otherwise).
  CommitCoordinator* CreateTable(const std::string& name, const TableSchema& schema);
  // nullptr if absent.
  CommitCoordinator* FindTable(const std::string& name);
  // Throws ValueError naming the table if absent.
  CommitCoordinator* GetTable(const std::string& name);
  std::vector<std::string> TableNames();

  // Checkpoints every table into dir (empty: options().checkpoint_dir). Returns table ->
  // committed step saved. Throws ValueError if no directory is known, IOError on failure.
  std::map<std::string, int64_t> Checkpoint(const std::string& dir);
  // Loads every table checkpoint found in dir (before serving). Returns table -> step.
  // Throws ValueError for a checkpoint of another shard or a table that already exists.
  std::map<std::string, int64_t> Restore(const std::string& dir);
  // Loads a checkpoint set written by another number of shards (ps_shard_restore.cc):
  // `dirs` are the set's shard directories (as Restore reads them), one per old shard
  // 0..K-1 in any order; this shard keeps the stored rows `partitioner` routes to it (its
  // shard_id of num_shards), weights and optimizer state bitwise. Every table must be in
  // every directory, at one committed step and with one schema. Before serving.
  // Returns table -> step. Throws ValueError naming the table and directory (no table is
  // added then).
  std::map<std::string, int64_t> RestoreResharded(const std::vector<std::string>& dirs,
                                                  protocol::PartitionKind partitioner);

  // Drain: new work is refused with kShuttingDown, deferred reads fail; Close still works.
  // Every refusal from then on (and the kNotifyShutdown notices) says "PS shard <id> is
  // shutting down: <why>". The first call wins; later ones do nothing.
  void BeginShutdown(const std::string& why);
  bool shutting_down() const { return shutting_down_.load(); }

  // Counters since construction.
  ShardStats stats();

  // The directory of table `name` inside checkpoint directory `dir`.
  static std::string TableDir(const std::string& dir, const std::string& name);

 private:
  struct Request;  // one request frame being handled (ps_shard.cc)
  class LinkSession;

  bool Dispatch(const Request& r);
  // One handler per request type; each replies (or rejects) and returns whether the link
  // stays open.
  bool OnHello(const Request& r);
  bool OnPing(const Request& r);
  bool OnOpen(const Request& r);
  bool OnCommit(const Request& r);
  bool OnGet(const Request& r);
  bool OnAssign(const Request& r);
  bool OnClose(const Request& r);
  bool OnCheckpoint(const Request& r);
  // Answers r with an error `status` (counted in stats) and returns `keep_link`.
  bool Reject(const Request& r, wire::Status status, const std::string& text, bool keep_link);
  static LinkSession& SessionOf(transport::ServerLink& link);
  CoordinatorOptions MakeCoordinatorOptions(const std::string& name) const;
  // Adds restored tables (name -> backend at its committed step); throws ValueError,
  // adding none, if one exists already.
  void AddRestored(std::map<std::string, std::pair<std::unique_ptr<TableBackend>, int64_t>> t);
  // The text refusals carry once shutting_down_ is set (it is in place before the flag).
  std::string ShutdownText();

  const ShardOptions options_;
  const LogFn log_;
  const TableBackendFactory factory_;
  const TableBackendLoader loader_;
  const uint64_t instance_id_;
  std::atomic<bool> shutting_down_{false};

  std::mutex mu_;  // guards tables_, stats_ and shutdown_text_
  std::map<std::string, std::unique_ptr<CommitCoordinator>> tables_;
  ShardStats stats_;
  std::string shutdown_text_;  // set once, before shutting_down_ goes up
};

}  // namespace bagpipe::shard
