// Bindings of ShardWriter and read_ranges. Python objects (the caller's arrays) are held and
// released here, on the calling thread with the GIL; the C++ core only sees raw pointers.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <list>
#include <memory>

#include "os_error.h"
#include "pybuf.h"
#include "mapped_region.h"
#include "reader.h"
#include "hash.h"
#include "buffer_pool.h"
#include "shard_writer.h"
#include "strided_reader.h"

namespace py = pybind11;
using namespace recckpt;

namespace {

// Keeps a submitted segment's buffers alive until the writer has written (or dropped) them.
struct Held {
  int64_t id = -1;
  std::shared_ptr<std::atomic<bool>> done;
  std::vector<py::buffer_info> bufs;
};

class PyShardWriter {
 public:
  PyShardWriter(const std::vector<std::string>& paths, int64_t num_buckets, int64_t chunk_bytes,
                int64_t max_inflight_bytes, bool writeback) {
    py::gil_scoped_release nogil;  // creating files can block
    w_ = std::make_unique<ShardWriter>(paths, num_buckets, chunk_bytes, max_inflight_bytes, writeback);
  }
  ~PyShardWriter() {
    if (w_) {
      {
        py::gil_scoped_release nogil;
        w_->abort();
      }
      held_.clear();
    }
  }

  // Checks one segment's arguments and takes hold of its buffers into `in` and `h` (GIL held).
  void prepare(int64_t table, const py::object& ids_obj, const py::sequence& columns, int64_t num_rows,
               int64_t id_range, const std::vector<int64_t>& group_bytes, bool runs, SegmentInput& in, Held& h) {
    h.done = std::make_shared<std::atomic<bool>>(false);
    in.table = table;
    py::buffer_info ids = int64_vector(ids_obj, "ShardWriter.submit: ids");
    in.n = ids.shape[0];
    in.ids = static_cast<const int64_t*>(ids.ptr);
    // Format version 4: 1 <= rows < 2^32 (the directory's row starts are uint32).
    if (in.n < 1 || in.n > (int64_t)UINT32_MAX)
      throw py::value_error("ShardWriter.submit: a segment holds 1 to 2**32-1 rows, got " + std::to_string(in.n));
    if (num_rows < 0 || num_rows >= kMaxRowRangeRows)
      throw py::value_error("ShardWriter.submit: num_rows must be in [0, 2**40), got " + std::to_string(num_rows));
    in.num_rows = num_rows;
    if (id_range < 0 || (id_range > 0 && num_rows > 0))
      throw py::value_error("ShardWriter.submit: id_range must be >= 0 and not given with num_rows, got " +
                            std::to_string(id_range));
    in.id_range = id_range;
    if (!group_bytes.empty() && group_bytes.size() != (size_t)py::len(columns))
      throw py::value_error("ShardWriter.submit: group_bytes has " + std::to_string(group_bytes.size()) +
                            " entries for " + std::to_string(py::len(columns)) + " columns");
    for (int64_t gb : group_bytes)
      if (gb < 0) throw py::value_error("ShardWriter.submit: group_bytes must be >= 0, got " + std::to_string(gb));
    in.group_bytes = group_bytes;
    in.runs = runs;
    if (num_rows > 0) {
      int64_t bad = -1;
      {
        py::gil_scoped_release nogil;
        for (int64_t i = 0; i < in.n && bad < 0; i++)
          if (in.ids[i] < 0 || in.ids[i] >= num_rows) bad = i;
      }
      if (bad >= 0)
        throw py::value_error("ShardWriter.submit: id " + std::to_string(in.ids[bad]) +
                              " is not a row of a fixed-size table of " + std::to_string(num_rows) + " rows");
    }
    h.bufs.push_back(std::move(ids));
    const size_t ncols = py::len(columns);
    for (size_t c = 0; c < ncols; c++) {
      py::object col = columns[c];
      const std::string what = "ShardWriter.submit: columns[" + std::to_string(c) + "]";
      if (!PyObject_CheckBuffer(col.ptr()))
        throw py::type_error(what + ": expected a uint8 array of shape [n, row_bytes], got " +
                             std::string(py::str(py::type::handle_of(col).attr("__name__"))));
      py::buffer_info b = py::reinterpret_borrow<py::buffer>(col).request();
      if (!is_uint8_format(b))
        throw py::type_error(what + ": expected dtype uint8, got buffer format '" + b.format +
                             "' with itemsize " + std::to_string(b.itemsize) +
                             " (view the rows as bytes: arr.view(numpy.uint8).reshape(n, -1))");
      if (b.ndim != 2)
        throw py::value_error(what + ": expected shape [n, row_bytes], got " + std::to_string(b.ndim) +
                              " dimensions");
      if (b.shape[0] != in.n)
        throw py::value_error(what + ": has " + std::to_string(b.shape[0]) + " rows, ids has " +
                              std::to_string(in.n));
      if (!is_c_contiguous(b)) throw py::value_error(what + ": array must be C-contiguous");
      in.columns.push_back(static_cast<const uint8_t*>(b.ptr));
      in.row_bytes.push_back(b.shape[1]);
      h.bufs.push_back(std::move(b));
    }
    in.done = h.done;
  }

