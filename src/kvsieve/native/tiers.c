/* Reading kvsieve's precision tiers on the CPU: KIVI dequantization of one tier straight into an attention view
 * (kvsieve_dequantize, below), and a decoding query's attention over the packed tiers and the full-precision
 * entries without any dequantized view (kvsieve_attend_dense / kvsieve_attend_tier, further down).
 *
 * kvsieve.native.build builds this file on first use; kvsieve.native.dequantize and kvsieve.native.tiered_attention
 * call it through ctypes. The Python reference of the dequantization is
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* A group's key steps and minimums (params: 2 x dim float16) as floats. */
static inline void key_floats(const uint16_t *params, int dim, float *step, float *minimum) {
    for (int c = 0; c < dim; ++c) {
        step[c] = half_to_float(params[c]);
        minimum[c] = half_to_float(params[dim + c]);
    }
}

/* Group i of the gathered order: its index in the tier (returned), its segment's offset in the view (base, in
 * elements) and its first slot there, and its key steps and minimums. */
static inline int64_t group_at(const Job *job, int64_t i, int64_t *base, int64_t *first_slot, float *step,
                               float *minimum) {
    const int64_t g = job->index ? job->index[i] : i;
    const int64_t segment = i / job->most;
    *first_slot = (i % job->most) * job->group;
    *base = (segment / job->heads) * job->stride_batch + (segment % job->heads) * job->stride_head;
    key_floats(job->key_params + g * 2 * job->dim, job->dim, step, minimum);
    return g;
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

/* One slot's key and value rows, eight channels at a time (dim and value_group multiples of 8). */
static inline void slot_vector(const Job *job, int64_t slot, int64_t offset, const float *step, const float *minimum) {
    const int dim = job->dim, bits = job->bits, width = (dim * bits + 7) / 8, out_kind = job->out_kind;
    const int value_groups = dim / job->value_group, value_group = job->value_group;
    const int64_t esize = out_kind == OUT_FLOAT32 ? 4 : 2;
    const uint8_t *key_codes = job->key_codes + slot * width, *value_codes = job->value_codes + slot * width;
    char *keys = job->out_keys + offset * esize, *values = job->out_values + offset * esize;
    for (int c = 0; c < dim; c += 8) {
        const __m256 x = _mm256_fmadd_ps(codes8(key_codes, c, bits), _mm256_loadu_ps(step + c),
                                         _mm256_loadu_ps(minimum + c));
        store8(x, keys + c * esize, out_kind);
    }
    const uint16_t *value_params = job->value_params + slot * 2 * value_groups;
    for (int v = 0; v < value_groups; ++v) {
        const __m256 sc = _mm256_set1_ps(half_to_float(value_params[v]));
        const __m256 mn = _mm256_set1_ps(half_to_float(value_params[value_groups + v]));
        for (int c = v * value_group; c < (v + 1) * value_group; c += 8)
            store8(_mm256_fmadd_ps(codes8(value_codes, c, bits), sc, mn), values + c * esize, out_kind);
    }
}
#endif

/* One slot's key and value rows, channel by channel (any dim and value_group). */
static inline void slot_scalar(const Job *job, int64_t slot, int64_t offset, const float *step,
                               const float *minimum) {
    const int dim = job->dim, width = (dim * job->bits + 7) / 8, value_groups = dim / job->value_group;
    const int64_t esize = job->out_kind == OUT_FLOAT32 ? 4 : 2;
    float row[KVSIEVE_MAX_DIM], codes[KVSIEVE_MAX_DIM + 8];
    unpack_row(job->key_codes + slot * width, width, job->bits, job->table, codes);
    for (int c = 0; c < dim; ++c) row[c] = minimum[c] + codes[c] * step[c];
    store_row(row, dim, job->out_keys + offset * esize, job->out_kind);
    unpack_row(job->value_codes + slot * width, width, job->bits, job->table, codes);
    const uint16_t *value_params = job->value_params + slot * 2 * value_groups;
    for (int v = 0; v < value_groups; ++v) {
        const float sc = half_to_float(value_params[v]), mn = half_to_float(value_params[value_groups + v]);
        for (int c = v * job->value_group; c < (v + 1) * job->value_group; ++c) row[c] = mn + codes[c] * sc;
    }
    store_row(row, dim, job->out_values + offset * esize, job->out_kind);
}

/* Every group of the job, slot by slot: the vector rows where they apply (vector), else the plain ones. */
static void run(const Job *job, int vector) {
    float step[KVSIEVE_MAX_DIM], minimum[KVSIEVE_MAX_DIM];
    for (int64_t i = job->begin; i < job->end; ++i) {
        int64_t base, first_slot;
        const int64_t g = group_at(job, i, &base, &first_slot, step, minimum);
        for (int t = 0; t < job->group; ++t) {
            const int64_t slot = g * job->group + t, offset = base + (first_slot + t) * job->stride_slot;
#ifdef KVSIEVE_VECTOR
            if (vector) {
                slot_vector(job, slot, offset, step, minimum);
                continue;
            }
#endif
            (void)vector;
            slot_scalar(job, slot, offset, step, minimum);
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
    int vector = 0;
#ifdef KVSIEVE_VECTOR
    vector = dim % 8 == 0 && value_group % 8 == 0;
#endif
    run(&job, vector);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * KIVI quantization of new groups (kvsieve_quantize; the Python reference is QuantizedTier._quantize_keys and
 * _quantize_values with kvsieve.ops.quantize.asymmetric_codes and pack, computed here bit for bit): per group and
 * channel for keys over the group's valid slots, per token and value group for values; a bound is rounded to float16,
 * step = float16((high - low) / levels), code = clamp(round_half_even((x - low) / step), 0, levels) (step 1 where it
 * is 0), an invalid key slot's codes 0.
 * ------------------------------------------------------------------------------------------------------------- */
static inline float half_round(float f) { return half_to_float(float_to_half(f)); }

/* Codes of n values x[i * step_x] against (low, high) bounds, written unpacked to codes[i * step_c]. */
static inline void code_values(const float *x, int64_t stride_x, int n, float low, float high, int levels,
                               uint8_t *codes, int64_t stride_c, float *step_out, float *low_out) {
    const float low16 = half_round(low);
    float high16 = half_round(high);
    if (high16 < low16) high16 = low16;
    const float step = half_round((high16 - low16) / (float)levels);
    const float safe = step > 0.0f ? step : 1.0f;
    for (int i = 0; i < n; ++i) {
        float q = nearbyintf((x[i * stride_x] - low16) / safe);
        q = q < 0.0f ? 0.0f : (q > (float)levels ? (float)levels : q);
        codes[i * stride_c] = (uint8_t)q;
    }
    *step_out = step;
    *low_out = low16;
}

static inline void pack_row(const uint8_t *codes, int dim, int bits, uint8_t *out) {
    const int per_byte = 8 / bits, width = (dim * bits + 7) / 8;
    for (int b = 0; b < width; ++b) {
        unsigned byte = 0;
        for (int k = 0; k < per_byte; ++k) {
            const int c = b * per_byte + k;
            if (c < dim) byte |= (unsigned)codes[c] << (k * bits);
        }
        out[b] = (uint8_t)byte;
    }
}

/* keys, values: (groups * group, dim) float32; valid: (groups * group) bool. Writes key_codes (groups, group,
 * width), key_params (groups, 2, dim) float16, value_codes (groups * group, width), value_params
 * (groups * group, 2, dim / value_group) float16. Returns 1 for arguments it does not take. */
int kvsieve_quantize(int bits, int group, int dim, int value_group, int64_t groups, const float *keys,
                     const float *values, const uint8_t *valid, uint8_t *key_codes, uint16_t *key_params,
                     uint8_t *value_codes, uint16_t *value_params) {
    if ((bits != 2 && bits != 4 && bits != 8) || dim < 1 || dim > KVSIEVE_MAX_DIM || group < 1 || group > 1024 ||
        value_group < 1 || dim % value_group)
        return 1;
    const int levels = (1 << bits) - 1, width = (dim * bits + 7) / 8, value_groups = dim / value_group;
    uint8_t *codes = malloc((size_t)group * (size_t)dim);
    if (!codes) return 1;
    for (int64_t g = 0; g < groups; ++g) {
        const float *k = keys + g * group * dim;
        const uint8_t *ok = valid + g * group;
        for (int c = 0; c < dim; ++c) {
            float low = INFINITY, high = -INFINITY;
            for (int t = 0; t < group; ++t) {
                if (!ok[t]) continue;
                const float x = k[t * dim + c];
                low = x < low ? x : low;
                high = x > high ? x : high;
            }
            float step, low16;
            code_values(k + c, dim, group, low, high, levels, codes + c, dim, &step, &low16);
            for (int t = 0; t < group; ++t)
                if (!ok[t]) codes[t * dim + c] = 0;
            key_params[g * 2 * dim + c] = float_to_half(step);
            key_params[g * 2 * dim + dim + c] = float_to_half(low16);
        }
        for (int t = 0; t < group; ++t) pack_row(codes + t * dim, dim, bits, key_codes + (g * group + t) * width);
    }
    for (int64_t r = 0; r < groups * group; ++r) {
        const float *v = values + r * dim;
        for (int vg = 0; vg < value_groups; ++vg) {
            float low = INFINITY, high = -INFINITY;
            for (int c = vg * value_group; c < (vg + 1) * value_group; ++c) {
                low = v[c] < low ? v[c] : low;
                high = v[c] > high ? v[c] : high;
            }
            float step, low16;
            code_values(v + vg * value_group, 1, value_group, low, high, levels, codes + vg * value_group, 1, &step,
                        &low16);
            value_params[r * 2 * value_groups + vg] = float_to_half(step);
            value_params[r * 2 * value_groups + value_groups + vg] = float_to_half(low16);
        }
        pack_row(codes, dim, bits, value_codes + r * width);
    }
    free(codes);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Decoding attention over a tiered store without a dequantized view (kvsieve.native.tiered_attention).
 *
 * One decoding query per query head; a KV head's q_per_kv query heads are rows (b * heads + h) * q_per_kv + g. The
 * full-precision part (kvsieve_attend_dense) and each tier (kvsieve_attend_tier) are folded into a running
 * softmax state per row, in float32: m (the largest logit so far), l (sum of exp(logit - m)) and acc (sum of
 * exp(logit - m) * value), so out = acc / l at the end, and the order of the parts does not matter beyond rounding.
 * Each part is attended segment by segment in two passes: the logits q.k * scaling of all its entries (a tier's
 * keys dequantized row by row as kvsieve_dequantize computes them), then exp(logit - max) and the weighted values.
 * An invalid entry (validity 0) has no weight. exp is a vector polynomial (Cephes' expf: ~1 ulp; 0 below -87.3).
 * Vector code only (AVX2, FMA, F16C): elsewhere these return 1 and the caller attends through its PyTorch path.
 * ------------------------------------------------------------------------------------------------------------- */
#define KVSIEVE_MAX_ROWS 16
/* Entries of a call from which its segments are shared among torch's OpenMP threads (a build with OpenMP). */
#define KVSIEVE_PARALLEL_FROM 4096

#ifdef KVSIEVE_VECTOR

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 exp8(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

/* Eight floats of a full-precision row (kind: OUT_FLOAT32, OUT_BFLOAT16 or OUT_FLOAT16). */
static inline __m256 load8(const char *p, int kind) {
    if (kind == OUT_FLOAT32) return _mm256_loadu_ps((const float *)p);
    const __m128i half = _mm_loadu_si128((const __m128i *)p);
    if (kind == OUT_FLOAT16) return _mm256_cvtph_ps(half);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* A segment's softmax part: logits[g * stride + e] of n entries (-inf: no weight) -> weights in place; returns
 * the segment's max per row in seg_max and the sum of weights in seg_sum. */
static void soften(float *logits, int rows, int64_t n, int64_t stride, float *seg_max, float *seg_sum) {
    for (int g = 0; g < rows; ++g) {
        float *x = logits + g * stride;
        float top = -INFINITY;
        for (int64_t e = 0; e < n; ++e) top = x[e] > top ? x[e] : top;
        seg_max[g] = top;
        __m256 total = _mm256_setzero_ps();
        const __m256 shift = _mm256_set1_ps(top == -INFINITY ? 0.0f : top);
        for (int64_t e = 0; e < stride; e += 8) {
            const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + e), shift));
            _mm256_storeu_ps(x + e, w);
            total = _mm256_add_ps(total, w);
        }
        seg_sum[g] = hsum8(total);
    }
}

/* Fold a segment's (seg_max, seg_sum, seg_acc) into the running state of its rows. */
static void fold(int rows, int dim, const float *seg_max, const float *seg_sum, const float *seg_acc, float *m,
                 float *l, float *acc) {
    for (int g = 0; g < rows; ++g) {
        if (seg_max[g] == -INFINITY) continue;
        const float top = m[g] > seg_max[g] ? m[g] : seg_max[g];
        const float old = m[g] == -INFINITY ? 0.0f : expf(m[g] - top), new = expf(seg_max[g] - top);
        l[g] = l[g] * old + seg_sum[g] * new;
        for (int c = 0; c < dim; ++c) acc[g * dim + c] = acc[g * dim + c] * old + seg_acc[g * dim + c] * new;
        m[g] = top;
    }
}
#endif

#ifdef KVSIEVE_VECTOR
/* Entries handled together in the logits and the weighted values: independent multiply-add chains, so the adds'
 * latency is hidden (one entry at a time was bound by it: ~3x slower). */
#define KVSIEVE_UNROLL 4

/* A block of 8 key (or value) channels of one entry, as floats: a full-precision row (kind) or a packed tier row
 * (codes * step + minimum). */
typedef struct {
    const char *base;   /* full precision: the part's first row; packed: the codes of slot 0 */
    int64_t row_bytes;  /* bytes from one entry to the next (full precision) or between slots (packed) */
    int kind, bits;     /* kind: OUT_* for full precision, -1 for packed codes of `bits` bits */
} Rows;

static inline __attribute__((always_inline)) __m256 block8(const Rows *r, int64_t at, int c, __m256 step,
                                                           __m256 minimum) {
    if (r->kind < 0) return _mm256_fmadd_ps(codes8((const uint8_t *)r->base + at * r->row_bytes, c, r->bits), step,
                                            minimum);
    const int64_t esize = r->kind == OUT_FLOAT32 ? 4 : 2;
    return load8(r->base + at * r->row_bytes + c * esize, r->kind);
}

/* logits[g * stride + e] = scaling * q_g . key(e) for the n entries e = entry[i] at rows slot[i] of r (slot[i] the
 * row's index in r: an entry of the part, or a tier slot); step/minimum: a packed group's per-channel parameters. */
static inline __attribute__((always_inline)) void logits_rows(const int rows, int dim, const float *q, const Rows *r,
                                                              const int64_t *slot, const int64_t *entry, int64_t n,
                                                              const float *step, const float *minimum,
                                                              float *logits, int64_t stride, float scaling) {
    int64_t i = 0;
    const __m256 zero = _mm256_setzero_ps();
    for (; i + KVSIEVE_UNROLL <= n; i += KVSIEVE_UNROLL) {
        __m256 dots[KVSIEVE_UNROLL][KVSIEVE_MAX_ROWS];
        for (int u = 0; u < KVSIEVE_UNROLL; ++u)
            for (int g = 0; g < rows; ++g) dots[u][g] = zero;
        for (int c = 0; c < dim; c += 8) {
            const __m256 st = step ? _mm256_loadu_ps(step + c) : zero, mn = minimum ? _mm256_loadu_ps(minimum + c) : zero;
            __m256 x[KVSIEVE_UNROLL];
            for (int u = 0; u < KVSIEVE_UNROLL; ++u) x[u] = block8(r, slot[i + u], c, st, mn);
            for (int g = 0; g < rows; ++g) {
                const __m256 qg = _mm256_loadu_ps(q + g * dim + c);
                for (int u = 0; u < KVSIEVE_UNROLL; ++u) dots[u][g] = _mm256_fmadd_ps(qg, x[u], dots[u][g]);
            }
        }
        for (int u = 0; u < KVSIEVE_UNROLL; ++u)
            for (int g = 0; g < rows; ++g) logits[g * stride + entry[i + u]] = hsum8(dots[u][g]) * scaling;
    }
    for (; i < n; ++i) {
        __m256 dots[KVSIEVE_MAX_ROWS];
        for (int g = 0; g < rows; ++g) dots[g] = zero;
        for (int c = 0; c < dim; c += 8) {
            const __m256 st = step ? _mm256_loadu_ps(step + c) : zero, mn = minimum ? _mm256_loadu_ps(minimum + c) : zero;
            const __m256 x = block8(r, slot[i], c, st, mn);
            for (int g = 0; g < rows; ++g) dots[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + c), x, dots[g]);
        }
        for (int g = 0; g < rows; ++g) logits[g * stride + entry[i]] = hsum8(dots[g]) * scaling;
    }
}

/* seg_acc[g * dim + c ...] += sum over the n entries of weight(g, entry[i]) * value(slot[i]), block c of 8 channels;
 * value_floats (packed rows): each entry's value steps and minimums ([entry][vg], [entry][groups + vg]). */
static inline __attribute__((always_inline)) void values_rows(const int rows, int c, int value_group,
                                                              int value_groups, const Rows *r, const int64_t *slot,
                                                              const int64_t *entry, int64_t n,
                                                              const float *value_floats, const float *weights,
                                                              int64_t stride, float *seg_acc, int dim) {
    const int vg = c / value_group;
    __m256 sums[2][KVSIEVE_MAX_ROWS];
    for (int u = 0; u < 2; ++u)
        for (int g = 0; g < rows; ++g) sums[u][g] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i < n; ++i) {
        const int u = (int)(i & 1);
        const int64_t e = entry[i];
        __m256 st = _mm256_setzero_ps(), mn = st;
        if (value_floats) {
            st = _mm256_broadcast_ss(value_floats + e * 2 * value_groups + vg);
            mn = _mm256_broadcast_ss(value_floats + e * 2 * value_groups + value_groups + vg);
        }
        const __m256 x = block8(r, slot[i], c, st, mn);
        for (int g = 0; g < rows; ++g)
            sums[u][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(weights + g * stride + e), x, sums[u][g]);
    }
    for (int g = 0; g < rows; ++g) _mm256_storeu_ps(seg_acc + g * dim + c, _mm256_add_ps(sums[0][g], sums[1][g]));
}

#define KVSIEVE_BY_ROWS(call_with_rows)                                                                             \
    switch (rows) {                                                                                                 \
    case 1: call_with_rows(1); break;                                                                               \
    case 2: call_with_rows(2); break;                                                                               \
    case 3: call_with_rows(3); break;                                                                               \
    case 4: call_with_rows(4); break;                                                                               \
    default: call_with_rows(rows); break;                                                                           \
    }

/* The softmax part of n valid entries (logits -inf elsewhere), then their weighted values block by block. */
static void weigh(int rows, int dim, int value_group, int value_groups, const Rows *values, const int64_t *slot,
                  const int64_t *entry, int64_t n, const float *value_floats, float *logits, int64_t length,
                  int64_t stride, float *m, float *l, float *acc) {
    float seg_max[KVSIEVE_MAX_ROWS], seg_sum[KVSIEVE_MAX_ROWS], seg_acc[KVSIEVE_MAX_ROWS * 256];
    soften(logits, rows, length, stride, seg_max, seg_sum);
    for (int c = 0; c < dim; c += 8) {
#define KVSIEVE_VALUES(R) values_rows(R, c, value_group, value_groups, values, slot, entry, n, value_floats, logits, \
                                      stride, seg_acc, dim)
        KVSIEVE_BY_ROWS(KVSIEVE_VALUES)
#undef KVSIEVE_VALUES
    }
    fold(rows, dim, seg_max, seg_sum, seg_acc, m, l, acc);
}

/* logf(n) of the whole merge counts n < LOG_COUNTS (a count is a sum of whole token counts), filled when the library
 * is loaded, before any call: a lookup instead of a logf per entry and step (EMS's bias). */
#define LOG_COUNTS 4096
static float log_counts[LOG_COUNTS];

__attribute__((constructor)) static void fill_log_counts(void) {
    for (int n = 1; n < LOG_COUNTS; ++n) log_counts[n] = logf((float)n);
}

/* log(max(count, 1)), as logf computes it (NaN stays NaN, as in torch). */
static inline float log_count(float count) {
    if (count < 1.0f) return 0.0f; /* counts once */
    if (count < (float)LOG_COUNTS && (float)(int)count == count) return log_counts[(int)count];
    return logf(count); /* a fraction, past the table, or NaN */
}

/* n consecutive full-precision entries (rows key_base, value_base + e * row_bytes; ok: their validity or NULL), folded
 * into the state m, l, acc of the query rows q. bias: a value per entry added to every row's logit, or NULL; with
 * bias_counts, merge counts whose log(max(count, 1)) is added (EMS's bias, kvsieve.core.step.count_bias). */
static int attend_dense_rows(int rows, int dim, const float *q, float scaling, const char *key_base,
                             const char *value_base, int kind, int64_t row_bytes, int64_t length, const uint8_t *ok,
                             const float *bias, int bias_counts, float *probs, float *m, float *l, float *acc) {
    const int64_t stride = (length + 7) / 8 * 8;
    float *logits = malloc(sizeof(float) * (size_t)(rows * stride));
    int64_t *entry = malloc(sizeof(int64_t) * (size_t)length);
    if (!logits || !entry) {
        free(logits);
        free(entry);
        return 1;
    }
    int64_t n = 0;
    for (int64_t e = 0; e < length; ++e)
        if (!ok || ok[e]) entry[n++] = e;
    for (int64_t e = 0; e < rows * stride; ++e) logits[e] = -INFINITY;
    const Rows key_rows = {key_base, row_bytes, kind, 0};
    const Rows value_rows = {value_base, row_bytes, kind, 0};
#define KVSIEVE_LOGITS(R) logits_rows(R, dim, q, &key_rows, entry, entry, n, NULL, NULL, logits, stride, scaling)
    KVSIEVE_BY_ROWS(KVSIEVE_LOGITS)
#undef KVSIEVE_LOGITS
    if (bias)
        for (int64_t i = 0; i < n; ++i) {
            const float b = bias_counts ? log_count(bias[entry[i]]) : bias[entry[i]];
            for (int g = 0; g < rows; ++g) logits[g * stride + entry[i]] += b;
        }
    weigh(rows, dim, 8, dim / 8, &value_rows, entry, entry, n, NULL, logits, length, stride, m, l, acc);
    if (probs) /* from an empty state: l is this part's sum of weights, and a weight is exp(logit - max) */
        for (int g = 0; g < rows; ++g) {
            const float inverse = 1.0f / l[g];
            for (int64_t e = 0; e < length; ++e) probs[g * length + e] = logits[g * stride + e] * inverse;
        }
    free(logits);
    free(entry);
    return 0;
}

/* The full-precision part of one segment (batch item, KV head), folded into its rows' state m, l, acc. */
static int attend_dense_segment(int64_t s, int heads, int rows, int dim, const float *q, float scaling,
                                const char *keys, const char *values, int kind, int64_t stride_batch,
                                int64_t stride_head, int64_t stride_entry, int64_t length, const uint8_t *valid,
                                float *m, float *l, float *acc) {
    const int64_t esize = kind == OUT_FLOAT32 ? 4 : 2;
    const int64_t base = ((s / heads) * stride_batch + (s % heads) * stride_head) * esize;
    return attend_dense_rows(rows, dim, q, scaling, keys + base, values + base, kind, stride_entry * esize, length,
                             valid ? valid + s * length : NULL, NULL, 0, NULL, m, l, acc);
}

/* One tier's part of one segment, folded into its rows' state m, l, acc. */
static int attend_tier_segment(int64_t s, int bits, int group, int dim, int value_group, int64_t most,
                               const int64_t *index, const uint8_t *key_codes, const uint16_t *key_params,
                               const uint8_t *value_codes, const uint16_t *value_params, const uint8_t *valid,
                               int rows, const float *q, float scaling, float *m, float *l, float *acc) {
    const int64_t length = most * group, stride = (length + 7) / 8 * 8;
    const int width = (dim * bits + 7) / 8, value_groups = dim / value_group;
    float *logits = malloc(sizeof(float) * (size_t)(rows * stride));
    float *value_floats = malloc(sizeof(float) * (size_t)(length * 2 * value_groups));
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)(2 * length));
    if (!logits || !value_floats || !slot) {
        free(logits);
        free(value_floats);
        free(slot);
        return 1;
    }
    int64_t *entry = slot + length;
    float step[256], minimum[256];
    const uint8_t *ok = valid ? valid + s * length : NULL;
    for (int64_t e = 0; e < rows * stride; ++e) logits[e] = -INFINITY;
    const Rows key_rows = {(const char *)key_codes, width, -1, bits};
    const Rows value_rows = {(const char *)value_codes, width, -1, bits};
    int64_t n = 0;
    for (int64_t j = 0; j < most; ++j) {
        const int64_t gi = index ? index[s * most + j] : s * most + j;
        key_floats(key_params + gi * 2 * dim, dim, step, minimum);
        const uint16_t *vparams = value_params + gi * group * 2 * value_groups;
        for (int64_t k = 0; k < (int64_t)group * 2 * value_groups; ++k)
            value_floats[j * group * 2 * value_groups + k] = half_to_float(vparams[k]);
        const int64_t first = n;
        for (int t = 0; t < group; ++t) {
            const int64_t e = j * group + t;
            if (ok && !ok[e]) continue;
            slot[n] = gi * group + t;
            entry[n++] = e;
        }
#define KVSIEVE_LOGITS(R) logits_rows(R, dim, q, &key_rows, slot + first, entry + first, n - first, step, minimum, \
                                      logits, stride, scaling)
        KVSIEVE_BY_ROWS(KVSIEVE_LOGITS)
#undef KVSIEVE_LOGITS
    }
    weigh(rows, dim, value_group, value_groups, &value_rows, slot, entry, n, value_floats, logits, length, stride, m,
          l, acc);
    free(logits);
    free(value_floats);
    free(slot);
    return 0;
}
#endif

