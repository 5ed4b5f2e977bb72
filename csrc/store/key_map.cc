#include "store/key_map.h"

#include <cstring>
#include <new>

#include "store/hash.h"
#include "store/os_memory.h"

namespace bagpipe::store {

namespace {
constexpr size_t kMinCapacity = 16;

// Smallest capacity (a multiple of 8 buckets, at least kMinCapacity) holding n keys.
size_t CapacityFor(size_t n) {
  size_t cap = (n * 10 + 6) / 7 + 1;
  cap = (cap + 7) & ~size_t{7};
  if (cap < kMinCapacity) cap = kMinCapacity;
  while (KeyMap::MaxSize(cap) < n) cap += 8;
  return cap;
}
}  // namespace

KeyMap::KeyMap(int shard_bits) : shard_bits_(shard_bits) {}

KeyMap::~KeyMap() { UnmapMemory(table_, mapped_bytes_); }

void KeyMap::Clear() {
  UnmapMemory(table_, mapped_bytes_);
  table_ = nullptr;
  capacity_ = 0;
  mapped_bytes_ = 0;
  size_ = 0;
}

void KeyMap::Rehash(size_t new_capacity) {
  const size_t bytes = RoundUp(new_capacity * sizeof(Entry), kOsPageBytes);
  auto* fresh = static_cast<Entry*>(MapAnonymous(bytes));  // zeroed: every tag is 0
  Entry* old = table_;
  const size_t old_capacity = capacity_;
  const size_t old_bytes = mapped_bytes_;
  table_ = fresh;
  capacity_ = new_capacity;
  mapped_bytes_ = bytes;
  for (size_t i = 0; i < old_capacity; ++i) {
    const Entry& e = old[i];
    if (e.tag == 0) continue;
    size_t b = Home(KeyHash(e.key));
    while (table_[b].tag != 0) {
      if (++b == capacity_) b = 0;
    }
    table_[b] = e;
  }
  UnmapMemory(old, old_bytes);
}

void KeyMap::Reserve(size_t n) {
  if (n <= MaxSize(capacity_)) return;
  Rehash(CapacityFor(n));
}

size_t KeyMap::Insert(int64_t key, uint64_t hash, uint32_t slot) {
  if (size_ + 1 > MaxSize(capacity_)) {
    // Doubling while small keeps rehash cost amortised; 1.5x when large bounds the memory
    // a growth step wastes.
    size_t grown = capacity_ < (size_t{1} << 16) ? capacity_ * 2 : capacity_ + capacity_ / 2;
    if (grown < CapacityFor(size_ + 1)) grown = CapacityFor(size_ + 1);
    Rehash(grown);
  }
  size_t b = Home(hash);
  while (table_[b].tag != 0) {
    if (++b == capacity_) b = 0;
  }
  table_[b].key = key;
  table_[b].tag = slot + 1;
  ++size_;
  return b;
}

void KeyMap::SetSlot(int64_t key, uint64_t hash, uint32_t slot) {
  size_t b = Home(hash);
  while (table_[b].key != key || table_[b].tag == 0) {
    if (++b == capacity_) b = 0;
  }
  table_[b].tag = slot + 1;
}

uint32_t KeyMap::Erase(int64_t key, uint64_t hash) {
  if (capacity_ == 0) return kNotFound;
  size_t i = Home(hash);
  for (;;) {
    const Entry& e = table_[i];
    if (e.tag == 0) return kNotFound;
    if (e.key == key) break;
    if (++i == capacity_) i = 0;
  }
  const uint32_t slot = table_[i].tag - 1;
  // Backward shift: pull every later entry of the run whose home does not lie in (i, j]
  // into the hole, so invariant 2 holds without tombstones.
  size_t j = i;
  for (;;) {
    if (++j == capacity_) j = 0;
    const Entry& e = table_[j];
    if (e.tag == 0) break;
    const size_t k = Home(KeyHash(e.key));
    const bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
    if (stays) continue;
    table_[i] = e;
    i = j;
  }
  table_[i].tag = 0;
  table_[i].key = 0;
  --size_;
  return slot;
}

}  // namespace bagpipe::store
