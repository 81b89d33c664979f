// Buffer-protocol checks shared by the bindings. Columns are never copied: a buffer with the wrong
// dtype, shape or layout is rejected with TypeError/ValueError instead of being converted.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace recckpt {
namespace py = pybind11;

inline char format_kind(const std::string& fmt) {
  // Strip byte-order/size prefixes ('<', '=', '@', '!', '>') from a struct format of one item.
  size_t i = 0;
  while (i < fmt.size() && (fmt[i] == '<' || fmt[i] == '=' || fmt[i] == '@' || fmt[i] == '!' ||
                            fmt[i] == '>'))
    i++;
  if (i + 1 != fmt.size()) return 0;
  return fmt[i];
}

inline bool is_little_or_native(const std::string& fmt) {
  if (fmt.empty()) return true;
  if (fmt[0] == '>' || fmt[0] == '!') {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return true;
#else
    return false;
#endif
  }
  return true;
}

inline bool is_int64_format(const py::buffer_info& b) {
  char k = format_kind(b.format);
  return b.itemsize == 8 && (k == 'q' || k == 'l') && is_little_or_native(b.format);
}

inline bool is_uint8_format(const py::buffer_info& b) {
  char k = format_kind(b.format);
  return b.itemsize == 1 && (k == 'B' || k == 'c');
}

// True when the buffer's bytes are one C-ordered contiguous block.
inline bool is_c_contiguous(const py::buffer_info& b) {
  py::ssize_t expect = b.itemsize;
  for (py::ssize_t d = b.ndim - 1; d >= 0; d--) {
    if (b.shape[d] == 0) return true;
    if (b.shape[d] != 1 && b.strides[d] != expect) return false;
    expect *= b.shape[d];
  }
  return true;
}

inline py::ssize_t nbytes(const py::buffer_info& b) {
  py::ssize_t n = b.itemsize;
  for (py::ssize_t d = 0; d < b.ndim; d++) n *= b.shape[d];
  return n;
}

// A 1-D C-contiguous int64 array (numpy int64 or anything with the same buffer layout).
inline py::buffer_info int64_vector(const py::handle& obj, const char* what) {
  if (!PyObject_CheckBuffer(obj.ptr()))
    throw py::type_error(std::string(what) + ": expected an int64 array (buffer protocol), got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  py::buffer_info b = py::reinterpret_borrow<py::buffer>(obj).request();
  if (!is_int64_format(b))
    throw py::type_error(std::string(what) + ": expected dtype int64, got buffer format '" +
                         b.format + "' with itemsize " + std::to_string(b.itemsize));
  if (b.ndim != 1)
    throw py::value_error(std::string(what) + ": expected a 1-D array, got " +
                          std::to_string(b.ndim) + " dimensions");
  if (!is_c_contiguous(b))
    throw py::value_error(std::string(what) + ": array must be C-contiguous (use numpy.ascontiguousarray)");
  return b;
}

// Any C-contiguous buffer viewed as raw bytes.
inline py::buffer_info byte_view(const py::handle& obj, const char* what, bool writable = false) {
  if (!PyObject_CheckBuffer(obj.ptr()))
    throw py::type_error(std::string(what) + ": expected a bytes-like object, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  py::buffer_info b = py::reinterpret_borrow<py::buffer>(obj).request(writable);
  if (!is_c_contiguous(b))
    throw py::value_error(std::string(what) + ": buffer must be C-contiguous");
  return b;
}

}  // namespace recckpt
