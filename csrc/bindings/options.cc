// Python bindings of the native components' options: torchrec_bagpipe._C.{InitSpec,
// OptimizerSpec, StoreOptions, LoadOverrides, TableSchema, ShardOptions, ClientOptions,
// ConnectOptions, TcpServerOptions} (UcxServerOptions: ucx.cc). Each is the component's own
// C++ struct, bound field by field (def_readwrite), so settings cross the binding boundary as
// one typed object per component instead of positional argument lists. The Python specs
// build them and check every value first, one spec per struct (torchrec_bagpipe/ps/
// optimizer_spec.py, table_specs.py, shard_specs.py, client_spec.py: `native()`); a
// BagPipeConfig becomes specs in torchrec_bagpipe/ps/config_specs.py.
//
// Thread safety: plain values, touched with the GIL held.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "bindings/convert.h"
#include "bindings/registry.h"
#include "client/ps_client.h"
#include "protocol/partitioner.h"
#include "server/tcp_server.h"
#include "shard/ps_shard.h"
#include "shard/table_backend.h"
#include "store/embedding_store.h"
#include "store/init.h"
#include "store/optimizer.h"
#include "transport/channel.h"

namespace py = pybind11;

namespace bagpipe::bindings {

namespace {

void BindInitSpec(py::module_& m) {
  using store::InitSpec;
  py::class_<InitSpec>(m, "InitSpec", "How never-written rows read (csrc/store/init.h).")
      .def(py::init<>())
      .def_property(
          "kind", [](const InitSpec& s) { return std::string(InitKindName(s.kind)); },
          [](InitSpec& s, const std::string& k) { s.kind = ParseInitKind(k); },
          "'uniform', 'zeros' or 'constant'")
      .def_readwrite("bound", &InitSpec::bound)
      .def_readwrite("value", &InitSpec::value)
      .def_readwrite("seed", &InitSpec::seed)
      .def_readwrite("bound_starts", &InitSpec::bound_starts)
      .def_readwrite("bound_values", &InitSpec::bound_values);
}

void BindOptimizerSpec(py::module_& m) {
  using store::OptimizerSpec;
  py::class_<OptimizerSpec>(m, "OptimizerSpec",
                            "A store's optimizer and its constants (csrc/store/optimizer.h).")
      .def(py::init<>())
      .def_property(
          "kind",
          [](const OptimizerSpec& s) { return std::string(store::OptimizerKindName(s.kind)); },
          [](OptimizerSpec& s, const std::string& k) { s.kind = store::ParseOptimizerKind(k); },
          "'sgd', 'adagrad', 'rowwise_adagrad' or 'adam'")
      .def_readwrite("eps", &OptimizerSpec::eps)
      .def_readwrite("beta1", &OptimizerSpec::beta1)
      .def_readwrite("beta2", &OptimizerSpec::beta2)
      .def_readwrite("weight_decay", &OptimizerSpec::weight_decay)
      .def_readwrite("initial_accumulator_value", &OptimizerSpec::initial_accumulator_value);
}

void BindStoreOptions(py::module_& m) {
  using store::StoreOptions;
  py::class_<StoreOptions>(m, "StoreOptions",
                           "An EmbeddingStore's options (csrc/store/embedding_store.h).")
      .def(py::init<>())
      .def_readwrite("dim", &StoreOptions::dim)
      .def_readwrite("num_shards", &StoreOptions::num_shards)
      .def_readwrite("num_threads", &StoreOptions::num_threads)
      .def_readwrite("init", &StoreOptions::init)
      .def_readwrite("optimizer", &StoreOptions::optimizer)
      .def_readwrite("key_bound", &StoreOptions::key_bound)
      .def_readwrite("page_rows", &StoreOptions::page_rows)
      .def_readwrite("memory_budget", &StoreOptions::memory_budget)
      .def_readwrite("spill_dir", &StoreOptions::spill_dir)
      .def_readwrite("high_watermark", &StoreOptions::high_watermark)
      .def_readwrite("low_watermark", &StoreOptions::low_watermark);
}

void BindLoadOverrides(py::module_& m) {
  using store::LoadOverrides;
  py::class_<LoadOverrides>(m, "LoadOverrides",
                            "Options of EmbeddingStore.load; None: from the checkpoint.")
      .def(py::init<>())
      .def_readwrite("num_shards", &LoadOverrides::num_shards)
      .def_readwrite("num_threads", &LoadOverrides::num_threads)
      .def_readwrite("key_bound", &LoadOverrides::key_bound)
      .def_readwrite("page_rows", &LoadOverrides::page_rows)
      .def_readwrite("memory_budget", &LoadOverrides::memory_budget)
      .def_readwrite("spill_dir", &LoadOverrides::spill_dir)
      .def_readwrite("high_watermark", &LoadOverrides::high_watermark)
      .def_readwrite("low_watermark", &LoadOverrides::low_watermark)
      .def_readwrite("dim", &LoadOverrides::dim)
      .def_readwrite("init", &LoadOverrides::init)
      .def_readwrite("optimizer", &LoadOverrides::optimizer)
      .def_readwrite("weights_only", &LoadOverrides::weights_only)
      .def_readwrite("chain_links", &LoadOverrides::chain_links);
}

void BindTableSchema(py::module_& m) {
  using shard::TableSchema;
  py::class_<TableSchema>(m, "TableSchema",
                          "A PS table: row width, init of never-written rows, key bound, "
                          "optimizer.")
      .def(py::init<>())
      .def_readwrite("dim", &TableSchema::dim)
      .def_readwrite("init", &TableSchema::init)
      .def_readwrite("key_bound", &TableSchema::key_bound)
      .def_readwrite("optimizer", &TableSchema::optimizer);
}

void BindShardOptions(py::module_& m) {
  using shard::ShardOptions;
  py::class_<ShardOptions>(m, "ShardOptions", "A PS shard's options (csrc/shard/ps_shard.h).")
      .def(py::init<>())
      .def_readwrite("shard_id", &ShardOptions::shard_id)
      .def_readwrite("num_shards", &ShardOptions::num_shards)
      .def_readwrite("expected_dim", &ShardOptions::expected_dim)
      .def_readwrite("checkpoint_dir", &ShardOptions::checkpoint_dir)
      .def_readwrite("checkpoint_every", &ShardOptions::checkpoint_every)
      .def_readwrite("checkpoint_incremental", &ShardOptions::checkpoint_incremental)
      .def_readwrite("checkpoint_full_every", &ShardOptions::checkpoint_full_every)
      .def_readwrite("checkpoint_chain_fraction", &ShardOptions::checkpoint_chain_fraction)
      .def_readwrite("checkpoint_background", &ShardOptions::checkpoint_background)
      .def_readwrite("max_frame_bytes", &ShardOptions::max_frame_bytes);
}

void BindClientOptions(py::module_& m) {
  using client::ClientOptions;
  py::class_<ClientOptions>(m, "ClientOptions",
                            "A PS client's session and protocol options (csrc/client/ps_client.h).")
      .def(py::init<>())
      .def_readwrite("table", &ClientOptions::table)
      .def_readwrite("session", &ClientOptions::session)
      .def_readwrite("rank", &ClientOptions::rank)
      .def_readwrite("world_size", &ClientOptions::world_size)
      .def_readwrite("dim", &ClientOptions::dim)
      .def_readwrite("lr", &ClientOptions::lr)
      .def_readwrite("grad_division", &ClientOptions::grad_division)
      .def_readwrite("init", &ClientOptions::init)
      .def_readwrite("key_bound", &ClientOptions::key_bound)
      .def_readwrite("optimizer", &ClientOptions::optimizer)
      .def_property(
          "partition",
          [](const ClientOptions& o) {
            return std::string(protocol::Partitioner::KindName(o.partition));
          },
          [](ClientOptions& o, const std::string& k) {
            o.partition = protocol::Partitioner::ParseKind(k);
          },
          "'modulo', 'hash' or 'fast_range'")
      .def_readwrite("max_packet_rows", &ClientOptions::max_packet_rows)
      .def_readwrite("inflight_packets", &ClientOptions::inflight_packets)
      .def_readwrite("timeout", &ClientOptions::timeout)
      .def_readwrite("start_step", &ClientOptions::start_step,
                     "the committed step the session starts after: -1 a new job, s >= 0 a "
                     "resume, -2 attach without a check");
}

void BindConnectOptions(py::module_& m) {
  using transport::ConnectOptions;
  py::class_<ConnectOptions>(m, "ConnectOptions",
                             "How a client connects to remote shards (csrc/transport/channel.h).")
      .def(py::init<>())
      .def_readwrite("job_token", &ConnectOptions::job_token)
      .def_readwrite("connect_timeout", &ConnectOptions::connect_timeout)
      .def_readwrite("keepalive_interval", &ConnectOptions::keepalive_interval);
}

void BindTcpServerOptions(py::module_& m) {
  using server::TcpServerOptions;
  py::class_<TcpServerOptions>(m, "TcpServerOptions",
                               "A TCP shard server's options (csrc/server/tcp_server.h).")
      .def(py::init<>())
      .def_readwrite("host", &TcpServerOptions::host)
      .def_readwrite("port", &TcpServerOptions::port)
      .def_readwrite("job_token", &TcpServerOptions::job_token)
      .def_readwrite("allow_no_token", &TcpServerOptions::allow_no_token)
      .def_readwrite("handshake_timeout", &TcpServerOptions::handshake_timeout)
      .def_readwrite("idle_timeout", &TcpServerOptions::idle_timeout)
      .def_readwrite("max_connections", &TcpServerOptions::max_connections)
      .def_readwrite("max_unauthenticated", &TcpServerOptions::max_unauthenticated)
      .def_readwrite("max_unauthenticated_per_host",
                     &TcpServerOptions::max_unauthenticated_per_host)
      .def_readwrite("io_threads", &TcpServerOptions::io_threads);
}

}  // namespace

// Registered first among the bindings that take these types (registry.h: name order), so
// their signatures name the Python types.
BAGPIPE_BINDING(options) {
  BindInitSpec(m);
  BindOptimizerSpec(m);
  BindStoreOptions(m);
  BindLoadOverrides(m);
  BindTableSchema(m);
  BindShardOptions(m);
  BindClientOptions(m);
  BindConnectOptions(m);
  BindTcpServerOptions(m);
}

}  // namespace bagpipe::bindings
