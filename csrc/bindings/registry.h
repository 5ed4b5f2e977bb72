// Each binding file registers one init function; module.cc calls them all in name order.
// Adding a binding file never edits another one.
//
// Thread safety: registration runs during static initialisation (one thread); the init
// functions run once, in PYBIND11_MODULE, with the GIL held.
// Invariants:
//   1. Every BAGPIPE_BINDING name is unique; a second registration of a name is ignored.
//   2. Init functions run in name order, so the module's contents do not depend on link order.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <string>

namespace bagpipe::bindings {

using InitFn = std::function<void(pybind11::module_&)>;

struct Registrar {
  Registrar(const std::string& name, InitFn fn);
};

}  // namespace bagpipe::bindings

#define BAGPIPE_BINDING(name)                                                            \
  static void bagpipe_bind_##name(pybind11::module_& m);                                \
  static ::bagpipe::bindings::Registrar bagpipe_binding_reg_##name(#name, bagpipe_bind_##name); \
  static void bagpipe_bind_##name(pybind11::module_& m)
