/* ReST-KV's window scores at a prompt's compaction in one pass over the held values (kvsieve_restkv_window_scores).
 *
 * kvsieve.native.build builds this file on first use; kvsieve.native.restkv_scores calls it through ctypes for the
 * restkv scorer (kvsieve.parts.scorers.restkv), whose PyTorch path (kvsieve.ops.reconstruction and
 * kvsieve.ops.smoothing) is the reference. For query head h of batch item b (KV head h / groups), window query t and
 * each entry j before the window (j < prefix), ReST-KV's indicator (An et al. 2026, arXiv:2605.08840, Eq. 7, App. A)
 *
 *   I[t, j] = A[t, j] / max(1 - A[t, j], eps) * sqrt(max(0, o_t G o_t' - 2 o_t G v_j' + v_j G v_j'))
 *
 * (G = W_O^h W_O^h' the head's Gram matrix, or the identity without the output projection), then
 *
 *   smoothed[j]  = sum_t weight[t] * I[t, j]         Eq. 9's EMA unrolled (or the plain mean), 0 from the window on
 *   per_query[t] = the mean index of I[t]'s k largest entries before the window (Eq. 10's inner sum)
 *
 * and, when asked (`smooth`), the adaptive window itself from per_query (Eq. 10-13, as
 * kvsieve.ops.smoothing.drift_window_mean: the halves' mean indices in double, where sums of float32 indices are exact
 * in any order, so the widths and shifts are the PyTorch path's; then each row's window mean from a float64 prefix sum
 * in the order torch.cumsum takes, so the smoothed scores are too, bit for bit, given the same unsmoothed ones);
 * without `smooth` kvsieve.ops.smoothing.drift_window_mean does that. The PyTorch path computes the same expansion in
 * float32 with other summation orders, so the scores agree within float32 rounding (relative ~1e-6, more where
 * o_t ~ v_j, where the expansion cancels in both); where several entries tie at the k-th largest value the lowest
 * indices are taken (torch.topk takes any of them).
 *
 * Work: o_t G per (batch item, query head) (and, with the tiles, o_t itself first); then the indicator in units of 256
 * entries of a (batch item, KV head), shared by its query heads; then one selection per (batch item, query head, window
 * query): a quickselect of the k-th largest order key on the vector units (kth_largest). Each part's units are shared
 * among torch's OpenMP threads.
 *
 * Two ways to the products o_t G v' and v G v':
 * - bfloat16 values with AMX tiles (KVSIEVE_AMX, granted by the kernel, d a multiple of 32): on the tiles, each
 *   float32 operand (o_t G, G, and for o_t = sum_j A[t, j] v_j the rows A) as three bfloat16 parts whose sum is within
 *   ~2^-27 of it, the values bfloat16 already, so every product is exact in float32 and only the tiles' float32 sums
 *   round: float32 accuracy (tested against the vector way on the same numbers), four blocks of 16 entries a round;
 * - otherwise on the vector units: blocks of LANES entries, one per lane, each block's values transposed to float32
 *   once, each of the d dimensions one vector (v G v' from G's upper triangle, o_t G v' for every window query).
 * Vector code needs AVX-512 (16 lanes), or AVX2 and FMA (an AVX2-only CPU: 8 lanes, the quickselect's partitions
 * scalar without a branch); -march=native builds for the CPU's own. Each lane computes its entry's numbers with the
 * same operations in the same order either way, so the two agree bit for bit. Elsewhere the function returns -1 and
 * the caller keeps PyTorch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define KVSIEVE_AVX512 1
#else
#define KVSIEVE_AVX512 0
#endif
#if !KVSIEVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSIEVE_AVX2 1
#else
#define KVSIEVE_AVX2 0
#endif
#define KVSIEVE_VECTORS (KVSIEVE_AVX512 || KVSIEVE_AVX2) /* the pass's vector code */
#if KVSIEVE_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVSIEVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a feature's register state (asm/prctl.h) */
#define XFEATURE_XTILEDATA 18      /* the AMX tiles' data */
#else
#define KVSIEVE_AMX 0
#endif

#define KVSIEVE_ABI 1
#if KVSIEVE_AVX2
#define LANES 8       /* entries per block: a vector's lanes */
#else
#define LANES 16      /* entries per block: a vector's lanes */
#endif
#define CHUNK 256     /* entries per unit of work */
#define MOST_DIM 256  /* head size */
#define MOST_WINDOW 128
#define GROUP 64      /* entries per round of the tiles: four blocks */

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

/* Whether the build has the vector code the pass needs: AVX-512, or AVX2 and FMA. */
int kvsieve_restkv_vector_code(void) { return KVSIEVE_VECTORS; }

#if KVSIEVE_VECTORS
/* LANES float32 lanes and the few operations the pass takes on them, each lane on its own (so the eight-lane code
 * computes every entry's numbers as the sixteen-lane code does, bit for bit). */
