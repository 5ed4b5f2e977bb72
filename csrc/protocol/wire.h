// The PS wire format: one frame = a fixed 40-byte header + a body. Every transport carries
// the same bytes (TCP streams them length-prefixed by the header's body_len, the local
// transport hands them over in memory, a UCX backend writes them into registered slots), so
// this file is the protocol's single definition. Python's test helper (tests/ps_wire.py)
// re-implements it independently.
//
// Thread safety: pure functions and plain structs.
//
// Invariants:
//   1. All integers and floats are little-endian (static_assert below); structs have no
//      implicit padding (each static_assert'ed to its documented size).
//   2. A frame's body is <fixed body struct of its type><payload>; body_len is exact: a
//      parser never reads past body_len and rejects a frame whose payload length does not
//      match what its fixed fields announce.
//   3. Bulk arrays (int64 keys) start 8-byte aligned relative to the frame start.
//   4. Parse* never throws: it returns false and a reason that names the offending field.
//   5. Rows on the wire (GetOk, Assign) are `dim + state_dim` floats wide: the weights, then
//      the row's optimizer state when the request asked for it (state_dim > 0), else 0.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace bagpipe::protocol::wire {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

inline constexpr uint32_t kMagic = 0x31535042;  // "BPS1"
// 2: optimizers (spec, per-step lr, state); 3: Open states the session's start step.
inline constexpr uint16_t kProtocolVersion = 3;
inline constexpr size_t kHeaderBytes = 40;
inline constexpr uint32_t kNoSlot = 0xFFFFFFFFu;  // notifications: not the reply to a slot
inline constexpr size_t kMaxTokenBytes = 1024;
inline constexpr size_t kMaxTableName = 128;
inline constexpr size_t kMaxMessageBytes = 4096;   // error / failure texts
inline constexpr uint32_t kMaxWorldSize = 1u << 16;
inline constexpr uint32_t kMaxDim = 1u << 16;
inline constexpr uint32_t kMaxStateDim = 2 * kMaxDim;  // Adam: first and second moments
inline constexpr uint8_t kMaxOptimizerKind = 3;        // store::OptimizerKind
inline constexpr uint32_t kMaxChunkCount = 1u << 24;
inline constexpr size_t kDefaultMaxFrameBytes = size_t{256} << 20;

enum class MsgType : uint16_t {
  kHello = 1,            // C->S  HelloBody + token bytes (must be a connection's first frame)
  kHelloOk = 2,          // S->C  HelloOkBody
  kOpen = 3,             // C->S  OpenBody + int64 starts[r] + f32 bounds[r] + table name
  kOpenOk = 4,           // S->C  OpenOkBody
  kCommit = 5,           // C->S  CommitBody + keys[nrows] + grads[nrows * dim] + evict[nevict]
  kAck = 6,              // S->C  AckBody
  kGet = 7,              // C->S  GetBody + keys[nrows]
  kGetOk = 8,            // S->C  GetOkBody + rows[nrows * (dim + state_dim)]
  kAssign = 9,           // C->S  AssignBody + keys[nrows] + rows[nrows * (dim + state_dim)]
  kAssignOk = 10,        // S->C  StepBody
  kClose = 11,           // C->S  CloseBody
  kCloseOk = 12,         // S->C  StepBody
  kCheckpoint = 13,      // C->S  SessionBody + optional label (a subdirectory, table-name rules)
  kCheckpointOk = 14,    // S->C  StepBody (the checkpointed step)
  kPing = 15,            // C->S  empty
  kPong = 16,            // S->C  empty
  kError = 17,           // S->C  MessageBody + text; header.status says which error
  kNotifyCommitted = 18, // S->C  StepBody (pushed to every attached rank after each commit)
  kNotifyFailed = 19,    // S->C  MessageBody + text (the session failed)
  kNotifyShutdown = 20,  // S->C  MessageBody + text (the shard is draining: new work is refused)
  kNotifyCheckpoint = 21,  // S->C  CheckpointNoteBody + text: a periodic checkpoint's outcome
                           //       (header.status kOk, or kInternal with the error text)
};

