#include "store/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "common/errors.h"

namespace bagpipe::store {

namespace {

constexpr size_t kWriteBuffer = size_t{1} << 20;

[[noreturn]] void ThrowIO(const std::string& what, int err) {
  throw IOError(what + ": " + std::strerror(err));
}

void SplitPath(const std::string& path, std::string* parent, std::string* base) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) {
    parent->assign(1, '.');
    *base = p;
  } else {
    *parent = p.substr(0, slash == 0 ? 1 : slash);
    *base = p.substr(slash + 1);
  }
}

void MakeDirs(const std::string& path) {
  if (path.empty()) return;
  struct stat st;
  if (stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) throw ValueError("path: " + path + " is not a directory");
    return;
  }
  std::string parent, base;
  SplitPath(path, &parent, &base);
  if (parent != path) MakeDirs(parent);
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) ThrowIO("cannot create " + path, errno);
}

void FsyncPath(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) ThrowIO("cannot open " + path, errno);
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0) ThrowIO("fsync of " + path + " failed", err);
}

std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  closedir(d);
  return names;
}

// Removes a flat directory of files (ours: a temp dir or a replaced checkpoint).
void RemoveFlatDir(const std::string& path) {
  for (const auto& n : ListDir(path)) unlink((path + "/" + n).c_str());
  rmdir(path.c_str());
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

std::atomic<uint64_t> g_temp_counter{0};

}  // namespace

// ---- writer --------------------------------------------------------------------------------

CheckpointWriter::CheckpointWriter(const std::string& dir) : dir_(dir) {
  if (dir.empty()) throw ValueError("path must not be empty");
  std::string base;
  SplitPath(dir, &parent_, &base);
  if (base.empty() || base == "." || base == "..") throw ValueError("path: " + dir + " is not a directory name");
  struct stat st;
  if (stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) throw ValueError("path: " + dir + " exists and is not a directory");
    const auto names = ListDir(dir);
    bool is_checkpoint = false;
    for (const auto& n : names) is_checkpoint |= n == "MANIFEST";
    if (!names.empty() && !is_checkpoint) {
      throw ValueError("path: " + dir + " exists and is neither empty nor a checkpoint; "
                       "refusing to replace it");
    }
  }
  MakeDirs(parent_);
  // Temp directories of processes that died mid-save.
  const std::string prefix = "." + base + ".tmp-";
  for (const auto& n : ListDir(parent_)) {
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = std::strtol(n.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && pid != getpid() && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      RemoveFlatDir(parent_ + "/" + n);
    }
  }
  tmp_ = parent_ + "/" + prefix + std::to_string(getpid()) + "-" + std::to_string(g_temp_counter++);
  if (mkdir(tmp_.c_str(), 0755) != 0) ThrowIO("cannot create " + tmp_, errno);
}

CheckpointWriter::~CheckpointWriter() {
  if (!committed_) RemoveFlatDir(tmp_);
}

CheckpointWriter::File::File(int fd, std::string name) : fd_(fd), name_(std::move(name)), buf_(kWriteBuffer) {}

CheckpointWriter::File::File(File&& o) noexcept
    : fd_(o.fd_), name_(std::move(o.name_)), buf_(std::move(o.buf_)), used_(o.used_), bytes_(o.bytes_), sum_(o.sum_) {
  o.fd_ = -1;
}

CheckpointWriter::File::~File() {
  if (fd_ >= 0) close(fd_);
}

void CheckpointWriter::File::Flush() {
  if (used_ == 0) return;
  if (!WriteAll(fd_, buf_.data(), used_)) ThrowIO("checkpoint: writing " + name_ + " failed", errno);
  used_ = 0;
}

void CheckpointWriter::File::Write(const void* data, size_t n) {
  if (n == 0) return;  // data may be null (an empty vector's data())
  sum_.Update(data, n);
  bytes_ += n;
  const char* p = static_cast<const char*>(data);
  if (used_ + n > buf_.size()) {
    Flush();
    if (n >= buf_.size()) {
      if (!WriteAll(fd_, p, n)) ThrowIO("checkpoint: writing " + name_ + " failed", errno);
      return;
    }
  }
  std::memcpy(buf_.data() + used_, p, n);
  used_ += n;
}

FileEntry CheckpointWriter::File::Finish() {
  Flush();
  if (fsync(fd_) != 0) ThrowIO("checkpoint: fsync of " + name_ + " failed", errno);
  close(fd_);
  fd_ = -1;
  FileEntry e;
  e.file = name_.substr(name_.rfind('/') + 1);
  e.bytes = bytes_;
  e.xxh64 = sum_.Digest();
  return e;
}

CheckpointWriter::File CheckpointWriter::Create(const std::string& name) {
  const std::string path = tmp_ + "/" + name;
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) ThrowIO("checkpoint: cannot create " + path, errno);
  return File(fd, path);
}