#if KVSIEVE_AVX512
typedef __m512 vec;
typedef __mmask16 lanemask;
static inline lanemask lanes_upto(int64_t count) { /* the lanes below count */
    return (__mmask16)(count >= 16 ? 0xFFFFu : ((1u << count) - 1u));
}
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vsqrt(vec a) { return _mm512_sqrt_ps(a); }
static inline vec vload(const float *p) { return _mm512_load_ps(p); } /* aligned */
static inline vec vload_some(lanemask lanes, const float *p) { return _mm512_maskz_loadu_ps(lanes, p); }
static inline void vstore_some(float *p, lanemask lanes, vec x) { _mm512_mask_storeu_ps(p, lanes, x); }
static inline __m512i order_keys(vec x) { /* the float's bits, negative numbers' reversed, without a branch */
    const __m512i bits = _mm512_castps_si512(x);
    return _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(INT32_MIN)));
}
static inline void store_order_keys(uint32_t *out, lanemask lanes, vec x) {
    _mm512_mask_storeu_epi32(out, lanes, order_keys(x));
}
#else
typedef __m256 vec;
typedef __m256i lanemask;
static inline lanemask lanes_upto(int64_t count) { /* the lanes below count: all ones */
    const int32_t c = count < 0 ? 0 : count > 8 ? 8 : (int32_t)count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vsqrt(vec a) { return _mm256_sqrt_ps(a); }
static inline vec vload(const float *p) { return _mm256_load_ps(p); } /* aligned */
static inline vec vload_some(lanemask lanes, const float *p) { return _mm256_maskload_ps(p, lanes); }
static inline void vstore_some(float *p, lanemask lanes, vec x) { _mm256_maskstore_ps(p, lanes, x); }
static inline void store_order_keys(uint32_t *out, lanemask lanes, vec x) {
    const __m256i bits = _mm256_castps_si256(x);
    _mm256_maskstore_epi32((int *)out, lanes, _mm256_xor_si256(bits, _mm256_or_si256(_mm256_srai_epi32(bits, 31),
                                                                                     _mm256_set1_epi32(INT32_MIN))));
}
#endif

static inline float value_at(const void *values, int kind, int64_t index) {
    if (kind == 0)
        return ((const float *)values)[index];
    uint32_t bits = (uint32_t)((const uint16_t *)values)[index] << 16; /* bfloat16: the top half of a float32 */
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* The values of entries j0 ... j0 + count - 1 (count <= 16) of one (batch item, KV head) as float32, transposed:
 * v[a] holds dimension a of the sixteen entries, one per lane (zero past count). */
static void transpose_values(const void *values, int kind, int64_t v_row, int64_t dim, int64_t j0, int64_t count,
                             vec *v) {
    float lanes[MOST_DIM][LANES] __attribute__((aligned(64)));
    for (int64_t l = 0; l < LANES; ++l)
        for (int64_t a = 0; a < dim; ++a)
            lanes[a][l] = l < count ? value_at(values, kind, (j0 + l) * v_row + a) : 0.0f;
    for (int64_t a = 0; a < dim; ++a)
        v[a] = vload(lanes[a]);
}

/* v G v' of the sixteen entries in v (G symmetric, dim x dim) from G's upper triangle, four rows of G at a time:
 * each v[c] read once for the four rows' products (two independent sums per row), so the loads do not bound the
 * fused multiply-adds. */
static vec gram_square(const vec *v, const float *gram, int64_t dim) {
    vec square = vzero();
    int64_t a = 0;
    for (; a + 4 <= dim; a += 4) {
        const float *g0 = gram + a * dim, *g1 = g0 + dim, *g2 = g1 + dim, *g3 = g2 + dim;
        vec s0 = vzero(), s1 = s0, s2 = s0, s3 = s0, t0 = s0, t1 = s0, t2 = s0, t3 = s0;
        int64_t c = a + 4;
        for (; c + 2 <= dim; c += 2) {
            const vec x = v[c], y = v[c + 1];
            s0 = vfma(vset(g0[c]), x, s0);
            s1 = vfma(vset(g1[c]), x, s1);
            s2 = vfma(vset(g2[c]), x, s2);
            s3 = vfma(vset(g3[c]), x, s3);
            t0 = vfma(vset(g0[c + 1]), y, t0);
            t1 = vfma(vset(g1[c + 1]), y, t1);
            t2 = vfma(vset(g2[c + 1]), y, t2);
            t3 = vfma(vset(g3[c + 1]), y, t3);
        }
        for (; c < dim; ++c) {
            s0 = vfma(vset(g0[c]), v[c], s0);
            s1 = vfma(vset(g1[c]), v[c], s1);
            s2 = vfma(vset(g2[c]), v[c], s2);
            s3 = vfma(vset(g3[c]), v[c], s3);
        }
        /* the four rows' own corner of the triangle */
        s0 = vfma(vset(g0[a + 1]), v[a + 1], s0);
        s0 = vfma(vset(g0[a + 2]), v[a + 2], s0);
        s0 = vfma(vset(g0[a + 3]), v[a + 3], s0);
        s1 = vfma(vset(g1[a + 2]), v[a + 2], s1);
        s1 = vfma(vset(g1[a + 3]), v[a + 3], s1);
        s2 = vfma(vset(g2[a + 3]), v[a + 3], s2);
        const vec two = vset(2.0f);
        const vec off[4] = {vadd(s0, t0), vadd(s1, t1), vadd(s2, t2), vadd(s3, t3)};
        const float diagonal[4] = {g0[a], g1[a + 1], g2[a + 2], g3[a + 3]};
        for (int i = 0; i < 4; ++i) {
            const vec inner = vfma(two, off[i], vmul(vset(diagonal[i]), v[a + i]));
            square = vfma(v[a + i], inner, square);
        }
    }
    for (; a < dim; ++a) { /* the last rows (dim not a multiple of 4) */
        const float *g = gram + a * dim;
        vec off = vzero();
        for (int64_t c = a + 1; c < dim; ++c)
            off = vfma(vset(g[c]), v[c], off);
        const vec inner = vfma(vset(2.0f), off, vmul(vset(g[a]), v[a]));
        square = vfma(v[a], inner, square);
    }
    return square;
}

/* One window query's indicator of a block's entries (cross: o_t G v' of each; square: v G v'), stored to out (the
 * entries present) as order keys (the float's bits, negative numbers' reversed: unsigned keys in the floats' order),
 * which the top-k reads, and total + weight x it. */
static inline vec query_indicator(vec cross, float outputs_sq, vec square, const float *attention_row,
                                  lanemask present, float eps, uint32_t *out, float weight, vec total) {
    /* as the PyTorch path: (-2 cross + o G o') + v G v', clamped at 0, then the root */
    const vec sq = vadd(vadd(vmul(cross, vset(-2.0f)),
                                                  vset(outputs_sq)), square);
    const vec distance = vsqrt(vmax(sq, vzero()));
    const vec attention = vload_some(present, attention_row);
    const vec value = vdiv(vmul(distance, attention),
                                       vmax(vsub(vset(1.0f), attention),
                                                     vset(eps)));
    store_order_keys(out, present, value);
    return vfma(vset(weight), value, total);
}

/* The indicator of one block of entries j0 ... j0 + count - 1 (count <= 16, their values transposed in v) for one
 * (batch item, query head): every window query's row written to indicator[t * prefix + j], the weighted sum to
 * smoothed[j]. */
static void block_indicator(const vec *v, int64_t dim, int64_t w, int64_t j0, int64_t count, int64_t prefix,
                            int64_t length, const float *rows, const float *projected, const float *outputs_sq,
                            const float *gram, const float *weights, float eps, uint32_t *indicator,
                            float *smoothed) {
    vec square = vzero(); /* v G v' */
    if (gram) {
        square = gram_square(v, gram, dim);
    } else {
        for (int64_t a = 0; a < dim; ++a)
            square = vfma(v[a], v[a], square);
    }
    const lanemask present = lanes_upto(count);
    vec total = vzero();
    for (int64_t t0 = 0; t0 < w; t0 += 8) {
        const int64_t span = w - t0 < 8 ? w - t0 : 8;
        vec cross[8];
        for (int i = 0; i < 8; ++i)
            cross[i] = vzero();
        if (span == 8) {
            for (int64_t a = 0; a < dim; ++a)
                for (int i = 0; i < 8; ++i)
                    cross[i] = vfma(vset(projected[(t0 + i) * dim + a]), v[a], cross[i]);
        } else {
            for (int64_t a = 0; a < dim; ++a)
                for (int64_t i = 0; i < span; ++i)
                    cross[i] = vfma(vset(projected[(t0 + i) * dim + a]), v[a], cross[i]);
        }
        for (int64_t i = 0; i < span; ++i) {
            const int64_t t = t0 + i;
            total = query_indicator(cross[i], outputs_sq[t], square, rows + t * length + j0, present, eps,
                                    indicator + t * prefix + j0, weights[t], total);
        }
    }
    vstore_some(smoothed + j0, present, total);
}


/* The k-th largest of keys[0 ... n - 1] (1 <= k <= n) by a radix selection: its top 11 bits from a histogram of all
 * n keys, then the keys in that bin alone, gathered into `bin_keys` (room for n), for the next 11 and the last 10. */
static uint32_t radix_kth(const uint32_t *keys, int64_t n, int64_t k, uint32_t *bin_keys) {
    uint32_t count[2048];
    memset(count, 0, sizeof count);
    for (int64_t j = 0; j < n; ++j)
        ++count[keys[j] >> 21];
    int64_t need = k;
    int bin = 2047;
    while (count[bin] < need) /* the bin holding the k-th largest */
        need -= count[bin--];
    uint32_t prefix = (uint32_t)bin << 21;
    int64_t m = 0;
    for (int64_t j = 0; j < n; ++j) { /* the bin's keys, without a branch */
        bin_keys[m] = keys[j];
        m += (keys[j] >> 21) == (uint32_t)bin;
    }
    const int shifts[2] = {10, 0}, widths[2] = {11, 10};
    uint32_t mask = 0xFFE00000u;
    for (int pass = 0; pass < 2; ++pass) {
        const int shift = shifts[pass], bins = 1 << widths[pass];
        memset(count, 0, (size_t)bins * sizeof count[0]);
        for (int64_t i = 0; i < m; ++i)
            if ((bin_keys[i] & mask) == prefix)
                ++count[(bin_keys[i] >> shift) & (uint32_t)(bins - 1)];
        bin = bins - 1;
        while (count[bin] < need)
            need -= count[bin--];
        prefix |= (uint32_t)bin << shift;
        mask |= (uint32_t)(bins - 1) << shift;
    }
    return prefix;
}

static inline uint32_t median_of_three(uint32_t a, uint32_t b, uint32_t c) {
    const uint32_t low = a < b ? a : b, high = a < b ? b : a;
    return c < low ? low : c > high ? high : c;
}

/* The k-th largest of keys[0 ... n - 1] (1 <= k <= n): a quickselect whose partitions run on the vector units with
 * AVX-512 (the keys above the pivot compressed to the front of a buffer, those below to its back, its equals counted;
 * with AVX2 a scalar partition without a branch) down to 32 keys, which an insertion sort orders; where 48 rounds of
 * pivots do not get there (keys that do not split), the radix selection (radix_kth). The result is the same key either way. `room` and `other` have room for n keys each. The
 * radix histogram alone took ~30 us per 4k row: the keys crowd into the bins of a few exponents, so most increments
 * wait on the one before; this takes a few. */
static uint32_t kth_largest(const uint32_t *keys, int64_t n, int64_t k, uint32_t *room, uint32_t *other) {
    const uint32_t *a = keys;
    uint32_t *buffers[2] = {room, other};
    int64_t m = n, want = k;
    for (int round = 0; m > 32; ++round) {
        if (round == 48)
            return radix_kth(a, m, want, buffers[round % 2]);
        const uint32_t pivot = median_of_three(a[0], a[m / 2], a[m - 1]);
        uint32_t *out = buffers[round % 2];
        int64_t above = 0, below = 0, j = 0;
#if KVSIEVE_AVX512
        const __m512i splat = _mm512_set1_epi32((int)pivot);
        for (; j + 16 <= m; j += 16) {
            const __m512i x = _mm512_loadu_si512(a + j);
            const __mmask16 up = _mm512_cmpgt_epu32_mask(x, splat), down = _mm512_cmplt_epu32_mask(x, splat);
            _mm512_mask_compressstoreu_epi32(out + above, up, x);
            above += __builtin_popcount(up);
            below += __builtin_popcount(down);
            _mm512_mask_compressstoreu_epi32(out + m - below, down, x);
        }
#endif
        for (; j < m; ++j) { /* without a branch: both stores land in the unfilled middle, one of them counts */
            const uint32_t x = a[j];
            out[above] = x;
            above += x > pivot;
            out[m - 1 - below] = x;
            below += x < pivot;
        }
        const int64_t equal = m - above - below;
        if (want <= above) {
            a = out, m = above;
        } else if (want <= above + equal) {
            return pivot;
        } else {
            want -= above + equal;
            a = out + m - below, m = below;
        }
    }
    uint32_t last[32];
    for (int64_t i = 0; i < m; ++i) { /* descending */
        int64_t at = i;
        while (at > 0 && last[at - 1] < a[i]) {
            last[at] = last[at - 1];
            --at;
        }
        last[at] = a[i];
    }
    return last[want - 1];
}

/* The mean index of the k largest of n scores, given as their order keys (query_indicator's; 1 <= k < n; ties at the
 * k-th value: the lowest indices): the k-th largest key (kth_largest), then one pass summing the indices above it and
 * one taking the lowest of its ties. `room` has room for 2 n. */
static float top_mean_index(const uint32_t *keys, int64_t n, int64_t k, uint32_t *room) {
    const uint32_t threshold = kth_largest(keys, n, k, room, room + n); /* `need` of its ties are taken, the lowest */
    int64_t sum = 0, above = 0, tie_sum = 0, ties = 0;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t over = keys[j] > threshold, tie = keys[j] == threshold;
        sum += over * j, above += over;
        tie_sum += tie * j, ties += tie;
    }
    if (above + ties == k) /* every tie is taken (one, mostly) */
        return (float)(sum + tie_sum) / (float)k;
    for (int64_t j = 0; j < n && above < k; ++j) /* the lowest of the ties */
        if (keys[j] == threshold)
            sum += j, ++above;
    return (float)sum / (float)k;
}

/* Eq. 10-12: each row's window width and shift from its window queries' mean top-k indices per_query (rows x w), as
 * kvsieve.ops.smoothing.drift_window_mean and adaptive_window with every query real: D_front and D_rear the halves'
 * means in double (rule 0: W = max(base, 2 floor(|dD| / beta) + 1); rule 1: W = base + 2 floor(|dD| / beta);
 * shift = trunc(dD / beta)); a window of fewer than two queries has no dD: width base, shift 0. Returns whether every
 * row keeps its scores as they are (width 1, shift 0: shifted_window_mean's early return), or -1 where a drift is too
 * large for an int64 (the caller then declines). */
static int plan_windows(const float *per_query, int64_t rows, int64_t w, double beta, int64_t base, int rule,
                        int64_t *widths, int64_t *shifts) {
    const int64_t half = w / 2;
    int unchanged = 1;
    for (int64_t row = 0; row < rows; ++row) {
        widths[row] = base, shifts[row] = 0;
        if (half > 0) {
            double front = 0.0, rear = 0.0;
            for (int64_t t = 0; t < half; ++t)
                front += per_query[row * w + t];
            for (int64_t t = half; t < w; ++t)
                rear += per_query[row * w + t];
            const double delta = front / (double)half - rear / (double)(w - half);
            if (!(fabs(delta) / beta < 1e15))
                return -1;
            const int64_t drift = 2 * (int64_t)floor(fabs(delta) / beta);
            widths[row] = rule == 0 ? (drift + 1 > base ? drift + 1 : base) : base + drift;
            shifts[row] = (int64_t)trunc(delta / beta);
        }
        unchanged &= widths[row] == 1 && shifts[row] == 0;
    }
    return unchanged;
}

/* Eq. 13 on one row of scores, in place: the mean over [j - W/2 + shift, j + W/2 + shift] (terms outside the row count
 * as 0, the divisor always W) from a float64 prefix sum taken in order (sums has room for length + 1). */
static void window_mean(float *scores, int64_t length, int64_t width, int64_t shift, double *sums) {
    sums[0] = 0.0;
    for (int64_t j = 0; j < length; ++j)
        sums[j + 1] = sums[j] + (double)scores[j];
    const int64_t half = width / 2;
    for (int64_t j = 0; j < length; ++j) {
        int64_t lo = j - half + shift, hi = j + half + shift + 1;
        lo = lo < 0 ? 0 : lo > length ? length : lo;
        hi = hi < 0 ? 0 : hi > length ? length : hi;
        scores[j] = (float)((sums[hi] - sums[lo]) / (double)width);
    }
}
#if KVSIEVE_AMX
/* The tiles' part (bfloat16 values with an AMX CPU): the three products of float32 accuracy on the tiles, each float32
 * operand taken as three bfloat16 parts (hi + mid + lo, each the rounding of what the parts before it leave; together
 * within ~2^-27 of the float), the other one bfloat16 already (the values), so that every product is exact in float32
 * and only the tiles' float32 sums round (the same as a float32 product's, in another order). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileShape;

static int tiles_granted(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* Eight tiles of 16 rows x 64 bytes: 0 ... 3 float32 sums (16 x 16), 4 ... 6 the first operand's three parts
 * (16 rows x 32 bfloat16), 7 the second operand (16 pairs x 16 columns x 2). */
static void shape_tiles(void) {
    TileShape shape;
    memset(&shape, 0, sizeof shape);
    shape.palette = 1;
    for (int tile = 0; tile < 8; ++tile) {
        shape.bytes_per_row[tile] = 64;
        shape.rows[tile] = 16;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(shape)); /* the whole shape as the operand (see fused_attention.c) */
}

static inline __m512 widen_bf16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* x[0 ... n - 1] as three bfloat16 parts, hi + mid + lo (each rounded to nearest), zero from n up to padded. */
static void split_parts(const float *x, int64_t n, int64_t padded, uint16_t *hi, uint16_t *mid, uint16_t *lo) {
    for (int64_t i = 0; i < padded; i += 16) {
        const int64_t left = n - i;
        const __mmask16 present = (__mmask16)(left >= 16 ? 0xFFFFu : left > 0 ? (1u << left) - 1u : 0u);
        __m512 rest = _mm512_maskz_loadu_ps(present, x + i);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(rest);
        rest = _mm512_sub_ps(rest, widen_bf16(h));
        const __m256i m = (__m256i)_mm512_cvtneps_pbh(rest);
        rest = _mm512_sub_ps(rest, widen_bf16(m));
        const __m256i l = (__m256i)_mm512_cvtneps_pbh(rest);
        const __mmask16 room = (__mmask16)(padded - i >= 16 ? 0xFFFFu : (1u << (padded - i)) - 1u);
        _mm256_mask_storeu_epi16(hi + i, room, h);
        _mm256_mask_storeu_epi16(mid + i, room, m);
        _mm256_mask_storeu_epi16(lo + i, room, l);
    }
}

static inline void zero_sums(int n) {
    _tile_zero(0);
    if (n > 1)
        _tile_zero(1);
    if (n > 2)
        _tile_zero(2);
    if (n > 3)
        _tile_zero(3);
}

/* sums tile `sum` += the three first-operand parts (tiles 4 ... 6) times the second operand (tile 7) */
static inline void add_products(int sum) {
    switch (sum) { /* the tile's number is an immediate */
    case 0: _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(0, 5, 7); _tile_dpbf16ps(0, 6, 7); break;
    case 1: _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7); _tile_dpbf16ps(1, 6, 7); break;
    case 2: _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(2, 5, 7); _tile_dpbf16ps(2, 6, 7); break;
    default: _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7); _tile_dpbf16ps(3, 6, 7); break;
    }
}

