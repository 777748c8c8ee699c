/* KIVI dequantization of one precision tier straight into an attention view, on the CPU.
 *
 * kvsieve.native.dequantize builds this file on first use and calls it through ctypes; the Python reference is
 * kvsieve.cache.quantized_tier.QuantizedTier.dequantized (its PyTorch path), which this computes bit for bit:
 *
 *   keys   (per channel, KIVI Sec. 3.2):  k[t, c] = minimum[g, c] + code[t, c] * step[g, c]
 *   values (per token,   KIVI Sec. 3.3):  v[t, c] = minimum[t, c / vg] + code[t, c] * step[t, c / vg]
 *
 * in float32, then rounded to the view's dtype (round to nearest even, as torch's copy rounds). A code is below
 * 2^8 and a step is float16-exact, so code * step is exact in float32 and the sum is rounded once: fused or not,
 * the result is the PyTorch path's. Steps and minimums are float16; codes are packed 8 / bits to a byte, low bits
 * first (kvsieve.ops.quantize.pack).
 *
 * With AVX2, FMA and F16C (the build's -march=native) rows of whole 8-channel blocks take an explicit vector loop
 * (codes unpacked by variable shifts, one fused multiply-add: exact for the reason above); other rows, and other
 * CPUs, take the plain loop. One thread: two threads (pthreads) made a batch-8 decoding step slower (1.66x instead of 1.44x an evict-only
 * step), competing with torch's OpenMP workers, which spin between parallel regions.
 *
 * Group i of the gathered order (index[i], or i without an index) is written to the view's segment i / most
 * (batch item = segment / heads, KV head = segment % heads) at slots (i % most) * group ... + group - 1.
 */
#include <stdint.h>
#include <string.h>

#define KVSIEVE_MAX_DIM 1024
#define KVSIEVE_ABI 1

enum { OUT_FLOAT32 = 0, OUT_BFLOAT16 = 1, OUT_FLOAT16 = 2 };

typedef struct {
    int bits, group, dim, value_group, heads, out_kind;
    int64_t most, begin, end; /* the groups [begin, end) of the gathered order */
    const int64_t *index;
    const uint8_t *key_codes, *value_codes;
    const uint16_t *key_params, *value_params;
    char *out_keys, *out_values;
    int64_t stride_batch, stride_head, stride_slot; /* in elements of the view */
    const float *table;                           /* 256 x (8 / bits) codes of each byte, for 2 and 4 bits */
} Job;

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

static inline float half_to_float(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline uint16_t float_to_bfloat16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
}

static inline uint16_t float_to_half(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}

static inline void store_row(const float *row, int dim, char *dst, int out_kind) {
    if (out_kind == OUT_FLOAT32) {
        memcpy(dst, row, (size_t)dim * 4);
        return;
    }
    uint16_t *out = (uint16_t *)dst;
    if (out_kind == OUT_BFLOAT16)
        for (int c = 0; c < dim; ++c) out[c] = float_to_bfloat16(row[c]);
    else
        for (int c = 0; c < dim; ++c) out[c] = float_to_half(row[c]);
}

/* The codes of one packed row, as floats (at least dim of them). */
static inline void unpack_row(const uint8_t *packed, int width, int bits, const float *table, float *codes) {
    if (bits == 2)
        for (int b = 0; b < width; ++b) memcpy(codes + 4 * b, table + 4 * packed[b], 16);
    else if (bits == 4)
        for (int b = 0; b < width; ++b) memcpy(codes + 2 * b, table + 2 * packed[b], 8);
    else
        for (int b = 0; b < width; ++b) codes[b] = (float)packed[b];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVSIEVE_VECTOR 1

/* The codes of channels c ... c + 7 of a packed row (c a multiple of 8), as float lanes. */
static inline __m256 codes8(const uint8_t *packed, int c, int bits) {
    __m256i lanes;
    if (bits == 2) {
        uint16_t word;
        memcpy(&word, packed + c / 4, 2);
        lanes = _mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        lanes = _mm256_and_si256(lanes, _mm256_set1_epi32(3));
    } else if (bits == 4) {
        uint32_t word;
        memcpy(&word, packed + c / 2, 4);
        lanes = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        lanes = _mm256_and_si256(lanes, _mm256_set1_epi32(15));
    } else {
        lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(packed + c)));
    }
    return _mm256_cvtepi32_ps(lanes);
}

/* Eight floats rounded to the view's dtype (store_row's rounding) and stored at dst. */
static inline void store8(__m256 x, char *dst, int out_kind) {
    if (out_kind == OUT_FLOAT32) {
        _mm256_storeu_ps((float *)dst, x);
    } else if (out_kind == OUT_FLOAT16) {
        _mm_storeu_si128((__m128i *)dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        const __m256i u = _mm256_castps_si256(x);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
        const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
        const __m256i halves = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(halves));
    }
}

