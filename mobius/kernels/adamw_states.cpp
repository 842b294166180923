// AdamW with bf16 or 8-bit moments over flat host buffers (train.optimizer_states: bf16 | int8): one pass that reads
// the fp32 master, the gradient (fp32, bf16 or fp16) and both moments and writes the master, the moments and the
// half-precision copy the GPUs load. The arithmetic of mobius/states.py's torch-op version, operation for operation
// (built with -ffp-contract=off: no fused multiply-adds), so that the two agree to the bit; the rules are described
// there. Built by mobius/kernels/__init__.py (g++ -O3 -march=native) and called through ctypes from several threads
// at once, which take tasks from one shared counter.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;       // elements per vector: GCC vector types, lowered to what the host has (no intrinsics)
constexpr int64_t BLOCK = 64;   // elements per int8 block (one scale per moment), = mobius.layout.ALIGN
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef _Float16 vhf __attribute__((vector_size(32)));
typedef uint8_t vb __attribute__((vector_size(16)));

struct Scalars {  // one step's float32 constants, in mobius/states.py's StepScalars order
  float factor, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bias2_sqrt, eps, decay;
};

template <class V>
inline V load(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <class V>
inline void store(void* p, V v) { std::memcpy(p, &v, sizeof v); }
inline vf as_f(vu u) { vf f; std::memcpy(&f, &u, sizeof f); return f; }
inline vu as_u(vf f) { vu u; std::memcpy(&u, &f, sizeof u); return u; }
inline vf splat(float x) { return vf{} + x; }

// widening 8 and 16-bit lanes to 32 bits: GCC 12 lowers __builtin_convertvector of these to scalar code, so an
// AVX-512 host gets the one instruction that does it
inline vu widen8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vu>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(__builtin_convertvector(load<vb>(p), vh), vu);
#endif
}

inline vu widen16(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vu>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  return __builtin_convertvector(load<vh>(p), vu);
#endif
}

inline vh narrow16(vu x) {  // the low 16 bits of each lane
#if defined(__AVX512F__)
  return reinterpret_cast<vh>(_mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(x)));
#else
  return __builtin_convertvector(x, vh);
#endif
}

// the half copy is written and not read again here (the GPU's upload reads it): where a vector's address allows, a
// streaming store, which skips reading the line first (2 of a bf16 rule's 24 bytes of traffic per element)
template <class V>
inline void store_out(void* p, V v) {
#if defined(__AVX__)
  static_assert(sizeof(V) == 32, "a half copy's vector is 32 bytes");
  if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
    __m256i x;
    std::memcpy(&x, &v, 32);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
    return;
  }
#endif
  store(p, v);
}

inline vf vsqrt(vf x) {
  vf out;
  for (int l = 0; l < LANES; ++l) out[l] = std::sqrt(x[l]);
  return out;
}

// ---- dtypes: LANES elements to and from fp32 -------------------------------------------------------------------
struct F32 {
  using T = float;
  static vf get(const T* p) { return load<vf>(p); }
  static void put(T* p, vf x) { store(p, x); }
};
struct BF16 {
  using T = uint16_t;
  static vf get(const T* p) { return as_f(widen16(p) << 16); }
  static void put(T* p, vf x) {  // round to nearest even, NaN to 0x7FC0: torch's float -> bfloat16
    vu u = as_u(x);
    vu r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    r = x != x ? vu{} + 0x7FC0u : r;
    store_out(p, narrow16(r));
  }
};
struct F16 {
  using T = _Float16;
  static vf get(const T* p) { return __builtin_convertvector(load<vhf>(p), vf); }
  static void put(T* p, vf x) { store_out(p, __builtin_convertvector(x, vhf)); }
};
struct NoHalf {
  using T = void;
  static void put(T*, vf) {}
};

template <class T>
inline T* at(T* p, int64_t i) {  // p + i, and no half copy (void) stays none
  if constexpr (std::is_void_v<T>) return p;
  else return p + i;
}

// ---- AdamW of LANES elements from fp32 moments: the new master, m and v ------------------------------------------
struct Step {
  vf p, m, v;
};

#define INLINE inline __attribute__((always_inline))