static inline void load_parts(const uint16_t *hi, const uint16_t *mid, const uint16_t *lo, int64_t stride) {
    _tile_loadd(4, hi, stride);
    _tile_loadd(5, mid, stride);
    _tile_loadd(6, lo, stride);
}

static inline void store_sums(int n, float *out, int64_t stride, int64_t step) {
    _tile_stored(0, out, stride);
    if (n > 1)
        _tile_stored(1, out + step, stride);
    if (n > 2)
        _tile_stored(2, out + 2 * step, stride);
    if (n > 3)
        _tile_stored(3, out + 3 * step, stride);
}

/* The bfloat16 values of one (batch item, KV head) as the second operand of A.v: entry pairs, each pair's dimensions
 * one after another with the two entries' values side by side ([pair][d][2]), zero from `length` up to `padded`. */
static void pack_value_pairs(const uint16_t *values, int64_t v_row, int64_t length, int64_t padded, int64_t dim,
                             uint16_t *packed) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < padded; j += 2)
        for (int64_t c = 0; c < dim; c += 32) { /* dim is a multiple of 32 */
            const __m512i first = j < length ? _mm512_loadu_si512(values + j * v_row + c) : _mm512_setzero_si512();
            const __m512i second = j + 1 < length ? _mm512_loadu_si512(values + (j + 1) * v_row + c)
                                                  : _mm512_setzero_si512();
            uint16_t *out = packed + ((j / 2) * dim + c) * 2;
            _mm512_storeu_si512(out, _mm512_permutex2var_epi16(first, low, second));
            _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(first, high, second));
        }
}

