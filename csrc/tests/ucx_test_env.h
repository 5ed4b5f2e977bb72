// Environment for native tests that run UCX. Under AddressSanitizer, UCX's memory hooks
// (which patch malloc/mmap through relocation to keep its registration cache coherent)
// conflict with ASan's own interceptors, so the tests turn them off before the first UCX
// context exists: UCX_MEM_MALLOC_HOOKS=no, UCX_MEM_MMAP_HOOK_MODE=none, UCX_MEM_EVENTS=no
// (registrations then are not cached across unmaps, which these tests never rely on).
#pragma once

#include <cstdlib>

namespace bagpipe::testing {

inline void UcxTestEnvironment() {
#if defined(__SANITIZE_ADDRESS__)
  static const bool once = [] {
    setenv("UCX_MEM_MALLOC_HOOKS", "no", 0);
    setenv("UCX_MEM_MMAP_HOOK_MODE", "none", 0);
    setenv("UCX_MEM_EVENTS", "no", 0);
    return true;
  }();
  (void)once;
#endif
}

}  // namespace bagpipe::testing
