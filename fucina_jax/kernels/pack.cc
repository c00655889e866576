// The two hot loops of loading (fucina_jax/kernels/pack.py's pack_tensor), in C with the GIL released:
//   pack_q8_0     Q8_0 rows straight into the packed codes (q + 128) and fp16 scales, no decode copy;
//   narrow_codes  the byte-code layout -> nibbles + bit planes (4-6-bit types).
// Each writes the bytes pack.py's NumPy statements write (tests/test_load_speed.py holds pack_tensor to pack_codes,
// and the NumPy fallback to this). Baseline x86-64 only (SSE2): loading runs before any instruction set is picked.

#include <Python.h>

#include <emmintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 16;   // output columns per group
constexpr int kQB = 32;      // values per block along K
constexpr int kBlockCodes = 8 * kLanes * 4;  // 512 byte codes per group and block

struct Buffers {
  Py_buffer v[3] = {};
  int n = 0;
  ~Buffers() {
    for (int i = 0; i < n; ++i) PyBuffer_Release(&v[i]);
  }
  bool get(PyObject* obj, bool writable, Py_ssize_t need, const char* what) {
    if (PyObject_GetBuffer(obj, &v[n], PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) return false;
    ++n;
    if (v[n - 1].len < need) {
      PyErr_Format(PyExc_ValueError, "%s has %zd bytes; %zd are needed", what, v[n - 1].len, need);
      return false;
    }
    return true;
  }
};

// src: n rows of nb Q8_0 blocks (2-byte fp16 scale + 32 int8), n a multiple of 16. q: [n/16][nb][8 chunks][16 lanes]
// [4 codes] bytes, code = int8 + 128; a: [n/16][nb][16 lanes] fp16 (the file's scale bytes as they are).
void pack_q8_0(const uint8_t* src, int64_t n, int64_t nb, uint8_t* q, uint8_t* a) {
  const int64_t row = nb * (2 + kQB);
  for (int64_t g = 0; g < n / kLanes; ++g) {
    const uint8_t* rows = src + g * kLanes * row;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* qb = q + (g * nb + b) * kBlockCodes;
      uint8_t* ab = a + (g * nb + b) * kLanes * 2;
      for (int l = 0; l < kLanes; ++l) {
        const uint8_t* blk = rows + l * row + b * (2 + kQB);
        std::memcpy(ab + l * 2, blk, 2);
        for (int c = 0; c < 8; ++c) {
          uint32_t w;
          std::memcpy(&w, blk + 2 + c * 4, 4);
          w ^= 0x80808080u;
          std::memcpy(qb + (c * kLanes + l) * 4, &w, 4);
        }
      }
    }
  }
}

// src: blocks of 512 byte codes (8 chunks x 64); dst: per block 256 bytes of nibbles (byte j: code j low, code
// 256 + j high), then for each bit p in [4, bits) 8 bytes per chunk: bit i (little-endian) = bit p of code i of the
// chunk. `sub` is subtracted from each code first (symmetric codes q + 128 -> q with zero 2^(bits-1)).
void narrow_codes(const uint8_t* src, int64_t n_blocks, int bits, uint8_t sub, uint8_t* dst) {
  const __m128i vsub = _mm_set1_epi8(static_cast<char>(sub));
  const __m128i lo = _mm_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const uint8_t* s = src + blk * kBlockCodes;
    uint8_t* d = dst + blk * 64 * bits;
    __m128i v[32];
    for (int i = 0; i < 32; ++i)
      v[i] = _mm_sub_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * i)), vsub);
    for (int i = 0; i < 16; ++i) {
      const __m128i hi = _mm_and_si128(_mm_slli_epi16(v[16 + i], 4), _mm_set1_epi8(static_cast<char>(0xF0)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16 * i), _mm_or_si128(_mm_and_si128(v[i], lo), hi));
    }
    for (int p = 4; p < bits; ++p) {
      uint8_t* plane = d + 256 + (p - 4) * 64;
      for (int i = 0; i < 32; ++i) {  // 16 codes -> 16 bits: bit p moved to each byte's top bit
        const uint32_t m = static_cast<uint32_t>(_mm_movemask_epi8(_mm_slli_epi16(v[i], 7 - p)));
        plane[2 * i] = static_cast<uint8_t>(m);
        plane[2 * i + 1] = static_cast<uint8_t>(m >> 8);
      }
    }
  }
}

}  // namespace

// pack_q8_0(src, n, nb, q, a): see pack_q8_0 above; buffers are C-contiguous, sizes checked.
extern "C" PyObject* fucina_py_pack_q8_0(PyObject*, PyObject* args) {
  PyObject *src, *q, *a;
  long long n, nb;
  if (!PyArg_ParseTuple(args, "OLLOO", &src, &n, &nb, &q, &a)) return nullptr;
  if (n < 0 || nb < 0 || n % kLanes) {
    PyErr_Format(PyExc_ValueError, "pack_q8_0: n = %lld must be a multiple of %d", n, kLanes);
    return nullptr;
  }
  Buffers buf;
  if (!buf.get(src, false, n * nb * (2 + kQB), "the Q8_0 rows") || !buf.get(q, true, n * nb * kQB, "the codes") ||
      !buf.get(a, true, n * nb * 2, "the scales"))
    return nullptr;
  Py_BEGIN_ALLOW_THREADS
  pack_q8_0(static_cast<const uint8_t*>(buf.v[0].buf), n, nb, static_cast<uint8_t*>(buf.v[1].buf),
            static_cast<uint8_t*>(buf.v[2].buf));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// narrow_codes(src, dst, bits, sub): src holds whole 512-code blocks; dst 64 * bits bytes per block.
extern "C" PyObject* fucina_py_narrow_codes(PyObject*, PyObject* args) {
  PyObject *src, *dst;
  int bits, sub;
  if (!PyArg_ParseTuple(args, "OOii", &src, &dst, &bits, &sub)) return nullptr;
  if (bits < 4 || bits > 7 || sub < 0 || sub > 255) {
    PyErr_Format(PyExc_ValueError, "narrow_codes: bits = %d must be 4..7 and sub = %d a byte", bits, sub);
    return nullptr;
  }
  Buffers buf;
  if (!buf.get(src, false, 0, "the byte codes")) return nullptr;
  if (buf.v[0].len % kBlockCodes) {
    PyErr_Format(PyExc_ValueError, "narrow_codes: %zd byte codes are not whole blocks of %d", buf.v[0].len,
                 kBlockCodes);
    return nullptr;
  }
  const int64_t n_blocks = buf.v[0].len / kBlockCodes;
  if (!buf.get(dst, true, n_blocks * 64 * bits, "the narrowed codes")) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  narrow_codes(static_cast<const uint8_t*>(buf.v[0].buf), n_blocks, bits, static_cast<uint8_t>(sub),
               static_cast<uint8_t*>(buf.v[1].buf));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}
