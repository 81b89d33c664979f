// A fast first look at JSON text for recckpt's metadata rules (recckpt/format/checked_json.py): nesting
// depth, integers of too many digits, and \u escapes of UTF-16 surrogates that are not a high-low pair
// (which decode to text that is not Unicode). Conservative: it answers "follows the rules" only when
// they surely hold; otherwise the Python walk (check_tree) looks again and words the problem. A metadata
// file of a thousand tables is one pass here instead of a Python call per value.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "pybuf.h"

namespace py = pybind11;

namespace recckpt {
namespace {

int hex_value(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The code unit of "\uXXXX" at p (p[0] == '\\'), or -1 if p does not start one.
int32_t escaped_unit(const unsigned char* p, const unsigned char* end) {
  if (end - p < 6 || p[0] != '\\' || p[1] != 'u') return -1;
  int32_t v = 0;
  for (int i = 2; i < 6; i++) {
    const int h = hex_value(p[i]);
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

bool follows_rules(const unsigned char* p, size_t n, int64_t max_depth, int64_t max_digits) {
  const unsigned char* end = p + n;
  int64_t depth = 0, digits = 0;
  while (p < end) {
    const unsigned char c = *p++;
    if (c >= '0' && c <= '9') {
      if (++digits > max_digits) return false;
      continue;
    }
    digits = 0;
    if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      depth--;
    } else if (c == '"') {
      while (p < end && *p != '"') {
        if (*p >= 0x80) return false;  // raw non-ASCII text: the walk checks it
        if (*p != '\\') {
          p++;
          continue;
        }
        const int32_t u = escaped_unit(p, end);
        if (u < 0) {  // any other escape: two characters
          p += 2;
          continue;
        }
        p += 6;
        if (u >= 0xDC00 && u <= 0xDFFF) return false;  // a low surrogate with no high one before it
        if (u >= 0xD800 && u <= 0xDBFF) {
          const int32_t low = escaped_unit(p, end);
          if (low < 0xDC00 || low > 0xDFFF) return false;  // a high surrogate alone
          p += 6;
        }
      }
      p++;  // the closing quote
    }
  }
  return true;
}

}  // namespace
}  // namespace recckpt

void bind_json_rules(py::module_& m) {
  m.def(
      "json_follows_rules",
      [](const py::object& text, int64_t max_depth, int64_t max_digits) {
        if (PyUnicode_Check(text.ptr())) {
          // A str's UTF-8 form: for ASCII text (metadata), its own characters, no copy.
          Py_ssize_t n = 0;
          const char* p = PyUnicode_AsUTF8AndSize(text.ptr(), &n);
          if (p == nullptr) {  // not encodable (a lone surrogate in the str itself): look closer
            PyErr_Clear();
            return false;
          }
          py::gil_scoped_release nogil;
          return recckpt::follows_rules(reinterpret_cast<const unsigned char*>(p), (size_t)n, max_depth,
                                        max_digits);
        }
        py::buffer_info b = recckpt::byte_view(text, "json_follows_rules: text");
        const auto* p = static_cast<const unsigned char*>(b.ptr);
        const size_t n = (size_t)recckpt::nbytes(b);
        py::gil_scoped_release nogil;
        return recckpt::follows_rules(p, n, max_depth, max_digits);
      },
      py::arg("text"), py::arg("max_depth"), py::arg("max_digits"),
      "True when the JSON text (a str, or UTF-8 bytes) surely nests at most max_depth deep, has no run of more than max_digits "
      "digits outside strings, no raw non-ASCII byte in a string and no \\u escape of a lone surrogate; "
      "False: look closer (checked_json.check_tree)");
}
