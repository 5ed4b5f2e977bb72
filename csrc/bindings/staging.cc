// Python bindings of gradient staging from device memory: torchrec_bagpipe._C.{
// cuda_runtime_status, DeviceStagerCore, DeviceSource, commit_async_device}. Built in every
// configuration; the CUDA runtime is loaded at run time (common/cuda_api.h), so on a machine
// without CUDA DeviceStagerCore raises a RuntimeError naming libcudart.
//
// Thread safety: the GIL is released around native calls. Device pointers and CUDA events
// cross as integers (tensor.data_ptr(), torch.cuda.Event.cuda_event); the Python client keeps
// the tensor and the event alive in the commit's handle until the commit is done.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "bindings/buffers.h"
#include "bindings/registry.h"
#include "client/device_staging.h"
#include "client/ps_client.h"
#include "common/cuda_api.h"
#include "common/errors.h"

namespace py = pybind11;

namespace bagpipe::bindings {

BAGPIPE_BINDING(staging) {
  m.def("cuda_runtime_status", [] {
    std::string why;
    auto api = CudaRuntimeApi(&why);
    return py::make_tuple(api != nullptr, api ? api->name() : why);
  });

  py::class_<client::DeviceStager>(m, "DeviceStagerCore")
      .def(py::init([](double timeout) {
             std::string why;
             auto api = CudaRuntimeApi(&why);
             if (!api) throw std::runtime_error(why);
             return std::make_unique<client::DeviceStager>(api, timeout);
           }),
           py::arg("timeout"))
      .def("stats", [](client::DeviceStager& s) {
        const auto st = s.stats();
        py::dict d;
        d["staged"] = st.staged;
        d["bytes"] = st.bytes;
        d["event_polls"] = st.event_polls;
        d["failed"] = st.failed;
        d["pinned_bytes"] = st.pinned_bytes;
        return d;
      });

  // Pointers cross as integers: tensor.data_ptr() and torch.cuda.Event.cuda_event.
  py::class_<client::DeviceSource>(m, "DeviceSource",
                                      "Gradient rows in CUDA memory, ready once `event` fired.")
      .def(py::init<>())
      .def_property(
          "src", [](const client::DeviceSource& s) { return reinterpret_cast<uintptr_t>(s.src); },
          [](client::DeviceSource& s, uintptr_t p) { s.src = reinterpret_cast<const void*>(p); })
      .def_readwrite("bytes", &client::DeviceSource::bytes)
      .def_readwrite("device", &client::DeviceSource::device)
      .def_property(
          "event",
          [](const client::DeviceSource& s) { return reinterpret_cast<uintptr_t>(s.event); },
          [](client::DeviceSource& s, uintptr_t p) { s.event = reinterpret_cast<void*>(p); });

  m.def(
      "commit_async_device",
      [](client::PSClient& client, int64_t step, const py::array& keys,
         client::DeviceStager& stager, const client::DeviceSource& source, float lr) {
        auto k = Vec<int64_t>(keys, "keys");
        const size_t want = k.size * client.options().dim * sizeof(float);
        if (source.bytes != want) {
          throw ValueError("grads must hold " + std::to_string(k.size) + " x " +
                           std::to_string(client.options().dim) + " float32 values (" +
                           std::to_string(want) + " bytes), got " + std::to_string(source.bytes));
        }
        if (!std::isfinite(lr) || lr < 0.0f) {
          throw ValueError("lr must be finite and >= 0, got " + std::to_string(lr));
        }
        py::gil_scoped_release release;
        auto rows = stager.Stage(source);
        // The worker waits for the copy before it reads the grads; the hook keeps the staged
        // buffer alive as long as the commit op.
        const auto deadline = DeadlineAfter(client.options().timeout);
        return client.CommitAsync(step, k.data, k.size, rows->data(),
                                  [rows, deadline] { rows->Wait(deadline); }, lr);
      },
      py::arg("client"), py::arg("step"), py::arg("keys"), py::arg("stager"), py::arg("source"),
      py::arg("lr"));
}

}  // namespace bagpipe::bindings
