#include "shard/ps_shard.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "common/errors.h"

namespace bagpipe::shard {

using transport::ServerLink;
using wire::MsgType;
using wire::Status;

namespace {

uint64_t RandomId() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count());
}

// Constant-time comparison of the job token (no early exit on the first differing byte).
bool TokenEquals(std::string_view a, std::string_view b) {
  unsigned diff = a.size() != b.size();
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

PSShard::PSShard(ShardOptions options, TableBackendFactory factory, TableBackendLoader loader,
                 LogFn log)
    : options_(std::move(options)),
      log_(std::move(log)),
      factory_(std::move(factory)),
      loader_(std::move(loader)),
      instance_id_(RandomId()) {
  if (options_.num_shards == 0 || options_.shard_id >= options_.num_shards) {
    throw ValueError("shard_id " + std::to_string(options_.shard_id) +
                     " must be below num_shards " + std::to_string(options_.num_shards));
  }
  if (options_.checkpoint_every < 0) throw ValueError("checkpoint_every must be >= 0");
  if (options_.checkpoint_full_every < 1) throw ValueError("checkpoint_full_every must be >= 1");
  if (!(options_.checkpoint_chain_fraction > 0.0) ||
      !std::isfinite(options_.checkpoint_chain_fraction)) {
    throw ValueError("checkpoint_chain_fraction must be > 0 and finite");
  }
  if (options_.max_frame_bytes < 4096) throw ValueError("max_frame_bytes must be >= 4096");
}

PSShard::~PSShard() = default;

std::string PSShard::TableDir(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / ("table-" + name)).string();
}

CoordinatorOptions PSShard::MakeCoordinatorOptions(const std::string& name) const {
  CoordinatorOptions o;
  o.log = log_;
  if (!options_.checkpoint_dir.empty()) o.checkpoint_dir = TableDir(options_.checkpoint_dir, name);
  o.checkpoint_every = options_.checkpoint_every;
  o.checkpoint_chain.incremental = options_.checkpoint_incremental;
  o.checkpoint_chain.full_every = options_.checkpoint_full_every;
  o.checkpoint_chain.chain_fraction = options_.checkpoint_chain_fraction;
  o.checkpoint_background = options_.checkpoint_background;
  o.checkpoint_meta = {{"shard_id", std::to_string(options_.shard_id)},
                       {"num_shards", std::to_string(options_.num_shards)}};
  return o;
}

CommitCoordinator* PSShard::CreateTable(const std::string& name, const TableSchema& schema) {
  if (!wire::ValidTableName(name)) {
    throw ValueError("table name '" + name + "' must be 1-128 characters of [A-Za-z0-9_.:-]");
  }
  if (schema.dim == 0 || schema.dim > wire::kMaxDim) {
    throw ValueError("dim " + std::to_string(schema.dim) + " is outside [1, " +
                     std::to_string(wire::kMaxDim) + "]");
  }
  if (options_.expected_dim != 0 && schema.dim != options_.expected_dim) {
    throw ValueError("dim " + std::to_string(schema.dim) + " of table '" + name +
                     "' differs from this shard's --dim " + std::to_string(options_.expected_dim));
  }
  try {
    store::ValidateOptimizerSpec(schema.optimizer);
  } catch (const ValueError& e) {
    throw ValueError("table '" + name + "': " + e.what());
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tables_.find(name);
  if (it != tables_.end()) {
    if (const std::string why = SchemaDifference(schema, it->second->schema()); !why.empty()) {
      throw ValueError("table '" + name + "': " + why);
    }
    return it->second.get();
  }
  auto backend = factory_(name, schema);
  auto coord = std::make_unique<CommitCoordinator>(name, std::move(backend), -1,
                                                   MakeCoordinatorOptions(name));
  auto* raw = coord.get();
  // A table created while the shard drains (an Open that passed Dispatch just before the
  // flag went up) drains too: BeginShutdown has already collected the tables it tells.
  if (shutting_down_.load(std::memory_order_relaxed)) raw->Shutdown(shutdown_text_);
  tables_.emplace(name, std::move(coord));
  if (log_) {
    log_("table '" + name + "' created (dim " + std::to_string(schema.dim) + ", " +
         store::OptimizerKindName(schema.optimizer.kind) + ")");
  }
  return raw;
}

CommitCoordinator* PSShard::FindTable(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tables_.find(name);
  return it == tables_.end() ? nullptr : it->second.get();
}

CommitCoordinator* PSShard::GetTable(const std::string& name) {
  auto* t = FindTable(name);
  if (!t) throw ValueError("table '" + name + "' does not exist on shard " +
                           std::to_string(options_.shard_id));
  return t;
}

std::vector<std::string> PSShard::TableNames() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  for (const auto& [name, _] : tables_) names.push_back(name);
  return names;
}

