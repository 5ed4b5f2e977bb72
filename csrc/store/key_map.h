// KeyMap: int64 key -> uint32 slot, one per hash shard of an EmbeddingStore.
//
// Open addressing with linear probing over 16-byte entries, load factor <= 0.7, any
// capacity (buckets are chosen by a multiply-shift "fast range" of the key hash, so the
// table need not be a power of two and can be sized tightly by Reserve), deletion by
// backward shift (no tombstones, probe sequences stay short after many erases).
//
// Thread safety: not synchronized. Any number of threads may call the const methods
// concurrently; a mutating method requires exclusive access (the store serializes batch
// operations and gives each shard to one thread).
//
// Invariants:
//   1. size() <= MaxSize(capacity()) = floor(0.7 * capacity()).
//   2. Every stored key lies in the probe run that starts at its home bucket: no empty
//      entry between Home(key) and the key's position (cyclically).
//   3. An entry is empty iff its tag is 0; a stored entry has tag = slot + 1.
//   4. Each key appears at most once.
#pragma once

#include <cstddef>
#include <cstdint>

namespace bagpipe::store {

class KeyMap {
 public:
  struct alignas(16) Entry {
    int64_t key;
    uint32_t tag;       // 0: empty; otherwise slot + 1
    uint32_t reserved;  // keeps entries 16-byte aligned so none straddles a cache line
  };
  static_assert(sizeof(Entry) == 16);

  static constexpr uint32_t kNotFound = 0xFFFFFFFFu;
  // A placeholder the store gives keys it inserts before their slot is chosen; no pending
  // entry survives a store operation.
  static constexpr uint32_t kPendingSlot = 0xFFFFFFFEu;
  static constexpr uint32_t kMaxSlot = 0xFFFFFFFDu;

  // shard_bits: how many top bits of the key hash chose this shard (they are constant
  // within the shard, so the bucket is taken from the remaining bits).
  explicit KeyMap(int shard_bits);
  ~KeyMap();
  KeyMap(const KeyMap&) = delete;
  KeyMap& operator=(const KeyMap&) = delete;

  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  size_t bytes() const { return mapped_bytes_; }

  // The most keys a table of `capacity` buckets may hold.
  static size_t MaxSize(size_t capacity) { return capacity * 7 / 10; }

  // Home bucket of a key hash (REQUIRES: capacity() > 0).
  size_t Home(uint64_t hash) const {
    return static_cast<size_t>((static_cast<unsigned __int128>(hash << shard_bits_) * capacity_) >> 64);
  }
  const Entry* bucket(size_t b) const { return table_ + b; }

  // Slot of key, or kNotFound. REQUIRES: hash == KeyHash(key).
  uint32_t Find(int64_t key, uint64_t hash) const {
    if (capacity_ == 0) return kNotFound;
    size_t b = Home(hash);
    for (;;) {
      const Entry& e = table_[b];
      if (e.tag == 0) return kNotFound;
      if (e.key == key) return e.tag - 1;
      if (++b == capacity_) b = 0;
    }
  }

  // Adds key -> slot and returns its bucket. REQUIRES: key absent, slot <= kMaxSlot or
  // kPendingSlot. Grows the table when the load would pass 0.7; on std::bad_alloc nothing
  // has changed. Inserting never moves other entries; only growth (a capacity change) does.
  size_t Insert(int64_t key, uint64_t hash, uint32_t slot);

  // Replaces the slot of the entry in bucket b. REQUIRES: b holds a key (e.g. returned by
  // Insert with no capacity change since), slot <= kMaxSlot.
  void SetSlotAt(size_t b, uint32_t slot) { table_[b].tag = slot + 1; }

  // Replaces the slot of a stored key. REQUIRES: key present, slot <= kMaxSlot.
  void SetSlot(int64_t key, uint64_t hash, uint32_t slot);

  // Removes key; returns its slot, or kNotFound when absent.
  uint32_t Erase(int64_t key, uint64_t hash);

  // Ensures `n` keys fit without growing. On std::bad_alloc nothing has changed.
  void Reserve(size_t n);

  // A read-only snapshot of the table for hot loops: valid until the next mutation. An
  // empty map yields a one-bucket empty table, so probing needs no capacity check.
  struct View {
    const Entry* table;
    uint64_t capacity;
    int shard_bits;
    size_t Home(uint64_t hash) const {
      return static_cast<size_t>((static_cast<unsigned __int128>(hash << shard_bits) * capacity) >> 64);
    }
    uint32_t Find(int64_t key, uint64_t hash) const { return FindFrom(Home(hash), key); }
    // Find with the home bucket already computed (REQUIRES: b == Home(KeyHash(key))).
    uint32_t FindFrom(size_t b, int64_t key) const {
      for (;;) {
        const Entry& e = table[b];
        if (e.tag == 0) return kNotFound;
        if (e.key == key) return e.tag - 1;
        if (++b == capacity) b = 0;
      }
    }
  };
  View view() const {
    static const Entry kEmpty{0, 0, 0};
    return capacity_ == 0 ? View{&kEmpty, 1, shard_bits_} : View{table_, capacity_, shard_bits_};
  }

  // Raw table for ordered iteration (entries with tag != 0 are stored keys).
  const Entry* entries() const { return table_; }

  // Removes every key and releases the table.
  void Clear();

 private:
  void Rehash(size_t new_capacity);

  const int shard_bits_;
  Entry* table_ = nullptr;     // owned mapping of mapped_bytes_ bytes
  size_t capacity_ = 0;        // buckets
  size_t mapped_bytes_ = 0;
  size_t size_ = 0;
};

}  // namespace bagpipe::store
