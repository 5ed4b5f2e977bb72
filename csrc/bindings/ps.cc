// Python bindings of the commit protocol, PS shards, transports and the TCP server:
// torchrec_bagpipe._C.{PSShardCore, ShardServerCore, PSClientCore, ClientOpCore, RawLink,
// partition_assign, fuzz_server}. torchrec_bagpipe.ps.{shard, client, partitioner} wrap them
// and own argument conversion from tensors.
//
// Thread safety: the GIL is released around every native call that may wait or work on
// rows; native threads (client workers, receive threads, the server) never touch Python
// objects. Buffers passed to the *_async methods are borrowed: the Python wrapper keeps
// the tensors alive until the operation is done.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bindings/buffers.h"
#include "bindings/convert.h"
#include "bindings/registry.h"
#include "commit/client.h"
#include "commit/partitioner.h"
#include "commit/ps_shard.h"
#include "commit/store_table.h"
#include "common/errors.h"
#include "server/frame_fuzzer.h"
#include "server/shard_server.h"
#include "transport/local_transport.h"
#include "transport/loopback_probe.h"
#include "transport/rdma.h"
#include "transport/socket_io.h"
#include "transport/tcp_transport.h"

namespace bagpipe::bindings {
namespace {

using commit::ClientOp;
using commit::PSClient;
using commit::PSShard;
using server::ShardServer;

// Writes one timestamped line to stderr (log lines of a shard; no Python involved).
commit::LogFn StderrLog(const std::string& prefix) {
  return [prefix](const std::string& line) {
    char ts[32];
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    std::strftime(ts, sizeof(ts), "%Y-%m-%d %H:%M:%S", &tm);
    std::fprintf(stderr, "%s [%s] %s\n", ts, prefix.c_str(), line.c_str());
    std::fflush(stderr);
  };
}

// The server side of a link driven from Python (tests of the protocol): every frame the
// shard sends through it is recorded as bytes (header + body).
class RawLink : public transport::ServerLink {
 public:
  explicit RawLink(std::shared_ptr<PSShard> shard) : shard_(std::move(shard)) {}

  bool Send(commit::wire::MsgType type, commit::wire::Status status, uint64_t tag, uint32_t slot,
            const void* fixed, size_t fixed_len, size_t payload_len,
            const transport::PayloadFill& fill) override {
    std::string frame(commit::wire::kHeaderBytes + fixed_len + payload_len, '\0');
    auto* p = reinterpret_cast<uint8_t*>(frame.data());
    commit::wire::StoreHeader(p, commit::wire::MakeHeader(type, job_digest, fixed_len + payload_len,
                                                          status, tag, slot));
    if (fixed_len) std::memcpy(p + commit::wire::kHeaderBytes, fixed, fixed_len);
    if (payload_len) fill(p + commit::wire::kHeaderBytes + fixed_len);
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    frames_.push_back(std::move(frame));
    return true;
  }
  std::string Describe() const override { return "raw"; }

  // Hands one frame to the shard; returns whether the link stays open.
  bool Request(const std::string& frame, const std::shared_ptr<RawLink>& self) {
    if (frame.size() < commit::wire::kHeaderBytes) {
      throw ValueError("frame is shorter than the 40-byte header");
    }
    const auto* p = reinterpret_cast<const uint8_t*>(frame.data());
    const auto h = commit::wire::LoadHeader(p);
    // The body is copied so that it is 8-byte aligned like a transport's buffer.
    std::vector<uint64_t> body((frame.size() - commit::wire::kHeaderBytes + 7) / 8);
    std::memcpy(body.data(), p + commit::wire::kHeaderBytes, frame.size() - commit::wire::kHeaderBytes);
    if (h.body_len != frame.size() - commit::wire::kHeaderBytes) {
      throw ValueError("frame: body_len does not match the bytes given");
    }
    return shard_->HandleFrame(self, h, reinterpret_cast<const uint8_t*>(body.data()), h.body_len);
  }

  std::vector<std::string> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out(std::make_move_iterator(frames_.begin()),
                                 std::make_move_iterator(frames_.end()));
    frames_.clear();
    return out;
  }

  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
    }
    shard_->LinkClosed(this);
  }

 private:
  const std::shared_ptr<PSShard> shard_;
  std::mutex mu_;
  std::deque<std::string> frames_;
  bool closed_ = false;
};

py::dict StatsDict(const std::map<std::string, int64_t>& m) {
  py::dict d;
  for (const auto& [k, v] : m) d[py::str(k)] = v;
  return d;
}