ShardStats PSShard::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

// ---- frame handling ----------------------------------------------------------------------

// The session a link opened, kept on the link (ServerLink::state); touched only by the
// thread delivering the link's requests and by LinkClosed.
class PSShard::LinkSession : public transport::LinkState {
 public:
  bool open = false;                        // after a successful Open
  std::string table;                        // the table the session is on
  uint64_t session = 0;
  uint32_t rank = 0;
  CommitCoordinator* coordinator = nullptr;  // owned by the shard (invariant 3)
};

struct PSShard::Request {
  const std::shared_ptr<ServerLink>& link;
  const wire::FrameHeader& header;
  const uint8_t* body;
  size_t len;
  transport::RecvBuffer* owner;
  LinkSession& session;
};

PSShard::LinkSession& PSShard::SessionOf(ServerLink& link) {
  if (!link.state) link.state = std::make_unique<LinkSession>();
  return static_cast<LinkSession&>(*link.state);
}

transport::FrameHandler::Identity PSShard::identity() const {
  Identity id;
  id.shard_id = options_.shard_id;
  id.num_shards = options_.num_shards;
  id.max_frame_bytes = options_.max_frame_bytes;
  return id;
}

bool PSShard::HandleFrame(const std::shared_ptr<ServerLink>& link, const wire::FrameHeader& h,
                          const uint8_t* body, size_t body_len, transport::RecvBuffer* owner) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.frames;
  }
  LinkSession& session = SessionOf(*link);
  const Request r{link, h, body, body_len, owner, session};
  try {
    return Dispatch(r);
  } catch (const std::exception& e) {
    // The handlers answer every error they expect; this is a last line of defence.
    link->SendError(h.tag, h.slot, Status::kInternal, session.session,
                    std::string("shard ") + std::to_string(options_.shard_id) +
                        " could not handle a " + wire::MsgTypeName(h.type) + " frame: " + e.what());
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.rejected;
    return true;
  }
}

bool PSShard::Reject(const Request& r, Status status, const std::string& text, bool keep_link) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.rejected;
    if (status == Status::kUnauthorized) ++stats_.unauthorized;
  }
  r.link->SendError(r.header.tag, r.header.slot, status, r.session.session, text);
  return keep_link;
}

bool PSShard::Dispatch(const Request& r) {
  const wire::FrameHeader& h = r.header;
  const auto type = static_cast<MsgType>(h.type);
  std::string why;
  if (!wire::CheckHeader(h, options_.max_frame_bytes, &why)) {
    return Reject(r, Status::kProtocolError, why, false);
  }
  if (!wire::IsRequestType(type)) {
    return Reject(r, Status::kProtocolError,
                  std::string("a client may not send ") + wire::MsgTypeName(h.type) + " frames",
                  false);
  }
  if (type == MsgType::kHello) return OnHello(r);
  if (!r.link->authenticated) {
    return Reject(r, Status::kUnauthorized, "the first frame of a connection must be Hello", false);
  }
  if (h.job != r.link->job_digest) {
    return Reject(r, Status::kUnauthorized, "frame carries another job's token digest", false);
  }
  if (shutting_down_.load(std::memory_order_acquire) && type != MsgType::kClose &&
      type != MsgType::kPing) {
    return Reject(r, Status::kShuttingDown, ShutdownText(), true);
  }
  switch (type) {
    case MsgType::kPing: return OnPing(r);
    case MsgType::kOpen: return OnOpen(r);
    case MsgType::kCommit: return OnCommit(r);
    case MsgType::kGet: return OnGet(r);
    case MsgType::kAssign: return OnAssign(r);
    case MsgType::kClose: return OnClose(r);
    case MsgType::kCheckpoint: return OnCheckpoint(r);
    default: return Reject(r, Status::kProtocolError, "unexpected frame type", false);
  }
}

bool PSShard::OnHello(const Request& r) {
  ServerLink& link = *r.link;
  if (link.authenticated) return Reject(r, Status::kProtocolError, "duplicate Hello", false);
  wire::HelloView hello;
  std::string why;
  if (!wire::ParseHello(r.body, r.len, &hello, &why)) {
    return Reject(r, Status::kProtocolError, why, false);
  }
  if (!TokenEquals(hello.token, link.expected_token) ||
      r.header.job != wire::TokenDigest(hello.token)) {
    return Reject(r, Status::kUnauthorized, "job token refused: this PS shard serves another job",
                  false);
  }
  link.authenticated = true;
  link.job_digest = r.header.job;
  wire::HelloOkBody ok{};
  ok.shard_id = options_.shard_id;
  ok.num_shards = options_.num_shards;
  ok.max_frame_bytes = options_.max_frame_bytes;
  ok.instance_id = instance_id_;
  link.Send(MsgType::kHelloOk, Status::kOk, r.header.tag, r.header.slot, &ok, sizeof(ok), 0,
            nullptr);
  return true;
}

