// Bindings of the content digests (digest.h): argument checks with the GIL held, the work without it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

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

// The digests of many chunks (of many tables) in one call: jobs of (ids, columns, specs) as row_digests
// takes them, checked with the GIL, then summed without it, the jobs shared among `threads` threads.
py::array_t<uint64_t> py_row_digests_many(const py::sequence& jobs, int threads) {
  if (threads < 1) throw py::value_error("row_digests_many: threads must be >= 1");
  struct Job {
    const int64_t* ids = nullptr;
    int64_t n = 0;
    std::vector<DigestColumn> cols;
    size_t out = 0;  // first row of its digests in the output
  };
  const size_t nj = (size_t)py::len(jobs);
  std::vector<Job> work(nj);
  std::vector<py::buffer_info> keep;
  size_t rows = 0;
  for (size_t i = 0; i < nj; i++) {
    py::tuple job = jobs[i].cast<py::tuple>();
    if (job.size() != 3) throw py::value_error("row_digests_many: each job is (ids, columns, specs)");
    const std::string what = "row_digests_many: job " + std::to_string(i);
    keep.push_back(int64_vector(job[0], what.c_str()));
    Job& w = work[i];
    w.ids = static_cast<const int64_t*>(keep.back().ptr);
    w.n = keep.back().shape[0];
    py::sequence columns = job[1].cast<py::sequence>();
    const auto specs = job[2].cast<std::vector<Spec>>();
    const size_t k = (size_t)py::len(columns);
    if (specs.size() != k) throw py::value_error(what + ": one spec per column");
    w.cols.resize(k);
    for (size_t j = 0; j < k; j++) {
      keep.push_back(byte_view(columns[j], what.c_str()));
      DigestColumn& c = w.cols[j];
      std::tie(c.row_bytes, c.itemsize, c.width, c.full, c.first) = specs[j];
      c.data = static_cast<const uint8_t*>(keep.back().ptr);
      if (const char* why = digest_column_error(c))
        throw py::value_error(what + ": column " + std::to_string(j) + ": " + why);
      if (nbytes(keep.back()) != w.n * c.row_bytes)
        throw py::value_error(what + ": column " + std::to_string(j) + " holds " +
                              std::to_string(nbytes(keep.back())) + " bytes, expected " + std::to_string(w.n) +
                              " rows of " + std::to_string(c.row_bytes));
    }
    w.out = rows;
    rows += k + 1;
  }
  std::vector<Digest128> out(rows);
  {
    py::gil_scoped_release nogil;
    if (nj == 1) {
      row_digests(work[0].ids, work[0].n, work[0].cols, out.data(), threads);
    } else {
      std::atomic<size_t> next{0};
      auto drain = [&] {
        for (size_t i; (i = next.fetch_add(1)) < nj;)
          row_digests(work[i].ids, work[i].n, work[i].cols, out.data() + work[i].out, 1);
      };
      std::vector<std::thread> pool;
      const size_t t = std::min<size_t>((size_t)threads, nj);
      try {
        for (size_t i = 1; i < t; i++) pool.emplace_back(drain);
      } catch (const std::system_error&) {  // no more threads: this one does the rest
      }
      drain();
      for (auto& th : pool) th.join();
    }
  }
  py::array_t<uint64_t> res({(py::ssize_t)rows, (py::ssize_t)2});
  auto r = res.mutable_unchecked<2>();
  for (size_t j = 0; j < rows; j++) {
    r(j, 0) = out[j].a;
    r(j, 1) = out[j].b;
  }
  return res;
}

}  // namespace

void bind_digest(py::module_& m) {
  m.def("row_digests_many", &py_row_digests_many, py::arg("jobs"), py::arg("threads") = 1,
        "row_digests of many chunks in one call: `jobs` a sequence of (ids, columns, specs); uint64 "
        "[sum of (1 + len(columns)), 2], each job's rows in turn (its ids' digest, then its columns')");
  m.def("row_digests", &py_row_digests, py::arg("ids"), py::arg("columns"), py::arg("specs"),
        py::arg("threads") = 1,
        "Content digests of n rows (docs/FORMAT.md): uint64 [1 + len(columns), 2], row 0 the ids' digest, "
        "row 1 + k column k's; each column a C-contiguous buffer of n rows, its spec (row_bytes, itemsize, "
        "width, full, first): elements of itemsize bytes, the rows holding elements [first, first + width) "
        "of a last dimension of `full`");
}