/* The row stride of window_outputs_tile's parts: a row of `padded` bfloat16 and one cache line more, so that a tile's
 * 16 rows do not fall on the same cache set (a multiple of 4 KiB apart, they did: 10x slower). */
static inline int64_t parts_stride(int64_t padded) { return padded + 32; }

/* Window outputs o_t = sum_j A[t, j] v_j of rows r0 ... r0 + 15 (those below `count`) of one KV head's group of query
 * heads (`rows` their (count x length) float32 block, packed the group's values from pack_value_pairs), written to
 * out (count x dim). `parts` has room for 3 x 16 x parts_stride(padded) + 32 bfloat16. */
static void window_outputs_tile(const float *rows, int64_t count, int64_t length, int64_t padded, int64_t r0,
                                const uint16_t *packed, int64_t dim, uint16_t *parts, float *out) {
    const int64_t stride = parts_stride(padded);
    uint16_t *hi = parts, *mid = parts + 16 * stride + 32, *lo = mid + 16 * stride; /* the parts a line apart too */
    for (int64_t i = 0; i < 16; ++i)
        split_parts(rows + (r0 + i) * length, r0 + i < count ? length : 0, padded, hi + i * stride,
                    mid + i * stride, lo + i * stride);
    float sums[16 * MOST_DIM] __attribute__((aligned(64)));
    for (int64_t c0 = 0; c0 < dim; c0 += 64) {
        const int n = dim - c0 >= 64 ? 4 : (int)((dim - c0) / 16);
        zero_sums(n);
        for (int64_t k0 = 0; k0 < padded; k0 += 32) {
            load_parts(hi + k0, mid + k0, lo + k0, stride * 2);
            for (int i = 0; i < n; ++i) {
                _tile_loadd(7, packed + ((k0 / 2) * dim + c0 + 16 * i) * 2, dim * 4);
                add_products(i);
            }
        }
        store_sums(n, sums + c0, dim * 4, 16);
    }
    for (int64_t i = 0; i < 16 && r0 + i < count; ++i)
        memcpy(out + (r0 + i) * dim, sums + i * dim, (size_t)dim * 4);
}