bool PSShard::OnPing(const Request& r) {
  r.link->Send(MsgType::kPong, Status::kOk, r.header.tag, r.header.slot, nullptr, 0, 0, nullptr);
  return true;
}

bool PSShard::OnOpen(const Request& r) {
  LinkSession& ls = r.session;
  wire::OpenView open;
  std::string why;
  if (!wire::ParseOpen(r.body, r.len, &open, &why)) {
    return Reject(r, Status::kProtocolError, why, true);
  }
  const std::string name(open.table);
  if (ls.open && name != ls.table) {
    return Reject(r, Status::kInvalidArgument,
                  "this connection already has table '" + ls.table + "' open", true);
  }
  TableSchema schema;
  schema.dim = open.body.dim;
  schema.init.kind = static_cast<store::InitKind>(open.body.init_kind);
  schema.init.bound = open.body.init_bound;
  schema.init.value = open.body.init_value;
  schema.init.seed = open.body.init_seed;
  schema.init.bound_starts = open.bound_starts;
  schema.init.bound_values = open.bound_values;
  schema.key_bound = open.body.key_bound;
  schema.optimizer.kind = static_cast<store::OptimizerKind>(open.body.optimizer);
  schema.optimizer.eps = open.body.eps;
  schema.optimizer.beta1 = open.body.beta1;
  schema.optimizer.beta2 = open.body.beta2;
  schema.optimizer.weight_decay = open.body.weight_decay;
  schema.optimizer.initial_accumulator_value = open.body.initial_accumulator_value;
  SessionParams params;
  params.session = open.body.session;
  params.world_size = open.body.world_size;
  params.dim = open.body.dim;
  params.grad_division = open.body.grad_division != 0;
  params.start_step = open.body.start_step;
  int64_t committed;
  CommitCoordinator* table;
  try {
    table = CreateTable(name, schema);
    committed = table->Open(params, open.body.rank, schema, r.link);
  } catch (const StartStepError& e) {
    return Reject(r, Status::kStartStep, e.what(), true);
  } catch (const ValueError& e) {
    return Reject(r, Status::kInvalidArgument, e.what(), true);
  } catch (const SessionError& e) {
    return Reject(r, Status::kSessionFailed, e.what(), true);
  } catch (const TransportError& e) {
    return Reject(r, Status::kShuttingDown, e.what(), true);
  } catch (const std::exception& e) {
    return Reject(r, Status::kInternal,
                  std::string("could not open table '") + name + "': " + e.what(), true);
  }
  ls.open = true;
  ls.table = name;
  ls.session = params.session;
  ls.rank = open.body.rank;
  ls.coordinator = table;
  wire::OpenOkBody ok{};
  ok.committed_step = committed;
  ok.dim = schema.dim;
  ok.state_dim = table->schema().state_dim();
  r.link->Send(MsgType::kOpenOk, Status::kOk, r.header.tag, r.header.slot, &ok, sizeof(ok), 0,
               nullptr);
  return true;
}

bool PSShard::OnCommit(const Request& r) {
  wire::CommitView chunk;
  std::string why;
  if (!wire::ParseCommit(r.body, r.len, &chunk, &why)) {
    return Reject(r, Status::kProtocolError, why, true);
  }
  if (!r.session.open) return Reject(r, Status::kNotOpen, "Commit before Open on this connection", true);
  r.session.coordinator->SubmitChunk(chunk, r.link, r.header.tag, r.header.slot, r.owner);
  return true;
}

bool PSShard::OnGet(const Request& r) {
  const LinkSession& ls = r.session;
  wire::GetView get;
  std::string why;
  if (!wire::ParseGet(r.body, r.len, &get, &why)) return Reject(r, Status::kProtocolError, why, true);
  if (!ls.open) return Reject(r, Status::kNotOpen, "Get before Open on this connection", true);
  if (get.body.session != ls.session) {
    return Reject(r, Status::kInvalidArgument,
                  "Get for session " + std::to_string(get.body.session) +
                      " on a connection of session " + std::to_string(ls.session), true);
  }
  ls.coordinator->Get(get.body.at_step, get.keys, get.body.nrows, get.body.dim,
                      get.body.state_dim, r.link, r.header.tag, r.header.slot);
  return true;
}

