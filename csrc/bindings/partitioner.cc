// Python bindings of the key partitioner and the wire's version: torchrec_bagpipe._C.{
// partition_assign, PROTOCOL_VERSION}. torchrec_bagpipe.ps.partitioner wraps partition_assign.
//
// Thread safety: partition_assign releases the GIL while it assigns.
#include "protocol/partitioner.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/buffers.h"
#include "bindings/registry.h"
#include "common/errors.h"
#include "protocol/wire.h"

namespace bagpipe::bindings {

BAGPIPE_BINDING(partitioner) {
  m.def(
      "partition_assign",
      [](const std::string& kind, uint32_t num_shards, const py::array& keys,
         const py::array& out) {
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
}

}  // namespace bagpipe::bindings
