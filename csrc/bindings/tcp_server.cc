// Python binding of the TCP shard server: torchrec_bagpipe._C.ShardServerCore, the handle
// PSShardCore.serve returns (shard.cc; torchrec_bagpipe.ps.native_server wraps it). Named
// "ps_server" so it is bound before PSShardCore names it (registry.h invariant 2).
//
// Thread safety: stop releases the GIL; the server's threads never touch Python objects.
#include "server/tcp_server.h"

#include <pybind11/pybind11.h>

#include "bindings/convert.h"
#include "bindings/registry.h"

namespace py = pybind11;

namespace bagpipe::bindings {

BAGPIPE_BINDING(ps_server) {
  using server::TcpShardServer;
  py::class_<TcpShardServer>(m, "ShardServerCore")
      .def_property_readonly("host", &TcpShardServer::host)
      .def_property_readonly("port", &TcpShardServer::port)
      .def_property_readonly("stopped", &TcpShardServer::stopped)
      .def("stop", &TcpShardServer::Stop, py::arg("drain_timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](TcpShardServer& s) { return ServerStatsDict(s.stats()); });
}

}  // namespace bagpipe::bindings
