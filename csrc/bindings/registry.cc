// The registry of binding init functions (registry.h). Each extension module compiles its
// own copy, so it runs exactly the bindings linked into it.
#include "bindings/registry.h"

#include <map>
#include <string>
#include <utility>

namespace bagpipe::bindings {
namespace {

std::map<std::string, InitFn>& Inits() {
  static std::map<std::string, InitFn> inits;
  return inits;
}

}  // namespace

Registrar::Registrar(const std::string& name, InitFn fn) { Inits().emplace(name, std::move(fn)); }

void RunBindings(pybind11::module_& m) {
  for (auto& [name, init] : Inits()) init(m);
}

}  // namespace bagpipe::bindings