py::dict ClientStatsDict(const commit::ClientStats& s) {
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
        commit::Partitioner p(commit::Partitioner::ParseKind(kind), num_shards);
        auto* o = static_cast<int64_t*>(info.ptr);
        py::gil_scoped_release release;
        for (size_t i = 0; i < k.size; ++i) o[i] = p.ShardOf(k.data[i]);
      },
      py::arg("kind"), py::arg("num_shards"), py::arg("keys"), py::arg("out"));

  // ---- shard ----------------------------------------------------------------------------------
  py::class_<ShardServer>(m, "ShardServerCore")
      .def_property_readonly("host", &ShardServer::host)
      .def_property_readonly("port", &ShardServer::port)
      .def_property_readonly("stopped", &ShardServer::stopped)
      .def("stop", &ShardServer::Stop, py::arg("drain_timeout"), py::call_guard<py::gil_scoped_release>())
      .def("stats", [](ShardServer& s) { return ServerStatsDict(s.stats()); });

  py::class_<PSShard, std::shared_ptr<PSShard>>(m, "PSShardCore")
      .def(py::init([](uint32_t shard_id, uint32_t num_shards, uint32_t expected_dim,
                       const std::string& checkpoint_dir, int64_t checkpoint_every,
                       uint64_t max_frame_bytes, bool verbose, int store_shards, int store_threads,
                       int64_t memory_budget, const std::string& spill_dir, double high, double low,
                       uint32_t page_rows) {
             commit::ShardOptions o;
             o.shard_id = shard_id;
             o.num_shards = num_shards;
             o.expected_dim = expected_dim;
             o.checkpoint_dir = checkpoint_dir;
             o.checkpoint_every = checkpoint_every;
             o.max_frame_bytes = max_frame_bytes;
             if (verbose) {
               o.log = StderrLog("bagpipe-ps shard " + std::to_string(shard_id) + "/" +
                                 std::to_string(num_shards));
             }
             commit::StoreDefaults d;
             d.num_shards = store_shards;
             d.num_threads = store_threads;
             d.memory_budget = memory_budget;
             d.spill_dir = spill_dir;
             d.high_watermark = high;
             d.low_watermark = low;
             d.page_rows = page_rows;
             return std::make_shared<PSShard>(o, commit::MakeStoreTableFactory(d),
                                              commit::MakeStoreTableLoader(d));
           }),
           py::arg("shard_id"), py::arg("num_shards"), py::arg("expected_dim"),
           py::arg("checkpoint_dir"), py::arg("checkpoint_every"), py::arg("max_frame_bytes"),
           py::arg("verbose"), py::arg("store_shards"), py::arg("store_threads"),
           py::arg("memory_budget"), py::arg("spill_dir"), py::arg("high_watermark"),
           py::arg("low_watermark"), py::arg("page_rows"))
      .def_property_readonly("shard_id", [](PSShard& s) { return s.options().shard_id; })
      .def_property_readonly("num_shards", [](PSShard& s) { return s.options().num_shards; })
      .def_property_readonly("instance_id", &PSShard::instance_id)
      .def("create_table",
           [](PSShard& s, const std::string& name, uint32_t dim, const std::string& init,
              float bound, float value, uint64_t seed, std::vector<int64_t> starts,
              std::vector<float> bounds, int64_t key_bound) {
             commit::TableSpec spec;
             spec.dim = dim;
             spec.init = MakeInitSpec(init, bound, value, seed, std::move(starts), std::move(bounds));
             spec.key_bound = key_bound;
             py::gil_scoped_release release;
             s.CreateTable(name, spec);
           })
      .def("tables", &PSShard::TableNames)
      .def("committed_step",
           [](PSShard& s, const std::string& name) { return s.GetTable(name)->committed_step(); })
      .def("table_dim", [](PSShard& s, const std::string& name) { return s.GetTable(name)->spec().dim; })
      .def("read",
           [](PSShard& s, const std::string& name, const py::array& keys, const py::array& out) {
             auto* t = s.GetTable(name);
             auto k = Vec<int64_t>(keys, "keys");
             auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size), t->spec().dim);
             py::gil_scoped_release release;
             return t->Read(k.data, k.size, o.data);
           })
      .def("read_at",
           [](PSShard& s, const std::string& name, int64_t at_step, const py::array& keys,
              const py::array& out, double timeout) {
             auto* t = s.GetTable(name);
             auto k = Vec<int64_t>(keys, "keys");
             auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size), t->spec().dim);
             py::gil_scoped_release release;
             return t->ReadAt(at_step, k.data, k.size, o.data, transport::DeadlineAfter(timeout));
           })
      .def("assign",
           [](PSShard& s, const std::string& name, const py::array& keys, const py::array& rows) {
             auto* t = s.GetTable(name);
             auto k = Vec<int64_t>(keys, "keys");
             auto r = Mat<float>(rows, "rows", static_cast<py::ssize_t>(k.size), t->spec().dim);
             py::gil_scoped_release release;
             t->Assign(k.data, k.size, r.data);
           })
      .def("checkpoint", &PSShard::Checkpoint, py::arg("dir"), py::call_guard<py::gil_scoped_release>())
      .def("restore", &PSShard::Restore, py::arg("dir"), py::call_guard<py::gil_scoped_release>())
      .def("table_stats",
           [](PSShard& s, const std::string& name) {
             auto* t = s.GetTable(name);
             const auto c = t->stats();
             std::map<std::string, int64_t> store_stats;
             {
               py::gil_scoped_release release;
               store_stats = t->store_stats();
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
             d["store"] = StatsDict(store_stats);
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
          [](std::shared_ptr<PSShard> s, const std::string& host, uint16_t port,
             const std::string& token, double handshake_timeout, size_t max_connections) {
            server::ServerOptions o;
            o.host = host;
            o.port = port;
            o.job_token = token;
            o.handshake_timeout = handshake_timeout;
            o.max_connections = max_connections;
            py::gil_scoped_release release;
            return std::make_unique<ShardServer>(std::move(s), o);
          },
          py::arg("host"), py::arg("port"), py::arg("job_token"), py::arg("handshake_timeout"),
          py::arg("max_connections"));

  py::class_<RawLink, std::shared_ptr<RawLink>>(m, "RawLink")
      .def(py::init([](std::shared_ptr<PSShard> shard, bool authenticated) {
             auto l = std::make_shared<RawLink>(std::move(shard));
             l->authenticated = authenticated;
             return l;
           }),
           py::arg("shard"), py::arg("authenticated") = true)
      .def("request",
           [](std::shared_ptr<RawLink> self, py::bytes frame) {
             std::string f = frame;
             py::gil_scoped_release release;
             return self->Request(f, self);
           })
      .def("take",
           [](RawLink& self) {
             std::vector<std::string> frames;
             {
               py::gil_scoped_release release;
               frames = self.Take();
             }
             py::list out;
             for (auto& f : frames) out.append(py::bytes(f));
             return out;
           })
      .def("close", &RawLink::Close, py::call_guard<py::gil_scoped_release>());

  // ---- client -----------------------------------------------------------------------------
  py::class_<ClientOp, std::shared_ptr<ClientOp>>(m, "ClientOpCore")
      .def("done", &ClientOp::Done)
      .def("wait",
           [](ClientOp& op, double timeout) {
             py::gil_scoped_release release;
             op.Wait(transport::DeadlineAfter(timeout));
           })
      .def_property_readonly("step", &ClientOp::step)
      .def_property_readonly("shard_steps", &ClientOp::shard_steps);

  py::class_<PSClient>(m, "PSClientCore")
      .def(py::init([](py::list endpoints, const std::string& table, uint64_t session,
                       uint32_t rank, uint32_t world_size, uint32_t dim, float lr,
                       bool grad_division, const std::string& init, float bound, float value,
                       uint64_t seed, std::vector<int64_t> starts, std::vector<float> bounds,
                       int64_t key_bound, const std::string& partition, uint32_t max_packet_rows,
                       uint32_t inflight_packets, double timeout, double connect_timeout,
                       const std::string& job_token) {
             commit::ClientOptions o;
             o.table = table;
             o.session = session;
             o.rank = rank;
             o.world_size = world_size;
             o.dim = dim;
             o.lr = lr;
             o.grad_division = grad_division;
             o.init = MakeInitSpec(init, bound, value, seed, std::move(starts), std::move(bounds));
             o.key_bound = key_bound;
             o.partition = commit::Partitioner::ParseKind(partition);
             o.max_packet_rows = max_packet_rows;
             o.inflight_packets = inflight_packets;
             o.timeout = timeout;
             transport::ChannelOptions co;
             co.num_slots = inflight_packets;
             co.slot_bytes = commit::SlotBytesFor(o);
             co.io_timeout = timeout;
             // Collect the endpoints with the GIL, connect without it.
             std::vector<std::shared_ptr<PSShard>> locals(endpoints.size());
             std::vector<std::pair<std::string, uint16_t>> remotes(endpoints.size());
             std::vector<bool> rdma(endpoints.size(), false);  // ("ucx", host, port)
             for (size_t j = 0; j < endpoints.size(); ++j) {
               py::handle e = endpoints[j];
               if (py::isinstance<PSShard>(e)) {
                 locals[j] = e.cast<std::shared_ptr<PSShard>>();
               } else if (py::isinstance<py::tuple>(e) && py::len(e) == 3) {
                 auto t = e.cast<py::tuple>();
                 if (t[0].cast<std::string>() != "ucx") {
                   throw ValueError("endpoint " + std::to_string(j) + ": unknown scheme");
                 }
                 rdma[j] = true;
                 remotes[j] = {t[1].cast<std::string>(), t[2].cast<uint16_t>()};
               } else if (py::isinstance<py::tuple>(e)) {
                 auto t = e.cast<py::tuple>();
                 remotes[j] = {t[0].cast<std::string>(), t[1].cast<uint16_t>()};
               } else {
                 throw TypeError("endpoint " + std::to_string(j) +
                                 " must be a PSShardCore, a (host, port) or a "
                                 "('ucx', host, port) tuple");
               }
             }
             py::gil_scoped_release release;
             std::vector<std::unique_ptr<transport::Channel>> channels;
             for (size_t j = 0; j < locals.size(); ++j) {
               if (locals[j]) {
                 channels.push_back(std::make_unique<transport::LocalChannel>(locals[j], co));
               } else if (rdma[j]) {
                 channels.push_back(transport::ConnectRdmaChannel(
                     remotes[j].first, remotes[j].second, job_token, co, connect_timeout));
               } else {
                 channels.push_back(transport::TcpChannel::Connect(
                     remotes[j].first, remotes[j].second, job_token, co, connect_timeout));
               }
             }
             return std::make_unique<PSClient>(o, std::move(channels));
           }),
           py::arg("endpoints"), py::arg("table"), py::arg("session"), py::arg("rank"),
           py::arg("world_size"), py::arg("dim"), py::arg("lr"), py::arg("grad_division"),
           py::arg("init"), py::arg("init_bound"), py::arg("init_value"), py::arg("seed"),
           py::arg("bound_starts"), py::arg("bound_values"), py::arg("key_bound"),
           py::arg("partition"), py::arg("max_packet_rows"), py::arg("inflight_packets"),
           py::arg("timeout"), py::arg("connect_timeout"), py::arg("job_token"))
      .def("commit_async",
           [](PSClient& c, int64_t step, const py::array& keys, const py::array& grads) {
             auto k = Vec<int64_t>(keys, "keys");
             auto g = Mat<float>(grads, "grads", static_cast<py::ssize_t>(k.size), c.options().dim);
             py::gil_scoped_release release;
             return c.CommitAsync(step, k.data, k.size, g.data);
           })
      .def("get_async",
           [](PSClient& c, const py::array& keys, int64_t at_step, const py::array& out) {
             auto k = Vec<int64_t>(keys, "keys");
             auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size), c.options().dim);
             py::gil_scoped_release release;
             return c.GetAsync(k.data, k.size, at_step, o.data);
           })
      .def("assign_async",
           [](PSClient& c, const py::array& keys, const py::array& rows) {
             auto k = Vec<int64_t>(keys, "keys");
             auto r = Mat<float>(rows, "rows", static_cast<py::ssize_t>(k.size), c.options().dim);
             py::gil_scoped_release release;
             return c.AssignAsync(k.data, k.size, r.data);
           })
      .def("checkpoint_async", &PSClient::CheckpointAsync, py::call_guard<py::gil_scoped_release>())
      .def("committed_step", &PSClient::CommittedStep, py::call_guard<py::gil_scoped_release>())
      .def("shard_committed_steps", &PSClient::ShardCommittedSteps,
           py::call_guard<py::gil_scoped_release>())
      .def("shard_peers", &PSClient::shard_peers)
      .def("failure",
           [](PSClient& c) -> py::object {
             auto f = c.failure();
             if (!f) return py::none();
             return py::str(f->message);
           })
      .def("stats", [](PSClient& c) {
        commit::ClientStats s;
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

  // ---- benchmark baselines ---------------------------------------------------------------------
  m.def("raw_loopback_seconds", &transport::RawLoopbackSeconds, py::arg("total_bytes"),
        py::arg("chunk_bytes"), py::call_guard<py::gil_scoped_release>());
  m.def("raw_pingpong_seconds", &transport::RawPingPongSeconds, py::arg("iterations"),
        py::arg("msg_bytes"), py::call_guard<py::gil_scoped_release>());

  // ---- fuzzing ------------------------------------------------------------------------------
  m.def(
      "fuzz_server",
      [](const std::string& host, uint16_t port, const std::string& token, uint64_t frames,
         uint64_t seed) {
        server::FuzzStats st;
        {
          py::gil_scoped_release release;
          st = server::FuzzServer(host, port, token, frames, seed);
        }
        py::dict d;
        d["frames"] = st.frames;
        d["connections"] = st.connections;
        d["error_replies"] = st.error_replies;
        d["closed_by_server"] = st.closed_by_server;
        d["accepted_replies"] = st.accepted_replies;
        d["timeouts"] = st.timeouts;
        d["first_accepted"] = st.first_accepted;
        return d;
      },
      py::arg("host"), py::arg("port"), py::arg("job_token"), py::arg("frames"), py::arg("seed"));
}

}  // namespace bagpipe::bindings
