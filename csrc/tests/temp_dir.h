// A private temporary directory for native tests, removed (with everything in it) when the
// object goes out of scope. Not thread-safe; one owner.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

namespace bagpipe::testing {

struct TempDir {
  std::string path;  // set by the constructor; never changed
  TempDir() {
    char buf[] = "/tmp/bagpipe-test-XXXXXX";
    const char* made = mkdtemp(buf);
    if (made == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    path = made;
  }
  ~TempDir() {
    const std::string cmd = "rm -rf '" + path + "'";
    if (std::system(cmd.c_str()) != 0) std::perror("rm");
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace bagpipe::testing