// Reply status, carried in FrameHeader::status. Maps 1:1 onto the Python exception a client
// raises (see StatusName / the bindings).
enum class Status : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // ValueError: a field disagrees with the session or the table
  kSessionFailed = 2,    // SessionError: the session is failed (sticky until every rank left)
  kUnauthorized = 3,     // TransportError: wrong job token / protocol version
  kProtocolError = 4,    // TransportError: malformed frame
  kNotOpen = 5,          // SessionError: no session open on this connection
  kShuttingDown = 6,     // TransportError: the shard is draining
  kInternal = 7,         // RuntimeError on the shard (e.g. an I/O error while checkpointing)
  kUnavailable = 8,      // SessionError: too many pending requests
  kStartStep = 9,        // StartStepError (a ValueError): Open's start_step is not the
                         // table's committed step (the session would renumber its steps)
};

// Names for messages: "Hello", ... ("Unknown" for a type outside MsgType); "ok", ...
// ("unknown status" outside Status).
const char* MsgTypeName(uint16_t type);
const char* StatusName(Status status);

struct FrameHeader {
  uint32_t magic;     // kMagic
  uint16_t version;   // kProtocolVersion
  uint16_t type;      // MsgType
  uint32_t slot;      // client slot the request occupies; echoed; kNoSlot for notifications
  int32_t status;     // Status (replies); 0 in requests
  uint64_t tag;       // client request id, echoed in the reply
  uint64_t job;       // TokenDigest(job token): every frame of a connection carries it
  uint64_t body_len;  // bytes that follow the header (the length prefix)
};
static_assert(sizeof(FrameHeader) == kHeaderBytes);

struct HelloBody {
  uint32_t token_len;  // <= kMaxTokenBytes; the token bytes follow
  uint32_t reserved;
};
static_assert(sizeof(HelloBody) == 8);

struct HelloOkBody {
  uint32_t shard_id;
  uint32_t num_shards;
  uint64_t max_frame_bytes;  // the largest frame (header + body) this shard accepts
  uint64_t instance_id;      // random per shard process: a restarted shard has another
};
static_assert(sizeof(HelloOkBody) == 24);

// The table's optimizer (store::OptimizerSpec) travels with every Open: the session's ranks
// and the table's store must agree on it. The learning rate does not: each Commit carries
// its step's.
struct OpenBody {
  uint64_t session;
  uint32_t rank;
  uint32_t world_size;
  uint32_t dim;
  uint8_t optimizer;      // store::OptimizerKind, <= kMaxOptimizerKind
  uint8_t reserved[3];
  uint8_t grad_division;  // 1: divide the summed gradient by world_size
  uint8_t init_kind;      // store::InitKind of rows never written
  uint16_t name_len;      // table name bytes that follow, 1..kMaxTableName
  float init_bound;
  float init_value;
  uint32_t num_bound_ranges;  // r: per-key-range uniform bounds (store::InitSpec), <= 2^16
  uint64_t init_seed;
  int64_t key_bound;      // >= 0: keys lie in [0, key_bound); -1: any int64
  double eps;             // the optimizer's constants (store::OptimizerSpec), finite
  double beta1;
  double beta2;
  double weight_decay;
  double initial_accumulator_value;
  // The table's committed step the session starts after (its first step is start_step + 1):
  // -1 a new job (the table must have no committed step), s >= 0 a declared resume (the
  // table must be at committed step s), kAnyStartStep: attach with no check (tools).
  int64_t start_step;
};
inline constexpr int64_t kAnyStartStep = -2;
static_assert(sizeof(OpenBody) == 104);
static_assert((kHeaderBytes + sizeof(OpenBody)) % 8 == 0);
inline constexpr uint32_t kMaxBoundRanges = 1u << 16;

struct OpenOkBody {
  int64_t committed_step;
  uint32_t dim;
  uint32_t state_dim;  // optimizer state floats per row of the table
};
static_assert(sizeof(OpenOkBody) == 16);

