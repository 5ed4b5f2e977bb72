// PageArena: the row memory of one EmbeddingStore, in fixed-size pages of row slots (the
// store decides the layout inside a page: weight rows, then their optimizer state). A page
// is one mapping of page_bytes(); its address never changes while the arena lives, whether
// its contents sit in anonymous DRAM or in a file extent (spilled): the move between the two
// is an address-stable remap (see MoveToFile / MoveToMemory).
//
// Thread safety: Allocate, MoveToFile and MoveToMemory require exclusive access to the
// arena (the store's op mutex). Reading or writing rows through page addresses and
// Touch() may happen from many threads at once between those calls.
//
// Invariants:
//   1. Every page address is valid, readable and writable until the arena is destroyed.
//   2. resident_pages() + spilled_pages() == num_pages().
//   3. A spilled page's bytes live in extent `extent` of the file it was moved to; the
//      file mapping is MAP_SHARED, so writes through the address reach that extent.
//   4. Row bytes survive every move bit for bit.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>

namespace bagpipe::store {

// slot -> (page, row in the page) for pages of `rows` rows, any count >= 1: a shift for a
// power of two, else an exact multiply-high division (Lemire, Kaser and Kurz, "Faster
// remainder by direct computation", 2019: with M = floor((2^64 - 1) / d) + 1 and d >= 2,
// n / d == (n * M) >> 64 for every 32-bit n).
class PageIndex {
 public:
  explicit PageIndex(uint32_t rows);  // REQUIRES: rows >= 1
  // Rows per page, as constructed.
  uint32_t rows() const { return rows_; }
  // slot / rows(), exactly.
  uint32_t Page(uint32_t slot) const {
    if (pow2_) return slot >> shift_;
    return static_cast<uint32_t>((static_cast<unsigned __int128>(magic_) * slot) >> 64);
  }
  // REQUIRES: page == Page(slot).
  uint32_t RowIn(uint32_t slot, uint32_t page) const { return slot - page * rows_; }
  // Pages that hold slots [0, slots).
  size_t PagesFor(size_t slots) const { return (slots + rows_ - 1) / rows_; }

 private:
  uint32_t rows_;
  bool pow2_;
  int shift_;
  uint64_t magic_;
};

class PageArena {
 public:
  struct Page {
    char* addr = nullptr;                 // set by Allocate; never changes
    int64_t extent = -1;                  // spill extent when spilled; owner: the spill tier
    bool spilled = false;                 // owner: MoveToFile / MoveToMemory
    uint8_t score = 0;                    // aging register (1 bit per op); owner: spill tier
    std::atomic<uint32_t> touched{0};     // last op epoch that accessed a row; any thread
    uint32_t id = 0;                      // index in the arena

    // Records an access in op epoch `epoch`: a load, and a store only once per epoch, so
    // readers on several cores do not bounce the line.
    void Touch(uint32_t epoch) {
      if (touched.load(std::memory_order_relaxed) != epoch) {
        touched.store(epoch, std::memory_order_relaxed);
      }
    }
  };

  // slot_bytes: the page bytes one row slot takes (weights and state, with padding).
  // REQUIRES: slot_bytes >= 1, page_rows >= 1.
  PageArena(size_t slot_bytes, uint32_t page_rows);
  ~PageArena();
  PageArena(const PageArena&) = delete;
  PageArena& operator=(const PageArena&) = delete;

  // As constructed.
  size_t slot_bytes() const { return slot_bytes_; }
  uint32_t page_rows() const { return page_rows_; }
  size_t page_bytes() const { return page_bytes_; }  // mapping size, a multiple of 4 KiB

  // Maps a new zeroed resident page. Throws std::bad_alloc; nothing changes then.
  Page* Allocate(uint32_t epoch);

  // Moves a resident page's bytes into extent `extent` of `fd` (already sized) and remaps
  // the page address onto that extent. Throws IOError; the page is unchanged then.
  void MoveToFile(Page* page, int fd, int64_t extent);
  // Moves a spilled page back into anonymous memory at the same address. Throws
  // std::bad_alloc / IOError; the page is unchanged then.
  void MoveToMemory(Page* page);

  // Pages allocated, of them in memory and in spill files; page i in allocation order
  // (REQUIRES: i < num_pages()).
  size_t num_pages() const { return pages_.size(); }
  size_t resident_pages() const { return pages_.size() - spilled_pages_; }
  size_t spilled_pages() const { return spilled_pages_; }
  Page* page(size_t i) { return &pages_[i]; }

 private:
  const size_t slot_bytes_;
  const uint32_t page_rows_;
  const size_t page_bytes_;
  std::deque<Page> pages_;       // deque: element addresses are stable as it grows
  size_t spilled_pages_ = 0;
};

}  // namespace bagpipe::store
