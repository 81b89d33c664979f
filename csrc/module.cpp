// Python bindings of the engine: recckpt._C. Argument checking and conversion happen here with the
// GIL held; every data loop runs in the C++ core with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "crc32c.h"
#include "hash.h"
#include "idmap.h"
#include "pybuf.h"

namespace py = pybind11;
using namespace recckpt;

namespace {

constexpr size_t kReleaseGilBytes = 1 << 16;  // below this, releasing the GIL costs more than it saves

uint32_t crc_value(int64_t value) {
  if (value < 0 || value > 0xFFFFFFFFll) throw py::value_error("crc32c: value must be in [0, 2**32)");
  return (uint32_t)value;
}

template <class F>
uint32_t crc_of(const py::buffer& data, int64_t value, F f) {
  py::buffer_info b = byte_view(data, "crc32c: data");
  const size_t n = (size_t)nbytes(b);
  uint32_t c = crc_value(value);
  if (n >= kReleaseGilBytes) {
    py::gil_scoped_release nogil;
    return f(c, b.ptr, n);
  }
  return f(c, b.ptr, n);
}

py::array_t<uint32_t> crc_chunks(const py::buffer& data, int64_t chunk_bytes) {
  if (chunk_bytes <= 0) throw py::value_error("crc32c_chunks: chunk_bytes must be > 0");
  py::buffer_info b = byte_view(data, "crc32c_chunks: data");
  const uint64_t n = (uint64_t)nbytes(b);
  const uint64_t cb = (uint64_t)chunk_bytes;
  const uint64_t k = (n + cb - 1) / cb;
  py::array_t<uint32_t> out((py::ssize_t)k);
  uint32_t* o = out.mutable_data();
  const uint8_t* p = static_cast<const uint8_t*>(b.ptr);
  {
    py::gil_scoped_release nogil;
    for (uint64_t j = 0; j < k; j++) {
      uint64_t lo = j * cb, len = std::min(cb, n - lo);
      o[j] = crc32c(0, p + lo, len);
    }
  }
  return out;
}

py::array_t<int64_t> py_bucket_of(const py::object& ids, int64_t num_buckets, int64_t num_rows,
                                  int64_t id_range) {
  if (num_buckets <= 0) throw py::value_error("bucket_of: num_buckets must be > 0");
  if (num_rows < 0 || num_rows >= kMaxRowRangeRows)
    throw py::value_error("bucket_of: num_rows must be in [0, 2**40)");
  if (id_range < 0 || (id_range > 0 && num_rows > 0))
    throw py::value_error("bucket_of: id_range must be >= 0 and not given with num_rows");
  py::buffer_info b = int64_vector(ids, "bucket_of: ids");
  const int64_t n = b.shape[0];
  py::array_t<int64_t> out(n);
  int64_t* o = out.mutable_data();
  const int64_t* p = static_cast<const int64_t*>(b.ptr);
  {
    py::gil_scoped_release nogil;
    if (id_range > 0)
      id_range_bucket_of(p, n, (uint64_t)num_buckets, (uint64_t)id_range, o);
    else if (num_rows > 0)
      row_range_bucket_of(p, n, (uint64_t)num_buckets, (uint64_t)num_rows, o);
    else
      bucket_of(p, n, (uint64_t)num_buckets, o);
  }
  return out;
}

// The map's lock is only taken with the GIL released and dropped before the GIL is retaken, so a
// thread holding the lock never waits for the GIL.
int64_t locked_size(const IdMap& s) {
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lk(s.mutex());
  return s.size();
}

void bind_idmap(py::module_& m) {
  py::class_<IdMap>(m, "IdMap",
                    "int64 id -> dense row map (open addressing). The i-th distinct id inserted gets row i.")
      .def(py::init<int64_t>(), py::arg("capacity") = 0)
      .def("__len__", [](const IdMap& s) { return locked_size(s); })
      .def_property_readonly("size", [](const IdMap& s) { return locked_size(s); })
      .def_property_readonly("capacity",
                             [](const IdMap& s) {
                               py::gil_scoped_release nogil;
                               std::lock_guard<std::mutex> lk(s.mutex());
                               return s.capacity();
                             },
                             "number of slots in the table (a power of two)")
      .def(
          "lookup",
          [](const IdMap& s, const py::object& ids) {
            py::buffer_info b = int64_vector(ids, "IdMap.lookup: ids");
            const int64_t n = b.shape[0];
            py::array_t<int64_t> rows(n);
            int64_t* r = rows.mutable_data();
            {
              py::gil_scoped_release nogil;
              std::lock_guard<std::mutex> lk(s.mutex());
              s.lookup(static_cast<const int64_t*>(b.ptr), n, r);
            }
            return rows;
          },
          py::arg("ids"), "row of each id, -1 where absent")
      .def(
          "insert",
          [](IdMap& s, const py::object& ids) {
            py::buffer_info b = int64_vector(ids, "IdMap.insert: ids");
            const int64_t n = b.shape[0];
            py::array_t<int64_t> rows(n);
            py::array_t<bool> is_new(n);
            int64_t* r = rows.mutable_data();
            uint8_t* nw = reinterpret_cast<uint8_t*>(is_new.mutable_data());
            {
              py::gil_scoped_release nogil;
              std::lock_guard<std::mutex> lk(s.mutex());
              s.insert(static_cast<const int64_t*>(b.ptr), n, r, nw);
            }
            return py::make_tuple(rows, is_new);
          },
          py::arg("ids"),
          "insert absent ids in first-occurrence order; returns (rows, is_new)")
      .def(
          "insert_new",
          [](IdMap& s, const py::object& ids) {
            py::buffer_info b = int64_vector(ids, "IdMap.insert_new: ids");
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> lk(s.mutex());
            return s.insert_new(static_cast<const int64_t*>(b.ptr), b.shape[0]);
          },
          py::arg("ids"),
          "insert ids expected to be absent (presized, no per-id output); returns the index of the first "
          "id already present or repeated (ids before it stay inserted), or len(ids) when all were new")
      .def(
          "probes",
          [](const IdMap& s, const py::object& ids) {
            py::buffer_info b = int64_vector(ids, "IdMap.probes: ids");
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> lk(s.mutex());
            return s.probes(static_cast<const int64_t*>(b.ptr), b.shape[0]);
          },
          py::arg("ids"),
          "slots visited to look up ids (len(ids) when no probe goes past its home slot): a measure of "
          "clustering, for tests and benchmarks")
      .def("keys",
           [](const IdMap& s) {
             // The map's lock is only ever taken with the GIL released (and dropped before the GIL is
             // retaken); the array is allocated with the GIL, so size it first and retry on a race.
             for (;;) {
               size_t n;
               {
                 py::gil_scoped_release nogil;
                 std::lock_guard<std::mutex> lk(s.mutex());
                 n = s.keys().size();
               }
               py::array_t<int64_t> out((py::ssize_t)n);
               int64_t* o = out.mutable_data();
               bool ok;
               {
                 py::gil_scoped_release nogil;
                 std::lock_guard<std::mutex> lk(s.mutex());
                 const auto& k = s.keys();
                 ok = k.size() == n;
                 if (ok && n) std::memcpy(o, k.data(), n * sizeof(int64_t));
               }
               if (ok) return out;
             }
           })
      .def(
          "reserve",
          [](IdMap& s, int64_t n) {
            if (n < 0) throw py::value_error("IdMap.reserve: n must be >= 0");
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> lk(s.mutex());
            s.reserve(n);
          },
          py::arg("n"))
      .def("clear", [](IdMap& s) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lk(s.mutex());
        s.clear();
      });
}

}  // namespace