struct CommitBody {
  uint64_t session;
  int64_t step;
  uint32_t rank;
  uint32_t world_size;
  uint32_t chunk_index;
  uint32_t chunk_count;
  uint32_t dim;
  float lr;          // the step's learning rate (Adam: its bias-corrected step size); finite,
                     // >= 0, the same in every chunk of the step (else the session fails)
  uint32_t nrows;
  uint32_t nevict;   // virtual tables: keys evicted at this step's boundary, int64[nevict]
                     // (erased once the step is applied; 0: none). A chunk carries rows or
                     // evicted keys, never both (nevict > 0 requires nrows == 0)
};
static_assert(sizeof(CommitBody) == 48);
static_assert((kHeaderBytes + sizeof(CommitBody)) % 8 == 0);

// How the shard took a chunk (AckBody::disposition).
enum class Disposition : uint32_t {
  kStored = 0,           // new chunk of the pending step
  kDuplicate = 1,        // identical retry of a pending chunk
  kAlreadyCommitted = 2, // the step is committed: acknowledged without SGD
};

struct AckBody {
  int64_t step;
  int64_t committed_step;  // the shard's committed step when it acknowledged
  uint32_t rank;
  uint32_t chunk_index;
  uint32_t disposition;    // Disposition
  uint32_t reserved;
};
static_assert(sizeof(AckBody) == 32);

struct GetBody {
  uint64_t session;
  int64_t at_step;  // served once committed_step >= at_step (-1: now)
  uint32_t nrows;
  uint32_t dim;
  uint32_t state_dim;  // 0: weights only; the table's state_dim: rows with their state
  uint32_t reserved;
};
static_assert(sizeof(GetBody) == 32);
static_assert((kHeaderBytes + sizeof(GetBody)) % 8 == 0);

struct GetOkBody {
  int64_t served_step;  // the committed step the rows are from (>= at_step)
  uint32_t nrows;
  uint32_t dim;
  uint32_t state_dim;   // as requested
  uint32_t reserved;
};
static_assert(sizeof(GetOkBody) == 24);

struct AssignBody {
  uint64_t session;
  uint32_t nrows;
  uint32_t dim;
  uint32_t state_dim;  // 0: weights only (rows keep their state); the table's: weights + state
  uint32_t reserved;
};
static_assert(sizeof(AssignBody) == 24);
static_assert((kHeaderBytes + sizeof(AssignBody)) % 8 == 0);

struct CloseBody {
  uint64_t session;
  uint32_t rank;
  uint32_t reserved;
};
static_assert(sizeof(CloseBody) == 16);

struct SessionBody {
  uint64_t session;
};
static_assert(sizeof(SessionBody) == 8);

struct StepBody {
  uint64_t session;
  int64_t step;
};
static_assert(sizeof(StepBody) == 16);

struct MessageBody {
  uint64_t session;   // 0 when not about a session
  uint32_t text_len;  // <= kMaxMessageBytes; the text follows
  uint32_t reserved;
};
static_assert(sizeof(MessageBody) == 16);

struct CheckpointNoteBody {
  uint64_t session;
  int64_t step;       // the committed step the checkpoint holds (or failed to hold)
  uint32_t text_len;  // <= kMaxMessageBytes; the text follows (the error, or the directory)
  uint32_t reserved;
};
static_assert(sizeof(CheckpointNoteBody) == 24);

// Size of the fixed body struct of `type`; 0 for empty bodies (Ping/Pong).
size_t FixedBodyBytes(MsgType type);
bool IsKnownType(uint16_t type);
bool IsRequestType(MsgType type);

// 64-bit digest of a job token (common/hash.h Digest64: FNV-1a then fmix64). Not a MAC: the
// token itself is compared in the Hello; the digest tags every later frame so frames of
// another job that reach a connection (a bug, a crossed wire) are refused.
uint64_t TokenDigest(std::string_view token);

