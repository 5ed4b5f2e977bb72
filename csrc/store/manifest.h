// The MANIFEST of a checkpoint: what the data files are, how to check them, and how to
// rebuild the store. Encoded as JSON followed by a trailer line "#xxh64 <16 hex>" holding the
// checksum of the JSON text, so a torn or edited manifest is detected before it is trusted.
//
// Version 2 fields: format, version, contents ("full" | "weights"), dim, init {kind, seed,
// bound_bits, value_bits, bound_starts, bound_value_bits (+ readable copies)}, key_bound,
// num_shards, page_rows, optimizer {name, state_dim, eps_bits, beta1_bits, beta2_bits,
// weight_decay_bits, initial_accumulator_value_bits (+ readable copies)}, rows, segments
// [{count, keys, rows, state?: {file, bytes, xxh64}}], meta {string: string}. fp32 values
// are stored as their IEEE bits, the optimizer's doubles as their 64 IEEE bits, so they
// round-trip exactly.
// Version 3 adds "chain" (manifest_chain.cc): an incremental checkpoint is the base above
// (rows, segments: a full checkpoint) plus increment links, applied in order. chain {id (16
// hex), base {link, step, meta}, increments [{link, parent, step, rows, total_rows,
// deletions {count, file}, segments [...], meta}]}: link i is "<id>:<i>" (the base is link
// 0) and names link i-1 as its parent; an increment holds the rows changed since its
// parent (weights and state, as a base's segments) and the keys erased since then; meta
// (top level) is the last link's. A manifest without increments is a full checkpoint.
// Versions 1 and 2 (read, never written) have no chain: a base alone, at step -1.
// Version 1 is version 2 without the optimizer's *_bits fields: its writer ran SGD only, so
// it decodes as the default SGD spec.
//
// Thread safety: pure functions on values.
//
// Invariants (of every decoded manifest):
//   1. optimizer passes ValidateOptimizerSpec and state_dim == StateDim(optimizer.kind, dim).
//   2. A segment has a state file iff the contents are "full" and state_dim > 0, and its
//      sizes agree with count, dim and state_dim.
//   3. Increment i (from 1) has index i, its link and parent are "<id>:<i>" and
//      "<id>:<i-1>", its rows are the sum of its segment counts, its deletions file holds
//      deletions.count keys, and its step is >= its parent's. Only a "full" manifest has
//      increments. Every data file name appears once in the whole manifest.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "store/init.h"
#include "store/optimizer.h"

namespace bagpipe::store {

inline constexpr int kCheckpointVersion = 3;        // written
inline constexpr int kOldestCheckpointVersion = 1;  // still read
inline constexpr const char* kCheckpointFormat = "torchrec_bagpipe.embedding_store";

struct FileEntry {
  std::string file;
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

struct SegmentEntry {
  uint64_t count = 0;  // rows in this segment
  FileEntry keys;      // count int64 keys
  FileEntry rows;      // count x dim float32
  bool has_state = false;
  FileEntry state;     // count x state_dim float32 (optimizer state), when has_state
};

// One increment of a chain (manifest.h version 3).
struct IncrementEntry {
  uint32_t index = 0;          // 1, 2, ... in chain order (the base is link 0)
  int64_t step = -1;           // the caller's step of this point (the shard's committed step)
  uint64_t rows = 0;           // rows written: changed since the parent (sum of segment counts)
  uint64_t total_rows = 0;     // rows stored once this increment is applied
  uint64_t deletion_count = 0; // keys erased since the parent (not stored at this point)
  FileEntry deletions;         // deletion_count int64 keys, ascending
  std::vector<SegmentEntry> segments;
  std::map<std::string, std::string> meta;
};

// The chain of a version 3 manifest: the base (the manifest's rows and segments) and its
// increments.
struct ChainEntry {
  uint64_t id = 0;             // drawn when the base was written (0: a version 1/2 manifest)
  int64_t base_step = -1;
  std::map<std::string, std::string> base_meta;
  std::vector<IncrementEntry> increments;
};

// "<id as 16 hex>:<index>": the name of link `index` of chain `id`.
std::string LinkName(uint64_t id, uint32_t index);
// Data bytes of segments (keys, rows, state files).
uint64_t SegmentBytes(const std::vector<SegmentEntry>& segments);
// Data bytes of an increment (its segments and its deletions file).
uint64_t IncrementBytes(const IncrementEntry& inc);

struct Manifest {
  int version = kCheckpointVersion;
  bool weights_only = false;
  int dim = 0;
  InitSpec init;
  int64_t key_bound = -1;
  int num_shards = 0;
  uint32_t page_rows = 0;
  OptimizerSpec optimizer;
  int state_dim = 0;  // per-row optimizer state floats (StateDim(optimizer.kind, dim))
  uint64_t rows = 0;
  std::vector<SegmentEntry> segments;
  std::map<std::string, std::string> meta;  // the last link's
  ChainEntry chain;
};

// The MANIFEST text of m, which DecodeManifest reads back field for field (floats as their
// bits): the JSON body, then its checksum trailer. REQUIRES: m satisfies the invariants above.
std::string EncodeManifest(const Manifest& m);

// Throws ValueError (naming `what`, e.g. the path) for a torn, corrupt or unknown-version
// manifest, or one that breaks an invariant above.
Manifest DecodeManifest(const std::string& text, const std::string& what);

}  // namespace bagpipe::store