/* sums[r][16 i ... 16 i + 15] (r < parts_rows, a multiple of 16; GROUP floats a row) = the first operand (three
 * bfloat16 parts, (parts_rows x dim) each, `part` elements apart) times block i's values (i < blocks <= 4; `packed`
 * from transpose_block, dim / 2 x 16 a block), over the dimensions: each tile of the first operand's parts is loaded
 * once for the four blocks (a tile a block, loading them again for each block took twice as long). */
static void times_blocks(const uint16_t *first, int64_t part, int64_t parts_rows, int64_t dim, const uint32_t *packed,
                         int blocks, float *sums) {
    const int64_t block_size = dim / 2 * LANES;
    for (int64_t r0 = 0; r0 < parts_rows; r0 += 16) {
        zero_sums(blocks);
        for (int64_t k0 = 0; k0 < dim; k0 += 32) {
            const uint16_t *a = first + r0 * dim + k0;
            load_parts(a, a + part, a + 2 * part, dim * 2);
            for (int i = 0; i < blocks; ++i) {
                _tile_loadd(7, packed + i * block_size + (k0 / 2) * LANES, 64);
                add_products(i);
            }
        }
        store_sums(blocks, sums + r0 * GROUP, GROUP * 4, LANES);
    }
}

/* Entries j0 ... j0 + count - 1 (count <= 16) of one (batch item, KV head), bfloat16: v[a] their dimension a as
 * float32 lanes (zero past count), as transpose_values; block their dimension pairs as the tiles' second operand
 * ([pair][entry], two bfloat16 in 32 bits). */
