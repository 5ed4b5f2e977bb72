// SegmentFiles: the data files of one segment of a store checkpoint (checkpoint.h layout):
// "<prefix>keys-GGGG.bin", "<prefix>rows-GGGG.bin" and, with state, "<prefix>state-GGGG.bin",
// written in step and finished into the manifest's SegmentEntry. Shared by Save
// (embedding_store_save.cc) and the chained checkpoints' snapshot writer
// (embedding_store_snapshot.cc).
//
// Thread safety: as CheckpointWriter::File: one thread per SegmentFiles.
//
// Invariants:
//   1. The files hold the same rows in the same order: row i of each is key i's.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "store/checkpoint.h"
#include "store/manifest.h"

namespace bagpipe::store {

class SegmentFiles {
 public:
  // Creates the segment's files in writer's temp directory. Throws IOError.
  SegmentFiles(CheckpointWriter& writer, const std::string& prefix, size_t segment,
               bool with_state)
      : keys_(writer.Create(Name(prefix, "keys", segment))),
        rows_(writer.Create(Name(prefix, "rows", segment))) {
    if (with_state) state_.emplace(writer.Create(Name(prefix, "state", segment)));
  }

  // Appends n rows: keys, rows (n x dim floats) and, with state, state (n x state_dim).
  // Throws IOError.
  void Write(const int64_t* keys, const float* rows, const float* state, size_t n, size_t dim,
             size_t state_dim) {
    keys_.Write(keys, n * sizeof(int64_t));
    rows_.Write(rows, n * dim * sizeof(float));
    if (state_) state_->Write(state, n * state_dim * sizeof(float));
    count_ += n;
  }

  // Flushes and fsyncs every file; their entry for the manifest. Throws IOError.
  SegmentEntry Finish() {
    SegmentEntry seg;
    seg.count = count_;
    seg.keys = keys_.Finish();
    seg.rows = rows_.Finish();
    if (state_) {
      seg.has_state = true;
      seg.state = state_->Finish();
    }
    return seg;
  }

 private:
  static std::string Name(const std::string& prefix, const char* kind, size_t segment) {
    char name[32];
    std::snprintf(name, sizeof(name), "%s-%04zu.bin", kind, segment);
    return prefix + name;
  }

  CheckpointWriter::File keys_;
  CheckpointWriter::File rows_;
  std::optional<CheckpointWriter::File> state_;
  uint64_t count_ = 0;  // rows written
};

}  // namespace bagpipe::store
