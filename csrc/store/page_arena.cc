#include "store/page_arena.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/errors.h"
#include "common/os_memory.h"

namespace bagpipe::store {

namespace {
// mremap(2) through the raw system call: some sanitizer runtimes intercept the libc wrapper
// and drop its fifth (new_address) argument.
void* RemapFixed(void* from, size_t bytes, void* to) {
  const long r = syscall(SYS_mremap, from, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, to);
  return r == -1 ? MAP_FAILED : reinterpret_cast<void*>(r);
}
}  // namespace

PageIndex::PageIndex(uint32_t rows)
    : rows_(rows),
      pow2_((rows & (rows - 1)) == 0),
      shift_(63 - __builtin_clzll(rows)),
      magic_(pow2_ ? 0 : ~uint64_t{0} / rows + 1) {}

PageArena::PageArena(size_t slot_bytes, uint32_t page_rows)
    : slot_bytes_(slot_bytes),
      page_rows_(page_rows),
      page_bytes_(RoundUp(slot_bytes * page_rows, kOsPageBytes)) {}

PageArena::~PageArena() {
  for (auto& p : pages_) UnmapMemory(p.addr, page_bytes_);
}

PageArena::Page* PageArena::Allocate(uint32_t epoch) {
  void* mem = MapAnonymous(page_bytes_);
  try {
    Page& p = pages_.emplace_back();
    p.addr = static_cast<char*>(mem);
    p.id = static_cast<uint32_t>(pages_.size() - 1);
    p.touched.store(epoch, std::memory_order_relaxed);
    return &p;
  } catch (...) {
    UnmapMemory(mem, page_bytes_);
    throw;
  }
}

// Both moves build the new backing at a temporary address, copy the bytes, then mremap it
// onto the page address with MREMAP_FIXED, which replaces the old mapping in one step and,
// unlike mmap(MAP_FIXED), leaves the old mapping intact when it fails.
void PageArena::MoveToFile(Page* page, int fd, int64_t extent) {
  const off_t offset = static_cast<off_t>(extent) * static_cast<off_t>(page_bytes_);
  void* tmp = mmap(nullptr, page_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, offset);
  if (tmp == MAP_FAILED) {
    throw IOError(std::string("spill: mmap of the spill file failed: ") + std::strerror(errno));
  }
  std::memcpy(tmp, page->addr, page_bytes_);
  void* r = RemapFixed(tmp, page_bytes_, page->addr);
  if (r == MAP_FAILED) {
    const int err = errno;
    munmap(tmp, page_bytes_);
    throw IOError(std::string("spill: remapping a page onto the spill file failed: ") +
                  std::strerror(err));
  }
  page->spilled = true;
  page->extent = extent;
  ++spilled_pages_;
}

void PageArena::MoveToMemory(Page* page) {
  void* tmp = MapAnonymous(page_bytes_);
  std::memcpy(tmp, page->addr, page_bytes_);
  void* r = RemapFixed(tmp, page_bytes_, page->addr);
  if (r == MAP_FAILED) {
    const int err = errno;
    UnmapMemory(tmp, page_bytes_);
    throw IOError(std::string("spill: remapping a page back into memory failed: ") +
                  std::strerror(err));
  }
  madvise(page->addr, page_bytes_, MADV_HUGEPAGE);
  page->spilled = false;
  page->extent = -1;
  --spilled_pages_;
}

}  // namespace bagpipe::store