/* A tier as kvsieve.native.tiered_attention.PackedTier describes it: bits, group, value_group, slots per segment
 * ("most" groups of "group"), then the addresses of its group index (0: none), key codes, key params, value codes,
 * value params and slot validity (0: all valid). */
enum { T_BITS, T_GROUP, T_VALUE_GROUP, T_MOST, T_INDEX, T_KEY_CODES, T_KEY_PARAMS, T_VALUE_CODES, T_VALUE_PARAMS,
       T_VALID, T_FIELDS };

#ifdef KVSIEVE_VECTOR
static int tier_ok(const int64_t *t, int dim) {
    const int64_t bits = t[T_BITS], value_group = t[T_VALUE_GROUP];
    return (bits == 2 || bits == 4 || bits == 8) && value_group >= 8 && value_group % 8 == 0 && dim % value_group == 0
           && t[T_GROUP] >= 1 && t[T_MOST] >= 1;
}

/* Segment s's query rows as floats (q: rows x dim), and an empty softmax state m, l, acc for them. */
static void start_rows(int64_t s, int heads, int rows, int dim, const char *query, int query_kind, int64_t query_batch,
                       int64_t query_head, float *q, float *m, float *l, float *acc) {
    const int64_t qsize = query_kind == OUT_FLOAT32 ? 4 : 2;
    for (int g = 0; g < rows; ++g) {
        const char *row = query + ((s / heads) * query_batch + ((s % heads) * rows + g) * query_head) * qsize;
        for (int c = 0; c < dim; c += 8) _mm256_storeu_ps(q + g * dim + c, load8(row + c * qsize, query_kind));
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * dim));
}