template <bool DECAY>
INLINE Step adamw(const Scalars& k, vf p, vf g, vf m, vf v) {
  g = g * k.factor;
  if constexpr (DECAY) p = p * k.decay;
  m = m * k.beta1 + g * k.one_minus_beta1;
  v = v * k.beta2 + (g * g) * k.one_minus_beta2;
  vf d = vsqrt(v) * k.inv_bias2_sqrt + k.eps;
  p = p - (m / d) * k.step_size;
  return {p, m, v};
}

// ---- bf16: both moments in bfloat16, stochastically rounded ------------------------------------------------------
inline vu mix(vu pos, uint32_t seed) {  // lowbias32 of each element's position in its parameter and the step's seed
  vu x = (pos * 0x9E3779B1u) ^ seed;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline vh round_bf16(vf x, vu random16) {  // add 16 random bits below bf16's last, keep the top 16 bits
  return narrow16((as_u(x) + random16) >> 16);
}

template <class G, class H, bool DECAY>
INLINE void bf16_lanes(const Scalars& k, float* master, const typename G::T* grad, typename H::T* half, uint16_t* m,
                       uint16_t* v, vu pos, uint32_t seed) {
  Step s = adamw<DECAY>(k, load<vf>(master), G::get(grad), BF16::get(m), BF16::get(v));
  store(master, s.p);
  H::put(half, s.p);
  vu r = mix(pos, seed);
  store(m, round_bf16(s.m, r >> 16));
  store(v, round_bf16(s.v, r & 0xFFFFu));
}

// ---- int8: float8 codes (m: e4m3fn, v: e5m2) of each block's values over its scale ----------------------------------
#if defined(__AVX512F__)
// float8 codes as fp16 bits (e5m2 is an fp16's top byte; e4m3fn's bits shifted by 7 are an fp16 of 1/256 its value,
// subnormals included), widened to fp32 by one instruction: exact
INLINE vf e4m3_value(const uint8_t* codes) {  // float8_e4m3fn -> fp32 (exact)
  __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7));
  return reinterpret_cast<vf>(_mm512_cvtph_ps(h)) * 256.0f;
}
#else
INLINE vf e4m3_value(const uint8_t* codes) {  // float8_e4m3fn -> fp32 (exact)
  vu c = widen8(codes), sign = (c & 0x80u) << 24, e = c & 0x78u;
  vf normal = as_f(sign | (((c & 0x7Fu) + (120u << 3)) << 20));
  vf sub = as_f(as_u(__builtin_convertvector(c & 7u, vf) * (1.0f / 512.0f)) | sign);
  return e == 0u ? sub : normal;
}
#endif

INLINE vb e4m3_code(vf x) {  // fp32 (|x| <= 448) -> float8_e4m3fn, round to nearest even: torch's conversion
  vu bits = as_u(x), sign = bits & 0x80000000u;
  bits ^= sign;
  vu sub = as_u(as_f(bits) + as_f(vu{} + (141u << 23))) - (141u << 23);
  vu normal = (bits + ((uint32_t(7 - 127) << 23) + 0x7FFFFu) + ((bits >> 20) & 1u)) >> 20;
  vu r = bits < (121u << 23) ? sub : normal;
  return __builtin_convertvector((r & 0xFFu) | (sign >> 24), vb);
}

INLINE vf e5m2_value(const uint8_t* codes) {  // float8_e5m2 -> fp32 (exact)
#if defined(__AVX512F__)
  __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_slli_epi16(c, 8)));
#else
  vu c = widen8(codes);
  vf normal = as_f((c + (112u << 2)) << 21);
  vf sub = __builtin_convertvector(c, vf) * (1.0f / 65536.0f);
  return c < 4u ? sub : normal;
#endif
}

INLINE vb e5m2_code(vf x) {  // fp32 (0 <= x <= 57344) -> float8_e5m2, round to nearest even: torch's conversion
  vu bits = as_u(x);
  vu sub = as_u(x + as_f(vu{} + (134u << 23))) - (134u << 23);
  vu normal = (bits + ((uint32_t(15 - 127) << 23) + 0xFFFFFu) + ((bits >> 21) & 1u)) >> 21;
  vu r = bits < (113u << 23) ? sub : normal;
  return __builtin_convertvector(r & 0xFFu, vb);
}

constexpr float E4M3_MAX = 448.0f, E5M2_MAX = 57344.0f;
constexpr int VECS = BLOCK / LANES;

