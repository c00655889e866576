// The hot loops of loading (fucina_jax/kernels/pack.py's pack_tensor), in C with the GIL released:
//   pack_q8_0     Q8_0 rows straight into the packed codes (q + 128) and fp16 scales, no decode copy;
//   decode_codes  the byte codes of the other types' blocks (pack.py's decoders' u);
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

// GGML type ids (ggml.h) of the types decode_codes takes; their block sizes in values and bytes.
enum : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23
};

bool block_shape(int type, int* values, int* bytes) {
  switch (type) {
    case kQ4_0: *values = 32, *bytes = 18; return true;
    case kQ4_1: *values = 32, *bytes = 20; return true;
    case kQ5_0: *values = 32, *bytes = 22; return true;
    case kQ5_1: *values = 32, *bytes = 24; return true;
    case kQ8_0: *values = 32, *bytes = 34; return true;
    case kQ2_K: *values = 256, *bytes = 84; return true;
    case kQ3_K: *values = 256, *bytes = 110; return true;
    case kQ4_K: *values = 256, *bytes = 144; return true;
    case kQ5_K: *values = 256, *bytes = 176; return true;
    case kQ6_K: *values = 256, *bytes = 210; return true;
    case kIQ4_NL: *values = 32, *bytes = 18; return true;
    case kIQ4_XS: *values = 256, *bytes = 136; return true;
    default: return false;
  }
}

// kBitBytes[x]: 8 bytes, byte k = bit k of x times 16 (a high-bit byte spread over the 8 codes it belongs to).
constexpr struct BitBytes {
  uint64_t t[256] = {};
  constexpr BitBytes() {
    for (int x = 0; x < 256; ++x)
      for (int k = 0; k < 8; ++k)
        if (x >> k & 1) t[x] |= uint64_t{16} << (8 * k);
  }
  constexpr uint64_t operator[](int x) const { return t[x]; }
} kBitBytes;

// n bytes at q in groups of `group`: per group its low nibbles, then its high nibbles.
inline void nibbles(const uint8_t* __restrict q, int n, int group, uint8_t* __restrict u) {
  for (int g = 0; g < n; g += group)
    for (int r = 0; r < group; ++r) {
      u[2 * g + r] = q[g + r] & 0x0F;
      u[2 * g + group + r] = q[g + r] >> 4;
    }
}

// The byte codes u of one block, as pack.py's decoders give them (the symmetric types with q - zero + 128).
template <int kType>
inline void decode_block(const uint8_t* __restrict b, uint8_t* __restrict u) {
  switch (kType) {
    case kQ4_0:
      nibbles(b + 2, 16, 16, u);
      for (int i = 0; i < 32; ++i) u[i] += 120;
      return;
    case kQ4_1:
      nibbles(b + 4, 16, 16, u);
      return;
    case kQ5_0:
    case kQ5_1: {
      const int qh = kType == kQ5_0 ? 2 : 4;  // 32 high bits (LE), then the nibbles
      nibbles(b + qh + 4, 16, 16, u);
      for (int j = 0; j < 4; ++j) {  // bit k of high byte j is value 8 j + k's fifth bit
        uint64_t w;
        std::memcpy(&w, u + 8 * j, 8);
        w |= kBitBytes[b[qh + j]];
        std::memcpy(u + 8 * j, &w, 8);
      }
      if (kType == kQ5_0)
        for (int i = 0; i < 32; ++i) u[i] += 112;
      return;
    }
    case kQ8_0:  // int8 q + 128: the byte with its sign bit flipped
      for (int i = 0; i < 32; ++i) u[i] = b[2 + i] ^ 0x80;
      return;
    case kQ2_K:  // value 128 g + 32 j + r: 2-bit field j of qs byte 32 g + r
      for (int g = 0; g < 2; ++g)
        for (int j = 0; j < 4; ++j)
          for (int r = 0; r < 32; ++r) u[128 * g + 32 * j + r] = (b[16 + 32 * g + r] >> (2 * j)) & 3;
      return;
    case kQ3_K:  // value 128 g + 32 j + r: 2-bit field j of qs byte 32 g + r, plus 4 if bit 4 g + j of hmask byte r,
                 // minus 4; stored + 128
      for (int g = 0; g < 2; ++g)
        for (int j = 0; j < 4; ++j)
          for (int r = 0; r < 32; ++r)
            u[128 * g + 32 * j + r] = static_cast<uint8_t>(((b[32 + 32 * g + r] >> (2 * j)) & 3) +
                                                           (((b[r] >> (4 * g + j)) & 1) << 2) + 124);
      return;
    case kQ4_K:
      nibbles(b + 16, 128, 32, u);
      return;
    case kQ5_K:  // bit p of high byte r is value 32 p + r's fifth bit
      nibbles(b + 48, 128, 32, u);
      for (int p = 0; p < 8; ++p)
        for (int r = 0; r < 32; ++r) u[32 * p + r] |= ((b[16 + r] >> p) & 1) << 4;
      return;
    case kIQ4_NL:  // the int8 level of each nibble, + 128
    case kIQ4_XS: {
      constexpr int8_t kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
      const int nq = kType == kIQ4_NL ? 16 : 128;
      nibbles(b + (kType == kIQ4_NL ? 2 : 8), nq, 16, u);
      for (int i = 0; i < 2 * nq; ++i) u[i] = static_cast<uint8_t>(kLevels[u[i]] + 128);
      return;
    }
    case kQ6_K:  // 2-bit field j of high byte 32 g + r is value 128 g + 32 j + r's bits 4-5
      nibbles(b, 128, 64, u);
      for (int g = 0; g < 2; ++g)
        for (int j = 0; j < 4; ++j)
          for (int r = 0; r < 32; ++r) {
            uint8_t& v = u[128 * g + 32 * j + r];
            v = static_cast<uint8_t>((v | ((b[128 + 32 * g + r] >> (2 * j)) & 3) << 4) + 96);
          }
      return;
  }
}

