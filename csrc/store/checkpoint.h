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
//   inc-IIII-*.bin        increment IIII of a chain (manifest.h version 3): its keys-, rows-
//                         and state-SSSS.bin as above, and deleted.bin (int64 keys)
//
// An increment is committed like any checkpoint: the temp directory gets hard links to the
// files of the chain it extends (Link; a copy where the file system has no hard links),
// the new link's files and a MANIFEST naming them all, then replaces <name>. A linked file
// is never opened for writing: new files have names no earlier link used.
//
// Crash safety: everything is written into a sibling temp directory ".<name>.tmp-<pid>-<n>",
// each file and the directory are fsync'd, then the temp directory replaces <name> in one
// renameat2(RENAME_EXCHANGE) (or rename when <name> is new) and the parent is fsync'd. A
// crash at any point leaves either the previous checkpoint or the new one under <name>;
// temp directories of dead processes are removed by the next save.
//
// Thread safety: a CheckpointWriter's File objects may be written from different threads
// at once (one thread per File), and Create may be too (it only opens a new file in the temp
// directory); Link and Commit are called from one thread, with no Create running.
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

  // A new data file in the temp directory. REQUIRES: no file of that name in it yet.
  File Create(const std::string& name);

  // Puts the data file `entry` of the checkpoint in `from_dir` into the temp directory
  // under its name, as a hard link (a copy where links fail). Throws IOError.
  // REQUIRES: no file of that name in the temp directory yet.
  void Link(const std::string& from_dir, const FileEntry& entry);

  // Writes the MANIFEST and swaps the temp directory into place (see the header comment).
  // Returns the checksum of the MANIFEST file's bytes (ManifestDigest of the result).
  uint64_t Commit(const Manifest& manifest);

 private:
  std::string dir_;     // final path
  std::string parent_;
  std::string tmp_;     // temp directory path
  bool committed_ = false;
};

// The checksum of the bytes of dir/MANIFEST as they are (not verified); 0 when it cannot be
// read. A store compares it with its Commit's to know that dir still holds its own chain.
uint64_t ManifestDigest(const std::string& dir);

class CheckpointReader {
 public:
  // Reads and verifies the MANIFEST. Throws ValueError for a missing, torn, corrupt or
  // unknown-version manifest (naming the path).
  explicit CheckpointReader(const std::string& dir);

  // The verified manifest, and the checkpoint directory as given.
  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  // The checksum of the MANIFEST bytes read (as ManifestDigest).
  uint64_t digest() const { return digest_; }

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
  uint64_t digest_ = 0;
};

}  // namespace bagpipe::store
