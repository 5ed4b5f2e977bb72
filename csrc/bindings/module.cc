// The torchrec_bagpipe._C extension: exception translation plus every registered binding.
#include <pybind11/pybind11.h>

#include <map>

#include "bindings/registry.h"
#include "common/errors.h"

namespace py = pybind11;

namespace bagpipe::bindings {
namespace {
std::map<std::string, InitFn>& Inits() {
  static std::map<std::string, InitFn> inits;
  return inits;
}
}  // namespace

Registrar::Registrar(const std::string& name, InitFn fn) { Inits().emplace(name, std::move(fn)); }

}  // namespace bagpipe::bindings

PYBIND11_MODULE(_C, m) {
  using namespace bagpipe;
  m.doc() = "torchrec_bagpipe native core (no libtorch dependency)";
  py::register_exception<SessionError>(m, "SessionError", PyExc_RuntimeError);
  auto transport_error =
      py::register_exception<TransportError>(m, "TransportError", PyExc_ConnectionError);
  py::register_exception<ShuttingDownError>(m, "ShuttingDownError", transport_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const bagpipe::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const bagpipe::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const bagpipe::TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const bagpipe::IOError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    } catch (const bagpipe::MemoryBudgetError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const std::bad_alloc& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });
  for (auto& [name, init] : bindings::Inits()) init(m);
}