INLINE float absmax(const vf* x) {  // the largest magnitude of a block (exact in any order)
  vf acc = vf{};
  for (int q = 0; q < VECS; ++q) {
    vf a = x[q] < 0.0f ? -x[q] : x[q];
    acc = acc > a ? acc : a;
  }
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(acc));
#else
  float out = 0.0f;
  for (int l = 0; l < LANES; ++l) out = out > acc[l] ? out : acc[l];
  return out;
#endif
}

constexpr int64_t CHUNK = 16 * BLOCK;  // elements updated in one pass before their blocks are encoded (8 KiB)

// blocks [0, n) of a chunk (n a multiple of BLOCK, at most CHUNK): decode, AdamW, then each block's new scales and
// codes (a shorter last block of a run comes in padded with zeros)
template <class G, class H, bool DECAY>
INLINE void int8_chunk(const Scalars& k, float* master, const typename G::T* grad, typename H::T* half, uint8_t* m,
                       uint8_t* v, float* m_scale, float* v_scale, int64_t n) {
  alignas(64) vf nm[CHUNK / LANES], nv[CHUNK / LANES];
  for (int64_t q = 0; q < n / LANES; ++q) {
    int64_t i = q * LANES, blk = i / BLOCK;
    Step s = adamw<DECAY>(k, load<vf>(master + i), G::get(grad + i), e4m3_value(m + i) * m_scale[blk],
                          e5m2_value(v + i) * v_scale[blk]);
    store(master + i, s.p);
    H::put(at(half, i), s.p);
    nm[q] = s.m;
    nv[q] = s.v;
  }
  for (int64_t blk = 0; blk < n / BLOCK; ++blk) {
    float sm = absmax(nm + blk * VECS) / E4M3_MAX, sv = absmax(nv + blk * VECS) / E5M2_MAX;  // (v >= 0)
    m_scale[blk] = sm;
    v_scale[blk] = sv;
    float im = sm > 0.0f ? 1.0f / sm : 0.0f, iv = sv > 0.0f ? 1.0f / sv : 0.0f;
    for (int q = 0; q < VECS; ++q) {
      store(m + blk * BLOCK + q * LANES, e4m3_code(nm[blk * VECS + q] * im));
      store(v + blk * BLOCK + q * LANES, e5m2_code(nv[blk * VECS + q] * iv));
    }
  }
}

// ---- tasks: [lo, hi) of the flat buffers, the position of lo in its parameter, whether it takes weight decay -------
struct Call {
  int rule;  // 1: bf16, 2: int8
  Scalars k;
  float* master;
  const void* grad;
  void* half;
  void* m;
  void* v;
  float* m_scale;
  float* v_scale;
  const int64_t* tasks;  // [ntasks, 4]
  int64_t ntasks;
  uint32_t seed;
};

template <class G, class H, bool DECAY>
void bf16_task(const Call& c, int64_t lo, int64_t hi, uint32_t pos) {
  using GT = typename G::T;
  using HT = typename H::T;
  const GT* grad = static_cast<const GT*>(c.grad);
  HT* half = static_cast<HT*>(c.half);
  uint16_t *m = static_cast<uint16_t*>(c.m), *v = static_cast<uint16_t*>(c.v);
  vu iota;
  for (int l = 0; l < LANES; ++l) iota[l] = uint32_t(l);
  int64_t i = lo;
  for (; i + LANES <= hi; i += LANES)
    bf16_lanes<G, H, DECAY>(c.k, c.master + i, grad + i, at(half, i), m + i, v + i, iota + (pos + uint32_t(i - lo)),
                            c.seed);
  if (i < hi) {  // the last elements, through a padded copy
    int64_t n = hi - i;
    alignas(64) float p[LANES] = {0};
    alignas(64) GT g[LANES] = {};
    alignas(64) uint16_t mm[LANES] = {0}, vv[LANES] = {0};
    alignas(64) std::conditional_t<std::is_void_v<HT>, char, HT> h[LANES];
    std::memcpy(p, c.master + i, n * 4);
    std::memcpy(g, grad + i, n * sizeof(GT));
    std::memcpy(mm, m + i, n * 2);
    std::memcpy(vv, v + i, n * 2);
    bf16_lanes<G, H, DECAY>(c.k, p, g, reinterpret_cast<HT*>(h), mm, vv, iota + (pos + uint32_t(i - lo)), c.seed);
    std::memcpy(c.master + i, p, n * 4);
    if constexpr (!std::is_void_v<HT>) std::memcpy(half + i, h, n * sizeof(HT));
    std::memcpy(m + i, mm, n * 2);
    std::memcpy(v + i, vv, n * 2);
  }
}