static void transpose_block(const uint16_t *values, int64_t v_row, int64_t dim, int64_t j0, int64_t count, __m512 *v,
                            uint32_t *block) {
    const __mmask16 present = (__mmask16)(count >= LANES ? 0xFFFFu : (1u << count) - 1u);
    const __m512i entry = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32((int)v_row)); /* in bfloat16 elements */
    const uint16_t *first = values + j0 * v_row;
    for (int64_t p = 0; p < dim / 2; ++p) { /* pair p of the sixteen entries, one gather */
        const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, entry, first + 2 * p, 2);
        _mm512_storeu_si512(block + p * LANES, pair);
        v[2 * p] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        v[2 * p + 1] = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
}

/* One thread's room for a round of the tiles' indicator: the four blocks' values as float32 lanes and packed, (v G)'
 * ([dimension][entry]) and o_t G v' ([window query][entry]), GROUP entries a row; one allocation (values holds it). */
typedef struct {
    __m512 *values;
    uint32_t *packed;
    float *spread, *cross;
} TileScratch;

static int tile_scratch(TileScratch *scratch) {
    const size_t values = 4 * MOST_DIM * 64, packed = 4 * (MOST_DIM / 2) * LANES * 4;
    const size_t spread = MOST_DIM * GROUP * 4, cross = MOST_WINDOW * GROUP * 4;
    char *room = aligned_alloc(64, values + packed + spread + cross);
    if (!room)
        return 0;
    scratch->values = (__m512 *)room;
    scratch->packed = (uint32_t *)(room + values);
    scratch->spread = (float *)(room + values + packed);
    scratch->cross = (float *)(room + values + packed + spread);
    return 1;
}
#endif
#endif

/* Whether the pass takes its products on the AMX tiles here (bfloat16 values of a head size a multiple of 32): built
 * with them and granted by the kernel. Only then may `outputs` be NULL. */
int kvsieve_restkv_tiles(void) {
#if KVSIEVE_AMX
    return tiles_granted();
#else
    return 0;
#endif
}

/* rows: float32 (batch, q_heads, w, length) and outputs (o_t) float32 (batch, q_heads, w, dim), contiguous, or NULL
 * (computed here from rows and values, on the tiles: kvsieve_restkv_tiles, bfloat16 values, dim a multiple of 32);
 * values:
 * float32 (kind 0) or bfloat16 (kind 1) (batch, kv_heads, length, dim) with strides in elements (unit over dim);
 * gram: float32 (q_heads, dim, dim), contiguous, or NULL (the identity); weights: float32 (w); budgets: int64
 * (batch, q_heads), or NULL (per_query not written). Writes smoothed float32 (batch, q_heads, length) (0 from
 * prefix on) and per_query float32 (batch, q_heads, w). With budgets and smooth != 0, smoothed is then the adaptive
 * window's mean (plan_windows with beta > 0, base >= 1 and rule 0 or 1, then window_mean). Returns 0, or -1 (no vector
 * code, sizes it does not take, no memory: nothing to use). */
