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
// Version 1 (read, never written) is version 2 without the optimizer's *_bits fields: its
// writer ran SGD only, so it decodes as the default SGD spec.
//
// Thread safety: pure functions on values.
//
// Invariants (of every decoded manifest):
//   1. optimizer passes ValidateOptimizerSpec and state_dim == StateDim(optimizer.kind, dim).
//   2. A segment has a state file iff the contents are "full" and state_dim > 0, and its
//      sizes agree with count, dim and state_dim.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "store/init.h"
#include "store/optimizer.h"

namespace bagpipe::store {

inline constexpr int kCheckpointVersion = 2;        // written
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
  std::map<std::string, std::string> meta;
};

// The MANIFEST text of m, which DecodeManifest reads back field for field (floats as their
// bits): the JSON body, then its checksum trailer. REQUIRES: m satisfies the invariants above.
std::string EncodeManifest(const Manifest& m);

// Throws ValueError (naming `what`, e.g. the path) for a torn, corrupt or unknown-version
// manifest, or one that breaks an invariant above.
Manifest DecodeManifest(const std::string& text, const std::string& what);

}  // namespace bagpipe::store