  int64_t submit(int64_t table, const py::object& ids_obj, const py::sequence& columns, int64_t num_rows,
                 int64_t id_range, const std::vector<int64_t>& group_bytes, bool runs) {
    if (!w_) throw py::value_error("ShardWriter is closed");
    Held h;
    SegmentInput in;
    prepare(table, ids_obj, columns, num_rows, id_range, group_bytes, runs, in, h);
    reap();
    std::shared_ptr<std::atomic<bool>> flag = h.done;
    held_.push_back(std::move(h));
    int64_t id;
    {
      py::gil_scoped_release nogil;
      id = w_->submit(std::move(in));  // on failure the segment is marked done (reaped below or later)
    }
    for (Held& held : held_)
      if (held.done == flag) held.id = id;
    reap();
    return id;
  }

  // Many segments in one call (a model of many small tables): each (table, ids, columns, num_rows,
  // id_range[, group_bytes, runs]) as submit takes it; all are checked before any is queued, then queued in
  // order with the GIL released once. Returns their ids.
  std::vector<int64_t> submit_many(const py::sequence& segments) {
    if (!w_) throw py::value_error("ShardWriter is closed");
    const size_t n = (size_t)py::len(segments);
    std::vector<SegmentInput> ins(n);
    std::list<Held> hs;
    for (size_t i = 0; i < n; i++) {
      py::tuple t = segments[i].cast<py::tuple>();
      if (t.size() != 5 && t.size() != 7)
        throw py::value_error("ShardWriter.submit_many: each segment is (table, ids, columns, num_rows, id_range"
                              "[, group_bytes, runs])");
      Held h;
      const bool v5 = t.size() == 7;
      prepare(t[0].cast<int64_t>(), t[1], t[2].cast<py::sequence>(), t[3].cast<int64_t>(), t[4].cast<int64_t>(),
              v5 ? t[5].cast<std::vector<int64_t>>() : std::vector<int64_t>(), v5 && t[6].cast<bool>(), ins[i], h);
      hs.push_back(std::move(h));
    }
    reap();
    std::vector<std::list<Held>::iterator> mine;
    mine.reserve(n);
    for (auto it = hs.begin(); it != hs.end(); ++it) mine.push_back(it);
    held_.splice(held_.end(), hs);   // (iterators stay valid)
    std::vector<int64_t> ids(n, -1);
    size_t queued = 0;
    try {
      py::gil_scoped_release nogil;
      for (; queued < n; queued++) ids[queued] = w_->submit(std::move(ins[queued]));
    } catch (...) {
      // The one that failed was marked done by the writer; those after it were never queued.
      for (size_t i = queued + 1; i < n; i++) mine[i]->done->store(true, std::memory_order_release);
      for (size_t i = 0; i < queued; i++) mine[i]->id = ids[i];
      reap();
      throw;
    }
    for (size_t i = 0; i < n; i++) mine[i]->id = ids[i];
    reap();
    return ids;
  }

