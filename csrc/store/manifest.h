// The MANIFEST of a checkpoint: what the data files are, how to check them, and how to
// rebuild the store. Encoded as JSON followed by a trailer line "#xxh64 <16 hex>" holding the
// checksum of the JSON text, so a torn or edited manifest is detected before it is trusted.
//
// Version 1 fields: format, version, contents ("full" | "weights"), dim, init {kind, seed,
// bound_bits, value_bits, bound_starts, bound_value_bits (+ readable copies)}, key_bound,
// num_shards, page_rows, optimizer {name, state_dim}, rows, segments [{count, keys, rows,
// state?: {file, bytes, xxh64}}], meta {string: string}. Floats are stored as their IEEE bits
// so they round-trip exactly.
//
// Thread safety: pure functions on values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "store/init.h"

namespace bagpipe::store {

inline constexpr int kCheckpointVersion = 1;
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
  std::string optimizer = "sgd";
  int state_dim = 0;  // per-row optimizer state floats (0 for SGD)
  uint64_t rows = 0;
  std::vector<SegmentEntry> segments;
  std::map<std::string, std::string> meta;
};

std::string EncodeManifest(const Manifest& m);

// Throws ValueError (naming `what`, e.g. the path) for a torn, corrupt or unknown-version
// manifest.
Manifest DecodeManifest(const std::string& text, const std::string& what);

}  // namespace bagpipe::store
