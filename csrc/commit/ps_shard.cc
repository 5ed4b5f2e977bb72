#include "commit/ps_shard.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>

#include "common/errors.h"

namespace bagpipe::commit {

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

bool SameSpec(const TableSpec& a, const TableSpec& b, std::string* why) {
  if (a.dim != b.dim) {
    *why = "dim " + std::to_string(a.dim) + " differs from the table's dim " + std::to_string(b.dim);
    return false;
  }
  if (const std::string d = InitDifference(a.init, b.init); !d.empty()) {
    *why = d;
    return false;
  }
  if (a.key_bound != b.key_bound) {
    *why = "key_bound " + std::to_string(a.key_bound) + " differs from the table's " +
           std::to_string(b.key_bound);
    return false;
  }
  return true;
}

}  // namespace

PSShard::PSShard(ShardOptions options, TableFactory factory, TableLoader loader)
    : options_(std::move(options)),
      factory_(std::move(factory)),
      loader_(std::move(loader)),
      instance_id_(RandomId()) {
  if (options_.num_shards == 0 || options_.shard_id >= options_.num_shards) {
    throw ValueError("shard_id " + std::to_string(options_.shard_id) +
                     " must be below num_shards " + std::to_string(options_.num_shards));
  }
  if (options_.checkpoint_every < 0) throw ValueError("checkpoint_every must be >= 0");
  if (options_.max_frame_bytes < 4096) throw ValueError("max_frame_bytes must be >= 4096");
}

PSShard::~PSShard() = default;

std::string PSShard::TableDir(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / ("table-" + name)).string();
}

CoordinatorOptions PSShard::MakeCoordinatorOptions(const std::string& name) const {
  CoordinatorOptions o;
  o.log = options_.log;
  if (!options_.checkpoint_dir.empty()) o.checkpoint_dir = TableDir(options_.checkpoint_dir, name);
  o.checkpoint_every = options_.checkpoint_every;
  o.checkpoint_meta = {{"shard_id", std::to_string(options_.shard_id)},
                       {"num_shards", std::to_string(options_.num_shards)}};
  return o;
}