  // Blocks (GIL released) until segment `id` is written, then lets go of its buffers.
  void wait(int64_t id) {
    if (!w_) throw py::value_error("ShardWriter is closed");
    std::shared_ptr<std::atomic<bool>> done;
    for (const Held& h : held_)
      if (h.id == id) done = h.done;
    if (done) {  // not held any more: written (or never submitted, which the caller cannot tell apart)
      py::gil_scoped_release nogil;
      w_->wait_done(*done);
    }
    reap();
  }

  py::list finish(bool fsync) {
    if (!w_) throw py::value_error("ShardWriter is closed");
    std::vector<std::vector<SegmentRecord>> recs;
    try {
      py::gil_scoped_release nogil;
      recs = w_->finish(fsync);
    } catch (...) {
      held_.clear();  // every segment is done once the workers are joined
      throw;
    }
    held_.clear();
    py::list out;
    for (auto& file : recs) {
      py::list lst;
      for (auto& r : file) {
        py::dict d;
        d["segment"] = r.segment;
        d["table"] = r.table;
        d["rows"] = r.rows;
        d["offset"] = r.offset;
        d["dir"] = r.dir_entries;
        d["first"] = r.first_bucket;
        d["last"] = r.last_bucket;
        d["packed"] = r.packed;
        d["id0"] = r.id0;
        py::dict b;
        b["offset"] = r.buckets_offset;
        b["length"] = r.buckets_length;
        b["crc32c"] = r.buckets_crc;
        d["buckets"] = b;
        py::list cols;
        for (auto& c : r.columns) {
          py::dict cd;
          cd["offset"] = c.offset;
          cd["length"] = c.length;
          cd["step"] = c.step;
          py::array_t<uint32_t> crcs((py::ssize_t)c.crcs.size());
          if (!c.crcs.empty()) std::memcpy(crcs.mutable_data(), c.crcs.data(), 4 * c.crcs.size());
          cd["crc32c"] = crcs;
          cols.append(cd);
        }
        d["columns"] = cols;
        lst.append(d);
      }
      out.append(lst);
    }
    return out;
  }

  void abort() {
    if (!w_) return;
    {
      py::gil_scoped_release nogil;
      w_->abort();
    }
    held_.clear();
  }

 private:
  void reap() {
    for (auto it = held_.begin(); it != held_.end();) {
      if (it->done->load(std::memory_order_acquire))
        it = held_.erase(it);
      else
        ++it;
    }
  }

