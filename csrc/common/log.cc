#include "common/log.h"

#include <cstdio>
#include <ctime>

namespace bagpipe {

LogFn StderrLog(const std::string& prefix) {
  return [prefix](const std::string& line) {
    char ts[32];
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    std::strftime(ts, sizeof(ts), "%Y-%m-%d %H:%M:%S", &tm);
    std::fprintf(stderr, "%s [%s] %s\n", ts, prefix.c_str(), line.c_str());
    std::fflush(stderr);
  };
}

}  // namespace bagpipe