/* Segment s's output rows out[s * rows + g] = acc / l, rounded to out_kind. */
static void finish_rows(int64_t s, int rows, int dim, const float *l, const float *acc, char *out, int out_kind) {
    const int64_t osize = out_kind == OUT_FLOAT32 ? 4 : 2;
    for (int g = 0; g < rows; ++g) {
        const __m256 inverse = _mm256_set1_ps(1.0f / l[g]);
        char *row = out + ((s * rows + g) * (int64_t)dim) * osize;
        for (int c = 0; c < dim; c += 8)
            store8(_mm256_mul_ps(_mm256_loadu_ps(acc + g * dim + c), inverse), row + c * osize, out_kind);
    }
}

/* One segment: its query rows as floats, the full-precision part, every tier, then out = acc / l rounded. */
static int attend_segment(int64_t s, int heads, int rows, int dim, const char *query, int query_kind,
                          int64_t query_batch, int64_t query_head, char *out, float scaling, const char *keys,
                          const char *values, int kind, int64_t stride_batch, int64_t stride_head,
                          int64_t stride_entry, int64_t length, const uint8_t *valid, int tiers,
                          const int64_t *descriptors) {
    float q[KVSIEVE_MAX_ROWS * 256], m[KVSIEVE_MAX_ROWS], l[KVSIEVE_MAX_ROWS], acc[KVSIEVE_MAX_ROWS * 256];
    start_rows(s, heads, rows, dim, query, query_kind, query_batch, query_head, q, m, l, acc);
    int failed = 0;
    if (length > 0)
        failed |= attend_dense_segment(s, heads, rows, dim, q, scaling, keys, values, kind, stride_batch, stride_head,
                                       stride_entry, length, valid, m, l, acc);
    for (int t = 0; t < tiers && !failed; ++t) {
        const int64_t *d = descriptors + t * T_FIELDS;
        failed |= attend_tier_segment(s, (int)d[T_BITS], (int)d[T_GROUP], dim, (int)d[T_VALUE_GROUP], d[T_MOST],
                                      (const int64_t *)(intptr_t)d[T_INDEX], (const uint8_t *)(intptr_t)d[T_KEY_CODES],
                                      (const uint16_t *)(intptr_t)d[T_KEY_PARAMS],
                                      (const uint8_t *)(intptr_t)d[T_VALUE_CODES],
                                      (const uint16_t *)(intptr_t)d[T_VALUE_PARAMS],
                                      (const uint8_t *)(intptr_t)d[T_VALID], rows, q, scaling, m, l, acc);
    }
    finish_rows(s, rows, dim, l, acc, out, query_kind);
    return failed;
}
#endif