// Bytes of whole frames (header included) of nrows rows: a Commit of dim floats per row, a
// Get, an Assign.
inline size_t CommitFrameBytes(size_t nrows, size_t dim, size_t nevict = 0) {
  return kHeaderBytes + sizeof(CommitBody) + nrows * 8 + nrows * dim * 4 + nevict * 8;
}
inline size_t GetFrameBytes(size_t nrows) { return kHeaderBytes + sizeof(GetBody) + nrows * 8; }
// `width`: dim + state_dim floats per row.
inline size_t AssignFrameBytes(size_t nrows, size_t width) {
  return kHeaderBytes + sizeof(AssignBody) + nrows * 8 + nrows * width * 4;
}

// ---- header -----------------------------------------------------------------------------

// A header of this build's magic and version with the given fields.
inline FrameHeader MakeHeader(MsgType type, uint64_t job, uint64_t body_len,
                              Status status = Status::kOk, uint64_t tag = 0,
                              uint32_t slot = kNoSlot) {
  FrameHeader h;
  h.magic = kMagic;
  h.version = kProtocolVersion;
  h.type = static_cast<uint16_t>(type);
  h.slot = slot;
  h.status = static_cast<int32_t>(status);
  h.tag = tag;
  h.job = job;
  h.body_len = body_len;
  return h;
}

// Header <-> bytes (no check: CheckHeader). REQUIRES: p holds kHeaderBytes bytes.
inline FrameHeader LoadHeader(const uint8_t* p) {
  FrameHeader h;
  std::memcpy(&h, p, sizeof(h));
  return h;
}
inline void StoreHeader(uint8_t* p, const FrameHeader& h) { std::memcpy(p, &h, sizeof(h)); }

// Checks magic, version, a known type and body_len against max_body. Does not check job.
bool CheckHeader(const FrameHeader& h, size_t max_body, std::string* why);

// ---- parsed views (pointers into the caller's body buffer) ---------------------------------

struct HelloView {
  std::string_view token;
};
struct OpenView {
  OpenBody body;
  std::vector<int64_t> bound_starts;
  std::vector<float> bound_values;
  std::string_view table;
};
struct CommitView {
  CommitBody body;
  const int64_t* keys;   // may be unaligned only if the caller's buffer is: see invariant 3
  const float* grads;
  const int64_t* evict;    // nevict keys after the grads (virtual tables)
  const uint8_t* payload;  // keys, grads, evicted keys: payload_len bytes (duplicate checks)
  size_t payload_len;
};
struct GetView {
  GetBody body;
  const int64_t* keys;
};
struct AssignView {
  AssignBody body;
  const int64_t* keys;
  const float* rows;
};

// Parse<Type>: checks a request body of len bytes field by field (sizes, ranges, exact payload
// length) and fills *out, whose pointers point into `body`; false with *why (naming the type
// and the field) for a malformed body, *out then unspecified. REQUIRES: body holds len bytes
// and outlives *out.
bool ParseHello(const uint8_t* body, size_t len, HelloView* out, std::string* why);
bool ParseOpen(const uint8_t* body, size_t len, OpenView* out, std::string* why);
bool ParseCommit(const uint8_t* body, size_t len, CommitView* out, std::string* why);
bool ParseGet(const uint8_t* body, size_t len, GetView* out, std::string* why);
bool ParseAssign(const uint8_t* body, size_t len, AssignView* out, std::string* why);
bool ParseClose(const uint8_t* body, size_t len, CloseBody* out, std::string* why);
// A Checkpoint: the session, then an optional label (0..kMaxTableName bytes following
// ValidTableName's rules; empty: the shard's checkpoint directory itself, else its
// subdirectory of that name).
struct CheckpointView {
  SessionBody body;
  std::string_view label;
};
// As the Parse functions above.
bool ParseCheckpoint(const uint8_t* body, size_t len, CheckpointView* out, std::string* why);

// Valid table names: 1..kMaxTableName characters from [A-Za-z0-9_.:-] (they become
// checkpoint directory names).
bool ValidTableName(std::string_view name);

// Copies a fixed-size struct out of an unaligned buffer.
template <typename T>
inline T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace bagpipe::protocol::wire
