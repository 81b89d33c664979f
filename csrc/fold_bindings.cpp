// Bindings of the chain fold (fold.h): argument checks with the GIL held, the work without it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "fold.h"
#include "pybuf.h"

namespace py = pybind11;
using namespace recckpt;

namespace {

py::array_t<int64_t> to_array(std::vector<int64_t>&& v) {
  auto* heap = new std::vector<int64_t>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  return py::array_t<int64_t>({(py::ssize_t)heap->size()}, {(py::ssize_t)sizeof(int64_t)}, heap->data(), owner);
}

const uint8_t* optional_mask(const py::handle& obj, int64_t n, const char* what, std::vector<py::buffer_info>& keep) {
  if (obj.is_none()) return nullptr;
  keep.push_back(byte_view(obj, what));
  const py::buffer_info& b = keep.back();
  if (b.itemsize != 1 || nbytes(b) != n)
    throw py::value_error(std::string(what) + ": expected one byte (bool) per id, " + std::to_string(n) + " in all");
  return static_cast<const uint8_t*>(b.ptr);
}

py::dict py_fold_links(const py::sequence& rows, const py::sequence& removed, const py::sequence& skip_rows,
                       const py::sequence& skip_removed, int threads) {
  if (threads < 1) throw py::value_error("fold_links: threads must be >= 1");
  const size_t L = (size_t)py::len(rows);
  if ((int64_t)L > kMaxFoldLinks) throw py::value_error("fold_links: too many links");
  if ((size_t)py::len(removed) != L || (size_t)py::len(skip_rows) != L || (size_t)py::len(skip_removed) != L)
    throw py::value_error("fold_links: rows, removed, skip_rows and skip_removed need one entry per link");
  std::vector<py::buffer_info> keep;
  keep.reserve(4 * L);
  std::vector<FoldLink> links(L);
  for (size_t j = 0; j < L; j++) {
    keep.push_back(int64_vector(rows[j], "fold_links: rows"));
    links[j].rows = static_cast<const int64_t*>(keep.back().ptr);
    links[j].n_rows = keep.back().shape[0];
    keep.push_back(int64_vector(removed[j], "fold_links: removed"));
    links[j].removed = static_cast<const int64_t*>(keep.back().ptr);
    links[j].n_removed = keep.back().shape[0];
    links[j].skip_rows = optional_mask(skip_rows[j], links[j].n_rows, "fold_links: skip_rows", keep);
    links[j].skip_removed = optional_mask(skip_removed[j], links[j].n_removed, "fold_links: skip_removed", keep);
  }
  if (L && links[0].n_rows >= kMaxFoldBase)
    throw py::value_error("fold_links: the base holds too many rows for one fold; fold smaller bucket ranges");
  FoldResult r;
  {
    py::gil_scoped_release nogil;
    fold_links(links, r, threads);
  }
  py::list src, dst;
  for (size_t j = 0; j < L; j++) {
    src.append(to_array(std::move(r.src[j])));
    dst.append(to_array(std::move(r.dst[j])));
  }
  py::dict out;
  out["new_rows"] = r.new_rows;
  out["src"] = src;
  out["dst"] = dst;
  out["holes"] = to_array(std::move(r.holes));
  out["hole_ids"] = to_array(std::move(r.hole_ids));
  out["dup_link"] = to_array(std::move(r.dup_link));
  out["dup_ids"] = to_array(std::move(r.dup_ids));
  return out;
}

void py_copy_rows(const py::buffer& src, const py::handle& src_idx, const py::buffer& dst, const py::handle& dst_idx,
                  int64_t row_bytes) {
  if (row_bytes < 0) throw py::value_error("copy_rows: row_bytes must be >= 0");
  py::buffer_info s = byte_view(src, "copy_rows: src");
  py::buffer_info d = byte_view(dst, "copy_rows: dst", true);
  if (d.readonly) throw py::value_error("copy_rows: dst must be writable");
  py::buffer_info si = int64_vector(src_idx, "copy_rows: src_idx");
  py::buffer_info di = int64_vector(dst_idx, "copy_rows: dst_idx");
  const int64_t n = si.shape[0];
  if (di.shape[0] != n) throw py::value_error("copy_rows: src_idx and dst_idx differ in length");
  if (row_bytes == 0 || n == 0) return;
  const int64_t sb = nbytes(s), db = nbytes(d);
  if (sb % row_bytes || db % row_bytes)
    throw py::value_error("copy_rows: src and dst must hold whole rows of row_bytes bytes");
  const int64_t ns = sb / row_bytes, nd = db / row_bytes;
  const int64_t* a = static_cast<const int64_t*>(si.ptr);
  const int64_t* b = static_cast<const int64_t*>(di.ptr);
  bool bad = false;
  {
    py::gil_scoped_release nogil;
    for (int64_t k = 0; k < n; k++) bad |= (uint64_t)a[k] >= (uint64_t)ns || (uint64_t)b[k] >= (uint64_t)nd;
    // One buffer (rows moved forward within it) must be copied in order; distinct buffers in parallel.
    const uint8_t* sp = static_cast<const uint8_t*>(s.ptr);
    uint8_t* dp = static_cast<uint8_t*>(d.ptr);
    const bool overlap = sp < dp + db && dp < sp + sb;
    if (!bad) copy_rows(sp, a, dp, b, n, row_bytes, overlap ? 1 : 4);
  }
  if (bad) throw py::index_error("copy_rows: a row index is out of range");
}

}  // namespace

void bind_fold(py::module_& m) {
  m.def("fold_links", &py_fold_links, py::arg("rows"), py::arg("removed"), py::arg("skip_rows"),
        py::arg("skip_removed"), py::arg("threads") = 1,
        "Fold the links of a chain (base first) for one bucket range: per link its row ids and removed ids "
        "(int64), and optional bool masks of events to ignore; on up to `threads` threads (the result is the "
        "same for any number). Returns a dict: new_rows, src/dst (per link, "
        "index 0 empty: winning row indices and their output positions; the base's rows keep positions "
        "[0, n_base)), holes/hole_ids (base positions that do not survive and their ids), dup_link/dup_ids "
        "(ids stored twice within one link).");
  m.def("copy_rows", &py_copy_rows, py::arg("src"), py::arg("src_idx"), py::arg("dst"), py::arg("dst_idx"),
        py::arg("row_bytes"), "dst row dst_idx[k] = src row src_idx[k] (rows of row_bytes bytes; dst_idx distinct), GIL released, "
        "big copies on several threads; src and dst may be one buffer when src_idx[k] > dst_idx[k] for every k "
        "and both increase (rows move forward in order of k, never reading a row already written)");
}