/* A decoding query per query head over a tiered store: out (batch, 1, heads * rows, dim) in the query's dtype,
 * contiguous. query (batch, heads * rows, 1, dim) with element strides query_batch / query_head (unit over dim);
 * keys / values the full-precision part (batch, heads, length, dim) with element strides stride_* (unit over dim),
 * valid its (batch, heads, length) bool validity or NULL; descriptors: tiers x T_FIELDS int64. Returns 0, or 1 for
 * arguments it does not take (nothing is then written that the caller reads). */
int kvsieve_attend_tiered(int batch, int heads, int rows, int dim, const void *query, int query_kind,
                          int64_t query_batch, int64_t query_head, void *out, float scaling, const void *keys,
                          const void *values, int kind, int64_t stride_batch, int64_t stride_head,
                          int64_t stride_entry, int64_t length, const uint8_t *valid, int tiers,
                          const int64_t *descriptors) {
#ifdef KVSIEVE_VECTOR
    if (dim % 8 || dim > 256 || rows < 1 || rows > KVSIEVE_MAX_ROWS || kind < 0 || kind > 2 || query_kind < 0 ||
        query_kind > 2 || length < 0 || tiers < 0 || batch < 1 || heads < 1)
        return 1;
    int64_t entries = length;
    for (int t = 0; t < tiers; ++t) {
        if (!tier_ok(descriptors + t * T_FIELDS, dim)) return 1;
        entries += descriptors[t * T_FIELDS + T_MOST] * descriptors[t * T_FIELDS + T_GROUP];
    }
    if (entries == 0) return 1;
    const int64_t segments = (int64_t)batch * heads;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed) if (segments * entries >= KVSIEVE_PARALLEL_FROM)
    for (int64_t s = 0; s < segments; ++s)
        failed |= attend_segment(s, heads, rows, dim, (const char *)query, query_kind, query_batch, query_head,
                                 (char *)out, scaling, (const char *)keys, (const char *)values, kind, stride_batch,
                                 stride_head, stride_entry, length, valid, tiers, descriptors);
    return failed;