void CheckpointWriter::Link(const std::string& from_dir, const FileEntry& entry) {
  const std::string src = from_dir + "/" + entry.file;
  const std::string dst = tmp_ + "/" + entry.file;
  if (link(src.c_str(), dst.c_str()) == 0) return;
  if (errno != EXDEV && errno != EPERM && errno != EMLINK && errno != ENOTSUP) {
    ThrowIO("checkpoint: cannot link " + src + " into " + tmp_, errno);
  }
  // No hard links here: a copy, fsync'd like any file of the checkpoint.
  const int in = open(src.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) ThrowIO("checkpoint: cannot open " + src, errno);
  File out = Create(entry.file);
  std::vector<char> buf(kWriteBuffer);
  for (;;) {
    const ssize_t r = read(in, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      close(in);
      ThrowIO("checkpoint: reading " + src + " failed", err);
    }
    if (r == 0) break;
    out.Write(buf.data(), static_cast<size_t>(r));
  }
  close(in);
  out.Finish();
}

uint64_t ManifestDigest(const std::string& dir) {
  const std::string path = dir + "/MANIFEST";
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  Checksum sum;
  char buf[65536];
  for (;;) {
    const ssize_t r = read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    sum.Update(buf, static_cast<size_t>(r));
  }
  close(fd);
  return sum.Digest();
}

uint64_t CheckpointWriter::Commit(const Manifest& manifest) {
  uint64_t digest = 0;
  {
    File f = Create("MANIFEST");
    const std::string text = EncodeManifest(manifest);
    f.Write(text.data(), text.size());
    digest = f.Finish().xxh64;
  }
  FsyncPath(tmp_);
  struct stat st;
  if (stat(dir_.c_str(), &st) == 0) {
    if (renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) != 0) {
      if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
        ThrowIO("checkpoint: cannot swap " + tmp_ + " into " + dir_, errno);
      }
      // File systems without RENAME_EXCHANGE: two renames. A crash between them leaves the
      // previous checkpoint under the ".old" name (reported by Load as missing).
      const std::string old = tmp_ + ".old";
      if (rename(dir_.c_str(), old.c_str()) != 0) ThrowIO("checkpoint: cannot move " + dir_, errno);
      if (rename(tmp_.c_str(), dir_.c_str()) != 0) {
        const int err = errno;
        rename(old.c_str(), dir_.c_str());
        ThrowIO("checkpoint: cannot move " + tmp_ + " to " + dir_, err);
      }
      committed_ = true;
      FsyncPath(parent_);
      RemoveFlatDir(old);
      return digest;
    }
    committed_ = true;
    FsyncPath(parent_);
    RemoveFlatDir(tmp_);  // now holds the previous checkpoint
    return digest;
  }
  if (rename(tmp_.c_str(), dir_.c_str()) != 0) ThrowIO("checkpoint: cannot move " + tmp_ + " to " + dir_, errno);
  committed_ = true;
  FsyncPath(parent_);
  return digest;
}

// ---- reader --------------------------------------------------------------------------------

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw ValueError("path: " + dir + " is not a checkpoint directory");
  }
  const std::string path = dir + "/MANIFEST";
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw ValueError("path: " + dir + " has no MANIFEST (not a checkpoint, or a torn one)");
  }
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t r = read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      close(fd);
      ThrowIO("checkpoint: reading " + path + " failed", err);
    }
    if (r == 0) break;
    text.append(buf, static_cast<size_t>(r));
    if (text.size() > (size_t{64} << 20)) {
      close(fd);
      throw ValueError(path + ": manifest is implausibly large");
    }
  }
  close(fd);
  manifest_ = DecodeManifest(text, path);
  Checksum sum;
  sum.Update(text.data(), text.size());
  digest_ = sum.Digest();
}

CheckpointReader::File::File(int fd, FileEntry entry, std::string path)
    : fd_(fd), entry_(std::move(entry)), path_(std::move(path)) {}

CheckpointReader::File::File(File&& o) noexcept
    : fd_(o.fd_), entry_(std::move(o.entry_)), path_(std::move(o.path_)), read_(o.read_), sum_(o.sum_) {
  o.fd_ = -1;
}

CheckpointReader::File::~File() {
  if (fd_ >= 0) close(fd_);
}

size_t CheckpointReader::File::Read(void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = read(fd_, p + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) ThrowIO("checkpoint: reading " + path_ + " failed", errno);
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  sum_.Update(p, got);
  read_ += got;
  return got;
}

void CheckpointReader::File::Finish() {
  char extra;
  if (read_ != entry_.bytes || read(fd_, &extra, 1) > 0) {
    throw ValueError(path_ + ": torn checkpoint (size differs from the manifest)");
  }
  if (sum_.Digest() != entry_.xxh64) {
    throw ValueError(path_ + ": corrupt checkpoint (checksum mismatch)");
  }
}

CheckpointReader::File CheckpointReader::Open(const FileEntry& entry) const {
  const std::string path = dir_ + "/" + entry.file;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ValueError(path + ": torn checkpoint (data file missing)");
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != entry.bytes) {
    close(fd);
    throw ValueError(path + ": torn checkpoint (size " + std::to_string(st.st_size) +
                     " bytes, the manifest says " + std::to_string(entry.bytes) + ")");
  }
  posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return File(fd, entry, path);
}

}  // namespace bagpipe::store
