/* EMS's every-step decoding compaction in place (kvsieve_merge_lowest): the Global-Local score's observation, the
 * score, the one entry each head gives up, its merge into the most redundant class centre (or its eviction) and the
 * drop, in one call over a uniform store's buffers.
 *
 * kvsieve.native.build builds this file on first use; kvsieve.native.merge_lowest calls it through ctypes for
 * kvsieve.cache.store_compaction.StoreCompaction.merge_lowest. The reference is the engine's general decoding step
 * under EMS (Li et al. 2024, arXiv:2412.08521; kvsieve.parts.scorers.global_local and
 * kvsieve.parts.actions.evict_merge, which cite the equations), at a step where every head holds one entry over its
 * budget B (schedule="decode"):
 *
 *   observation  s_glo += the group mean of the query's softmax rows; s_loc's current part takes it too, and once it
 *                holds `window` rows it becomes the past part and restarts (Sec. 3.3) — each update added as the
 *                general step adds it (new - old, then old + that): these side data are the general step's bit for
 *                bit;
 *   score        Eq. 2, s = max(s_glo * sum(s_loc) / sum(s_glo), s_loc), the newest `window` entries zeroed, then
 *                a zero-padded mean pool of `kernel` entries; the newest `candidates`.. entries are protected;
 *   plan         the lowest score among the candidates is the one to-be-merged entry i (Sec. 4.2; with gamma = 1
 *                it is evicted); the other candidates are the class centres;
 *   redundancy   R_c = cos(k_i, k_c) * cos(v_i, v_c) on raw keys (un-rotated at their positions with the rotary
 *                table's cos and sin; Sec. 4.1), clamped to [-1, 1]; i merges into argmax_c R_c (the first of equals)
 *                when that exceeds tau, else it is evicted (the zero class); decided on R in float64 (below);
 *   merge        weights w = max(score, 1e-12): key = normalize(w_c k_c/|k_c| + w_i k_i/|k_i|) *
 *                (w_c|k_c| + w_i|k_i|) / (w_c + w_i) in raw space, re-rotated at the centre's position; value =
 *                (w_c v_c + w_i v_i) / (w_c + w_i); count = n_c + n_i (kvsieve.parts.actions.merge.merge_kept); a
 *                merge whose weight is below the float resolution (w_c + w_i == w_c) keeps the centre's bits;
 *   drop         every buffer's rows after i move down by one (evict.c's drop).
 *
 * The scores are Eq. 2 and the pooling in double rounded to float32 once, as GlobalLocal.raw computes them: the general
 * step's bit for bit but where a double sum's last bits decide a rounding. The merge's norms and sums run in double or
 * float32 in another order than torch's, so the merged rows are the general step's within float32 rounding, not bit
 * for bit. The decisions are kept equal. The general step decides the merge target and the comparison with tau on the redundancy in float64
 * (EvictThenMerge.assign); this pass screens in float32 and, where the best two redundancies or the best one and tau
 * lie within a margin far above float32's rounding (NEAR), takes the float64 redundancy (redundancy64) of the centres
 * within NEAR of the best: two float64 sums agree to ~1e-15, so that decides as the general step does — the first
 * centre within EXACT_TIE of the best — unless one lies within EXACT_EDGE of that tie's edge or the best within it of
 * tau (session 29: such ties were most of what sent a layer to the general step — a layer of nearly collinear keys
 * gives redundancies of 0.99999x within 1e-6 of one another, and in float32 a token's duplicates tie at 1 - 1e-15).
 * Where the lowest two scores lie within SCORE_NEAR (relative), or a double redundancy at an edge, the call returns 1
 * after the observation with nothing moved, and the general step plans from the same side data. No vector code beyond
 * what the compiler makes of the loops over a head's entries, except the redundancy, which runs on AVX-512 registers
 * where the build has them, else on AVX2's eight lanes (the same products, its lanes summed by the register's
 * reduction: within float32 rounding of the portable loops). The segments are planned on torch's OpenMP threads once
 * there are at least two and PARALLEL_WORK candidates in all.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KVSIEVE_ABI 1
#define MOST_DIM 256
#define MIN_WEIGHT 1e-12f /* evict_merge.MIN_WEIGHT and merge.EPS */
#define LANES 16       /* the redundancy's partial sums */
#define NEAR 2e-5f     /* margin of a redundancy decision in float32, absolute (its rounding, here and in torch: below
                          * 4e-6) */
#define SCORE_NEAR 5e-7f /* margin of the lowest score, relative: four float32 ulps (the scores are torch's bit for bit
                          * but where the float64 sums' last bits decide a rounding) */
