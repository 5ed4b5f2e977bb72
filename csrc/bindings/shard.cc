// Python binding of a PS shard: torchrec_bagpipe._C.PSShardCore, wrapped by
// torchrec_bagpipe.ps.shard.PSShard (which owns argument conversion from tensors); settings
// arrive as the option structs of options.cc. Types and calls only: what a call does lives in
// csrc/shard/.
//
// Thread safety: the GIL is released around every native call that may wait or work on
// rows; the shard's and the server's native threads never touch Python objects.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <string>

#include "bindings/buffers.h"
#include "bindings/registry.h"
#include "common/errors.h"
#include "common/log.h"
#include "server/tcp_server.h"
#include "shard/embedding_store_backend.h"
#include "shard/ps_shard.h"

namespace bagpipe::bindings {
namespace {

using server::TcpShardServer;
using shard::PSShard;
using ShardClass = py::class_<PSShard, std::shared_ptr<PSShard>>;

py::dict StatsDict(const std::map<std::string, int64_t>& m) {
  py::dict d;
  for (const auto& [k, v] : m) d[py::str(k)] = v;
  return d;
}

// Floats per row of a table read or written with (or without) its optimizer state.
py::ssize_t RowWidth(const shard::TableSchema& schema, bool with_state) {
  return static_cast<py::ssize_t>(schema.dim) + (with_state ? schema.state_dim() : 0);
}

// Construction, identity and the tables.
void BindShardTables(ShardClass& cls) {
  cls.def(py::init([](const shard::ShardOptions& shard, const store::StoreOptions& store,
                      bool verbose) {
            LogFn log;
            if (verbose) {
              log = StderrLog("bagpipe-ps shard " + std::to_string(shard.shard_id) + "/" +
                              std::to_string(shard.num_shards));
            }
            return std::make_shared<PSShard>(shard, shard::MakeEmbeddingStoreBackendFactory(store),
                                             shard::MakeEmbeddingStoreBackendLoader(store),
                                             std::move(log));
          }),
          py::arg("shard"), py::arg("store"), py::arg("verbose"));
  cls.def_property_readonly("shard_id", [](PSShard& s) { return s.options().shard_id; });
  cls.def_property_readonly("num_shards", [](PSShard& s) { return s.options().num_shards; });
  cls.def_property_readonly("instance_id", &PSShard::instance_id);
  cls.def(
      "create_table",
      [](PSShard& s, const std::string& name, const shard::TableSchema& schema) {
        s.CreateTable(name, schema);
      },
      py::arg("name"), py::arg("schema"), py::call_guard<py::gil_scoped_release>());
  cls.def("tables", &PSShard::TableNames);
  cls.def("committed_step",
          [](PSShard& s, const std::string& name) { return s.GetTable(name)->committed_step(); });
  cls.def("table_dim",
          [](PSShard& s, const std::string& name) { return s.GetTable(name)->schema().dim; });
  cls.def("table_schema",
          [](PSShard& s, const std::string& name) { return s.GetTable(name)->schema(); });
}

// Rows in process (tests, the Python PSShard): weights, or weights and optimizer state.
void BindShardRows(ShardClass& cls) {
  // Rows are dim floats wide, or dim + state_dim with their optimizer state (with_state).
  cls.def(
      "read",
      [](PSShard& s, const std::string& name, const py::array& keys, const py::array& out,
         bool with_state) {
        auto* t = s.GetTable(name);
        auto k = Vec<int64_t>(keys, "keys");
        auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size),
                               RowWidth(t->schema(), with_state));
        py::gil_scoped_release release;
        return t->Read(k.data, k.size, o.data, with_state);
      },
      py::arg("name"), py::arg("keys"), py::arg("out"), py::arg("with_state") = false);
  cls.def(
      "read_at",
      [](PSShard& s, const std::string& name, int64_t at_step, const py::array& keys,
         const py::array& out, double timeout, bool with_state) {
        auto* t = s.GetTable(name);
        auto k = Vec<int64_t>(keys, "keys");
        auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size),
                               RowWidth(t->schema(), with_state));
        py::gil_scoped_release release;
        return t->ReadAt(at_step, k.data, k.size, o.data, DeadlineAfter(timeout), with_state);
      },
      py::arg("name"), py::arg("at_step"), py::arg("keys"), py::arg("out"), py::arg("timeout"),
      py::arg("with_state") = false);
  cls.def(
      "assign",
      [](PSShard& s, const std::string& name, const py::array& keys, const py::array& rows,
         bool with_state) {
        auto* t = s.GetTable(name);
        auto k = Vec<int64_t>(keys, "keys");
        auto r = Mat<float>(rows, "rows", static_cast<py::ssize_t>(k.size),
                            RowWidth(t->schema(), with_state));
        py::gil_scoped_release release;
        t->Assign(k.data, k.size, r.data, with_state);
      },
      py::arg("name"), py::arg("keys"), py::arg("rows"), py::arg("with_state") = false);
}