  std::unique_ptr<ShardWriter> w_;
  std::list<Held> held_;
};

std::string path_of(const py::handle& obj) {
  py::object p = py::module_::import("os").attr("fspath")(obj);
  if (py::isinstance<py::bytes>(p)) return std::string(py::reinterpret_borrow<py::bytes>(p));
  return p.cast<std::string>();
}

int64_t int_of(const py::handle& obj, const char* what, size_t i) {
  if (!PyIndex_Check(obj.ptr()))
    throw py::type_error("read_ranges: requests[" + std::to_string(i) + "]." + what + " must be an int, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  return py::int_(py::reinterpret_borrow<py::object>(obj)).cast<int64_t>();
}

// crcs: any 1-D integer buffer (normally uint32) or a sequence of ints. Out-of-range values make the
// request invalid (reported) rather than raising.
void crcs_of(const py::handle& obj, std::vector<uint32_t>& crcs, std::string& invalid, size_t i) {
  auto put = [&](long double v, size_t k) {
    if (v < 0 || v > 4294967295.0L) {
      if (invalid.empty())
        invalid = "invalid request: crcs[" + std::to_string(k) + "] is not a uint32";
      crcs.push_back(0);
    } else {
      crcs.push_back((uint32_t)v);
    }
  };
  if (PyObject_CheckBuffer(obj.ptr())) {
    py::buffer_info b = py::reinterpret_borrow<py::buffer>(obj).request();
    const char k = format_kind(b.format);
    const std::string ints = "bBhHiIlLqQ";
    if (k == 0 || ints.find(k) == std::string::npos || b.ndim != 1 || !is_c_contiguous(b))
      throw py::type_error("read_ranges: requests[" + std::to_string(i) +
                           "].crcs must be a 1-D contiguous integer array (uint32), got format '" + b.format +
                           "'");
    const bool sgn = (k == 'b' || k == 'h' || k == 'i' || k == 'l' || k == 'q');
    const size_t n = (size_t)b.shape[0];
    crcs.reserve(n);
    const uint8_t* p = static_cast<const uint8_t*>(b.ptr);
    for (size_t j = 0; j < n; j++) {
      const uint8_t* e = p + j * b.itemsize;
      long double v;
      switch (b.itemsize) {
        case 1: v = sgn ? (long double)*(const int8_t*)e : (long double)*(const uint8_t*)e; break;
        case 2: { int16_t s; uint16_t u; std::memcpy(&s, e, 2); std::memcpy(&u, e, 2); v = sgn ? s : u; break; }
        case 4: { int32_t s; uint32_t u; std::memcpy(&s, e, 4); std::memcpy(&u, e, 4); v = sgn ? s : u; break; }
        case 8: { int64_t s; uint64_t u; std::memcpy(&s, e, 8); std::memcpy(&u, e, 8); v = sgn ? (long double)s : (long double)u; break; }
        default: throw py::type_error("read_ranges: crcs has an unsupported item size");
      }
      put(v, j);
    }
    return;
  }
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj))
    throw py::type_error("read_ranges: requests[" + std::to_string(i) + "].crcs must be a uint32 array");
  py::sequence s = py::reinterpret_borrow<py::sequence>(obj);
  const size_t n = py::len(s);
  crcs.reserve(n);
  for (size_t j = 0; j < n; j++) {
    py::object v = s[j];
    if (!PyIndex_Check(v.ptr()))
      throw py::type_error("read_ranges: requests[" + std::to_string(i) + "].crcs must hold ints");
    py::int_ iv(v);
    long long x;
    try {
      x = iv.cast<long long>();
    } catch (const py::cast_error&) {
      x = -1;
    }
    put((long double)x, j);
  }
}

// The engine's readers take `direct` as DIRECT_NEVER/AUTO/ALWAYS; anything else is the caller's mistake.
void check_direct(const char* fn, int direct) {
  if (direct != kDirectNever && direct != kDirectAuto && direct != kDirectAlways)
    throw py::value_error(std::string(fn) + ": direct must be 0 (never), 1 (auto) or 2 (always), got " +
                          std::to_string(direct));
}

py::tuple py_read_ranges(const py::sequence& requests, int threads, int64_t readahead_bytes,
                         std::shared_ptr<MappedRegion> map_into, int direct) {
  check_direct("read_ranges", direct);
  const size_t n = py::len(requests);
  std::vector<ReadRequest> reqs(n);
  std::vector<py::buffer_info> dsts;
  dsts.reserve(n);
  for (size_t i = 0; i < n; i++) {
    py::object item = requests[i];
    if (!py::isinstance<py::sequence>(item) || (py::len(item) != 8 && py::len(item) != 9))
      throw py::type_error("read_ranges: requests[" + std::to_string(i) +
                           "] must be a tuple (path, col_offset, col_length, chunk_bytes, crcs, lo, hi, dst"
                           "[, pad_before])");
    py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    ReadRequest& r = reqs[i];
    r.path = path_of(t[0]);
    r.col_offset = int_of(t[1], "col_offset", i);
    r.col_length = int_of(t[2], "col_length", i);
    r.chunk_bytes = int_of(t[3], "chunk_bytes", i);
    crcs_of(t[4], r.crcs, r.invalid, i);
    r.lo = int_of(t[5], "lo", i);
    r.hi = int_of(t[6], "hi", i);
    if (py::len(t) == 9) r.pad_before = int_of(t[8], "pad_before", i);
    py::object dst = t[7];
    if (!PyObject_CheckBuffer(dst.ptr()))
      throw py::type_error("read_ranges: requests[" + std::to_string(i) + "].dst must be a writable buffer, got " +
                           std::string(py::str(py::type::handle_of(dst).attr("__name__"))));
    py::buffer_info b;
    try {
      b = py::reinterpret_borrow<py::buffer>(dst).request(true);
    } catch (py::error_already_set&) {
      throw py::type_error("read_ranges: requests[" + std::to_string(i) + "].dst is not writable");
    }
    if (!is_c_contiguous(b))
      throw py::value_error("read_ranges: requests[" + std::to_string(i) + "].dst must be C-contiguous");
    r.dst = static_cast<uint8_t*>(b.ptr);
    r.dst_len = nbytes(b);
    dsts.push_back(std::move(b));
  }
  ReadResult res;
  {
    py::gil_scoped_release nogil;
    res = read_ranges(reqs, threads, readahead_bytes, map_into.get(), direct);
  }
  py::list errs;
  for (auto& e : res.errors) errs.append(py::make_tuple(e.first, e.second));
  return py::make_tuple(res.bytes_read, errs);
}