void bind_io(py::module_& m);
void bind_fault(py::module_& m);
void bind_fold(py::module_& m);
void bind_digest(py::module_& m);
void bind_json_rules(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "recckpt C++ engine: bucketing, CRC32C, IdMap, parallel shard writes and verified reads";

  m.def("bucket_of", &py_bucket_of, py::arg("ids"), py::arg("num_buckets"), py::arg("num_rows") = 0, py::arg("id_range") = 0,
        "bucket(id) = mix64(id) mod num_buckets for each id; with num_rows = N > 0 the row_range function "
        "floor(id * num_buckets / N), -1 for an id outside [0, N)");
  m.def(
      "crc32c",
      [](const py::buffer& data, int64_t value) {
        return crc_of(data, value, [](uint32_t c, const void* p, size_t n) { return crc32c(c, p, n); });
      },
      py::arg("data"), py::arg("value") = 0, "CRC-32C of data, continuing `value` like zlib.crc32");
  m.def(
      "_crc32c_software",
      [](const py::buffer& data, int64_t value) {
        return crc_of(data, value,
                      [](uint32_t c, const void* p, size_t n) { return crc32c_software(c, p, n); });
      },
      py::arg("data"), py::arg("value") = 0, "CRC-32C forced onto the slice-by-8 software path (tests)");
  m.def("crc32c_chunks", &crc_chunks, py::arg("data"), py::arg("chunk_bytes"),
        "CRC-32C of each chunk_bytes piece of data (the last may be short)");
  m.def("crc32c_backend", []() { return std::string(crc32c_backend()); });
  m.def(
      "_crc32c_combine",
      [](int64_t a, int64_t b, int64_t len_b) {
        if (len_b < 0) throw py::value_error("len_b must be >= 0");
        return crc32c_combine(crc_value(a), crc_value(b), (uint64_t)len_b);
      },
      py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"), "crc of A||B from crc(A), crc(B), len(B)");

  bind_idmap(m);
  bind_io(m);
  bind_fault(m);
  bind_fold(m);
  bind_digest(m);
  bind_json_rules(m);
}
