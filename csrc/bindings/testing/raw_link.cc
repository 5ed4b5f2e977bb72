// Python binding of RawLink (csrc/testing/raw_link.h): torchrec_bagpipe.testing._C_testing.
// RawLink, a shard's FrameHandler driven frame by frame from Python (tests/test_ps_protocol.py).
//
// Thread safety: the GIL is released around every call into the shard.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/registry.h"
#include "shard/ps_shard.h"
#include "testing/raw_link.h"

namespace py = pybind11;

namespace bagpipe::bindings {

BAGPIPE_BINDING(raw_link) {
  using testing::RawLink;
  py::class_<RawLink, std::shared_ptr<RawLink>>(m, "RawLink")
      .def(py::init([](std::shared_ptr<shard::PSShard> shard, bool authenticated) {
             return std::make_shared<RawLink>(std::move(shard), authenticated);
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
}

}  // namespace bagpipe::bindings
