// Wire layouts private to the UCX transport: the bootstrap exchange on the TCP control
// connection, the registered slot ring's header, doorbell entries and the prefix of every
// active message. The frames themselves (protocol/wire.h) travel unchanged inside slots and
// messages.
//
// Connection life cycle (client C, PS shard S):
//   1. C opens a TCP control connection to S and sends BootHello + token + C's worker address.
//   2. S checks magic/version/bounds and the job token, creates a worker and an endpoint to C,
//      allocates and registers a slot ring (RingHeader + num_slots slots of slot_stride bytes)
//      and answers BootReply + packed ring key + S's worker address (or a status + text).
//   3. C checks the key digest, unpacks the key, creates its endpoint to S and reads the
//      RingHeader back with a one-sided get: ring id, slot count and stride must match the
//      BootReply (a remote-key mismatch is caught here, before any frame is written).
//   4. Data path: C writes frames one-sided into ring slots (ucp_put_nbx), flushes its
//      endpoint, then sends a doorbell message listing (slot, length, tag) of every frame the
//      flush covered. S replies with frame messages (eager or rendezvous).
//   5. The control connection stays open as the liveness channel: a Bye byte is a graceful
//      close; EOF or an error without Bye is a torn connection.
//
// Thread safety: plain structs and pure functions.
//
// Invariants:
//   1. Little-endian, no implicit padding (static_assert'ed sizes).
//   2. Every length announced on the control connection is bounded before anything is
//      allocated for it (kMax* below).
//   3. Every active message starts with MessagePrefix; seq numbers one direction of one
//      connection 0, 1, 2, ... and the receiver acts on messages strictly in seq order;
//      ring_id names the connection (several share a shard's UCP worker).
#pragma once

#include <cstddef>
#include <cstdint>

namespace bagpipe::transport::ucx::wire {

inline constexpr uint32_t kBootMagic = 0x58555042;  // "BPUX"
inline constexpr uint32_t kRingMagic = 0x474e5242;  // "BRNG"
inline constexpr uint16_t kBootVersion = 1;
inline constexpr size_t kMaxTokenBytes = 1024;
inline constexpr size_t kMaxWorkerAddress = 64 * 1024;
inline constexpr size_t kMaxPackedKey = 64 * 1024;
inline constexpr size_t kMaxBootText = 4096;
inline constexpr uint32_t kMaxSlots = 4096;
inline constexpr size_t kRingHeaderBytes = 64;
inline constexpr size_t kSlotAlign = 64;
inline constexpr uint8_t kByeByte = 0x42;

// Active message ids.
inline constexpr unsigned kAmDoorbell = 1;  // C->S: payload = DoorbellEntry[count]
inline constexpr unsigned kAmFrame = 2;     // S->C: header = prefix + frame head, payload = bulk

struct BootHello {
  uint32_t magic;        // kBootMagic
  uint16_t version;      // kBootVersion
  uint16_t reserved;
  uint32_t num_slots;    // 1..kMaxSlots
  uint32_t token_len;    // <= kMaxTokenBytes; token bytes follow
  uint64_t slot_bytes;   // capacity of one slot (the largest frame C will write)
  uint32_t address_len;  // <= kMaxWorkerAddress; C's worker address follows the token
  uint32_t reserved2;
};
static_assert(sizeof(BootHello) == 32);

enum class BootStatus : int32_t {
  kOk = 0,
  kBadRequest = 1,    // malformed hello (magic, version, bounds)
  kUnauthorized = 2,  // wrong job token
  kTooLarge = 3,      // the ring would exceed the shard's limits
  kInternal = 4,      // UCX failed on the shard
  kShuttingDown = 5,
};

struct BootReply {
  uint32_t magic;        // kBootMagic
  int32_t status;        // BootStatus; on error only text follows
  uint64_t ring_addr;    // remote address of the RingHeader
  uint64_t ring_bytes;   // registered bytes from ring_addr
  uint64_t slot_stride;  // distance between slots; slot i at ring_addr + kRingHeaderBytes + i*stride
  uint64_t ring_id;      // random; also stored in the RingHeader
  uint64_t key_digest;   // KeyDigest(packed key)
  uint32_t num_slots;
  uint32_t key_len;      // <= kMaxPackedKey; packed key follows
  uint32_t address_len;  // <= kMaxWorkerAddress; S's worker address follows the key
  uint32_t text_len;     // <= kMaxBootText; error text (status != kOk) follows
};
static_assert(sizeof(BootReply) == 64);

struct RingHeader {
  uint32_t magic;  // kRingMagic
  uint32_t num_slots;
  uint64_t ring_id;
  uint64_t slot_stride;
  uint64_t reserved[5];
};
static_assert(sizeof(RingHeader) == kRingHeaderBytes);

struct DoorbellEntry {
  uint32_t slot;
  uint32_t reserved;
  uint64_t len;  // bytes written into the slot
  uint64_t tag;  // opaque to the UCX layer (the frame's tag), checked by the receiver
};
static_assert(sizeof(DoorbellEntry) == 24);

struct MessagePrefix {
  uint64_t seq;
  uint64_t ring_id;  // the connection's ring id (BootReply): shards demultiplex a shared
                     // worker's messages by it; clients check it is their connection's
};
static_assert(sizeof(MessagePrefix) == 16);

// Bytes between ring slots: slot_bytes rounded up to kSlotAlign.
inline size_t SlotStride(size_t slot_bytes) {
  return (slot_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

}  // namespace bagpipe::transport::ucx::wire