template <class G, class H, bool DECAY>
void int8_task(const Call& c, int64_t lo, int64_t hi) {  // lo is a multiple of BLOCK
  using GT = typename G::T;
  using HT = typename H::T;
  const GT* grad = static_cast<const GT*>(c.grad);
  HT* half = static_cast<HT*>(c.half);
  uint8_t *m = static_cast<uint8_t*>(c.m), *v = static_cast<uint8_t*>(c.v);
  int64_t b = lo + (hi - lo) / BLOCK * BLOCK;  // the whole blocks end here
  for (int64_t a = lo; a < b; a += CHUNK)
    int8_chunk<G, H, DECAY>(c.k, c.master + a, grad + a, at(half, a), m + a, v + a, c.m_scale + a / BLOCK,
                            c.v_scale + a / BLOCK, std::min(CHUNK, b - a));
  if (b < hi) {  // a block cut short by the end of its run: zeros in its place past the end
    int64_t n = hi - b;
    alignas(64) float p[BLOCK] = {0};
    alignas(64) GT g[BLOCK] = {};
    alignas(64) uint8_t mm[BLOCK] = {0}, vv[BLOCK] = {0};
    alignas(64) std::conditional_t<std::is_void_v<HT>, char, HT> h[BLOCK];
    std::memcpy(p, c.master + b, n * 4);
    std::memcpy(g, grad + b, n * sizeof(GT));
    std::memcpy(mm, m + b, n);
    std::memcpy(vv, v + b, n);
    int8_chunk<G, H, DECAY>(c.k, p, g, reinterpret_cast<HT*>(h), mm, vv, c.m_scale + b / BLOCK,
                            c.v_scale + b / BLOCK, BLOCK);
    std::memcpy(c.master + b, p, n * 4);
    if constexpr (!std::is_void_v<HT>) std::memcpy(half + b, h, n * sizeof(HT));
    std::memcpy(m + b, mm, n);
    std::memcpy(v + b, vv, n);
  }
}

template <class G, class H>
void run(const Call& c, int64_t* next) {
  for (int64_t t; (t = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < c.ntasks;) {
    const int64_t* task = c.tasks + 4 * t;
    bool decay = task[3] != 0;
    if (c.rule == 1)
      (decay ? bf16_task<G, H, true> : bf16_task<G, H, false>)(c, task[0], task[1], uint32_t(task[2]));
    else
      (decay ? int8_task<G, H, true> : int8_task<G, H, false>)(c, task[0], task[1]);
  }
}

template <class G>
void run_half(const Call& c, int half_dtype, int64_t* next) {
  if (half_dtype == 0) run<G, F32>(c, next);
  else if (half_dtype == 1) run<G, BF16>(c, next);
  else if (half_dtype == 2) run<G, F16>(c, next);
  else run<G, NoHalf>(c, next);
}

}  // namespace

// One worker's share of a step: tasks taken from *next (shared by every thread of the step) until none is left.
// dtypes: 0 fp32, 1 bf16, 2 fp16 (half_dtype: the compute copy's, -1 for none). Returns 0, or -1 for an unknown rule
// or dtype.
extern "C" int mobius_adamw_states(int rule, int grad_dtype, int half_dtype, int64_t* next, const float* scalars,
                                   float* master, const void* grad, void* half, void* m, void* v, float* m_scale,
                                   float* v_scale, const int64_t* tasks, int64_t ntasks, uint32_t seed) {
  if ((rule != 1 && rule != 2) || grad_dtype < 0 || grad_dtype > 2 || half_dtype < -1 || half_dtype > 2) return -1;
  Call c{rule, {}, master, grad, half, m, v, m_scale, v_scale, tasks, ntasks, seed};
  std::memcpy(&c.k, scalars, sizeof c.k);
  if (grad_dtype == 0) run_half<F32>(c, half_dtype, next);
  else if (grad_dtype == 1) run_half<BF16>(c, half_dtype, next);
  else run_half<F16>(c, half_dtype, next);
#if defined(__AVX__)
  _mm_sfence();  // the streaming stores reach memory before whoever reads the half copy next
#endif
  return 0;
}