// Checkpoints, counters, the drain and serving over TCP.
void BindShardAdmin(ShardClass& cls) {
  cls.def("checkpoint", &PSShard::Checkpoint, py::arg("dir"),
          py::call_guard<py::gil_scoped_release>());
  cls.def("restore", &PSShard::Restore, py::arg("dir"), py::call_guard<py::gil_scoped_release>());
  cls.def(
      "restore_resharded",
      [](PSShard& s, const std::vector<std::string>& dirs, const std::string& partitioner) {
        const auto kind = protocol::Partitioner::ParseKind(partitioner);
        py::gil_scoped_release release;
        return s.RestoreResharded(dirs, kind);
      },
      py::arg("dirs"), py::arg("partitioner"));
  cls.def("table_stats", [](PSShard& s, const std::string& name) {
    auto* t = s.GetTable(name);
    const auto c = t->stats();
    std::map<std::string, int64_t> backend_stats;
    {
      py::gil_scoped_release release;
      backend_stats = t->backend_stats();
    }
    py::dict d;
    d["committed_step"] = c.committed_step;
    d["steps_applied"] = c.steps_applied;
    d["rows_applied"] = c.rows_applied;
    d["chunks_received"] = c.chunks_received;
    d["duplicate_chunks"] = c.duplicate_chunks;
    d["committed_retries"] = c.committed_retries;
    d["reads"] = c.reads;
    d["rows_read"] = c.rows_read;
    d["deferred_reads"] = c.deferred_reads;
    d["checkpoints"] = c.checkpoints;
    d["incremental_checkpoints"] = c.incremental_checkpoints;
    d["checkpoint_bytes"] = c.checkpoint_bytes;
    d["checkpoint_links"] = c.checkpoint_links;
    d["attached_ranks"] = t->attached_ranks();
    d["failed"] = t->failed();
    d["failure"] = t->failure();
    d["store"] = StatsDict(backend_stats);
    return d;
  });
  cls.def("stats", [](PSShard& s) {
    const auto st = s.stats();
    py::dict d;
    d["frames"] = st.frames;
    d["rejected"] = st.rejected;
    d["unauthorized"] = st.unauthorized;
    return d;
  });
  cls.def("begin_shutdown", &PSShard::BeginShutdown, py::arg("why"),
          py::call_guard<py::gil_scoped_release>());
  cls.def_property_readonly("shutting_down", &PSShard::shutting_down);
  cls.def(
      "serve",
      [](std::shared_ptr<PSShard> s, const server::TcpServerOptions& options) {
        py::gil_scoped_release release;
        return std::make_unique<TcpShardServer>(std::move(s), options);
      },
      py::arg("options"));
}

}  // namespace

// After ps_server (ShardServerCore, which serve returns) and options (registry.h invariant 2).
BAGPIPE_BINDING(ps_shard) {
  ShardClass c(m, "PSShardCore");
  BindShardTables(c);
  BindShardRows(c);
  BindShardAdmin(c);
}

}  // namespace bagpipe::bindings
