// Bindings of the content digests (digest.h): argument checks with the GIL held, the work without it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>

#include "digest.h"
#include "pybuf.h"

namespace py = pybind11;
using namespace recckpt;

namespace {

using Spec = std::tuple<int64_t, int, int64_t, int64_t, int64_t>;  // row_bytes, itemsize, width, full, first

py::array_t<uint64_t> py_row_digests(const py::object& ids, const py::sequence& columns,
                                     const std::vector<Spec>& specs, int threads) {
  if (threads < 1) throw py::value_error("row_digests: threads must be >= 1");
  py::buffer_info ib = int64_vector(ids, "row_digests: ids");
  const int64_t n = ib.shape[0];
  const size_t k = (size_t)py::len(columns);
  if (specs.size() != k) throw py::value_error("row_digests: one spec per column");
  std::vector<py::buffer_info> keep;
  keep.reserve(k);
  std::vector<DigestColumn> cols(k);
  for (size_t j = 0; j < k; j++) {
    keep.push_back(byte_view(columns[j], "row_digests: column"));
    DigestColumn& c = cols[j];
    std::tie(c.row_bytes, c.itemsize, c.width, c.full, c.first) = specs[j];
    c.data = static_cast<const uint8_t*>(keep.back().ptr);
    if (const char* why = digest_column_error(c))
      throw py::value_error("row_digests: column " + std::to_string(j) + ": " + why);
    if (nbytes(keep.back()) != n * c.row_bytes)
      throw py::value_error("row_digests: column " + std::to_string(j) + " holds " +
                            std::to_string(nbytes(keep.back())) + " bytes, expected " + std::to_string(n) +
                            " rows of " + std::to_string(c.row_bytes));
  }
  std::vector<Digest128> out(k + 1);
  {
    py::gil_scoped_release nogil;
    row_digests(static_cast<const int64_t*>(ib.ptr), n, cols, out.data(), threads);
  }
  py::array_t<uint64_t> res({(py::ssize_t)(k + 1), (py::ssize_t)2});
  auto r = res.mutable_unchecked<2>();
  for (size_t j = 0; j <= k; j++) {
    r(j, 0) = out[j].a;
    r(j, 1) = out[j].b;
  }
  return res;
}

}  // namespace

void bind_digest(py::module_& m) {
  m.def("row_digests", &py_row_digests, py::arg("ids"), py::arg("columns"), py::arg("specs"),
        py::arg("threads") = 1,
        "Content digests of n rows (docs/FORMAT.md): uint64 [1 + len(columns), 2], row 0 the ids' digest, "
        "row 1 + k column k's; each column a C-contiguous buffer of n rows, its spec (row_bytes, itemsize, "
        "width, full, first): elements of itemsize bytes, the rows holding elements [first, first + width) "
        "of a last dimension of `full`");
}
