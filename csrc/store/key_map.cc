#include "store/key_map.h"

#include <cstring>
#include <new>

#include "store/splitmix64.h"
#include "common/os_memory.h"

namespace bagpipe::store {

namespace {
constexpr size_t kMinBuckets = 4;

// Smallest bucket count (even, at least kMinBuckets) whose capacity holds n keys.
size_t BucketsFor(size_t n) {
  size_t entries = (n * 10 + 6) / 7 + 1;
  size_t buckets = (entries + KeyMap::kBucketEntries - 1) / KeyMap::kBucketEntries;
  buckets = (buckets + 1) & ~size_t{1};
  if (buckets < kMinBuckets) buckets = kMinBuckets;
  while (KeyMap::MaxSize(buckets * KeyMap::kBucketEntries) < n) buckets += 2;
  return buckets;
}

// Whether bucket h lies in the cyclic range (lo, hi].
bool InRange(size_t lo, size_t h, size_t hi) { return lo <= hi ? (lo < h && h <= hi) : (lo < h || h <= hi); }
}  // namespace

KeyMap::KeyMap(int shard_bits) : shard_bits_(shard_bits) {}

KeyMap::~KeyMap() { UnmapMemory(table_, mapped_bytes_); }

void KeyMap::Clear() {
  UnmapMemory(table_, mapped_bytes_);
  table_ = nullptr;
  num_buckets_ = 0;
  mapped_bytes_ = 0;
  size_ = 0;
}

size_t KeyMap::FreeEntryFor(uint64_t hash) const {
  for (size_t b = Home(hash);; b = b + 1 == num_buckets_ ? 0 : b + 1) {
    const Entry* e = bucket(b);
    for (size_t i = 0; i < kBucketEntries; ++i) {
      if (e[i].tag == 0) return b * kBucketEntries + i;
    }
  }
}

void KeyMap::Rehash(size_t new_num_buckets) {
  size_t bytes = RoundUp(new_num_buckets * kBucketEntries * sizeof(Entry), kOsPageBytes);
  // A partial last huge page is backed by 4 KiB pages and costs its keys a TLB miss each;
  // when rounding up to whole huge pages adds at most 1/8 of the table, map whole huge pages
  // and use the tail as buckets too (bytes per key stay within 1/8 of the 0.7 load bound).
  const size_t whole = RoundUp(bytes, kHugePageBytes);
  if (bytes >= kHugePageBytes && whole - bytes <= bytes / 8) {
    bytes = whole;
    new_num_buckets = bytes / (kBucketEntries * sizeof(Entry));
  }
  auto* fresh = static_cast<Entry*>(MapAnonymous(bytes));  // zeroed: every entry is empty
  Entry* old = table_;
  const size_t old_capacity = capacity();
  const size_t old_bytes = mapped_bytes_;
  table_ = fresh;
  num_buckets_ = new_num_buckets;
  mapped_bytes_ = bytes;
  for (size_t i = 0; i < old_capacity; ++i) {
    const Entry& e = old[i];
    if (e.tag != 0) table_[FreeEntryFor(KeyHash(e.key))] = e;
  }
  UnmapMemory(old, old_bytes);
}

void KeyMap::Reserve(size_t n) {
  if (n <= MaxSize(capacity())) return;
  Rehash(BucketsFor(n));
}

size_t KeyMap::Insert(int64_t key, uint64_t hash, uint32_t slot) {
  if (size_ + 1 > MaxSize(capacity())) {
    // Doubling while small keeps rehash cost amortised; 1.5x when large bounds the memory
    // a growth step wastes.
    size_t grown = num_buckets_ < (size_t{1} << 14) ? num_buckets_ * 2 : num_buckets_ + num_buckets_ / 2;
    grown = (grown + 1) & ~size_t{1};
    if (grown < BucketsFor(size_ + 1)) grown = BucketsFor(size_ + 1);
    Rehash(grown);
  }
  const size_t i = FreeEntryFor(hash);
  table_[i].key = key;
  table_[i].tag = slot + 1;
  ++size_;
  return i;
}

void KeyMap::SetSlot(int64_t key, uint64_t hash, uint32_t slot) {
  for (size_t b = Home(hash);; b = b + 1 == num_buckets_ ? 0 : b + 1) {
    Entry* e = table_ + b * kBucketEntries;
    const Match m = MatchBucket(e, key);
    if (m.hit != 0) {
      e[EntryOf(__builtin_ctz(m.hit))].tag = slot + 1;
      return;
    }
  }
}

uint32_t KeyMap::Erase(int64_t key, uint64_t hash) {
  if (num_buckets_ == 0) return kNotFound;
  size_t hb = Home(hash);  // bucket of the hole
  size_t hp = 0;           // entry of the hole within it
  for (;; hb = hb + 1 == num_buckets_ ? 0 : hb + 1) {
    const Match m = MatchBucket(bucket(hb), key);
    if (m.hit != 0) {
      hp = EntryOf(__builtin_ctz(m.hit));
      break;
    }
    if (m.empty != 0) return kNotFound;
  }
  Entry* const hole_bucket = table_ + hb * kBucketEntries;
  const uint32_t slot = hole_bucket[hp].tag - 1;
  bool was_full = true;
  for (size_t i = 0; i < kBucketEntries; ++i) was_full &= hole_bucket[i].tag != 0;
  hole_bucket[hp] = Entry{0, 0, 0};
  --size_;
  // A bucket that was not full let no key probe past it: nothing can move into the hole.
  if (!was_full) return slot;
  // Backward shift (invariant 2): walk the run of full buckets after the hole; an entry whose
  // home is not in (hole, j] probed past the hole and moves into it, leaving a hole in j.
  // The walk ends after the first bucket that was not full before the erase: no key beyond
  // it probed past it.
  for (size_t j = hb + 1 == num_buckets_ ? 0 : hb + 1;; j = j + 1 == num_buckets_ ? 0 : j + 1) {
    Entry* e = table_ + j * kBucketEntries;
    bool full = true;    // before any move out of j
    bool moved = false;  // one entry per bucket suffices: the hole then moves to j
    for (size_t i = 0; i < kBucketEntries; ++i) {
      if (e[i].tag == 0) {
        full = false;
        continue;
      }
      if (moved || InRange(hb, Home(KeyHash(e[i].key)), j)) continue;
      table_[hb * kBucketEntries + hp] = e[i];
      e[i] = Entry{0, 0, 0};
      hb = j;
      hp = i;
      moved = true;
    }
    if (!full) break;
  }
  return slot;
}

}  // namespace bagpipe::store