#else
    return 1; /* no vector code: the caller takes its PyTorch path */
#endif
}

/* ---------------------------------------------------------------------------------------------------------------
 * Decoding attention over a ragged layout read in place (kvsieve.native.segment_attention): segment s (batch item
 * s / heads, KV head s % heads) holds length[s] + extra entries at rows start[s] ... of the buffers keys / values
 * (total rows x dim, contiguous), every one valid (a layer store's layout: kvsieve.cache.store_layout). Any mix of
 * lengths is one call: each segment is cut into units of at most `chunk` entries, the units are shared among torch's
 * OpenMP threads (a long head beside short ones keeps every thread busy), each unit's softmax state is computed as
 * kvsieve_attend_tiered computes a part's, and a segment's units are folded in order. out (segments * rows, dim) in
 * the query's dtype, query rows as in kvsieve_attend_tiered. Returns 0, or 1 for arguments it does not take (an
 * empty segment among them).
 * ------------------------------------------------------------------------------------------------------------- */
int kvsieve_attend_segments(int batch, int heads, int rows, int dim, const void *query, int query_kind,
                            int64_t query_batch, int64_t query_head, void *out, float scaling, const void *keys,
                            const void *values, int kind, const int64_t *start, const int64_t *length, int64_t extra,
                            int64_t chunk, int64_t parallel_from) {
#ifdef KVSIEVE_VECTOR
    if (dim % 8 || dim > 256 || rows < 1 || rows > KVSIEVE_MAX_ROWS || kind < 0 || kind > 2 || query_kind < 0 ||
        query_kind > 2 || batch < 1 || heads < 1 || chunk < 1 || extra < 0)
        return 1;
    const int64_t segments = (int64_t)batch * heads, state = (int64_t)rows * (dim + 2);
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(segments + 1)); /* segment s's units: first[s] ... */
    if (!first) return 1;
    int64_t units = 0, entries = 0;
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t n = length[s] + extra;
        if (n <= 0) {
            free(first);
            return 1;
        }
        first[s] = units;
        units += (n + chunk - 1) / chunk;
        entries += n;
    }
    first[segments] = units;
    int64_t *owner = malloc(sizeof(int64_t) * (size_t)units);
    float *states = malloc(sizeof(float) * (size_t)(units * state)); /* per unit: m (rows), l (rows), acc */
    if (!owner || !states) {
        free(first);
        free(owner);
        free(states);
        return 1;
    }
    for (int64_t s = 0; s < segments; ++s)
        for (int64_t u = first[s]; u < first[s + 1]; ++u) owner[u] = s;
    const int64_t esize = kind == OUT_FLOAT32 ? 4 : 2, row_bytes = (int64_t)dim * esize;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed) if (units > 1 && entries >= parallel_from)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t s = owner[u], begin = (u - first[s]) * chunk, n = length[s] + extra;
        const int64_t count = n - begin < chunk ? n - begin : chunk, row = start[s] + begin;
        float q[KVSIEVE_MAX_ROWS * 256];
        float *m = states + u * state, *l = m + rows, *acc = l + rows;
        start_rows(s, heads, rows, dim, (const char *)query, query_kind, query_batch, query_head, q, m, l, acc);
        failed |= attend_dense_rows(rows, dim, q, scaling, (const char *)keys + row * row_bytes,
                                    (const char *)values + row * row_bytes, kind, row_bytes, count, NULL, NULL, 0, NULL, m,
                                    l, acc);
    }
    for (int64_t s = 0; s < segments && !failed; ++s) {
        float *m = states + first[s] * state, *l = m + rows, *acc = l + rows;
        for (int64_t u = first[s] + 1; u < first[s + 1]; ++u) {
            const float *um = states + u * state;
            fold(rows, dim, um, um + rows, um + 2 * rows, m, l, acc);
        }
        finish_rows(s, rows, dim, l, acc, (char *)out, query_kind);
    }
    free(first);
    free(owner);
    free(states);
    return failed;
