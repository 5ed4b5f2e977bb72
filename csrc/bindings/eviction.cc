// Python binding of the virtual tables' eviction rule (cache/eviction_rule.h): the rule the
// step planner applies, exposed on its own for the store state-machine tests and tools.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <vector>

#include "bindings/buffers.h"
#include "bindings/eviction_options.h"
#include "bindings/registry.h"
#include "cache/eviction_rule.h"

namespace py = pybind11;

namespace bagpipe::bindings {
namespace {

using cache::EvictionRule;

py::array_t<int64_t> ToInt64Array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(int64_t));
  return out;
}

}  // namespace

BAGPIPE_BINDING(eviction) {
  py::class_<EvictionRule> cls(m, "EvictionRule", R"doc(
The eviction rule of a virtual table (docs/virtual_tables.md): fed each step's trained keys,
it returns the keys evicted at that step's boundary. Options: a dict of threshold,
decay_rate, ttl_steps, trigger_rows, admit_after (None: no eviction). Not thread-safe.
)doc");
  cls.def(py::init([](const py::object& options) {
            return new EvictionRule(EvictionOptionsFrom(options));
          }),
          py::arg("options") = py::none());
  cls.def(
      "on_step",
      [](EvictionRule& r, int64_t step, const py::array& keys) {
        auto k = Vec<int64_t>(keys, "keys");
        std::vector<int64_t> out;
        {
          py::gil_scoped_release release;
          r.OnStep(step, k.data, k.size, &out);
        }
        return ToInt64Array(out);
      },
      py::arg("step"), py::arg("keys"),
      "Step `step` trained `keys` (distinct int64): -> the keys evicted at its boundary, sorted");
  cls.def("admit", &EvictionRule::Admit, py::arg("key"),
          "Admission: whether `key`, read at the step about to be fed, is trained at it "
          "(call once per key per step, before on_step)");
  cls.def("get", [](const EvictionRule& r, int64_t key) -> py::object {
    double count = 0;
    int64_t last = 0;
    if (!r.Get(key, &count, &last)) return py::none();
    return py::make_tuple(count, last);
  }, py::arg("key"), "(count, last trained step) of a live key, or None");
  cls.def_property_readonly("live", &EvictionRule::live);
  cls.def_property_readonly("created", &EvictionRule::created);
  cls.def_property_readonly("evicted", &EvictionRule::evicted);
  cls.def_property_readonly("rounds", &EvictionRule::rounds);
  cls.def("memory_bytes", &EvictionRule::MemoryBytes);
}

}  // namespace bagpipe::bindings
