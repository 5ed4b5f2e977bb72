// Checkpoint files: a crash-safe directory commit (CheckpointWriter) and a verifying reader
// (CheckpointReader). The store decides what goes into the files (embedding_store_save.cc,
// embedding_store_load.cc); this file decides how they reach the disk.
//
// Layout of a checkpoint directory (see manifest.h for the MANIFEST fields):
//   MANIFEST              JSON + checksum trailer, written last
//   keys-SSSS.bin         int64 keys of segment SSSS (one segment per shard of the writer)
//   rows-SSSS.bin         float32 rows, count x dim, row-major, no padding
//   state-SSSS.bin        float32 optimizer state, count x state_dim (absent for SGD and in
//                         weights-only checkpoints)
//
// Crash safety: everything is written into a sibling temp directory ".<name>.tmp-<pid>-<n>",
// each file and the directory are fsync'd, then the temp directory replaces <name> in one
// renameat2(RENAME_EXCHANGE) (or rename when <name> is new) and the parent is fsync'd. A
// crash at any point leaves either the previous checkpoint or the new one under <name>;
// temp directories of dead processes are removed by the next save.
//
// Thread safety: a CheckpointWriter's File objects may be written from different threads
// at once (one thread per File); Create and Commit are called from one thread.
//
// Invariants:
//   1. <name> is only ever replaced by a directory whose MANIFEST was durable first.
//   2. A reader trusts no byte before its checksum matched: sizes are checked on open,
//      contents at Finish().
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/checksum.h"
#include "store/manifest.h"

namespace bagpipe::store {

class CheckpointWriter {
 public:
  // REQUIRES: `dir` is absent, an empty directory or a checkpoint (ValueError otherwise).
  // Creates missing parent directories. Throws IOError when the file system refuses.
  explicit CheckpointWriter(const std::string& dir);
  // Removes the temp directory unless Commit succeeded.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  class File {
   public:
    // Move-only; the destructor closes the file (Finish not called: it stays incomplete and
    // the temp directory is removed with the writer).
    File(File&&) noexcept;
    ~File();
    // Appends n bytes (buffered; counted in the checksum). Throws IOError.
    void Write(const void* data, size_t n);
    // Flushes, fsyncs and closes; returns the file's entry for the manifest.
    FileEntry Finish();

   private:
    friend class CheckpointWriter;
    File(int fd, std::string name);
    void Flush();
    int fd_;
    std::string name_;
    std::vector<char> buf_;
    size_t used_ = 0;
    uint64_t bytes_ = 0;
    Checksum sum_;
  };

  // A new data file in the temp directory.
  File Create(const std::string& name);

  // Writes the MANIFEST and swaps the temp directory into place (see the header comment).
  void Commit(const Manifest& manifest);

 private:
  std::string dir_;     // final path
  std::string parent_;
  std::string tmp_;     // temp directory path
  bool committed_ = false;
};

class CheckpointReader {
 public:
  // Reads and verifies the MANIFEST. Throws ValueError for a missing, torn, corrupt or
  // unknown-version manifest (naming the path).
  explicit CheckpointReader(const std::string& dir);

  // The verified manifest, and the checkpoint directory as given.
  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }

  class File {
   public:
    // Move-only; the destructor closes the file.
    File(File&&) noexcept;
    ~File();
    // Reads up to n bytes (fewer only at the end).
    size_t Read(void* buf, size_t n);
    // Throws ValueError unless every byte was read and the checksum matches.
    void Finish();

   private:
    friend class CheckpointReader;
    File(int fd, FileEntry entry, std::string path);
    int fd_;
    FileEntry entry_;
    std::string path_;
    uint64_t read_ = 0;
    Checksum sum_;
  };

  // Opens a data file named by the manifest; its size must match (ValueError otherwise).
  File Open(const FileEntry& entry) const;

 private:
  std::string dir_;
  Manifest manifest_;
};

}  // namespace bagpipe::store
