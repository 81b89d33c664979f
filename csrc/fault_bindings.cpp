// Private bindings of the test-only fault hook (csrc/fault.h): recckpt._C._inject_fault / _fault_seen.
#include <pybind11/pybind11.h>

#include <cerrno>
#include <string>

#include "fault.h"

namespace py = pybind11;
using namespace recckpt;

namespace {

fault::Op op_of(const std::string& op) {
  if (op == "write") return fault::kWrite;
  if (op == "fsync") return fault::kFsync;
  if (op == "mmap") return fault::kMmap;
  if (op == "direct") return fault::kDirect;
  if (op == "cachestat") return fault::kCachestat;
  if (op == "sweep") return fault::kSweep;
  if (op == "alloc") return fault::kAlloc;
  if (op == "setup") return fault::kSetup;
  throw py::value_error("fault op must be 'write', 'fsync', 'mmap', 'direct', 'cachestat', 'sweep', 'alloc' or "
                        "'setup', got '" + op + "'");
}

}  // namespace

void bind_fault(py::module_& m) {
  m.def(
      "_inject_fault",
      [](const std::string& op, int64_t fail_at, int err) {
        const fault::Op o = op_of(op);
        if (fail_at < 0) throw py::value_error("_inject_fault: fail_at must be >= 0 (0 turns it off)");
        if ((o == fault::kAlloc || o == fault::kSetup) && err == 0) err = ENOMEM;  // they throw std::bad_alloc
        if (fail_at > 0 && err <= 0) throw py::value_error("_inject_fault: errno must be > 0");
        fault::arm(o, fail_at, err);
      },
      py::arg("op"), py::arg("fail_at"), py::arg("errno") = 0,
      "test hook: fail the fail_at-th engine 'write' (pwrite), 'fsync', 'mmap' (of a column, in a mapped "
      "read), 'direct' (O_DIRECT read of a piece), 'cachestat' (page-cache probe) or 'sweep' (a cold strided read's "
      "sequential read ahead of its workers) from now with errno, or make the fail_at-th 'alloc' (a writer "
      "thread's allocation point) or 'setup' (a file a ShardWriter constructor opened) throw std::bad_alloc; "
      "0 = off. "
      "Also resets the operation counter.");
  m.def(
      "_fault_seen", [](const std::string& op) { return fault::seen(op_of(op)); }, py::arg("op"),
      "test hook: engine operations of this kind since the last _inject_fault");
}