template <int kType>
void decode_all(const uint8_t* b, int64_t n, uint8_t* u) {
  int values = 0, bytes = 0;
  block_shape(kType, &values, &bytes);
  for (int64_t i = 0; i < n; ++i) decode_block<kType>(b + i * bytes, u + i * values);
}

}  // namespace

// decode_codes(type, blocks, u): the byte codes of whole blocks of a GGML type (pack.py's decoders' u).
extern "C" PyObject* fucina_py_decode_codes(PyObject*, PyObject* args) {
  PyObject *src, *dst;
  int type, values, bytes;
  if (!PyArg_ParseTuple(args, "iOO", &type, &src, &dst)) return nullptr;
  if (!block_shape(type, &values, &bytes)) {
    PyErr_Format(PyExc_ValueError, "decode_codes: GGML type %d is not one of the decoded types", type);
    return nullptr;
  }
  Buffers buf;
  if (!buf.get(src, false, 0, "the blocks")) return nullptr;
  if (buf.v[0].len % bytes) {
    PyErr_Format(PyExc_ValueError, "decode_codes: %zd bytes are not whole %d-byte blocks", buf.v[0].len, bytes);
    return nullptr;
  }
  const int64_t n = buf.v[0].len / bytes;
  if (!buf.get(dst, true, n * values, "the codes")) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  const uint8_t* b = static_cast<const uint8_t*>(buf.v[0].buf);
  uint8_t* u = static_cast<uint8_t*>(buf.v[1].buf);
  switch (type) {
    case kQ4_0: decode_all<kQ4_0>(b, n, u); break;
    case kQ4_1: decode_all<kQ4_1>(b, n, u); break;
    case kQ5_0: decode_all<kQ5_0>(b, n, u); break;
    case kQ5_1: decode_all<kQ5_1>(b, n, u); break;
    case kQ8_0: decode_all<kQ8_0>(b, n, u); break;
    case kQ2_K: decode_all<kQ2_K>(b, n, u); break;
    case kQ3_K: decode_all<kQ3_K>(b, n, u); break;
    case kQ4_K: decode_all<kQ4_K>(b, n, u); break;
    case kQ5_K: decode_all<kQ5_K>(b, n, u); break;
    case kQ6_K: decode_all<kQ6_K>(b, n, u); break;
    case kIQ4_NL: decode_all<kIQ4_NL>(b, n, u); break;
    case kIQ4_XS: decode_all<kIQ4_XS>(b, n, u); break;
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

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