// A writable C-contiguous buffer for requests[i].dst; kept in `held` while the engine runs.
uint8_t* writable_dst(const py::object& dst, size_t i, const char* fn, std::vector<py::buffer_info>& held,
                      int64_t& len) {
  if (!PyObject_CheckBuffer(dst.ptr()))
    throw py::type_error(std::string(fn) + ": requests[" + std::to_string(i) + "].dst must be a writable buffer, got " +
                         std::string(py::str(py::type::handle_of(dst).attr("__name__"))));
  py::buffer_info b;
  try {
    b = py::reinterpret_borrow<py::buffer>(dst).request(true);
  } catch (py::error_already_set&) {
    throw py::type_error(std::string(fn) + ": requests[" + std::to_string(i) + "].dst is not writable");
  }
  if (!is_c_contiguous(b))
    throw py::value_error(std::string(fn) + ": requests[" + std::to_string(i) + "].dst must be C-contiguous");
  len = nbytes(b);
  uint8_t* p = static_cast<uint8_t*>(b.ptr);
  held.push_back(std::move(b));
  return p;
}

py::tuple py_read_strided(const py::sequence& requests, int threads, int64_t readahead_bytes, int64_t block_bytes,
                          int direct) {
  check_direct("read_strided", direct);
  const size_t n = py::len(requests);
  std::vector<StridedRequest> reqs(n);
  std::vector<py::buffer_info> dsts;
  dsts.reserve(n);
  const char* shape = "(path, r0, r1, dst, dst_stride, parts), each part (col_offset, col_length, chunk_bytes, "
                      "crcs, width, src, nbytes, dst, pad_before)";
  for (size_t i = 0; i < n; i++) {
    py::object item = requests[i];
    if (!py::isinstance<py::sequence>(item) || py::len(item) != 6)
      throw py::type_error("read_strided: requests[" + std::to_string(i) + "] must be a tuple " + shape);
    py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    StridedRequest& r = reqs[i];
    r.path = path_of(t[0]);
    r.r0 = int_of(t[1], "r0", i);
    r.r1 = int_of(t[2], "r1", i);
    r.dst = writable_dst(t[3], i, "read_strided", dsts, r.dst_len);
    r.dst_stride = int_of(t[4], "dst_stride", i);
    py::object parts_obj = t[5];
    if (!py::isinstance<py::sequence>(parts_obj))
      throw py::type_error("read_strided: requests[" + std::to_string(i) + "].parts must be a sequence");
    py::sequence parts = py::reinterpret_borrow<py::sequence>(parts_obj);
    for (size_t k = 0; k < py::len(parts); k++) {
      py::object po = parts[k];
      if (!py::isinstance<py::sequence>(po) || py::len(po) != 9)
        throw py::type_error("read_strided: requests[" + std::to_string(i) + "] must be a tuple " + shape);
      py::sequence q = py::reinterpret_borrow<py::sequence>(po);
      StridedPart p;
      p.col_offset = int_of(q[0], "col_offset", i);
      p.col_length = int_of(q[1], "col_length", i);
      p.chunk_bytes = int_of(q[2], "chunk_bytes", i);
      crcs_of(q[3], p.crcs, r.invalid, i);
      p.width = int_of(q[4], "width", i);
      p.src = int_of(q[5], "src", i);
      p.nbytes = int_of(q[6], "nbytes", i);
      p.dst = int_of(q[7], "dst", i);
      p.pad_before = int_of(q[8], "pad_before", i);
      r.parts.push_back(std::move(p));
    }
  }
  ReadResult res;
  {
    py::gil_scoped_release nogil;
    res = read_strided(reqs, threads, readahead_bytes, block_bytes, direct);
  }
  py::list errs;
  for (auto& e : res.errors) errs.append(py::make_tuple(e.first, e.second));
  return py::make_tuple(res.bytes_read, errs);
}

}  // namespace