bool PSShard::OnAssign(const Request& r) {
  const LinkSession& ls = r.session;
  wire::AssignView as;
  std::string why;
  if (!wire::ParseAssign(r.body, r.len, &as, &why)) {
    return Reject(r, Status::kProtocolError, why, true);
  }
  if (!ls.open) return Reject(r, Status::kNotOpen, "Assign before Open on this connection", true);
  CommitCoordinator* coord = ls.coordinator;
  if (as.body.session != ls.session || as.body.dim != coord->schema().dim) {
    return Reject(r, Status::kInvalidArgument,
                  "Assign: session or dim differs from the open session", true);
  }
  if (as.body.state_dim != 0 && as.body.state_dim != coord->schema().state_dim()) {
    return Reject(r, Status::kInvalidArgument,
                  "Assign: state_dim " + std::to_string(as.body.state_dim) + " differs from table '" +
                      ls.table + "' state_dim " + std::to_string(coord->schema().state_dim()),
                  true);
  }
  try {
    coord->Assign(as.keys, as.body.nrows, as.rows, as.body.state_dim != 0);
  } catch (const ValueError& e) {
    return Reject(r, Status::kInvalidArgument, e.what(), true);
  } catch (const std::exception& e) {
    return Reject(r, Status::kInternal, e.what(), true);
  }
  wire::StepBody ok{ls.session, coord->committed_step()};
  r.link->Send(MsgType::kAssignOk, Status::kOk, r.header.tag, r.header.slot, &ok, sizeof(ok), 0,
               nullptr);
  return true;
}

bool PSShard::OnClose(const Request& r) {
  LinkSession& ls = r.session;
  wire::CloseBody cl;
  std::string why;
  if (!wire::ParseClose(r.body, r.len, &cl, &why)) return Reject(r, Status::kProtocolError, why, true);
  int64_t committed = -1;
  if (ls.open) {
    committed = ls.coordinator->Close(ls.rank, r.link.get());
    ls.open = false;
    ls.coordinator = nullptr;
  }
  wire::StepBody ok{cl.session, committed};
  r.link->Send(MsgType::kCloseOk, Status::kOk, r.header.tag, r.header.slot, &ok, sizeof(ok), 0,
               nullptr);
  return true;
}

bool PSShard::OnCheckpoint(const Request& r) {
  const LinkSession& ls = r.session;
  wire::CheckpointView cp;
  std::string why;
  if (!wire::ParseCheckpoint(r.body, r.len, &cp, &why)) {
    return Reject(r, Status::kProtocolError, why, true);
  }
  if (!ls.open) return Reject(r, Status::kNotOpen, "Checkpoint before Open on this connection", true);
  if (options_.checkpoint_dir.empty()) {
    return Reject(r, Status::kInvalidArgument,
                  "PS shard " + std::to_string(options_.shard_id) +
                      " has no checkpoint directory (start it with --checkpoint-dir)", true);
  }
  int64_t step;
  try {
    const std::string dir =
        cp.label.empty()
            ? options_.checkpoint_dir
            : (std::filesystem::path(options_.checkpoint_dir) / std::string(cp.label)).string();
    step = ls.coordinator->Checkpoint(TableDir(dir, ls.table));
  } catch (const std::exception& e) {
    return Reject(r, Status::kInternal, std::string("checkpoint failed: ") + e.what(), true);
  }
  wire::StepBody ok{ls.session, step};
  r.link->Send(MsgType::kCheckpointOk, Status::kOk, r.header.tag, r.header.slot, &ok, sizeof(ok),
               0, nullptr);
  return true;
}

void PSShard::LinkClosed(ServerLink* link) {
  LinkSession& ls = SessionOf(*link);
  if (ls.open && ls.coordinator) ls.coordinator->Detach(link);
  ls.open = false;
  ls.coordinator = nullptr;
}

std::map<std::string, int64_t> PSShard::Checkpoint(const std::string& dir_in) {
  const std::string dir = dir_in.empty() ? options_.checkpoint_dir : dir_in;
  if (dir.empty()) throw ValueError("checkpoint: no directory given and no checkpoint_dir set");
  std::map<std::string, int64_t> steps;
  for (const auto& name : TableNames()) {
    steps[name] = GetTable(name)->Checkpoint(TableDir(dir, name));
  }
  return steps;
}

void PSShard::BeginShutdown(const std::string& why) {
  std::vector<CommitCoordinator*> coords;
  std::string text;
  {
    // The reason is in place before the flag is up (both under mu_, the flag released after
    // it): every refusal that sees the flag names the reason (ShutdownText).
    std::lock_guard<std::mutex> lock(mu_);
    if (shutting_down_.load(std::memory_order_relaxed)) return;
    shutdown_text_ = "PS shard " + std::to_string(options_.shard_id) +
                     " is shutting down: " + why;
    text = shutdown_text_;
    shutting_down_.store(true, std::memory_order_release);
    for (auto& [_, c] : tables_) coords.push_back(c.get());
  }
  for (auto* c : coords) c->Shutdown(text);
  if (log_) log_("shutting down: " + why);
}

std::string PSShard::ShutdownText() {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_text_;
}

}  // namespace bagpipe::shard