int kvsieve_restkv_window_scores(int64_t batch, int64_t kv_heads, int64_t groups, int64_t w, int64_t length,
                                 int64_t dim, int64_t prefix, const float *rows, const float *outputs,
                                 const void *values, int kind, int64_t v_batch, int64_t v_head, int64_t v_row,
                                 const float *gram, const float *weights, const int64_t *budgets, float eps,
                                 int smooth, double beta, int64_t base, int rule, float *smoothed, float *per_query) {
#if KVSIEVE_VECTORS
    if (batch < 1 || kv_heads < 1 || groups < 1 || w < 1 || w > MOST_WINDOW || dim < 1 || dim > MOST_DIM
            || prefix < 0 || prefix > length || (kind != 0 && kind != 1)
            || (smooth && (!budgets || !(beta > 0.0) || base < 1 || (rule != 0 && rule != 1))))
        return -1;
    const int64_t q_heads = kv_heads * groups, heads = batch * q_heads;
    const int64_t chunks = (prefix + CHUNK - 1) / CHUNK;
#if KVSIEVE_AMX
    /* (the gathers take 32-bit offsets) */
    const int tiles = kind == 1 && dim % 32 == 0 && v_row <= INT32_MAX / LANES && tiles_granted();
#else
    const int tiles = 0;
#endif
    if (!outputs && !tiles)
        return -1;
    /* with the tiles: the values packed for A.v (when computing the outputs), each row's o_t G and each head's G in
     * three bfloat16 parts, the window rounded up to whole tiles */
    const int64_t padded = (length + 31) / 32 * 32, w_tiles = (w + 15) / 16 * 16;
    float *projected = malloc((size_t)(heads * w * dim) * 4), *outputs_sq = malloc((size_t)(heads * w) * 4);
    uint32_t *indicator = malloc((size_t)(heads * w * (prefix > 0 ? prefix : 1)) * 4); /* as order keys */
    int64_t *widths = smooth ? malloc((size_t)heads * 16) : NULL, *shifts = widths ? widths + heads : NULL;
    float *own_outputs = outputs ? NULL : malloc((size_t)(heads * w * dim) * 4);
    uint16_t *packed = outputs ? NULL : malloc((size_t)(batch * kv_heads * padded * dim) * 2);
    uint16_t *projected_parts = tiles ? malloc((size_t)(heads * 3 * w_tiles * dim) * 2) : NULL;
    uint16_t *gram_parts = tiles && gram ? malloc((size_t)(q_heads * 3 * dim * dim) * 2) : NULL;
    if (!projected || !outputs_sq || !indicator || (smooth && !widths) || (!outputs && (!own_outputs || !packed))
            || (tiles && !projected_parts) || (tiles && gram && !gram_parts)) {
        free(projected), free(outputs_sq), free(indicator), free(widths), free(own_outputs), free(packed);
        free(projected_parts), free(gram_parts);
        return -1;
    }
    const float *window_out = outputs ? outputs : own_outputs;
    int failed = 0, unchanged = 0;
#pragma omp parallel if (heads * prefix >= 4096)
    {
#if KVSIEVE_AMX
    if (tiles)
        shape_tiles();
    if (!outputs) { /* o_t = sum_j A[t, j] v_j on the tiles, 16 rows of a KV head's group a unit */
        const int64_t group_rows = groups * w, units = (group_rows + 15) / 16;
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < batch * kv_heads; ++pair)
            pack_value_pairs((const uint16_t *)values + (pair / kv_heads) * v_batch + (pair % kv_heads) * v_head,
                             v_row, length, padded, dim, packed + pair * padded * dim);
        uint16_t *parts = malloc((size_t)(3 * 16 * parts_stride(padded) + 32) * 2);
        if (!parts) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < batch * kv_heads * units; ++u) {
            const int64_t pair = u / units, first = (pair / kv_heads) * q_heads + (pair % kv_heads) * groups;
            if (parts)
                window_outputs_tile(rows + first * w * length, group_rows, length, padded, (u % units) * 16,
                                    packed + pair * padded * dim, dim, parts, own_outputs + first * w * dim);
        }
        free(parts);
    }
    if (gram_parts) {
#pragma omp for schedule(static)
        for (int64_t h = 0; h < q_heads; ++h) {
            uint16_t *part = gram_parts + h * 3 * dim * dim;
            for (int64_t a = 0; a < dim; ++a)
                split_parts(gram + (h * dim + a) * dim, dim, dim, part + a * dim, part + dim * dim + a * dim,
                            part + 2 * dim * dim + a * dim);
        }
    }
#endif
#pragma omp for schedule(static)
    for (int64_t row = 0; row < heads; ++row) { /* o_t G and o_t G o_t' */
        const float *o = window_out + row * w * dim, *g = gram ? gram + (row % q_heads) * dim * dim : NULL;
        float *p = projected + row * w * dim;
        for (int64_t t = 0; t < w; ++t) {
            if (g) { /* p[c] = sum over a of o[a] g[a][c], a in order, a vector of c at a time */
                for (int64_t c0 = 0; c0 < dim; c0 += LANES) {
                    const lanemask lanes = lanes_upto(dim - c0);
                    vec sum = vzero();
                    for (int64_t a = 0; a < dim; ++a)
                        sum = vadd(sum, vmul(vset(o[t * dim + a]), vload_some(lanes, g + a * dim + c0)));
                    vstore_some(p + t * dim + c0, lanes, sum);
                }
            } else {
                memcpy(p + t * dim, o + t * dim, (size_t)dim * 4);
            }
            float square = 0.0f;
            for (int64_t a = 0; a < dim; ++a)
                square += p[t * dim + a] * o[t * dim + a];
            outputs_sq[row * w + t] = square;
        }
#if KVSIEVE_AMX
        if (projected_parts) {
            uint16_t *part = projected_parts + row * 3 * w_tiles * dim;
            split_parts(p, w * dim, w_tiles * dim, part, part + w_tiles * dim, part + 2 * w_tiles * dim);
        }
#endif
        memset(smoothed + row * length + prefix, 0, (size_t)(length - prefix) * 4);
    }
