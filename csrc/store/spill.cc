#include "store/spill.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/errors.h"

namespace bagpipe::store {

namespace {
// Hot spilled pages swapped back per op, at most: bounds the work an op pays for policy.
constexpr int kMaxSwapInsPerOp = 2;
// A spilled page comes back into free room when touched in at least this many of the last
// 8 ops...
constexpr int kHotPopcount = 4;
// ...and trades places with a resident page only when it is clearly hot and the resident
// one clearly cold, so pages of similar heat (scattered hot rows) do not ping-pong.
constexpr int kTradeHotPopcount = 6;
constexpr int kTradeColdPopcount = 2;
}  // namespace

SpillTier::SpillTier(PageArena* arena, const Options& options)
    : arena_(arena),
      budget_(options.budget_bytes),
      dir_(options.budget_bytes > 0 ? options.dir : std::string()),
      high_bytes_(static_cast<int64_t>(options.high_watermark * static_cast<double>(budget_))),
      low_bytes_(static_cast<int64_t>(options.low_watermark * static_cast<double>(budget_))) {
  if (!dir_.empty()) {
    struct stat st;
    if (stat(dir_.c_str(), &st) != 0) {
      if (mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) {
        throw ValueError("spill_dir: cannot create " + dir_ + ": " + std::strerror(errno));
      }
    } else if (!S_ISDIR(st.st_mode)) {
      throw ValueError("spill_dir: " + dir_ + " is not a directory");
    }
    if (access(dir_.c_str(), W_OK | X_OK) != 0) {
      throw ValueError("spill_dir: " + dir_ + " is not writable");
    }
  }
}

SpillTier::~SpillTier() {
  if (fd_ >= 0) close(fd_);
}

int64_t SpillTier::resident_bytes() const {
  return static_cast<int64_t>(arena_->resident_pages() * arena_->page_bytes());
}

int SpillTier::Heat(const PageArena::Page& p) { return std::popcount(p.score) * 256 + p.score; }

void SpillTier::OpenFile() {
  if (fd_ >= 0) return;
  int fd = open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {  // file systems without O_TMPFILE: create, then unlink at once
    std::string path = dir_ + "/bagpipe-spill-XXXXXX";
    fd = mkostemp(path.data(), O_CLOEXEC);
    if (fd < 0) {
      throw IOError("spill_dir: cannot create a spill file in " + dir_ + ": " +
                    std::strerror(errno));
    }
    unlink(path.c_str());
  }
  fd_ = fd;
}

int64_t SpillTier::AcquireExtent() {
  OpenFile();
  int64_t extent;
  if (!free_extents_.empty()) {
    extent = free_extents_.back();
  } else {
    extent = next_extent_;
  }
  if (extent == next_extent_) {
    // Reserve the blocks of a new extent now: a write into a sparse file mapping on a full
    // disk would be a SIGBUS later, an error here is clean.
    const off_t bytes = static_cast<off_t>(arena_->page_bytes());
    const int rc = posix_fallocate(fd_, static_cast<off_t>(extent) * bytes, bytes);
    if (rc != 0) {
      throw IOError("spill_dir: cannot reserve " + std::to_string(bytes) + " bytes in " + dir_ +
                    ": " + std::strerror(rc));
    }
  }
  if (!free_extents_.empty()) {
    free_extents_.pop_back();
  } else {
    ++next_extent_;
  }
  return extent;
}

void SpillTier::ReleaseExtent(int64_t extent) {
  // The extent keeps its disk blocks for reuse (the spill file never outgrows the largest
  // number of pages spilled at once); its page cache copy is reclaimed by the kernel.
  free_extents_.push_back(extent);
}

void SpillTier::SwapOut(PageArena::Page* p) {
  const int64_t extent = AcquireExtent();
  try {
    arena_->MoveToFile(p, fd_, extent);
  } catch (...) {
    free_extents_.push_back(extent);
    throw;
  }
  // Write-back is left to the kernel: forcing it now would write-protect the page cache
  // copy, and every later write to a spilled row would take a fault.
  ++swap_outs_;
  if (first_spill_.empty()) {
    first_spill_ = "EmbeddingStore: resident rows passed the memory budget of " +
                   std::to_string(budget_) + " bytes; cold pages now spill to " + dir_;
  }
  if (!warned_ && callback_) {
    warned_ = true;
    callback_(first_spill_);
  }
}

void SpillTier::set_callback(SpillCallback cb) {
  callback_ = std::move(cb);
  if (!warned_ && callback_ && !first_spill_.empty()) {
    warned_ = true;
    callback_(first_spill_);
  }
}

void SpillTier::SwapIn(PageArena::Page* p) {
  const int64_t extent = p->extent;
  arena_->MoveToMemory(p);
  ReleaseExtent(extent);
  ++swap_ins_;
}

void SpillTier::EvictTo(int64_t target) {
  if (resident_bytes() <= target) return;
  std::vector<PageArena::Page*> resident;
  resident.reserve(arena_->resident_pages());
  for (size_t i = 0; i < arena_->num_pages(); ++i) {
    PageArena::Page* p = arena_->page(i);
    if (!p->spilled) resident.push_back(p);
  }
  std::sort(resident.begin(), resident.end(), [](const PageArena::Page* a, const PageArena::Page* b) {
    const int ha = Heat(*a), hb = Heat(*b);
    return ha != hb ? ha < hb : a->id < b->id;
  });
  ++spill_count_;
  for (PageArena::Page* p : resident) {
    if (resident_bytes() <= target) break;
    SwapOut(p);
  }
}

void SpillTier::MakeRoom(size_t new_pages) {
  if (budget_ <= 0 || new_pages == 0) return;
  const int64_t need = static_cast<int64_t>(new_pages * arena_->page_bytes());
  if (!spilling()) {
    if (resident_bytes() + need > budget_) {
      throw MemoryBudgetError(
          "memory budget exhausted: the call needs " + std::to_string(new_pages) +
          " new page(s) of " + std::to_string(arena_->page_bytes()) + " bytes, " +
          std::to_string(resident_bytes()) + " of " + std::to_string(budget_) +
          " bytes are in use; raise memory_budget or set spill_dir to spill cold pages");
    }
    return;
  }
  if (resident_bytes() + need > high_bytes_) EvictTo(low_bytes_ - need);
}

void SpillTier::AfterOp(uint32_t epoch) {
  if (!spilling()) return;
  for (size_t i = 0; i < arena_->num_pages(); ++i) {
    PageArena::Page* p = arena_->page(i);
    const bool touched = p->touched.load(std::memory_order_relaxed) == epoch;
    p->score = static_cast<uint8_t>((p->score >> 1) | (touched ? 0x80 : 0));
  }
  if (resident_bytes() > high_bytes_) EvictTo(low_bytes_);
  if (arena_->spilled_pages() == 0) return;

  // Hot spilled pages, hottest first.
  std::vector<PageArena::Page*> hot;
  for (size_t i = 0; i < arena_->num_pages(); ++i) {
    PageArena::Page* p = arena_->page(i);
    if (p->spilled && std::popcount(p->score) >= kHotPopcount) hot.push_back(p);
  }
  if (hot.empty()) return;
  std::sort(hot.begin(), hot.end(), [](const PageArena::Page* a, const PageArena::Page* b) {
    const int ha = Heat(*a), hb = Heat(*b);
    return ha != hb ? ha > hb : a->id < b->id;
  });
  if (hot.size() > kMaxSwapInsPerOp) hot.resize(kMaxSwapInsPerOp);
  const int64_t page_bytes = static_cast<int64_t>(arena_->page_bytes());
  for (PageArena::Page* p : hot) {
    if (resident_bytes() + page_bytes <= high_bytes_) {
      SwapIn(p);
      continue;
    }
    // Trade places with the coldest resident page if it is clearly colder.
    PageArena::Page* coldest = nullptr;
    for (size_t i = 0; i < arena_->num_pages(); ++i) {
      PageArena::Page* q = arena_->page(i);
      if (q->spilled) continue;
      if (coldest == nullptr || Heat(*q) < Heat(*coldest)) coldest = q;
    }
    if (coldest == nullptr || std::popcount(p->score) < kTradeHotPopcount ||
        std::popcount(coldest->score) > kTradeColdPopcount) {
      break;
    }
    SwapOut(coldest);
    SwapIn(p);
  }
}

}  // namespace bagpipe::store