/* run()'s loop, eight channels at a time (dim and value_group multiples of 8). */
static void run_vector(const Job *job) {
    const int dim = job->dim, group = job->group, bits = job->bits, width = (dim * bits + 7) / 8;
    const int value_groups = dim / job->value_group, value_group = job->value_group, out_kind = job->out_kind;
    const int64_t esize = out_kind == OUT_FLOAT32 ? 4 : 2;
    float step[KVSIEVE_MAX_DIM], minimum[KVSIEVE_MAX_DIM];
    for (int64_t i = job->begin; i < job->end; ++i) {
        const int64_t g = job->index ? job->index[i] : i;
        const int64_t segment = i / job->most, first_slot = (i % job->most) * group;
        const int64_t base = (segment / job->heads) * job->stride_batch + (segment % job->heads) * job->stride_head;
        const uint16_t *key_params = job->key_params + g * 2 * dim;
        for (int c = 0; c < dim; ++c) {
            step[c] = half_to_float(key_params[c]);
            minimum[c] = half_to_float(key_params[dim + c]);
        }
        for (int t = 0; t < group; ++t) {
            const int64_t slot = g * group + t;
            const int64_t offset = (base + (first_slot + t) * job->stride_slot) * esize;
            const uint8_t *key_codes = job->key_codes + slot * width, *value_codes = job->value_codes + slot * width;
            char *keys = job->out_keys + offset, *values = job->out_values + offset;
            for (int c = 0; c < dim; c += 8) {
                const __m256 x = _mm256_fmadd_ps(codes8(key_codes, c, bits), _mm256_loadu_ps(step + c),
                                                 _mm256_loadu_ps(minimum + c));
                store8(x, keys + c * esize, out_kind);
            }
            const uint16_t *value_params = job->value_params + slot * 2 * value_groups;
            for (int v = 0; v < value_groups; ++v) {
                const __m256 s = _mm256_set1_ps(half_to_float(value_params[v]));
                const __m256 m = _mm256_set1_ps(half_to_float(value_params[value_groups + v]));
                for (int c = v * value_group; c < (v + 1) * value_group; c += 8)
                    store8(_mm256_fmadd_ps(codes8(value_codes, c, bits), s, m), values + c * esize, out_kind);
            }
        }
    }
}
#endif

static void run(const Job *job) {
    const int dim = job->dim, group = job->group, width = (dim * job->bits + 7) / 8;
    const int value_groups = dim / job->value_group;
    const int64_t esize = job->out_kind == OUT_FLOAT32 ? 4 : 2;
    float step[KVSIEVE_MAX_DIM], minimum[KVSIEVE_MAX_DIM], row[KVSIEVE_MAX_DIM], codes[KVSIEVE_MAX_DIM + 8];
    for (int64_t i = job->begin; i < job->end; ++i) {
        const int64_t g = job->index ? job->index[i] : i;
        const int64_t segment = i / job->most, first_slot = (i % job->most) * group;
        const int64_t base = (segment / job->heads) * job->stride_batch + (segment % job->heads) * job->stride_head;
        const uint16_t *key_params = job->key_params + g * 2 * dim;
        for (int c = 0; c < dim; ++c) {
            step[c] = half_to_float(key_params[c]);
            minimum[c] = half_to_float(key_params[dim + c]);
        }
        for (int t = 0; t < group; ++t) {
            const int64_t slot = g * group + t;
            const int64_t offset = (base + (first_slot + t) * job->stride_slot) * esize;
            unpack_row(job->key_codes + slot * width, width, job->bits, job->table, codes);
            for (int c = 0; c < dim; ++c) row[c] = minimum[c] + codes[c] * step[c];
            store_row(row, dim, job->out_keys + offset, job->out_kind);
            unpack_row(job->value_codes + slot * width, width, job->bits, job->table, codes);
            const uint16_t *value_params = job->value_params + slot * 2 * value_groups;
            for (int v = 0; v < value_groups; ++v) {
                const float s = half_to_float(value_params[v]), m = half_to_float(value_params[value_groups + v]);
                for (int c = v * job->value_group; c < (v + 1) * job->value_group; ++c) row[c] = m + codes[c] * s;
            }
            store_row(row, dim, job->out_values + offset, job->out_kind);
        }
    }
}

/* Returns 0 on success, 1 for arguments this kernel does not take (the caller keeps its PyTorch path). */
int kvsieve_dequantize(int bits, int group, int dim, int value_group, int64_t groups, int64_t most,
                       const int64_t *index, const uint8_t *key_codes, const uint16_t *key_params,
                       const uint8_t *value_codes, const uint16_t *value_params, int heads, void *out_keys,
                       void *out_values, int out_kind, int64_t stride_batch, int64_t stride_head,
                       int64_t stride_slot) {
    if ((bits != 2 && bits != 4 && bits != 8) || dim < 1 || dim > KVSIEVE_MAX_DIM || group < 1 ||
        value_group < 1 || dim % value_group || most < 1 || heads < 1 || out_kind < 0 || out_kind > 2)
        return 1;
    float table[256 * 4];
    if (bits < 8) {
        const int per_byte = 8 / bits, mask = (1 << bits) - 1;
        for (int byte = 0; byte < 256; ++byte)
            for (int k = 0; k < per_byte; ++k) table[byte * per_byte + k] = (float)((byte >> (k * bits)) & mask);
    }
    Job job = {bits, group, dim, value_group, heads, out_kind, most, 0, groups, index, key_codes, value_codes,
               key_params, value_params, (char *)out_keys, (char *)out_values, stride_batch, stride_head,
               stride_slot, table};
#ifdef KVSIEVE_VECTOR
    if (dim % 8 == 0 && value_group % 8 == 0) {
        run_vector(&job);
        return 0;
    }
#endif
    run(&job);
    return 0;
}
