// PSShard's restores: a checkpoint of this very shard (Restore), and a whole set written by
// another number of shards, re-partitioned as it loads (RestoreResharded).
//
// A table checkpoint is <dir>/table-<name>/ with meta committed_step, table, shard_id and
// num_shards (ps_shard.h invariant 4). A resharded restore loads the old shards' checkpoints
// of one table one at a time (so at most one old shard's rows besides this shard's are in
// memory), exports their stored rows with state and keeps those the partitioner routes
// here: rows never written were never stored and still read as their initial value, so the
// restored shard is bitwise the rows the old set held for its keys.
#include <algorithm>
#include <filesystem>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "shard/ps_shard.h"

namespace bagpipe::shard {
namespace {

namespace fs = std::filesystem;

// The table checkpoints (table-<name>/) of one set directory, sorted by name.
std::vector<fs::path> TableEntries(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw ValueError("restore: '" + dir + "' is not a directory");
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string fname = e.path().filename().string();
    if (e.is_directory() && fname.rfind("table-", 0) == 0) entries.push_back(e.path());
  }
  if (ec) throw IOError("restore: cannot list '" + dir + "': " + ec.message());
  std::sort(entries.begin(), entries.end());
  return entries;
}

std::string Join(const std::vector<std::string>& names) {
  std::string out = "[";
  for (const auto& n : names) out += (out.size() > 1 ? ", '" : "'") + n + "'";
  return out + "]";
}

// What a PS shard recorded in a table checkpoint's meta.
struct TableMeta {
  int64_t step = -1;
  int64_t shard_id = 0;
  int64_t num_shards = 1;
};

TableMeta ParseMeta(const fs::path& path, const std::string& name,
                    const std::map<std::string, std::string>& meta) {
  auto get = [&](const char* key) -> std::string {
    auto it = meta.find(key);
    if (it == meta.end()) {
      throw ValueError("restore: checkpoint '" + path.string() + "' has no '" + key +
                       "' in its meta (not written by a PS shard)");
    }
    return it->second;
  };
  auto number = [&](const char* key) -> int64_t {
    const std::string text = get(key);
    try {
      size_t used = 0;
      const int64_t v = std::stoll(text, &used);
      if (used == text.size()) return v;
    } catch (const std::logic_error&) {
    }
    throw ValueError("restore: checkpoint '" + path.string() + "' has a malformed " + key);
  };
  if (get("table") != name) {
    throw ValueError("restore: checkpoint '" + path.string() + "' holds table '" +
                     get("table") + "'");
  }
  return TableMeta{number("committed_step"), number("shard_id"), number("num_shards")};
}

}  // namespace

void PSShard::AddRestored(
    std::map<std::string, std::pair<std::unique_ptr<TableBackend>, int64_t>> tables) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, _] : tables) {
    if (tables_.count(name)) throw ValueError("restore: table '" + name + "' already exists");
  }
  for (auto& [name, t] : tables) {
    tables_.emplace(name, std::make_unique<CommitCoordinator>(
                              name, std::move(t.first), t.second, MakeCoordinatorOptions(name)));
  }
}

std::map<std::string, int64_t> PSShard::Restore(const std::string& dir) {
  std::map<std::string, std::pair<std::unique_ptr<TableBackend>, int64_t>> loaded;
  for (const auto& path : TableEntries(dir)) {
    const std::string name = path.filename().string().substr(6);
    std::map<std::string, std::string> meta;
    auto backend = loader_(path.string(), &meta);
    const TableMeta m = ParseMeta(path, name, meta);
    if (m.shard_id != options_.shard_id || m.num_shards != options_.num_shards) {
      throw ValueError("restore: checkpoint '" + path.string() + "' belongs to shard " +
                       std::to_string(m.shard_id) + " of " + std::to_string(m.num_shards) +
                       ", this is shard " + std::to_string(options_.shard_id) + " of " +
                       std::to_string(options_.num_shards) +
                       " (a set of another shard count restores resharded)");
    }
    if (options_.expected_dim != 0 && backend->schema().dim != options_.expected_dim) {
      throw ValueError("restore: table '" + name + "' has dim " +
                       std::to_string(backend->schema().dim) + ", this shard's --dim is " +
                       std::to_string(options_.expected_dim));
    }
    loaded.emplace(name, std::make_pair(std::move(backend), m.step));
  }
  std::map<std::string, int64_t> steps;
  for (const auto& [name, t] : loaded) steps[name] = t.second;
  AddRestored(std::move(loaded));
  if (log_) {
    for (const auto& [name, step] : steps) {
      log_("table '" + name + "' restored from " + TableDir(dir, name) + " at committed step " +
           std::to_string(step));
    }
  }
  return steps;
}

