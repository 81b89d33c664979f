// An OS-level failure with the path and operation it concerns; the bindings turn it into OSError.
#pragma once
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace recckpt {

struct OsError : std::runtime_error {
  int err;           // errno value
  std::string path;  // file concerned
  std::string op;    // e.g. "ShardWriter: pwrite at offset 123"
  OsError(int e, std::string p, std::string o)
      : std::runtime_error(o + ": " + std::strerror(e) + ": '" + p + "'"),
        err(e),
        path(std::move(p)),
        op(std::move(o)) {}
  // "<op>: <strerror>" — the OSError strerror argument (Python adds errno and the path).
  std::string describe() const { return op + ": " + std::strerror(err); }
};

}  // namespace recckpt
