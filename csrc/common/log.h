// Log sinks of native components: a component that logs takes a LogFn (one call per line)
// and never writes anywhere itself; whoever builds it chooses where lines go.
//
// Thread safety: a LogFn may be called from any native thread, concurrently; StderrLog's
// sink is safe for that (one fprintf + fflush per line). Sinks never touch Python objects.
//
// Invariants:
//   1. An empty LogFn means "do not log": callers test it before formatting a line.
#pragma once

#include <functional>
#include <string>

namespace bagpipe {

using LogFn = std::function<void(const std::string& line)>;

// A sink writing "YYYY-MM-DD HH:MM:SS [prefix] line" to stderr, flushed per line.
LogFn StderrLog(const std::string& prefix);

}  // namespace bagpipe