std::map<std::string, int64_t> PSShard::RestoreResharded(const std::vector<std::string>& dirs,
                                                         protocol::PartitionKind partitioner) {
  if (dirs.empty()) throw ValueError("restore: a resharded restore needs the set's directories");
  // Every directory holds the same tables.
  std::vector<std::string> names;
  for (const auto& path : TableEntries(dirs[0])) names.push_back(path.filename().string().substr(6));
  for (size_t i = 1; i < dirs.size(); ++i) {
    std::vector<std::string> other;
    for (const auto& path : TableEntries(dirs[i])) other.push_back(path.filename().string().substr(6));
    if (other != names) {
      throw ValueError("restore: the set's shard directories hold different tables: '" +
                       dirs[0] + "' holds " + Join(names) + ", '" + dirs[i] + "' holds " +
                       Join(other));
    }
  }
  const protocol::Partitioner route(partitioner, options_.num_shards);
  constexpr size_t kChunk = 4096;
  std::vector<int64_t> keys(kChunk), mine;
  std::vector<float> rows, kept;
  std::map<std::string, std::pair<std::unique_ptr<TableBackend>, int64_t>> built;
  for (const auto& name : names) {
    std::unique_ptr<TableBackend> table;
    TableSchema schema;
    int64_t step = -1;
    std::string first;  // the directory whose checkpoint fixed the table's schema and step
    std::vector<bool> seen(dirs.size(), false);
    for (const auto& dir : dirs) {
      const fs::path path = fs::path(TableDir(dir, name));
      std::map<std::string, std::string> meta;
      auto old = loader_(path.string(), &meta);
      const TableMeta m = ParseMeta(path, name, meta);
      if (m.num_shards != static_cast<int64_t>(dirs.size()) || m.shard_id < 0 ||
          m.shard_id >= m.num_shards || seen[static_cast<size_t>(m.shard_id)]) {
        throw ValueError("restore: checkpoint '" + path.string() + "' is shard " +
                         std::to_string(m.shard_id) + " of " + std::to_string(m.num_shards) +
                         ", but " + std::to_string(dirs.size()) +
                         " directories were given: a resharded restore needs each shard of "
                         "the set exactly once");
      }
      seen[static_cast<size_t>(m.shard_id)] = true;
      if (!table) {
        schema = old->schema();
        step = m.step;
        first = path.string();
        if (options_.expected_dim != 0 && schema.dim != options_.expected_dim) {
          throw ValueError("restore: table '" + name + "' has dim " +
                           std::to_string(schema.dim) + ", this shard's --dim is " +
                           std::to_string(options_.expected_dim));
        }
        table = factory_(name, schema);
      } else {
        if (m.step != step) {
          throw ValueError("restore: table '" + name + "' is at committed step " +
                           std::to_string(m.step) + " in '" + path.string() + "' but at " +
                           std::to_string(step) + " in '" + first +
                           "': not one checkpoint set");
        }
        const std::string diff = SchemaDifference(old->schema(), schema);
        if (!diff.empty()) {
          throw ValueError("restore: table '" + name + "' in '" + path.string() + "': " + diff +
                           " (in '" + first + "')");
        }
      }
      const size_t width = schema.dim + schema.state_dim();
      rows.resize(kChunk * width);
      int64_t cursor = 0;
      while (cursor >= 0) {
        const size_t n = old->Export(&cursor, kChunk, keys.data(), rows.data());
        mine.clear();
        kept.clear();
        for (size_t i = 0; i < n; ++i) {
          if (route.ShardOf(keys[i]) != options_.shard_id) continue;
          mine.push_back(keys[i]);
          kept.insert(kept.end(), rows.begin() + static_cast<std::ptrdiff_t>(i * width),
                      rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * width));
        }
        if (!mine.empty()) table->Assign(mine.data(), mine.size(), kept.data(), /*with_state=*/true);
      }
    }
    built.emplace(name, std::make_pair(std::move(table), step));
  }
  std::map<std::string, int64_t> steps;
  for (const auto& [name, t] : built) steps[name] = t.second;
  AddRestored(std::move(built));
  if (log_) {
    for (const auto& [name, step] : steps) {
      log_("table '" + name + "' restored resharded from " + std::to_string(dirs.size()) +
           " shards (" + protocol::Partitioner::KindName(partitioner) + ") at committed step " +
           std::to_string(step));
    }
  }
  return steps;
}

}  // namespace bagpipe::shard