CommitCoordinator* PSShard::CreateTable(const std::string& name, const TableSpec& spec) {
  if (!wire::ValidTableName(name)) {
    throw ValueError("table name '" + name + "' must be 1-128 characters of [A-Za-z0-9_.:-]");
  }
  if (spec.dim == 0 || spec.dim > wire::kMaxDim) {
    throw ValueError("dim " + std::to_string(spec.dim) + " is outside [1, " +
                     std::to_string(wire::kMaxDim) + "]");
  }
  if (options_.expected_dim != 0 && spec.dim != options_.expected_dim) {
    throw ValueError("dim " + std::to_string(spec.dim) + " of table '" + name +
                     "' differs from this shard's --dim " + std::to_string(options_.expected_dim));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tables_.find(name);
  if (it != tables_.end()) {
    std::string why;
    if (!SameSpec(spec, it->second->spec(), &why)) {
      throw ValueError("table '" + name + "': " + why);
    }
    return it->second.get();
  }
  auto store = factory_(name, spec);
  auto coord = std::make_unique<CommitCoordinator>(name, std::move(store), -1,
                                                   MakeCoordinatorOptions(name));
  auto* raw = coord.get();
  tables_.emplace(name, std::move(coord));
  if (options_.log) {
    options_.log("table '" + name + "' created (dim " + std::to_string(spec.dim) + ")");
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

bool PSShard::HandleFrame(const std::shared_ptr<ServerLink>& link, const wire::FrameHeader& h,
                          const uint8_t* body, size_t body_len, transport::RecvBuffer* owner) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.frames;
  }
  try {
    return Dispatch(link, h, body, body_len, owner);
  } catch (const std::exception& e) {
    // Dispatch answers every error it expects; this is a last line of defence.
    link->SendError(h.tag, h.slot, Status::kInternal, link->session,
                    std::string("shard ") + std::to_string(options_.shard_id) +
                        " could not handle a " + wire::MsgTypeName(h.type) + " frame: " + e.what());
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.rejected;
    return true;
  }
}

bool PSShard::Dispatch(const std::shared_ptr<ServerLink>& link, const wire::FrameHeader& h,
                       const uint8_t* body, size_t len, transport::RecvBuffer* owner) {
  const auto type = static_cast<MsgType>(h.type);
  auto reject = [&](Status st, const std::string& text, bool keep) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.rejected;
      if (st == Status::kUnauthorized) ++stats_.unauthorized;
    }
    link->SendError(h.tag, h.slot, st, link->session, text);
    return keep;
  };
  std::string why;
  if (!wire::CheckHeader(h, options_.max_frame_bytes, &why)) {
    return reject(Status::kProtocolError, why, false);
  }
  if (!wire::IsRequestType(type)) {
    return reject(Status::kProtocolError,
                  std::string("a client may not send ") + wire::MsgTypeName(h.type) + " frames",
                  false);
  }
  if (type == MsgType::kHello) {
    if (link->authenticated) return reject(Status::kProtocolError, "duplicate Hello", false);
    wire::HelloView hello;
    if (!wire::ParseHello(body, len, &hello, &why)) return reject(Status::kProtocolError, why, false);
    if (!TokenEquals(hello.token, link->expected_token) ||
        h.job != wire::TokenDigest(hello.token)) {
      return reject(Status::kUnauthorized,
                    "job token refused: this PS shard serves another job", false);
    }
    link->authenticated = true;
    link->job_digest = h.job;
    wire::HelloOkBody ok{};
    ok.shard_id = options_.shard_id;
    ok.num_shards = options_.num_shards;
    ok.max_frame_bytes = options_.max_frame_bytes;
    ok.instance_id = instance_id_;
    link->Send(MsgType::kHelloOk, Status::kOk, h.tag, h.slot, &ok, sizeof(ok), 0, nullptr);
    return true;
  }
  if (!link->authenticated) {
    return reject(Status::kUnauthorized, "the first frame of a connection must be Hello", false);
  }
  if (h.job != link->job_digest) {
    return reject(Status::kUnauthorized, "frame carries another job's token digest", false);
  }
  if (shutting_down_.load() && type != MsgType::kClose && type != MsgType::kPing) {
    return reject(Status::kShuttingDown,
                  "PS shard " + std::to_string(options_.shard_id) + " is shutting down", true);
  }
  auto* coord = static_cast<CommitCoordinator*>(link->coordinator);
  switch (type) {
    case MsgType::kPing:
      link->Send(MsgType::kPong, Status::kOk, h.tag, h.slot, nullptr, 0, 0, nullptr);
      return true;
    case MsgType::kOpen: {
      wire::OpenView open;
      if (!wire::ParseOpen(body, len, &open, &why)) return reject(Status::kProtocolError, why, true);
      const std::string name(open.table);
      if (link->session_open && name != link->table) {
        return reject(Status::kInvalidArgument,
                      "this connection already has table '" + link->table + "' open", true);
      }
      TableSpec spec;
      spec.dim = open.body.dim;
      spec.init.kind = static_cast<store::InitKind>(open.body.init_kind);
      spec.init.bound = open.body.init_bound;
      spec.init.value = open.body.init_value;
      spec.init.seed = open.body.init_seed;
      spec.init.bound_starts = open.bound_starts;
      spec.init.bound_values = open.bound_values;
      spec.key_bound = open.body.key_bound;
      SessionParams params;
      params.session = open.body.session;
      params.world_size = open.body.world_size;
      params.dim = open.body.dim;
      params.lr = open.body.lr;
      params.grad_division = open.body.grad_division != 0;
      int64_t committed;
      CommitCoordinator* table;
      try {
        table = CreateTable(name, spec);
        committed = table->Open(params, open.body.rank, spec, link);
      } catch (const ValueError& e) {
        return reject(Status::kInvalidArgument, e.what(), true);
      } catch (const SessionError& e) {
        return reject(Status::kSessionFailed, e.what(), true);
      } catch (const TransportError& e) {
        return reject(Status::kShuttingDown, e.what(), true);
      } catch (const std::exception& e) {
        return reject(Status::kInternal, std::string("could not open table '") + name + "': " +
                                             e.what(), true);
      }
      link->session_open = true;
      link->table = name;
      link->session = params.session;
      link->rank = open.body.rank;
      link->coordinator = table;
      wire::OpenOkBody ok{};
      ok.committed_step = committed;
      ok.dim = spec.dim;
      link->Send(MsgType::kOpenOk, Status::kOk, h.tag, h.slot, &ok, sizeof(ok), 0, nullptr);
      return true;
    }
    case MsgType::kCommit: {
      wire::CommitView chunk;
      if (!wire::ParseCommit(body, len, &chunk, &why)) return reject(Status::kProtocolError, why, true);
      if (!link->session_open) {
        return reject(Status::kNotOpen, "Commit before Open on this connection", true);
      }
      coord->SubmitChunk(chunk, link, h.tag, h.slot, owner);
      return true;
    }
    case MsgType::kGet: {
      wire::GetView get;
      if (!wire::ParseGet(body, len, &get, &why)) return reject(Status::kProtocolError, why, true);
      if (!link->session_open) return reject(Status::kNotOpen, "Get before Open on this connection", true);
      if (get.body.session != link->session) {
        return reject(Status::kInvalidArgument, "Get for session " + std::to_string(get.body.session) +
                                                    " on a connection of session " +
                                                    std::to_string(link->session), true);
      }
      coord->Get(get.body.at_step, get.keys, get.body.nrows, get.body.dim, link, h.tag, h.slot);
      return true;
    }
    case MsgType::kAssign: {
      wire::AssignView as;
      if (!wire::ParseAssign(body, len, &as, &why)) return reject(Status::kProtocolError, why, true);
      if (!link->session_open) {
        return reject(Status::kNotOpen, "Assign before Open on this connection", true);
      }
      if (as.body.session != link->session || as.body.dim != coord->spec().dim) {
        return reject(Status::kInvalidArgument, "Assign: session or dim differs from the open session",
                      true);
      }
      try {
        coord->Assign(as.keys, as.body.nrows, as.rows);
      } catch (const ValueError& e) {
        return reject(Status::kInvalidArgument, e.what(), true);
      } catch (const std::exception& e) {
        return reject(Status::kInternal, e.what(), true);
      }
      wire::StepBody ok{link->session, coord->committed_step()};
      link->Send(MsgType::kAssignOk, Status::kOk, h.tag, h.slot, &ok, sizeof(ok), 0, nullptr);
      return true;
    }
    case MsgType::kClose: {
      wire::CloseBody cl;
      if (!wire::ParseClose(body, len, &cl, &why)) return reject(Status::kProtocolError, why, true);
      int64_t committed = -1;
      if (link->session_open) {
        committed = coord->Close(link->rank, link.get());
        link->session_open = false;
        link->coordinator = nullptr;
      }
      wire::StepBody ok{cl.session, committed};
      link->Send(MsgType::kCloseOk, Status::kOk, h.tag, h.slot, &ok, sizeof(ok), 0, nullptr);
      return true;
    }
    case MsgType::kCheckpoint: {
      wire::SessionBody sb;
      if (!wire::ParseSession(body, len, &sb, &why)) return reject(Status::kProtocolError, why, true);
      if (!link->session_open) {
        return reject(Status::kNotOpen, "Checkpoint before Open on this connection", true);
      }
      if (options_.checkpoint_dir.empty()) {
        return reject(Status::kInvalidArgument,
                      "PS shard " + std::to_string(options_.shard_id) +
                          " has no checkpoint directory (start it with --checkpoint-dir)", true);
      }
      int64_t step;
      try {
        step = coord->Checkpoint(TableDir(options_.checkpoint_dir, link->table));
      } catch (const std::exception& e) {
        return reject(Status::kInternal, std::string("checkpoint failed: ") + e.what(), true);
      }
      wire::StepBody ok{link->session, step};
      link->Send(MsgType::kCheckpointOk, Status::kOk, h.tag, h.slot, &ok, sizeof(ok), 0, nullptr);
      return true;
    }
    default:
      return reject(Status::kProtocolError, "unexpected frame type", false);
  }
}

