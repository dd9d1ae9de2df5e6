// CRC-32C (Castagnoli) of a byte range, and a copy that computes it while it copies: the
// memory tier's checksum of a committed slot (Note [slot checksum] in
// zeroshard/resilience/checksum.py).
//
// zlib's crc32 runs at ~1.7 GB/s here and was a commit's largest single pass (57 ms of 100 MB,
// more than the copy into the slot); the SSE4.2 crc32 instruction runs at ~8 GB/s on one chain,
// and folded into the copy it reads the state once instead of twice. The instruction is
// chosen at run time (no -msse4.2: the library must load on any x86-64 CPU); elsewhere a
// table runs instead (same values, slower).
//
// Addresses come as integers from the Python side (torch's data_ptr(): any dtype, no buffer
// protocol needed), which checks bounds, device and contiguity. No torch headers: pybind11
// only, so the build takes seconds. The GIL is released while the bytes are read.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define ZS_X86 1
#endif

namespace py = pybind11;

namespace {

uint32_t kTable[256];

void init_table() {
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    kTable[i] = c;
  }
}

uint32_t soft(uint32_t c, const uint8_t* p, size_t n) {
  while (n--) c = kTable[(c ^ *p++) & 0xFF] ^ (c >> 8);
  return c;
}

void soft_copy(uint8_t* dst, const uint8_t* src, size_t n, uint32_t* c) {
  constexpr size_t kChunk = 1 << 16;  // (copy a chunk, then sum it while it is in cache)
  while (n) {
    const size_t m = n < kChunk ? n : kChunk;
    std::memcpy(dst, src, m);
    *c = soft(*c, dst, m);
    dst += m, src += m, n -= m;
  }
}

#ifdef ZS_X86
__attribute__((target("sse4.2"))) uint32_t hw(uint32_t c, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) c = _mm_crc32_u8(c, *p++), --n;
  uint64_t w = c;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    w = _mm_crc32_u64(w, v);
  }
  c = static_cast<uint32_t>(w);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}

__attribute__((target("sse4.2"))) void hw_copy(uint8_t* dst, const uint8_t* src, size_t n, uint32_t* c) {
  uint64_t w = *c;
  for (; n >= 8; dst += 8, src += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, src, 8);
    std::memcpy(dst, &v, 8);
    w = _mm_crc32_u64(w, v);
  }
  uint32_t s = static_cast<uint32_t>(w);
  for (; n; --n) {
    *dst++ = *src;
    s = _mm_crc32_u8(s, *src++);
  }
  *c = s;
}

const bool kHw = __builtin_cpu_supports("sse4.2");
#else
const bool kHw = false;
#endif

uint32_t update(uint32_t value, const uint8_t* p, size_t n) {
  uint32_t c = ~value;
#ifdef ZS_X86
  if (kHw) return ~hw(c, p, n);
#endif
  return ~soft(c, p, n);
}

uint32_t copy_update(uint8_t* dst, const uint8_t* src, size_t n, uint32_t value) {
  uint32_t c = ~value;
#ifdef ZS_X86
  if (kHw) {
    hw_copy(dst, src, n, &c);
    return ~c;
  }
#endif
  soft_copy(dst, src, n, &c);
  return ~c;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  init_table();
  m.doc() = "CRC-32C of memory ranges (zeroshard's memory tier)";
  m.def(
      "crc32c",
      [](uintptr_t addr, size_t nbytes, uint32_t value) {
        py::gil_scoped_release nogil;
        return update(value, reinterpret_cast<const uint8_t*>(addr), nbytes);
      },
      py::arg("addr"), py::arg("nbytes"), py::arg("value") = 0,
      "CRC-32C of nbytes at addr, continuing from value (the CRC of the bytes before; 0 to start)");
  m.def(
      "copy_crc32c",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, uint32_t value) {
        py::gil_scoped_release nogil;
        return copy_update(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(src), nbytes, value);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("value") = 0,
      "Copies nbytes from src to dst (not overlapping) and returns their CRC-32C, continuing from value");
  m.def("hardware", []() { return kHw; }, "Whether the SSE4.2 instruction computes it (else a table)");
}