#define PARALLEL_WORK 512 /* segments x candidates from which the segments are planned on several threads */
#define PARALLEL_MOVES 2048 /* segments x entries from which they are merged and dropped on several threads */
#define EXACT_TIE 1e-12 /* redundancies this close to the best are one tie, the first taken (EvictThenMerge's
                          * REDUNDANCY_TIE: duplicates of a token, identical but for rounding, tie at 1 - 1e-15) */
#define EXACT_EDGE 1e-13 /* margin of a decision on a double redundancy (two orders of summation: ~1e-15 apart) */

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

enum { KIND_FLOAT32 = 0, KIND_BFLOAT16 = 1 };

static inline float load(const void *base, int kind, int64_t index) {
    if (kind == KIND_FLOAT32)
        return ((const float *)base)[index];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[index] << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* float32 to the store's dtype: bfloat16 rounded to nearest even (torch's conversion), NaN kept quiet. */
static inline void store(void *base, int kind, int64_t index, float x) {
    if (kind == KIND_FLOAT32) {
        ((float *)base)[index] = x;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint16_t out;
    if (isnan(x))
        out = (uint16_t)((bits >> 16) | 0x40u);
    else
        out = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    ((uint16_t *)base)[index] = out;
}

typedef struct {
    const float *cos, *sin; /* (rows, half): the rotary table's cos and sin of each position, unscaled */
    const double *cos64, *sin64; /* the same in double, of the same float32 angles (the exact redundancy's) */
    int64_t half, rows;
    float scaling, unrotate_factor; /* the attention factor the model multiplies them by, and 1 / that */
} Rotary;

/* A stored (rotated) key at `position` -> its raw key (float32): x1 = y1 c + y2 s, x2 = y2 c - y1 s with c, s the
 * table's times 1/scaling (rope.unrotate); the dims past the rotary ones as stored. */
static void unrotate(const void *keys, int kind, int64_t row, int64_t dim, int64_t position, const Rotary *rope,
                     float *raw) {
    const float factor = rope->unrotate_factor;
    const float *cos = rope->cos + position * rope->half, *sin = rope->sin + position * rope->half;
    for (int64_t f = 0; f < rope->half; ++f) {
        float c = cos[f], s = sin[f];
        if (factor != 1.0f)
            c *= factor, s *= factor;
        const float y1 = load(keys, kind, row * dim + f), y2 = load(keys, kind, row * dim + rope->half + f);
        raw[f] = y1 * c + y2 * s;
        raw[rope->half + f] = y2 * c - y1 * s;
    }
    for (int64_t e = 2 * rope->half; e < dim; ++e)
        raw[e] = load(keys, kind, row * dim + e);
}

static float norm(const float *x, int64_t dim) {
    double sum = 0.0;
    for (int64_t e = 0; e < dim; ++e)
        sum += (double)x[e] * x[e];
    return (float)sqrt(sum);
}

/* x / max(|x|, 1e-12) in place. */
static void unit(float *x, int64_t dim) {
    float n = norm(x, dim);
    if (n < MIN_WEIGHT)
        n = MIN_WEIGHT;
    for (int64_t e = 0; e < dim; ++e)
        x[e] /= n;
}

/* A stored row of `dim` elements as float32. */
static inline void row_floats(const void *base, int kind, int64_t row, int64_t dim, float *out) {
    if (kind == KIND_FLOAT32) {
        memcpy(out, (const float *)base + row * dim, (size_t)dim * sizeof(float));
        return;
    }
    const uint16_t *bits = (const uint16_t *)base + row * dim;
    for (int64_t e = 0; e < dim; ++e) {
        const uint32_t wide = (uint32_t)bits[e] << 16;
        memcpy(out + e, &wide, 4);
    }
}

/* R = cos(raw k_c, raw k_i) * cos(v_c, v_i) of centre row `row` against the to-be-merged entry's unit raw key and
 * unit value: the key un-rotated on the fly without the attention factor (a cosine does not see it), its dot product
 * and squared norm summed together, then the value's, in float32 lanes (the decisions' margin is far above their
 * rounding). The portable loops; redundancy() below is the same arithmetic on AVX-512 registers. */
__attribute__((unused)) static float redundancy_scalar(const void *keys, const void *values, int kind, int64_t row, int64_t dim, int64_t position,
                        const Rotary *rope, const float *unit_key, const float *unit_value) {
    float k[MOST_DIM], v[MOST_DIM];
    row_floats(keys, kind, row, dim, k);
    row_floats(values, kind, row, dim, v);
    const float *cos = rope->cos + position * rope->half, *sin = rope->sin + position * rope->half;
    const int64_t half = rope->half;
    float key_dot[LANES] = {0}, key_sq[LANES] = {0}, value_dot[LANES] = {0}, value_sq[LANES] = {0};
    int64_t f = 0;
    for (; f + LANES <= half; f += LANES) /* LANES independent sums: vector code without reassociation */
        for (int l = 0; l < LANES; ++l) {
            const float c = cos[f + l], s = sin[f + l], y1 = k[f + l], y2 = k[half + f + l];
            const float x1 = y1 * c + y2 * s, x2 = y2 * c - y1 * s;
            key_dot[l] += x1 * unit_key[f + l] + x2 * unit_key[half + f + l];
            key_sq[l] += x1 * x1 + x2 * x2;
        }
    for (; f < half; ++f) {
        const float c = cos[f], s = sin[f], y1 = k[f], y2 = k[half + f];
        const float x1 = y1 * c + y2 * s, x2 = y2 * c - y1 * s;
        key_dot[0] += x1 * unit_key[f] + x2 * unit_key[half + f];
        key_sq[0] += x1 * x1 + x2 * x2;
    }
    for (int64_t e = 2 * half; e < dim; ++e) {
        key_dot[0] += k[e] * unit_key[e];
        key_sq[0] += k[e] * k[e];
    }
    int64_t e = 0;
    for (; e + LANES <= dim; e += LANES)
        for (int l = 0; l < LANES; ++l) {
            value_dot[l] += v[e + l] * unit_value[e + l];
            value_sq[l] += v[e + l] * v[e + l];
        }
    for (; e < dim; ++e) {
        value_dot[0] += v[e] * unit_value[e];
        value_sq[0] += v[e] * v[e];
    }
    for (int l = 1; l < LANES; ++l) {
        key_dot[0] += key_dot[l], key_sq[0] += key_sq[l];
        value_dot[0] += value_dot[l], value_sq[0] += value_sq[l];
    }
    float key_norm = sqrtf(key_sq[0]), value_norm = sqrtf(value_sq[0]);
    key_norm = key_norm > MIN_WEIGHT ? key_norm : MIN_WEIGHT;
    value_norm = value_norm > MIN_WEIGHT ? value_norm : MIN_WEIGHT;
    return (key_dot[0] / key_norm) * (value_dot[0] / value_norm);
}

/* The vector redundancies' end: the lanes' sums (key dot, key square, value dot, value square) plus the elements
 * their lanes left — rotary pairs from f, the key's dimensions past the rotary ones, the value's from e — then R. */
__attribute__((unused)) static float redundancy_tails(const float sums[4], const void *keys, const void *values,
                                                      int kind, int64_t start, int64_t dim, int64_t f, int64_t e,
                                                      const float *cos, const float *sin, int64_t half,
                                                      const float *unit_key, const float *unit_value) {
    float key_dot = sums[0], key_sq = sums[1], value_dot = sums[2], value_sq = sums[3];
    for (; f < half; ++f) {
        const float c = cos[f], s = sin[f], y1 = load(keys, kind, start + f), y2 = load(keys, kind, start + half + f);
        const float x1 = y1 * c + y2 * s, x2 = y2 * c - y1 * s;
        key_dot += x1 * unit_key[f] + x2 * unit_key[half + f];
        key_sq += x1 * x1 + x2 * x2;
    }
    for (int64_t d = 2 * half; d < dim; ++d) {
        const float k = load(keys, kind, start + d);
        key_dot += k * unit_key[d];
        key_sq += k * k;
    }
    for (; e < dim; ++e) {
        const float v = load(values, kind, start + e);
        value_dot += v * unit_value[e];
        value_sq += v * v;
    }
    float key_norm = sqrtf(key_sq), value_norm = sqrtf(value_sq);
    key_norm = key_norm > MIN_WEIGHT ? key_norm : MIN_WEIGHT;
    value_norm = value_norm > MIN_WEIGHT ? value_norm : MIN_WEIGHT;
    return (key_dot / key_norm) * (value_dot / value_norm);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 stored elements from `index` on as float32 (bfloat16: its bits in a float32's top half). */
static inline __m512 load16(const void *base, int kind, int64_t index) {
    if (kind == KIND_FLOAT32)
        return _mm512_loadu_ps((const float *)base + index);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* redundancy_scalar's arithmetic with each LANES-wide step in one register, the lanes summed by the register's own
 * reduction (session 29; before, lane by lane in redundancy_scalar's order, bit for bit with it, which the decisions
 * no longer need: the float32 redundancy only screens, within its margin, and the float64 one decides near ties):
 * within float32 rounding of the portable loops, ~10x faster than what the compiler made of them (the redundancy was
 * ~90% of the pass, ~150 ns per centre). */
static float redundancy(const void *keys, const void *values, int kind, int64_t row, int64_t dim, int64_t position,
                        const Rotary *rope, const float *unit_key, const float *unit_value) {
    const float *cos = rope->cos + position * rope->half, *sin = rope->sin + position * rope->half;
    const int64_t half = rope->half, start = row * dim;
    __m512 kd = _mm512_setzero_ps(), ks = kd, vd = kd, vs = kd;
    int64_t f = 0;
    for (; f + LANES <= half; f += LANES) {
        const __m512 c = _mm512_loadu_ps(cos + f), s = _mm512_loadu_ps(sin + f);
        const __m512 y1 = load16(keys, kind, start + f), y2 = load16(keys, kind, start + half + f);
        const __m512 x1 = _mm512_add_ps(_mm512_mul_ps(y1, c), _mm512_mul_ps(y2, s));
        const __m512 x2 = _mm512_sub_ps(_mm512_mul_ps(y2, c), _mm512_mul_ps(y1, s));
        kd = _mm512_add_ps(kd, _mm512_add_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(unit_key + f)),
                                             _mm512_mul_ps(x2, _mm512_loadu_ps(unit_key + half + f))));
        ks = _mm512_add_ps(ks, _mm512_add_ps(_mm512_mul_ps(x1, x1), _mm512_mul_ps(x2, x2)));
    }
    int64_t e = 0;
    for (; e + LANES <= dim; e += LANES) {
        const __m512 v = load16(values, kind, start + e), u = _mm512_loadu_ps(unit_value + e);
        vd = _mm512_add_ps(vd, _mm512_mul_ps(v, u));
        vs = _mm512_add_ps(vs, _mm512_mul_ps(v, v));
    }
    const float sums[4] = {_mm512_reduce_add_ps(kd), _mm512_reduce_add_ps(ks), _mm512_reduce_add_ps(vd),
                           _mm512_reduce_add_ps(vs)};
    return redundancy_tails(sums, keys, values, kind, start, dim, f, e, cos, sin, half, unit_key, unit_value);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 stored elements from `index` on as float32 (load16 on eight lanes). */
static inline __m256 load8(const void *base, int kind, int64_t index) {
    if (kind == KIND_FLOAT32)
        return _mm256_loadu_ps((const float *)base + index);
    const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

static inline float sum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* redundancy (above, AVX-512) on eight lanes, for an AVX2-only CPU: the same products, summed in another grouping
 * (within float32 rounding of the portable loops, which the compiler keeps scalar: ~150 ns per centre). */
static float redundancy(const void *keys, const void *values, int kind, int64_t row, int64_t dim, int64_t position,
                        const Rotary *rope, const float *unit_key, const float *unit_value) {
    const float *cos = rope->cos + position * rope->half, *sin = rope->sin + position * rope->half;
    const int64_t half = rope->half, start = row * dim;
    __m256 kd = _mm256_setzero_ps(), ks = kd, vd = kd, vs = kd;
    int64_t f = 0;
    for (; f + 8 <= half; f += 8) {
        const __m256 c = _mm256_loadu_ps(cos + f), s = _mm256_loadu_ps(sin + f);
        const __m256 y1 = load8(keys, kind, start + f), y2 = load8(keys, kind, start + half + f);
        const __m256 x1 = _mm256_add_ps(_mm256_mul_ps(y1, c), _mm256_mul_ps(y2, s));
        const __m256 x2 = _mm256_sub_ps(_mm256_mul_ps(y2, c), _mm256_mul_ps(y1, s));
        kd = _mm256_add_ps(kd, _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(unit_key + f)),
                                             _mm256_mul_ps(x2, _mm256_loadu_ps(unit_key + half + f))));
        ks = _mm256_add_ps(ks, _mm256_add_ps(_mm256_mul_ps(x1, x1), _mm256_mul_ps(x2, x2)));
    }
    int64_t e = 0;
    for (; e + 8 <= dim; e += 8) {
        const __m256 v = load8(values, kind, start + e), u = _mm256_loadu_ps(unit_value + e);
        vd = _mm256_add_ps(vd, _mm256_mul_ps(v, u));
        vs = _mm256_add_ps(vs, _mm256_mul_ps(v, v));
    }
    const float sums[4] = {sum8(kd), sum8(ks), sum8(vd), sum8(vs)};
    return redundancy_tails(sums, keys, values, kind, start, dim, f, e, cos, sin, half, unit_key, unit_value);
}
#else
#define redundancy redundancy_scalar
#endif

/* A stored key at `position` -> its raw key in double, without the attention factor (a cosine does not see it):
 * x1 = y1 c + y2 s, x2 = y2 c - y1 s over the double table. */
static void unrotate64(const void *keys, int kind, int64_t row, int64_t dim, int64_t position, const Rotary *rope,
                       double *raw) {
    const double *cos = rope->cos64 + position * rope->half, *sin = rope->sin64 + position * rope->half;
    for (int64_t f = 0; f < rope->half; ++f) {
        const double y1 = load(keys, kind, row * dim + f), y2 = load(keys, kind, row * dim + rope->half + f);
        raw[f] = y1 * cos[f] + y2 * sin[f];
        raw[rope->half + f] = y2 * cos[f] - y1 * sin[f];
    }
    for (int64_t e = 2 * rope->half; e < dim; ++e)
        raw[e] = load(keys, kind, row * dim + e);
}

static double norm64(const double *x, int64_t dim) {
    double sum = 0.0;
    for (int64_t e = 0; e < dim; ++e)
        sum += x[e] * x[e];
    return sqrt(sum);
}

/* x / max(|x|, 1e-12) in place, in double. */
static void unit64(double *x, int64_t dim) {
    double n = norm64(x, dim);
    if (n < MIN_WEIGHT)
        n = MIN_WEIGHT;
    for (int64_t e = 0; e < dim; ++e)
        x[e] /= n;
}

/* The exact redundancy of the decisions (EvictThenMerge.assign's): R = cos(raw k_c, raw k_i) * cos(v_c, v_i) in
 * double from the stored elements and the double table, clamped to [-1, 1]. Any two sums of these products agree to
 * ~1e-15, so a decision made on it is the general step's unless a centre lies at the edge of a tie (EXACT_EDGE). */
static double redundancy64(const void *keys, const void *values, int kind, int64_t row, int64_t dim, int64_t position,
                           const Rotary *rope, const double *unit_key, const double *unit_value) {
    double k[MOST_DIM], v[MOST_DIM];
    unrotate64(keys, kind, row, dim, position, rope, k);
    for (int64_t e = 0; e < dim; ++e)
        v[e] = load(values, kind, row * dim + e);
    unit64(k, dim);
    unit64(v, dim);
    double key_cos = 0.0, value_cos = 0.0;
    for (int64_t e = 0; e < dim; ++e) {
        key_cos += k[e] * unit_key[e];
        value_cos += v[e] * unit_value[e];
    }
    const double r = key_cos * value_cos;
    return r < -1.0 ? -1.0 : r > 1.0 ? 1.0 : r;
}

typedef struct {
    int64_t window, kernel, candidates;
    int use_global, merges;
    double tau; /* compared in double, as torch compares the float64 redundancy with the Python float */
} Ems;

/* The observation of one segment's `length` entries (side data: capacity-row buffers at this segment's rows). */
static void observe(const float *rows, int64_t groups, int64_t length, float *glo, float *past, float *cur,
                    float *held_rows, int64_t window) {
    float held = 0.0f; /* rows held by s_loc's current part: the same on every entry (0 on the new one) */
    for (int64_t j = 0; j < length; ++j)
        if (held_rows[j] > held)
            held = held_rows[j];
    held += 1.0f;
    const int swap = held >= (float)window;
    for (int64_t j = 0; j < length; ++j) {
        float mean = rows[j];
        for (int64_t g = 1; g < groups; ++g)
            mean += rows[g * length + j];
        mean = mean / (float)groups;
        glo[j] = glo[j] + mean;
        const float new_cur = cur[j] + mean;
        const float next_past = swap ? new_cur : past[j], next_cur = swap ? 0.0f : new_cur;
        const float next_rows = swap ? 0.0f : held;
        past[j] = past[j] + (next_past - past[j]);
        cur[j] = cur[j] + (next_cur - cur[j]);
        held_rows[j] = held_rows[j] + (next_rows - held_rows[j]);
    }
}

/* Eq. 2 of entry j in double, 0 from the window on: max(glo * ratio, past + cur), past + cur added in float32 as torch
 * adds them (GlobalLocal.raw). */
static inline double eq2(const float *glo, const float *past, const float *cur, int64_t j, int64_t length,
                         double ratio, const Ems *ems) {
    if (j >= length - ems->window)
        return 0.0;
    const double local = (double)(past[j] + cur[j]);
    if (!ems->use_global)
        return local;
    const double scaled = (double)glo[j] * ratio;
    return scaled > local ? scaled : local;
}

/* Eq. 2, the window zeroed and the mean pool in double, rounded to float32 once (GlobalLocal.raw computes the same in
 * float64: two sums of these agree to ~1e-16, so the float32 scores are torch's bit for bit but where one lies within
 * that of a float32 rounding boundary): pooled[0 .. length - 1]; plain[] is scratch of the same length. */
static void scores(const float *glo, const float *past, const float *cur, int64_t length, const Ems *ems,
                   double *plain, float *pooled) {
    double sum_loc = 0.0, sum_glo = 0.0;
    for (int64_t j = 0; j < length; ++j) {
        sum_loc += (double)(past[j] + cur[j]);
        sum_glo += glo[j];
    }
    double ratio = sum_loc / sum_glo;
    if (!isfinite(ratio))
        ratio = 0.0;
    for (int64_t j = 0; j < length; ++j)
        plain[j] = eq2(glo, past, cur, j, length, ratio, ems);
    const int64_t pad = ems->kernel / 2;
    for (int64_t j = 0; j < length; ++j) {
        double sum = 0.0;
        for (int64_t m = j - pad; m <= j + pad; ++m)
            if (m >= 0 && m < length)
                sum += plain[m];
        pooled[j] = (float)(sum / (double)ems->kernel);
    }
}

/* Whether two scores lie within SCORE_NEAR of each other, relative. */
static inline int near(float a, float b) {
    const float scale = fabsf(a) > fabsf(b) ? fabsf(a) : fabsf(b);
    return fabsf(a - b) <= SCORE_NEAR * scale;
}

/* Entry row_i merged into the centre row_c with weights w_c, w_i (merge.merge_kept with one source): the centre's
 * key, value and count rewritten in place. */
static void merge(void *keys, void *values, float *counts, int kind, int64_t dim, const int64_t *positions,
                  const Rotary *rope, int64_t row_c, int64_t row_i, float w_c, float w_i) {
    float raw_c[MOST_DIM], raw_i[MOST_DIM], sum[MOST_DIM];
    unrotate(keys, kind, row_c, dim, positions[row_c], rope, raw_c);
    unrotate(keys, kind, row_i, dim, positions[row_i], rope, raw_i);
    const float norm_c = norm(raw_c, dim), norm_i = norm(raw_i, dim);
    const float div_c = norm_c > MIN_WEIGHT ? norm_c : MIN_WEIGHT, div_i = norm_i > MIN_WEIGHT ? norm_i : MIN_WEIGHT;
    for (int64_t e = 0; e < dim; ++e)
        sum[e] = w_c * raw_c[e] / div_c + w_i * raw_i[e] / div_i;
    const float norm_sum = w_c * norm_c + w_i * norm_i, weight_sum = w_c + w_i;
    counts[row_c] = counts[row_c] + counts[row_i];
    if (weight_sum == w_c)
        return; /* the merged weight is below the float resolution: the centre's bits stay */
    const float total = weight_sum > MIN_WEIGHT ? weight_sum : MIN_WEIGHT;
    float direction = norm(sum, dim);
    if (direction < MIN_WEIGHT)
        direction = MIN_WEIGHT;
    const float scale = norm_sum / total;
    for (int64_t e = 0; e < dim; ++e)
        sum[e] = sum[e] / direction * scale;
    /* re-rotated at the centre's position: y1 = x1 c - x2 s, y2 = x2 c + x1 s, c and s times the scaling */
    const int64_t p = positions[row_c], half = rope->half;
    for (int64_t f = 0; f < half; ++f) {
        float c = rope->cos[p * half + f], sn = rope->sin[p * half + f];
        if (rope->scaling != 1.0f)
            c *= rope->scaling, sn *= rope->scaling;
        const float x1 = sum[f], x2 = sum[half + f];
        store(keys, kind, row_c * dim + f, x1 * c + (-x2) * sn);
        store(keys, kind, row_c * dim + half + f, x2 * c + x1 * sn);
    }
    for (int64_t e = 2 * half; e < dim; ++e)
        store(keys, kind, row_c * dim + e, sum[e]);
    for (int64_t e = 0; e < dim; ++e) {
        const float v = (w_c * load(values, kind, row_c * dim + e) + w_i * load(values, kind, row_i * dim + e)) / total;
        store(values, kind, row_c * dim + e, v);
    }
}

/* One segment's plan from its side data (after the observation): the entry it gives up (*dropped) and the centre
 * it merges into (*target, -1: evicted) with the merge's weights (w_i, w_c); 0 where a decision lies within the
 * margin or meets a NaN. positions: the segment's; base: its first row; scratch: 4 * length floats. */
static int decide(const void *keys, const void *values, int kind, int64_t dim, const int64_t *positions, int64_t base,
                  int64_t length, const float *glo, const float *past, const float *cur, const Ems *ems,
                  const Rotary *rope, float *scratch, int64_t *dropped, int64_t *target, float *weights) {
    /* scratch: 4 * length floats (the redundancies, the scores, then Eq. 2 in double) */
    float *redundancies = scratch, *pooled = scratch + length;
    double *plain = (double *)(scratch + 2 * length);
    const int64_t candidates = ems->candidates;
    scores(glo, past, cur, length, ems, plain, pooled);
    int64_t at = 0;
    float lowest = pooled[0], second = INFINITY;
    for (int64_t j = 0; j < candidates; ++j) {
        if (isnan(pooled[j]))
            return 0;
        if (j == 0)
            continue;
        if (pooled[j] < lowest) {
            second = lowest;
            lowest = pooled[j];
            at = j;
        } else if (pooled[j] < second)
            second = pooled[j];
    }
    if (candidates > 1 && near(lowest, second))
        return 0;
    *dropped = at;
    *target = -1;
    if (!ems->merges || candidates < 2)
        return 1;
    /* the to-be-merged entry's raw unit key and unit value, against every centre's */
    float raw_i[MOST_DIM], unit_vi[MOST_DIM];
    unrotate(keys, kind, base + at, dim, positions[at], rope, raw_i);
    unit(raw_i, dim);
    for (int64_t e = 0; e < dim; ++e)
        unit_vi[e] = load(values, kind, (base + at) * dim + e);
    unit(unit_vi, dim);
    float best = -INFINITY, runner = -INFINITY;
    int64_t best_at = -1;
    for (int64_t c = 0; c < candidates; ++c) {
        if (c == at)
            continue;
        float r = redundancy(keys, values, kind, base + c, dim, positions[c], rope, raw_i, unit_vi);
        r = r < -1.0f ? -1.0f : r > 1.0f ? 1.0f : r;
        if (isnan(r))
            return 0;
        redundancies[c] = r;
        if (r > best) {
            runner = best;
            best = r;
            best_at = c;
        } else if (r > runner)
            runner = r;
    }
    int merges_into_best = best > ems->tau;
    if (fabs(best - ems->tau) <= NEAR || (merges_into_best && best - runner <= NEAR)) {
        /* too close for float32: the exact redundancy of the centres within the margin of the best (the exact best
         * is among them: float32's error is below half the margin); the target is the first of them within
         * EXACT_TIE of the exact best, as EvictThenMerge.assign takes it */
        double raw64[MOST_DIM], value64[MOST_DIM], best64 = -INFINITY;
        unrotate64(keys, kind, base + at, dim, positions[at], rope, raw64);
        unit64(raw64, dim);
        for (int64_t e = 0; e < dim; ++e)
            value64[e] = load(values, kind, (base + at) * dim + e);
        unit64(value64, dim);
        for (int64_t c = 0; c < candidates; ++c)
            if (c != at && redundancies[c] >= best - NEAR) {
                const double r = redundancy64(keys, values, kind, base + c, dim, positions[c], rope, raw64, value64);
                if (isnan(r))
                    return 0;
                best64 = r > best64 ? r : best64;
            }
        const double tied = best64 - EXACT_TIE;
        best_at = -1;
        for (int64_t c = 0; c < candidates; ++c) /* again (rare): the first within the tie, none at its edge */
            if (c != at && redundancies[c] >= best - NEAR) {
                const double r = redundancy64(keys, values, kind, base + c, dim, positions[c], rope, raw64, value64);
                if (fabs(r - tied) <= EXACT_EDGE)
                    return 0;
                if (r >= tied && best_at < 0)
                    best_at = c;
            }
        merges_into_best = best64 > ems->tau;
        if (fabs(best64 - ems->tau) <= EXACT_EDGE)
            return 0;
    }
    if (merges_into_best) {
        *target = best_at;
        weights[0] = pooled[at] > MIN_WEIGHT ? pooled[at] : MIN_WEIGHT;
        weights[1] = pooled[best_at] > MIN_WEIGHT ? pooled[best_at] : MIN_WEIGHT;
    }
    return 1;
}

/* rows: (batch, kv_heads * groups, length) float32, contiguous. glo, past, cur, held_rows, counts: float32 side data,
 * entry j of segment s at row s * capacity + j. keys, values: (rows, dim) of `kind`; positions: int64 per row.
 * cos, sin: (table_rows, half) float32, the rotary table's of each position (half 0: no rotary dims); cos64, sin64
 * the same in double, of the same float32 angles (the exact redundancy's, for decisions too close for float32); scaling its
 * attention factor (rotate multiplies by it), unrotate_factor 1 / scaling (unrotate multiplies by that).
 * buffers[b]: row r at buffers[b] + r * row_bytes[b] (every buffer the drop moves). scratch: 4 * length floats per
 * segment, 8-byte aligned (the segments are planned in parallel on torch's OpenMP threads).
 * dropped, target: (batch * kv_heads) int64, written (target -1: evicted); weights: 2 * batch * kv_heads floats
 * (each merge's w_i, w_c), written. Returns 0 (done, nothing merged), 2 (done, some segment merged), 1 (a
 * decision within the margin, or NaN: observed, nothing else changed), -1 (bad sizes: nothing changed). */
int kvsieve_merge_lowest(int64_t batch, int64_t kv_heads, int64_t groups, int64_t length, int64_t capacity,
                         const float *rows, float *glo, float *past, float *cur, float *held_rows, float *counts,
                         int64_t window, int64_t kernel, int64_t candidates, int use_global, int merges, double tau,
                         void *keys, void *values, int kind, int64_t dim, const int64_t *positions,
                         const float *cos, const float *sin, const double *cos64, const double *sin64, int64_t half,
                         int64_t table_rows, float scaling,
                         float unrotate_factor, int n_buffers, char *const *buffers, const int64_t *row_bytes,
                         float *scratch, int64_t *dropped, int64_t *target, float *weights) {
    if (batch < 1 || kv_heads < 1 || groups < 1 || length < 2 || capacity < length || candidates < 1
        || candidates > length || window < 0 || kernel < 1 || kernel % 2 == 0 || dim < 1 || dim > MOST_DIM
        || half < 0 || 2 * half > dim || (kind != KIND_FLOAT32 && kind != KIND_BFLOAT16) || n_buffers < 0
        || !(scaling > 0.0f) || !(unrotate_factor > 0.0f))
        return -1;
    const int64_t segments = batch * kv_heads;
    for (int64_t s = 0; s < segments; ++s)
        for (int64_t j = 0; j < length; ++j) {
            const int64_t p = positions[s * capacity + j];
            if (half > 0 && (p < 0 || p >= table_rows))
                return -1;
        }
    const Rotary rope = {cos, sin, cos64, sin64, half, table_rows, scaling, unrotate_factor};
    const Ems ems = {window, kernel, candidates, use_global, merges, tau};
    int decided = 1;
#pragma omp parallel for schedule(static) if (segments > 1 && segments * candidates >= PARALLEL_WORK)
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t base = s * capacity;
        observe(rows + s * groups * length, groups, length, glo + base, past + base, cur + base, held_rows + base,
                window);
        if (!decide(keys, values, kind, dim, positions + base, base, length, glo + base, past + base, cur + base,
                    &ems, &rope, scratch + s * 4 * length, dropped + s, target + s, weights + 2 * s)) {
#pragma omp atomic write
            decided = 0;
        }
    }
    if (!decided)
        return 1;
    int merged = 0;
    for (int64_t s = 0; s < segments; ++s)
        merged |= target[s] >= 0;
    /* each segment's merge and drop touch its own rows only: the segments on threads (at batch 8 the drops' moves,
     * ~35 KB per segment, were a third of the pass) */
#pragma omp parallel for schedule(static) if (segments > 1 && segments * length >= PARALLEL_MOVES)
    for (int64_t s = 0; s < segments; ++s) {
        if (target[s] >= 0)
            merge(keys, values, counts, kind, dim, positions, &rope, s * capacity + target[s],
                  s * capacity + dropped[s], weights[2 * s + 1], weights[2 * s]);
        const int64_t j = dropped[s], moved = length - 1 - j;
        for (int b = 0; b < n_buffers && moved > 0; ++b) {
            char *row = buffers[b] + (s * capacity + j) * row_bytes[b];
            memmove(row, row + row_bytes[b], (size_t)(moved * row_bytes[b]));
        }
    }
    return merged ? 2 : 0;
}