void PSShard::LinkClosed(ServerLink* link) {
  if (link->session_open && link->coordinator) {
    static_cast<CommitCoordinator*>(link->coordinator)->Detach(link);
  }
  link->session_open = false;
  link->coordinator = nullptr;
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

std::map<std::string, int64_t> PSShard::Restore(const std::string& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw ValueError("restore: '" + dir + "' is not a directory");
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string fname = e.path().filename().string();
    if (e.is_directory() && fname.rfind("table-", 0) == 0) entries.push_back(e.path());
  }
  if (ec) throw IOError("restore: cannot list '" + dir + "': " + ec.message());
  std::sort(entries.begin(), entries.end());
  for (const auto& path : entries) {
    const std::string name = path.filename().string().substr(6);
    std::map<std::string, std::string> meta;
    auto store = loader_(path.string(), &meta);
    auto get = [&](const char* key) -> std::string {
      auto it = meta.find(key);
      if (it == meta.end()) {
        throw ValueError("restore: checkpoint '" + path.string() + "' has no '" + key +
                         "' in its meta (not written by a PS shard)");
      }
      return it->second;
    };
    int64_t step;
    try {
      step = std::stoll(get("committed_step"));
    } catch (const std::logic_error&) {
      throw ValueError("restore: checkpoint '" + path.string() + "' has a malformed committed_step");
    }
    const std::string sid = get("shard_id");
    const std::string nsh = get("num_shards");
    if (sid != std::to_string(options_.shard_id) || nsh != std::to_string(options_.num_shards)) {
      throw ValueError("restore: checkpoint '" + path.string() + "' belongs to shard " + sid +
                       " of " + nsh + ", this is shard " + std::to_string(options_.shard_id) +
                       " of " + std::to_string(options_.num_shards));
    }
    if (get("table") != name) {
      throw ValueError("restore: checkpoint '" + path.string() + "' holds table '" +
                       get("table") + "'");
    }
    if (options_.expected_dim != 0 && store->spec().dim != options_.expected_dim) {
      throw ValueError("restore: table '" + name + "' has dim " +
                       std::to_string(store->spec().dim) + ", this shard's --dim is " +
                       std::to_string(options_.expected_dim));
    }
    auto coord = std::make_unique<CommitCoordinator>(name, std::move(store), step,
                                                     MakeCoordinatorOptions(name));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (tables_.count(name)) throw ValueError("restore: table '" + name + "' already exists");
      tables_.emplace(name, std::move(coord));
    }
    steps[name] = step;
    if (options_.log) {
      options_.log("table '" + name + "' restored from " + path.string() + " at committed step " +
                   std::to_string(step));
    }
  }
  return steps;
}

void PSShard::BeginShutdown(const std::string& why) {
  if (shutting_down_.exchange(true)) return;
  std::vector<CommitCoordinator*> coords;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [_, c] : tables_) coords.push_back(c.get());
  }
  for (auto* c : coords) c->Shutdown("PS shard " + std::to_string(options_.shard_id) +
                                     " is shutting down: " + why);
  if (options_.log) options_.log("shutting down: " + why);
}

}  // namespace bagpipe::commit