#else
    return 1; /* no vector code: the caller takes its PyTorch path */
#endif
}

/* ---------------------------------------------------------------------------------------------------------------
 * A decoding query's attention output and its float32 softmax rows in one pass (kvsieve.native.decoding_rows): what
 * a scorer that compacts at every decoding step reads (H2O's and EMS's column sums, TOVA's last row) and the output
 * P.V from the same probabilities, as kvsieve.core.step.LayerStep.decoding_output_from_row computes them in PyTorch.
 * keys / values (batch, heads, length, dim) with element strides (unit over dim), valid (batch, heads, length) bool
 * or NULL, bias float32 (batch, heads, length) with a stride of bias_stride elements per (batch item, head) (unit
 * over length) added to every query row's logits, or NULL; with bias_counts, EMS's merge counts, whose
 * log(max(count, 1)) is added (kvsieve.core.step.count_bias; the C library's logf, within an ulp of torch's log);
 * writes out (batch, 1, heads * rows, dim) in the query's dtype and probs (batch, heads * rows, length) float32
 * (invalid entries 0). One segment per (batch item, KV head), in parallel from KVSIEVE_PARALLEL_FROM entries.
 * Returns 0, or 1 for arguments it does not take.
 * ------------------------------------------------------------------------------------------------------------- */