void bind_io(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OsError& e) {
      py::object exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.err, e.describe(), e.path);
      PyErr_SetObject((PyObject*)Py_TYPE(exc.ptr()), exc.ptr());
    } catch (const std::logic_error& e) {
      if (dynamic_cast<const std::invalid_argument*>(&e) || dynamic_cast<const std::length_error*>(&e) ||
          dynamic_cast<const std::out_of_range*>(&e) || dynamic_cast<const std::domain_error*>(&e))
        throw;  // pybind11's defaults: ValueError, ValueError, IndexError, ValueError
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<PyShardWriter>(m, "ShardWriter",
                            "Writes bucket-sorted segments to files in parallel, one worker thread per file.")
      .def(py::init([](const py::sequence& paths, int64_t num_buckets, int64_t chunk_bytes,
                       int64_t max_inflight_bytes, bool writeback) {
             if (py::isinstance<py::str>(paths) || py::isinstance<py::bytes>(paths))
               throw py::type_error("ShardWriter: paths must be a list of paths, not a single path");
             std::vector<std::string> ps;
             for (const auto& p : paths) ps.push_back(path_of(p));
             return std::make_unique<PyShardWriter>(ps, num_buckets, chunk_bytes, max_inflight_bytes, writeback);
           }),
           py::arg("paths"),
           py::arg("num_buckets"), py::arg("chunk_bytes"), py::arg("max_inflight_bytes"), py::arg("writeback") = false,
           "writeback: start writing each block back to the device once written (sync_file_range), for "
           "writers that finish(fsync=True): the fsync then has little left to do")
      .def("submit", &PyShardWriter::submit, py::arg("table"), py::arg("ids"), py::arg("columns"),
           py::arg("num_rows") = 0, py::arg("id_range") = 0, py::arg("group_bytes") = std::vector<int64_t>(),
           py::arg("runs") = false,
           "queue a segment (1 to 2**32-1 rows); blocks (GIL released) while too many bytes are in flight; returns "
           "its id. num_rows = N > 0: bucket the ids (rows 0..N-1) with format version 4's row_range function; "
           "id_range = H > 0: bucket them with its id_range function over [0, H). group_bytes: per column, > 0 "
           "stores it as column groups of that many bytes of each row (format version 5). runs: a row_range "
           "segment whose ids are one run in order is written without ids or directory (format version 5)")
      .def("submit_many", &PyShardWriter::submit_many, py::arg("segments"),
           "queue many segments, each (table, ids, columns, num_rows, id_range[, group_bytes, runs]) as submit "
           "takes them, checked first and queued in order with the GIL released once; returns their ids")
      .def("wait", &PyShardWriter::wait, py::arg("segment"),
           "block (GIL released) until segment `segment` (an id submit returned) is written, so the caller may "
           "reuse its buffers; raises the writer's first failure instead")
      .def("finish", &PyShardWriter::finish, py::arg("fsync") = true,
           "wait for every segment, fsync and close the files; per file the records of its segments")
      .def("abort", &PyShardWriter::abort, "stop the workers and close the files (kept on disk)");

  py::class_<MappedRegion, std::shared_ptr<MappedRegion>>(
      m, "MappedRegion", py::buffer_protocol(),
      "Zeroed private anonymous memory (a writable buffer of `nbytes` bytes) into which read_ranges(map_into=) "
      "may map checkpoint pages copy-on-write. Unmapped when the last reference (e.g. a tensor made with "
      "torch.frombuffer) goes away.")
      .def(py::init([](int64_t nbytes) {
             py::gil_scoped_release nogil;
             return std::make_shared<MappedRegion>(nbytes);
           }),
           py::arg("nbytes"))
      .def_buffer([](MappedRegion& r) {
        return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {r.size()}, {1}, false);
      })
      .def("__len__", &MappedRegion::size)
      .def_property_readonly("bytes_mapped", [](const MappedRegion& r) { return r.bytes_mapped.load(); },
                             "file bytes mapped (not copied) into the region so far")
      .def_property_readonly_static("page_size", [](py::object) { return MappedRegion::page_size(); });

  m.attr("DEFAULT_READAHEAD_BYTES") = kDefaultReadaheadBytes;
  m.attr("COLUMN_ALIGN") = kColumnAlign;
  m.attr("PACK_BELOW") = kPackBelow;
  init_buffer_pool();   // before any writer thread exists (buffer_pool.h)
  m.def(
      "staging_pool",
      [] {
        const PoolStats s = pool_stats();
        py::dict d;
        d["idle_bytes"] = s.idle_bytes;
        d["fresh"] = s.fresh;
        d["reused"] = s.reused;
        return d;
      },
      "The writers' staging buffers kept between saves (csrc/buffer_pool.h): idle_bytes held now (at "
      "most STAGING_POOL_BYTES), and how many buffers were allocated fresh and handed out again");
  m.def("_hold_staging_pool_lock", &hold_pool_lock_for, py::arg("ms"),
        py::call_guard<py::gil_scoped_release>(),
        "Tests: holds the staging pool's lock on a thread of its own for `ms` ms; returns once it is held");
  m.def("release_staging_pool", &release_pooled_buffers,
        "Frees the idle staging buffers that writers keep for the process's next save");
  m.attr("STAGING_POOL_BYTES") = kIdleBytes;
  m.def("column_step", &column_step, py::arg("length"), py::arg("chunk_bytes"),
        "format version 4: bytes per checksum of a column of `length` bytes");
  m.attr("DIRECT_NEVER") = (int)kDirectNever;
  m.attr("DIRECT_AUTO") = (int)kDirectAuto;
  m.attr("DIRECT_ALWAYS") = (int)kDirectAlways;
  m.def("read_strided", &py_read_strided, py::arg("requests"), py::arg("threads") = 4,
        py::arg("readahead_bytes") = kDefaultReadaheadBytes, py::arg("block_bytes") = kStridedBlockBytes,
        py::arg("direct") = (int)kDirectAuto,
        "verified parallel reads of rows of several columns (a slot's column groups, format version 5) into "
        "row-major destinations, in blocks of rows: returns (bytes_read, [(request_index, message), ...]); "
        "direct as read_ranges; see docs/ENGINE.md");
  m.def("read_ranges", &py_read_ranges, py::arg("requests"), py::arg("threads") = 4,
        py::arg("readahead_bytes") = kDefaultReadaheadBytes, py::arg("map_into") = nullptr,
        py::arg("direct") = (int)kDirectAuto,
        "verified parallel reads: returns (bytes_read, [(request_index, message), ...]); the kernel is told "
        "to start reading up to readahead_bytes ahead of the threads (0: off). With map_into (a MappedRegion), "
        "whole columns read into that region at page-congruent addresses are mapped copy-on-write instead of "
        "copied. direct: DIRECT_NEVER, DIRECT_AUTO (O_DIRECT for pieces not in the page cache) or "
        "DIRECT_ALWAYS (docs/ENGINE.md)");
}
