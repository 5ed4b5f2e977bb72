#include "protocol/wire.h"

#include <cmath>

#include "common/hash.h"

namespace bagpipe::protocol::wire {
namespace {

bool Fail(std::string* why, std::string text) {
  if (why) *why = std::move(text);
  return false;
}

// Validates that `len` holds exactly fixed + nrows * per_row bytes (no overflow).
bool ExactPayload(size_t len, size_t fixed, uint64_t nrows, uint64_t per_row, const char* what,
                  std::string* why) {
  if (per_row != 0 && nrows > (uint64_t{1} << 40) / per_row) {
    return Fail(why, std::string(what) + ": nrows " + std::to_string(nrows) + " is too large");
  }
  const uint64_t want = fixed + nrows * per_row;
  if (want != len) {
    return Fail(why, std::string(what) + ": body_len " + std::to_string(len) + " does not match nrows " +
                         std::to_string(nrows) + " (expected " + std::to_string(want) + ")");
  }
  return true;
}

bool CheckDim(uint32_t dim, const char* what, std::string* why) {
  if (dim == 0 || dim > kMaxDim) {
    return Fail(why, std::string(what) + ": dim " + std::to_string(dim) + " is outside [1, " +
                         std::to_string(kMaxDim) + "]");
  }
  return true;
}

}  // namespace

const char* MsgTypeName(uint16_t type) {
  switch (static_cast<MsgType>(type)) {
    case MsgType::kHello: return "Hello";
    case MsgType::kHelloOk: return "HelloOk";
    case MsgType::kOpen: return "Open";
    case MsgType::kOpenOk: return "OpenOk";
    case MsgType::kCommit: return "Commit";
    case MsgType::kAck: return "Ack";
    case MsgType::kGet: return "Get";
    case MsgType::kGetOk: return "GetOk";
    case MsgType::kAssign: return "Assign";
    case MsgType::kAssignOk: return "AssignOk";
    case MsgType::kClose: return "Close";
    case MsgType::kCloseOk: return "CloseOk";
    case MsgType::kCheckpoint: return "Checkpoint";
    case MsgType::kCheckpointOk: return "CheckpointOk";
    case MsgType::kPing: return "Ping";
    case MsgType::kPong: return "Pong";
    case MsgType::kError: return "Error";
    case MsgType::kNotifyCommitted: return "NotifyCommitted";
    case MsgType::kNotifyFailed: return "NotifyFailed";
    case MsgType::kNotifyShutdown: return "NotifyShutdown";
    case MsgType::kNotifyCheckpoint: return "NotifyCheckpoint";
  }
  return "Unknown";
}

const char* StatusName(Status status) {
  switch (status) {
    case Status::kOk: return "ok";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kSessionFailed: return "session failed";
    case Status::kUnauthorized: return "unauthorized";
    case Status::kProtocolError: return "protocol error";
    case Status::kNotOpen: return "no open session";
    case Status::kShuttingDown: return "shutting down";
    case Status::kInternal: return "internal error";
    case Status::kUnavailable: return "unavailable";
    case Status::kStartStep: return "start step mismatch";
  }
  return "unknown status";
}

bool IsKnownType(uint16_t type) {
  return type >= static_cast<uint16_t>(MsgType::kHello) &&
         type <= static_cast<uint16_t>(MsgType::kNotifyCheckpoint);
}

bool IsRequestType(MsgType type) {
  switch (type) {
    case MsgType::kHello:
    case MsgType::kOpen:
    case MsgType::kCommit:
    case MsgType::kGet:
    case MsgType::kAssign:
    case MsgType::kClose:
    case MsgType::kCheckpoint:
    case MsgType::kPing:
      return true;
    default:
      return false;
  }
}

size_t FixedBodyBytes(MsgType type) {
  switch (type) {
    case MsgType::kHello: return sizeof(HelloBody);
    case MsgType::kHelloOk: return sizeof(HelloOkBody);
    case MsgType::kOpen: return sizeof(OpenBody);
    case MsgType::kOpenOk: return sizeof(OpenOkBody);
    case MsgType::kCommit: return sizeof(CommitBody);
    case MsgType::kAck: return sizeof(AckBody);
    case MsgType::kGet: return sizeof(GetBody);
    case MsgType::kGetOk: return sizeof(GetOkBody);
    case MsgType::kAssign: return sizeof(AssignBody);
    case MsgType::kAssignOk: return sizeof(StepBody);
    case MsgType::kClose: return sizeof(CloseBody);
    case MsgType::kCloseOk: return sizeof(StepBody);
    case MsgType::kCheckpoint: return sizeof(SessionBody);
    case MsgType::kCheckpointOk: return sizeof(StepBody);
    case MsgType::kPing: return 0;
    case MsgType::kPong: return 0;
    case MsgType::kError: return sizeof(MessageBody);
    case MsgType::kNotifyCommitted: return sizeof(StepBody);
    case MsgType::kNotifyFailed: return sizeof(MessageBody);
    case MsgType::kNotifyShutdown: return sizeof(MessageBody);
    case MsgType::kNotifyCheckpoint: return sizeof(CheckpointNoteBody);
  }
  return 0;
}

uint64_t TokenDigest(std::string_view token) { return Digest64(token); }

bool CheckHeader(const FrameHeader& h, size_t max_body, std::string* why) {
  if (h.magic != kMagic) return Fail(why, "bad magic (not a torchrec_bagpipe PS frame)");
  if (h.version != kProtocolVersion) {
    return Fail(why, "protocol version " + std::to_string(h.version) + " is not supported (this "
                     "side speaks " + std::to_string(kProtocolVersion) + ")");
  }
  if (!IsKnownType(h.type)) return Fail(why, "unknown frame type " + std::to_string(h.type));
  if (h.body_len > max_body) {
    return Fail(why, std::string(MsgTypeName(h.type)) + " frame body_len " +
                         std::to_string(h.body_len) + " exceeds the limit " +
                         std::to_string(max_body));
  }
  if (h.body_len < FixedBodyBytes(static_cast<MsgType>(h.type))) {
    return Fail(why, std::string(MsgTypeName(h.type)) + " frame body_len " +
                         std::to_string(h.body_len) + " is shorter than its fixed part");
  }
  return true;
}

bool ValidTableName(std::string_view name) {
  if (name.empty() || name.size() > kMaxTableName) return false;
  if (name == "." || name == "..") return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

bool ParseHello(const uint8_t* body, size_t len, HelloView* out, std::string* why) {
  if (len < sizeof(HelloBody)) return Fail(why, "Hello: body too short");
  const auto b = Load<HelloBody>(body);
  if (b.token_len > kMaxTokenBytes) return Fail(why, "Hello: token_len exceeds the limit");
  if (!ExactPayload(len, sizeof(HelloBody), b.token_len, 1, "Hello", why)) return false;
  out->token = std::string_view(reinterpret_cast<const char*>(body + sizeof(HelloBody)),
                                b.token_len);
  return true;
}

bool ParseOpen(const uint8_t* body, size_t len, OpenView* out, std::string* why) {
  if (len < sizeof(OpenBody)) return Fail(why, "Open: body too short");
  out->body = Load<OpenBody>(body);
  const auto& b = out->body;
  if (b.num_bound_ranges > kMaxBoundRanges) return Fail(why, "Open: num_bound_ranges is too large");
  const size_t ranges_len = size_t{b.num_bound_ranges} * 12;
  if (!ExactPayload(len, sizeof(OpenBody) + ranges_len, b.name_len, 1, "Open", why)) return false;
  const uint8_t* ranges = body + sizeof(OpenBody);
  out->bound_starts.resize(b.num_bound_ranges);
  out->bound_values.resize(b.num_bound_ranges);
  if (b.num_bound_ranges) {
    std::memcpy(out->bound_starts.data(), ranges, size_t{b.num_bound_ranges} * 8);
    std::memcpy(out->bound_values.data(), ranges + size_t{b.num_bound_ranges} * 8,
                size_t{b.num_bound_ranges} * 4);
  }
  for (size_t i = 0; i < out->bound_values.size(); ++i) {
    if (!std::isfinite(out->bound_values[i]) || out->bound_values[i] < 0) {
      return Fail(why, "Open: bound range " + std::to_string(i) + " is not a finite bound >= 0");
    }
    if (i > 0 && out->bound_starts[i] <= out->bound_starts[i - 1]) {
      return Fail(why, "Open: bound range starts must be strictly increasing");
    }
  }
  out->table = std::string_view(reinterpret_cast<const char*>(ranges + ranges_len), b.name_len);
  if (!ValidTableName(out->table)) {
    return Fail(why, "Open: table name must be 1-128 characters of [A-Za-z0-9_.:-]");
  }
  if (b.world_size == 0 || b.world_size > kMaxWorldSize) {
    return Fail(why, "Open: world_size " + std::to_string(b.world_size) + " is outside [1, " +
                         std::to_string(kMaxWorldSize) + "]");
  }
  if (b.rank >= b.world_size) {
    return Fail(why, "Open: rank " + std::to_string(b.rank) + " is not below world_size " +
                         std::to_string(b.world_size));
  }
  if (!CheckDim(b.dim, "Open", why)) return false;
  if (b.optimizer > kMaxOptimizerKind) {
    return Fail(why, "Open: optimizer " + std::to_string(b.optimizer) + " unknown");
  }
  for (double v : {b.eps, b.beta1, b.beta2, b.weight_decay, b.initial_accumulator_value}) {
    if (!std::isfinite(v)) return Fail(why, "Open: the optimizer's constants must be finite");
  }
  if (b.grad_division > 1) return Fail(why, "Open: grad_division must be 0 or 1");
  if (b.init_kind > 2) return Fail(why, "Open: init_kind " + std::to_string(b.init_kind) + " unknown");
  if (!std::isfinite(b.init_bound) || !std::isfinite(b.init_value)) {
    return Fail(why, "Open: init_bound and init_value must be finite");
  }
  if (b.key_bound < -1) return Fail(why, "Open: key_bound must be >= -1");
  if (b.start_step < kAnyStartStep) {
    return Fail(why, "Open: start_step " + std::to_string(b.start_step) +
                         " must be >= -1 (or -2: attach without a check)");
  }
  return true;
}

bool ParseCommit(const uint8_t* body, size_t len, CommitView* out, std::string* why) {
  if (len < sizeof(CommitBody)) return Fail(why, "Commit: body too short");
  out->body = Load<CommitBody>(body);
  const auto& b = out->body;
  if (!CheckDim(b.dim, "Commit", why)) return false;
  if (b.nevict > kMaxChunkCount * 64ull) return Fail(why, "Commit: nevict is too large");
  if (b.nevict != 0 && b.nrows != 0) {  // (keeps the keys 8-byte aligned: invariant 3)
    return Fail(why, "Commit: a chunk carries gradient rows or evicted keys, not both");
  }
  if (!ExactPayload(len, sizeof(CommitBody) + uint64_t{b.nevict} * 8, b.nrows,
                    8 + uint64_t{b.dim} * 4, "Commit", why)) {
    return false;
  }
  if (b.world_size == 0 || b.world_size > kMaxWorldSize) {
    return Fail(why, "Commit: world_size " + std::to_string(b.world_size) + " out of range");
  }
  if (b.rank >= b.world_size) {
    return Fail(why, "Commit: rank " + std::to_string(b.rank) + " is not below world_size " +
                         std::to_string(b.world_size));
  }
  if (b.chunk_count == 0 || b.chunk_count > kMaxChunkCount) {
    return Fail(why, "Commit: chunk_count " + std::to_string(b.chunk_count) + " out of range");
  }
  if (b.chunk_index >= b.chunk_count) {
    return Fail(why, "Commit: chunk_index " + std::to_string(b.chunk_index) +
                         " is not below chunk_count " + std::to_string(b.chunk_count));
  }
  if (b.step < 0) return Fail(why, "Commit: step " + std::to_string(b.step) + " is negative");
  if (!std::isfinite(b.lr) || b.lr < 0.0f) return Fail(why, "Commit: lr must be finite and >= 0");
  out->payload = body + sizeof(CommitBody);
  out->payload_len = len - sizeof(CommitBody);
  out->keys = reinterpret_cast<const int64_t*>(out->payload);
  out->grads = reinterpret_cast<const float*>(out->payload + size_t{b.nrows} * 8);
  out->evict = reinterpret_cast<const int64_t*>(out->payload + size_t{b.nrows} * 8 +
                                                size_t{b.nrows} * b.dim * 4);
  return true;
}

bool ParseGet(const uint8_t* body, size_t len, GetView* out, std::string* why) {
  if (len < sizeof(GetBody)) return Fail(why, "Get: body too short");
  out->body = Load<GetBody>(body);
  if (!CheckDim(out->body.dim, "Get", why)) return false;
  if (out->body.state_dim > kMaxStateDim) return Fail(why, "Get: state_dim is too large");
  if (!ExactPayload(len, sizeof(GetBody), out->body.nrows, 8, "Get", why)) return false;
  if (out->body.at_step < -1) return Fail(why, "Get: at_step must be >= -1");
  out->keys = reinterpret_cast<const int64_t*>(body + sizeof(GetBody));
  return true;
}

bool ParseAssign(const uint8_t* body, size_t len, AssignView* out, std::string* why) {
  if (len < sizeof(AssignBody)) return Fail(why, "Assign: body too short");
  out->body = Load<AssignBody>(body);
  if (!CheckDim(out->body.dim, "Assign", why)) return false;
  if (out->body.state_dim > kMaxStateDim) return Fail(why, "Assign: state_dim is too large");
  const uint64_t width = uint64_t{out->body.dim} + out->body.state_dim;
  if (!ExactPayload(len, sizeof(AssignBody), out->body.nrows, 8 + width * 4, "Assign", why)) {
    return false;
  }
  out->keys = reinterpret_cast<const int64_t*>(body + sizeof(AssignBody));
  out->rows = reinterpret_cast<const float*>(body + sizeof(AssignBody) +
                                             size_t{out->body.nrows} * 8);
  return true;
}

bool ParseClose(const uint8_t* body, size_t len, CloseBody* out, std::string* why) {
  if (len != sizeof(CloseBody)) return Fail(why, "Close: body_len must be 16");
  *out = Load<CloseBody>(body);
  return true;
}

bool ParseCheckpoint(const uint8_t* body, size_t len, CheckpointView* out, std::string* why) {
  if (len < sizeof(SessionBody) || len > sizeof(SessionBody) + kMaxTableName) {
    return Fail(why, "Checkpoint: body_len must be 8 plus a label of at most " +
                         std::to_string(kMaxTableName) + " bytes");
  }
  out->body = Load<SessionBody>(body);
  out->label = std::string_view(reinterpret_cast<const char*>(body) + sizeof(SessionBody),
                                len - sizeof(SessionBody));
  if (!out->label.empty() && !ValidTableName(out->label)) {
    return Fail(why, "Checkpoint: a label must be 1-128 characters of [A-Za-z0-9_.:-], "
                     "not . or ..");
  }
  return true;
}

}  // namespace bagpipe::protocol::wire
