// Python bindings of the commit protocol, PS shards, transports and the TCP server:
// torchrec_bagpipe._C.{PSShardCore, ShardServerCore, PSClientCore, ClientOpCore,
// partition_assign, PROTOCOL_VERSION}. torchrec_bagpipe.ps.{shard, client, partitioner} wrap them
// and own argument conversion from tensors; settings arrive as the option structs of
// options.cc. Types and calls only: what a call does lives in the layers below.
//
// Thread safety: the GIL is released around every native call that may wait or work on
// rows; native threads (client workers, receive threads, the server) never touch Python
// objects. Buffers passed to the *_async methods are borrowed: the Python wrapper keeps
// the tensors alive until the operation is done.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/buffers.h"
#include "bindings/convert.h"
#include "bindings/registry.h"
#include "client/ps_client.h"
#include "common/errors.h"
#include "common/log.h"
#include "protocol/partitioner.h"
#include "protocol/wire.h"
#include "server/tcp_server.h"
#include "shard/embedding_store_backend.h"
#include "shard/ps_shard.h"
#include "transport/connect.h"

namespace bagpipe::bindings {
namespace {

using client::ClientOp;
using client::PSClient;
using shard::PSShard;
using server::TcpShardServer;
using transport::ShardEndpoint;

// A PSClientCore endpoint: a PSShardCore (local), (host, port) (tcp) or ("ucx", host, port).
ShardEndpoint EndpointOf(py::handle e, size_t index) {
  if (py::isinstance<PSShard>(e)) return ShardEndpoint::Local(e.cast<std::shared_ptr<PSShard>>());
  if (py::isinstance<py::tuple>(e) && py::len(e) == 3) {
    auto t = e.cast<py::tuple>();
    if (t[0].cast<std::string>() != "ucx") {
      throw ValueError("endpoint " + std::to_string(index) + ": unknown scheme");
    }
    return ShardEndpoint::Rdma(t[1].cast<std::string>(), t[2].cast<uint16_t>());
  }
  if (py::isinstance<py::tuple>(e)) {
    auto t = e.cast<py::tuple>();
    return ShardEndpoint::Tcp(t[0].cast<std::string>(), t[1].cast<uint16_t>());
  }
  throw TypeError("endpoint " + std::to_string(index) +
                  " must be a PSShardCore, a (host, port) or a ('ucx', host, port) tuple");
}

py::dict StatsDict(const std::map<std::string, int64_t>& m) {
  py::dict d;
  for (const auto& [k, v] : m) d[py::str(k)] = v;
  return d;
}

// Floats per row of a table read or written with (or without) its optimizer state.
py::ssize_t RowWidth(const shard::TableSchema& schema, bool with_state) {
  return static_cast<py::ssize_t>(schema.dim) + (with_state ? schema.state_dim() : 0);
}

py::dict ClientStatsDict(const client::ClientStats& s) {
  py::dict d;
  d["commits"] = s.commits;
  d["gets"] = s.gets;
  d["packets"] = s.packets;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["ack_waits"] = s.slot_waits;
  d["rows_committed"] = s.rows_committed;
  d["rows_read"] = s.rows_read;
  return d;
}

}  // namespace

BAGPIPE_BINDING(ps) {
  // ---- partitioner ------------------------------------------------------------------------
  m.def(
      "partition_assign",
      [](const std::string& kind, uint32_t num_shards, const py::array& keys, const py::array& out) {
        auto k = Vec<int64_t>(keys, "keys");
        auto info = CheckedBuffer<int64_t>(out, "out", 1, true);
        if (static_cast<size_t>(info.shape[0]) != k.size) throw ValueError("out must match keys");
        const protocol::Partitioner p(protocol::Partitioner::ParseKind(kind), num_shards);
        auto* o = static_cast<int64_t*>(info.ptr);
        py::gil_scoped_release release;
        for (size_t i = 0; i < k.size; ++i) o[i] = p.ShardOf(k.data[i]);
      },
      py::arg("kind"), py::arg("num_shards"), py::arg("keys"), py::arg("out"));

  // The wire's version, for tools that speak the protocol by hand (hostile-client tests,
  // the connection benchmark).
  m.attr("PROTOCOL_VERSION") = protocol::wire::kProtocolVersion;

  // ---- shard ----------------------------------------------------------------------------------
  py::class_<TcpShardServer>(m, "ShardServerCore")
      .def_property_readonly("host", &TcpShardServer::host)
      .def_property_readonly("port", &TcpShardServer::port)
      .def_property_readonly("stopped", &TcpShardServer::stopped)
      .def("stop", &TcpShardServer::Stop, py::arg("drain_timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](TcpShardServer& s) { return ServerStatsDict(s.stats()); });

  py::class_<PSShard, std::shared_ptr<PSShard>>(m, "PSShardCore")
      .def(py::init([](const shard::ShardOptions& shard, const store::StoreOptions& store,
                       bool verbose) {
             LogFn log;
             if (verbose) {
               log = StderrLog("bagpipe-ps shard " + std::to_string(shard.shard_id) + "/" +
                               std::to_string(shard.num_shards));
             }
             return std::make_shared<PSShard>(shard,
                                              shard::MakeEmbeddingStoreBackendFactory(store),
                                              shard::MakeEmbeddingStoreBackendLoader(store),
                                              std::move(log));
           }),
           py::arg("shard"), py::arg("store"), py::arg("verbose"))
      .def_property_readonly("shard_id", [](PSShard& s) { return s.options().shard_id; })
      .def_property_readonly("num_shards", [](PSShard& s) { return s.options().num_shards; })
      .def_property_readonly("instance_id", &PSShard::instance_id)
      .def(
          "create_table",
          [](PSShard& s, const std::string& name, const shard::TableSchema& schema) {
            s.CreateTable(name, schema);
          },
          py::arg("name"), py::arg("schema"), py::call_guard<py::gil_scoped_release>())
      .def("tables", &PSShard::TableNames)
      .def("committed_step",
           [](PSShard& s, const std::string& name) { return s.GetTable(name)->committed_step(); })
      .def("table_dim", [](PSShard& s, const std::string& name) { return s.GetTable(name)->schema().dim; })
      .def("table_schema", [](PSShard& s, const std::string& name) { return s.GetTable(name)->schema(); })
      // Rows are dim floats wide, or dim + state_dim with their optimizer state (with_state).
      .def("read",
           [](PSShard& s, const std::string& name, const py::array& keys, const py::array& out,
              bool with_state) {
             auto* t = s.GetTable(name);
             auto k = Vec<int64_t>(keys, "keys");
             auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size),
                                    RowWidth(t->schema(), with_state));
             py::gil_scoped_release release;
             return t->Read(k.data, k.size, o.data, with_state);
           },
           py::arg("name"), py::arg("keys"), py::arg("out"), py::arg("with_state") = false)
      .def("read_at",
           [](PSShard& s, const std::string& name, int64_t at_step, const py::array& keys,
              const py::array& out, double timeout, bool with_state) {
             auto* t = s.GetTable(name);
             auto k = Vec<int64_t>(keys, "keys");
             auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size),
                                    RowWidth(t->schema(), with_state));
             py::gil_scoped_release release;
             return t->ReadAt(at_step, k.data, k.size, o.data, DeadlineAfter(timeout), with_state);
           },
           py::arg("name"), py::arg("at_step"), py::arg("keys"), py::arg("out"),
           py::arg("timeout"), py::arg("with_state") = false)
      .def("assign",
           [](PSShard& s, const std::string& name, const py::array& keys, const py::array& rows,
              bool with_state) {
             auto* t = s.GetTable(name);
             auto k = Vec<int64_t>(keys, "keys");
             auto r = Mat<float>(rows, "rows", static_cast<py::ssize_t>(k.size),
                                 RowWidth(t->schema(), with_state));
             py::gil_scoped_release release;
             t->Assign(k.data, k.size, r.data, with_state);
           },
           py::arg("name"), py::arg("keys"), py::arg("rows"), py::arg("with_state") = false)
      .def("checkpoint", &PSShard::Checkpoint, py::arg("dir"), py::call_guard<py::gil_scoped_release>())
      .def("restore", &PSShard::Restore, py::arg("dir"), py::call_guard<py::gil_scoped_release>())
      .def("table_stats",
           [](PSShard& s, const std::string& name) {
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
             d["attached_ranks"] = t->attached_ranks();
             d["failed"] = t->failed();
             d["failure"] = t->failure();
             d["store"] = StatsDict(backend_stats);
             return d;
           })
      .def("stats",
           [](PSShard& s) {
             const auto st = s.stats();
             py::dict d;
             d["frames"] = st.frames;
             d["rejected"] = st.rejected;
             d["unauthorized"] = st.unauthorized;
             return d;
           })
      .def("begin_shutdown", &PSShard::BeginShutdown, py::arg("why"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shutting_down", &PSShard::shutting_down)
      .def(
          "serve",
          [](std::shared_ptr<PSShard> s, const server::TcpServerOptions& options) {
            py::gil_scoped_release release;
            return std::make_unique<TcpShardServer>(std::move(s), options);
          },
          py::arg("options"));

  // ---- client -----------------------------------------------------------------------------
  py::class_<ClientOp, std::shared_ptr<ClientOp>>(m, "ClientOpCore")
      .def("done", &ClientOp::Done)
      .def("wait",
           [](ClientOp& op, double timeout) {
             if (op.Done()) {  // finished: report without giving the GIL away
               op.Wait(DeadlineAfter(0.0));
               return;
             }
             py::gil_scoped_release release;
             op.Wait(DeadlineAfter(timeout));
           })
      .def_property_readonly("step", &ClientOp::step)
      .def_property_readonly("shard_steps", &ClientOp::shard_steps);

  py::class_<PSClient>(m, "PSClientCore")
      .def(py::init([](py::list endpoints, const client::ClientOptions& options,
                       const transport::ConnectOptions& connect) {
             // Collect the endpoints with the GIL, connect without it.
             std::vector<ShardEndpoint> eps;
             for (size_t j = 0; j < endpoints.size(); ++j) eps.push_back(EndpointOf(endpoints[j], j));
             py::gil_scoped_release release;
             return PSClient::Connect(options, eps, connect);
           }),
           py::arg("endpoints"), py::arg("options"), py::arg("connect"))
      .def_property_readonly("state_dim", &PSClient::state_dim)
      .def("commit_async",
           [](PSClient& c, int64_t step, const py::array& keys, const py::array& grads, float lr) {
             auto k = Vec<int64_t>(keys, "keys");
             auto g = Mat<float>(grads, "grads", static_cast<py::ssize_t>(k.size), c.options().dim);
             // The GIL stays held: enqueueing is microseconds of work (the client's worker
             // thread stages the packets), and releasing the GIL would hand it to another
             // Python thread of the trainer for longer than that.
             return c.CommitAsync(step, k.data, k.size, g.data, nullptr, lr);
           },
           py::arg("step"), py::arg("keys"), py::arg("grads"), py::arg("lr"))
      .def("get_async",
           [](PSClient& c, const py::array& keys, int64_t at_step, const py::array& out,
              bool with_state) {
             auto k = Vec<int64_t>(keys, "keys");
             const py::ssize_t width = c.options().dim + (with_state ? c.state_dim() : 0);
             auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size), width);
             // Enqueue only: GIL held.
             return c.GetAsync(k.data, k.size, at_step, o.data, with_state);
           },
           py::arg("keys"), py::arg("at_step"), py::arg("out"), py::arg("with_state") = false)
      .def("assign_async",
           [](PSClient& c, const py::array& keys, const py::array& rows, bool with_state) {
             auto k = Vec<int64_t>(keys, "keys");
             const py::ssize_t width = c.options().dim + (with_state ? c.state_dim() : 0);
             auto r = Mat<float>(rows, "rows", static_cast<py::ssize_t>(k.size), width);
             py::gil_scoped_release release;
             return c.AssignAsync(k.data, k.size, r.data, with_state);
           },
           py::arg("keys"), py::arg("rows"), py::arg("with_state") = false)
      .def("checkpoint_async", &PSClient::CheckpointAsync, py::arg("label") = std::string(),
           py::call_guard<py::gil_scoped_release>())
      .def("committed_step", &PSClient::CommittedStep)  // a locked read: GIL held
      .def("shard_committed_steps", &PSClient::ShardCommittedSteps,
           py::call_guard<py::gil_scoped_release>())
      .def("shard_peers", &PSClient::shard_peers)
      .def("failure",
           [](PSClient& c) -> py::object {
             auto f = c.failure();
             if (!f) return py::none();
             return py::str(f->message);
           })
      .def("checkpoint_report",
           [](PSClient& c) {
             client::CheckpointReport r;
             {
               py::gil_scoped_release release;
               r = c.checkpoint_report();
             }
             py::dict d;
             d["succeeded"] = r.succeeded;
             d["failed"] = r.failed;
             d["consecutive_failures"] = r.consecutive_failures;
             d["last_step"] = r.last_step;
             d["last_error"] = r.last_error;
             return d;
           })
      .def("stats", [](PSClient& c) {
        client::ClientStats s;
        {
          py::gil_scoped_release release;
          s = c.stats();
        }
        return ClientStatsDict(s);
      })
      .def("channel_stats", [](PSClient& c) {
        std::vector<transport::ChannelStats> cs;
        {
          py::gil_scoped_release release;
          cs = c.channel_stats();
        }
        const auto peers = c.shard_peers();
        py::list out;
        for (size_t j = 0; j < cs.size(); ++j) {
          py::dict d;
          d["peer"] = j < peers.size() ? peers[j] : std::string();
          d["frames_sent"] = cs[j].frames_sent;
          d["bytes_sent"] = cs[j].bytes_sent;
          d["frames_received"] = cs[j].frames_received;
          d["bytes_received"] = cs[j].bytes_received;
          d["slot_waits"] = cs[j].slot_waits;
          d["flushes"] = cs[j].flushes;
          d["one_sided_writes"] = cs[j].one_sided_writes;
          d["doorbells"] = cs[j].doorbells;
          out.append(d);
        }
        return out;
      })
      .def("close", &PSClient::Close, py::arg("timeout"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace bagpipe::bindings
