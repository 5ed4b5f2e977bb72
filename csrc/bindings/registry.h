// Each binding file registers its init functions (BAGPIPE_BINDING); the extension module's
// PYBIND11_MODULE runs them all, in name order, with RunBindings. Adding a binding file never
// edits another one. Each module (module.cc: _C; testing/module.cc: _C_testing) links its
// own registry (registry.cc) and runs only the bindings linked into it.
//
// Thread safety: registration runs during static initialisation (one thread); the init
// functions run once, in PYBIND11_MODULE, with the GIL held.
// Invariants:
//   1. Every BAGPIPE_BINDING name is unique; a second registration of a name is ignored.
//   2. Init functions run in name order, so the module's contents do not depend on link order;
//      a binding whose signatures name another binding's classes is named to sort after it
//      (pybind11 spells a class in a signature by its Python name only once it is bound).
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <string>

namespace bagpipe::bindings {

using InitFn = std::function<void(pybind11::module_&)>;

struct Registrar {
  // Registers fn under name (invariant 1). REQUIRES: static initialisation.
  Registrar(const std::string& name, InitFn fn);
};

// Runs every registered init function on m, in name order (invariant 2).
// REQUIRES: GIL held; called once per module, from its PYBIND11_MODULE.
void RunBindings(pybind11::module_& m);

}  // namespace bagpipe::bindings

// BAGPIPE_BINDING(name) { ... }: defines the init function `name` (its module is `m`) and
// registers it. REQUIRES: at namespace scope, once per name in a module.
#define BAGPIPE_BINDING(name)                                                            \
  static void bagpipe_bind_##name(pybind11::module_& m);                                \
  static ::bagpipe::bindings::Registrar bagpipe_binding_reg_##name(#name, bagpipe_bind_##name); \
  static void bagpipe_bind_##name(pybind11::module_& m)