int kvsieve_attend_rows(int batch, int heads, int rows, int dim, const void *query, int query_kind,
                        int64_t query_batch, int64_t query_head, void *out, float scaling, const void *keys,
                        const void *values, int kind, int64_t stride_batch, int64_t stride_head, int64_t stride_entry,
                        int64_t length, const uint8_t *valid, const float *bias, int64_t bias_stride,
                        int bias_counts, float *probs) {
#ifdef KVSIEVE_VECTOR
    if (dim % 8 || dim > 256 || rows < 1 || rows > KVSIEVE_MAX_ROWS || kind < 0 || kind > 2 || query_kind < 0 ||
        query_kind > 2 || batch < 1 || heads < 1 || length < 1 || !probs ||
        (bias && bias_stride < length))
        return 1;
    const int64_t segments = (int64_t)batch * heads, esize = kind == OUT_FLOAT32 ? 4 : 2;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed) if (segments > 1 && segments * length >= KVSIEVE_PARALLEL_FROM)
    for (int64_t s = 0; s < segments; ++s) {
        float q[KVSIEVE_MAX_ROWS * 256], m[KVSIEVE_MAX_ROWS], l[KVSIEVE_MAX_ROWS], acc[KVSIEVE_MAX_ROWS * 256];
        start_rows(s, heads, rows, dim, (const char *)query, query_kind, query_batch, query_head, q, m, l, acc);
        const int64_t base = ((s / heads) * stride_batch + (s % heads) * stride_head) * esize;
        failed |= attend_dense_rows(rows, dim, q, scaling, (const char *)keys + base, (const char *)values + base,
                                    kind, stride_entry * esize, length, valid ? valid + s * length : NULL,
                                    bias ? bias + s * bias_stride : NULL, bias_counts, probs + s * rows * length, m,
                                    l, acc);
        for (int g = 0; g < rows && !failed; ++g) failed |= l[g] > 0.0f ? 0 : 1; /* a row that sees nothing */
        finish_rows(s, rows, dim, l, acc, (char *)out, query_kind);
    }
    return failed;
#else
    return 1; /* no vector code: the caller takes its PyTorch path */
#endif
}

/* 1 when this build has the vector code (AVX2, FMA, F16C), so the attention passes run; 0: they always return 1. */
int kvsieve_vector_code(void) {
#ifdef KVSIEVE_VECTOR
    return 1;
#else
    return 0;
#endif
}
