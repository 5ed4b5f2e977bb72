#include "store/checksum.h"

#include <cstring>

namespace bagpipe::store {

namespace {
constexpr uint64_t P1 = 11400714785074694791ULL;
constexpr uint64_t P2 = 14029467366897019727ULL;
constexpr uint64_t P3 = 1609587929392839161ULL;
constexpr uint64_t P4 = 9650029242287828579ULL;
constexpr uint64_t P5 = 2870177450012600261ULL;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t Read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian hosts (x86-64, aarch64)
}
inline uint32_t Read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t Round(uint64_t acc, uint64_t input) {
  acc += input * P2;
  acc = Rotl(acc, 31);
  return acc * P1;
}
inline uint64_t Merge(uint64_t acc, uint64_t val) {
  acc ^= Round(0, val);
  return acc * P1 + P4;
}
}  // namespace

Checksum::Checksum(uint64_t seed) : seed_(seed) {
  v_[0] = seed + P1 + P2;
  v_[1] = seed + P2;
  v_[2] = seed;
  v_[3] = seed - P1;
}

void Checksum::Update(const void* data, size_t n) {
  if (n == 0) return;  // data may be null (an empty vector's data())
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += n;
  if (buffered_ + n < 32) {
    std::memcpy(buf_ + buffered_, p, n);
    buffered_ += n;
    return;
  }
  if (buffered_ > 0) {
    const size_t take = 32 - buffered_;
    std::memcpy(buf_ + buffered_, p, take);
    for (int i = 0; i < 4; ++i) v_[i] = Round(v_[i], Read64(buf_ + 8 * i));
    p += take;
    n -= take;
    buffered_ = 0;
  }
  while (n >= 32) {
    v_[0] = Round(v_[0], Read64(p));
    v_[1] = Round(v_[1], Read64(p + 8));
    v_[2] = Round(v_[2], Read64(p + 16));
    v_[3] = Round(v_[3], Read64(p + 24));
    p += 32;
    n -= 32;
  }
  std::memcpy(buf_, p, n);
  buffered_ = n;
}

uint64_t Checksum::Digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = Rotl(v_[0], 1) + Rotl(v_[1], 7) + Rotl(v_[2], 12) + Rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = Merge(h, v_[i]);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const unsigned char* p = buf_;
  size_t n = buffered_;
  while (n >= 8) {
    h ^= Round(0, Read64(p));
    h = Rotl(h, 27) * P1 + P4;
    p += 8;
    n -= 8;
  }
  if (n >= 4) {
    h ^= static_cast<uint64_t>(Read32(p)) * P1;
    h = Rotl(h, 23) * P2 + P3;
    p += 4;
    n -= 4;
  }
  while (n > 0) {
    h ^= (*p) * P5;
    h = Rotl(h, 11) * P1;
    ++p;
    --n;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

std::string Checksum::Hex(uint64_t v) {
  static const char* kDigits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[i] = kDigits[v & 15];
  return s;
}

}  // namespace bagpipe::store