#if KVSIEVE_AMX
    TileScratch scratch = {NULL, NULL, NULL, NULL};
    if (tiles && !tile_scratch(&scratch)) {
#pragma omp atomic write
        failed = 1;
    }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < batch * kv_heads * chunks; ++u) { /* the indicator, block by block */
        const int64_t pair = u / chunks, chunk = u % chunks, b = pair / kv_heads, g = pair % kv_heads;
        const void *v = kind == 0 ? (const void *)((const float *)values + b * v_batch + g * v_head)
                                  : (const void *)((const uint16_t *)values + b * v_batch + g * v_head);
        const int64_t end = (chunk + 1) * CHUNK < prefix ? (chunk + 1) * CHUNK : prefix;
        vec transposed[MOST_DIM];
        for (int64_t j0 = chunk * CHUNK; j0 < end; j0 += LANES) {
            const int64_t count = end - j0 < LANES ? end - j0 : LANES;
#if KVSIEVE_AMX
            if (tiles && !scratch.values)
                break;
            if (tiles) { /* four blocks a round */
                const int64_t round_end = j0 + GROUP < end ? j0 + GROUP : end;
                const int blocks = (int)((round_end - j0 + LANES - 1) / LANES);
                for (int i = 0; i < blocks; ++i) { /* once for the group's query heads */
                    const int64_t first = j0 + i * LANES, left = round_end - first;
                    transpose_block(v, v_row, dim, first, left < LANES ? left : LANES, scratch.values + i * MOST_DIM,
                                    scratch.packed + i * (dim / 2) * LANES);
                }
                for (int64_t h = g * groups; h < (g + 1) * groups; ++h) {
                    const int64_t row = b * q_heads + h;
                    if (gram_parts)
                        times_blocks(gram_parts + h * 3 * dim * dim, dim * dim, dim, dim, scratch.packed, blocks,
                                     scratch.spread);
                    times_blocks(projected_parts + row * 3 * w_tiles * dim, w_tiles * dim, w_tiles, dim,
                                 scratch.packed, blocks, scratch.cross);
                    for (int i = 0; i < blocks; ++i) {
                        const int64_t first = j0 + i * LANES, left = round_end - first;
                        const __mmask16 present = (__mmask16)(left >= LANES ? 0xFFFFu : ((1u << left) - 1u));
                        const __m512 *vi = scratch.values + i * MOST_DIM;
                        __m512 square = _mm512_setzero_ps(), total = _mm512_setzero_ps();
                        for (int64_t a = 0; a < dim; ++a)
                            square = _mm512_fmadd_ps(gram_parts ? _mm512_load_ps(scratch.spread + a * GROUP + i * LANES)
                                                                : vi[a], vi[a], square);
                        for (int64_t t = 0; t < w; ++t) {
                            const int64_t query = row * w + t;
                            total = query_indicator(_mm512_load_ps(scratch.cross + t * GROUP + i * LANES),
                                                    outputs_sq[query], square, rows + query * length + first, present,
                                                    eps, indicator + query * prefix + first, weights[t], total);
                        }
                        _mm512_mask_storeu_ps(smoothed + row * length + first, present, total);
                    }
                }
                j0 += GROUP - LANES; /* the loop adds the rest */
                continue;
            }
#endif
            transpose_values(v, kind, v_row, dim, j0, count, transposed); /* once for the group's query heads */
            for (int64_t h = g * groups; h < (g + 1) * groups; ++h) {
                const int64_t row = b * q_heads + h;
                block_indicator(transposed, dim, w, j0, count, prefix, length, rows + row * w * length,
                                projected + row * w * dim, outputs_sq + row * w, gram ? gram + h * dim * dim : NULL,
                                weights, eps, indicator + row * w * prefix, smoothed + row * length);
            }
        }
    }
#if KVSIEVE_AMX
    free(scratch.values);
#endif
    if (budgets) {
        const int64_t most = prefix > 0 ? prefix : 1;
        uint32_t *room = malloc((size_t)most * 8); /* kth_largest's two buffers */
        if (!room) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < heads * w; ++u) { /* each window query's top-k mean index */
            if (!room)
                continue;
            const int64_t row = u / w, t = u % w, k = budgets[row];
            float mean = 0.0f;
            if (k > 0 && prefix > 0)
                mean = k >= prefix ? (float)(prefix * (prefix - 1) / 2) / (float)prefix /* all of them */
                                   : top_mean_index(indicator + (row * w + t) * prefix, prefix, k, room);
            per_query[u] = mean;
        }
        free(room);
    }
    if (smooth) { /* the adaptive window, once every query's mean index is known (the loop above ends in a barrier) */
#pragma omp single
        {
            unchanged = failed ? 1 : plan_windows(per_query, heads, w, beta, base, rule, widths, shifts);
            if (unchanged < 0)
                failed = 1;
        }
        double *sums = unchanged ? NULL : malloc((size_t)(length + 1) * 8);
        if (!unchanged && !sums) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t row = 0; row < heads; ++row)
            if (sums)
                window_mean(smoothed + row * length, length, widths[row], shifts[row], sums);
        free(sums);
    }
#if KVSIEVE_AMX
    if (tiles)
        _tile_release();
#endif
    }
    free(projected), free(outputs_sq), free(indicator), free(widths), free(own_outputs), free(packed);
    free(projected_parts), free(gram_parts);
    return failed ? -1 : 0;
#else
    (void)batch, (void)kv_heads, (void)groups, (void)w, (void)length, (void)dim, (void)prefix, (void)rows;
    (void)outputs, (void)values, (void)kind, (void)v_batch, (void)v_head, (void)v_row, (void)gram, (void)weights;
    (void)budgets, (void)eps, (void)smooth, (void)beta, (void)base, (void)rule, (void)smoothed, (void)per_query;
    return -1;
#endif
}
