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
 * in the order torch.cumsum takes, so the smoothed scores are too, bit for bit, given the same unsmoothed ones).
 * Without `smooth` kvsieve.ops.smoothing.drift_window_mean turns per_query into the adaptive window. The PyTorch path computes the
 * same expansion in float32 with other summation orders, so the scores agree within float32 rounding (relative ~1e-6,
 * more where o_t ~ v_j, where the expansion cancels in both); where several entries tie at the k-th largest value the
 * lowest indices are taken (torch.topk takes any of them).
 *
 * Work: o_t G per (batch item, query head); then blocks of 16 entries, one per vector lane, the values of a block
 * transposed to float32 once for the KV head's query heads so that each of the d dimensions is one vector (v G v' from
 * G's upper triangle, o_t G v' for every window query); then one selection per (batch item, query head, window query)
 * (a radix selection of the k-th largest: three histograms of the float's ordered bits). Each part's units
 * are shared among torch's OpenMP threads. Vector code needs AVX-512 (-march=native on a CPU with it); elsewhere the
 * function returns -1 and the caller keeps PyTorch.
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

#define KVSIEVE_ABI 1
#define LANES 16      /* entries per block */
#define CHUNK 256     /* entries per unit of work */
#define MOST_DIM 256  /* head size */
#define MOST_WINDOW 128

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

/* Whether the build has the vector code the pass needs (AVX-512). */
int kvsieve_restkv_vector_code(void) { return KVSIEVE_AVX512; }

#if KVSIEVE_AVX512
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
                             __m512 *v) {
    float lanes[MOST_DIM][LANES] __attribute__((aligned(64)));
    for (int64_t l = 0; l < LANES; ++l)
        for (int64_t a = 0; a < dim; ++a)
            lanes[a][l] = l < count ? value_at(values, kind, (j0 + l) * v_row + a) : 0.0f;
    for (int64_t a = 0; a < dim; ++a)
        v[a] = _mm512_load_ps(lanes[a]);
}

/* v G v' of the sixteen entries in v (G symmetric, dim x dim) from G's upper triangle, four rows of G at a time:
 * each v[c] read once for the four rows' products (two independent sums per row), so the loads do not bound the
 * fused multiply-adds. */
static __m512 gram_square(const __m512 *v, const float *gram, int64_t dim) {
    __m512 square = _mm512_setzero_ps();
    int64_t a = 0;
    for (; a + 4 <= dim; a += 4) {
        const float *g0 = gram + a * dim, *g1 = g0 + dim, *g2 = g1 + dim, *g3 = g2 + dim;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, t0 = s0, t1 = s0, t2 = s0, t3 = s0;
        int64_t c = a + 4;
        for (; c + 2 <= dim; c += 2) {
            const __m512 x = v[c], y = v[c + 1];
            s0 = _mm512_fmadd_ps(_mm512_set1_ps(g0[c]), x, s0);
            s1 = _mm512_fmadd_ps(_mm512_set1_ps(g1[c]), x, s1);
            s2 = _mm512_fmadd_ps(_mm512_set1_ps(g2[c]), x, s2);
            s3 = _mm512_fmadd_ps(_mm512_set1_ps(g3[c]), x, s3);
            t0 = _mm512_fmadd_ps(_mm512_set1_ps(g0[c + 1]), y, t0);
            t1 = _mm512_fmadd_ps(_mm512_set1_ps(g1[c + 1]), y, t1);
            t2 = _mm512_fmadd_ps(_mm512_set1_ps(g2[c + 1]), y, t2);
            t3 = _mm512_fmadd_ps(_mm512_set1_ps(g3[c + 1]), y, t3);
        }
        for (; c < dim; ++c) {
            s0 = _mm512_fmadd_ps(_mm512_set1_ps(g0[c]), v[c], s0);
            s1 = _mm512_fmadd_ps(_mm512_set1_ps(g1[c]), v[c], s1);
            s2 = _mm512_fmadd_ps(_mm512_set1_ps(g2[c]), v[c], s2);
            s3 = _mm512_fmadd_ps(_mm512_set1_ps(g3[c]), v[c], s3);
        }
        /* the four rows' own corner of the triangle */
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(g0[a + 1]), v[a + 1], s0);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(g0[a + 2]), v[a + 2], s0);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(g0[a + 3]), v[a + 3], s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(g1[a + 2]), v[a + 2], s1);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(g1[a + 3]), v[a + 3], s1);
        s2 = _mm512_fmadd_ps(_mm512_set1_ps(g2[a + 3]), v[a + 3], s2);
        const __m512 two = _mm512_set1_ps(2.0f);
        const __m512 off[4] = {_mm512_add_ps(s0, t0), _mm512_add_ps(s1, t1), _mm512_add_ps(s2, t2),
                               _mm512_add_ps(s3, t3)};
        const float diagonal[4] = {g0[a], g1[a + 1], g2[a + 2], g3[a + 3]};
        for (int i = 0; i < 4; ++i) {
            const __m512 inner = _mm512_fmadd_ps(two, off[i], _mm512_mul_ps(_mm512_set1_ps(diagonal[i]), v[a + i]));
            square = _mm512_fmadd_ps(v[a + i], inner, square);
        }
    }
    for (; a < dim; ++a) { /* the last rows (dim not a multiple of 4) */
        const float *g = gram + a * dim;
        __m512 off = _mm512_setzero_ps();
        for (int64_t c = a + 1; c < dim; ++c)
            off = _mm512_fmadd_ps(_mm512_set1_ps(g[c]), v[c], off);
        const __m512 inner = _mm512_fmadd_ps(_mm512_set1_ps(2.0f), off, _mm512_mul_ps(_mm512_set1_ps(g[a]), v[a]));
        square = _mm512_fmadd_ps(v[a], inner, square);
    }
    return square;
}

/* The indicator of one block of entries j0 ... j0 + count - 1 (count <= 16, their values transposed in v) for one
 * (batch item, query head): every window query's row written to indicator[t * prefix + j], the weighted sum to
 * smoothed[j]. */
static void block_indicator(const __m512 *v, int64_t dim, int64_t w, int64_t j0, int64_t count, int64_t prefix,
                            int64_t length, const float *rows, const float *projected, const float *outputs_sq,
                            const float *gram, const float *weights, float eps, float *indicator, float *smoothed) {
    __m512 square = _mm512_setzero_ps(); /* v G v' */
    if (gram) {
        square = gram_square(v, gram, dim);
    } else {
        for (int64_t a = 0; a < dim; ++a)
            square = _mm512_fmadd_ps(v[a], v[a], square);
    }
    const __mmask16 present = (__mmask16)(count >= LANES ? 0xFFFFu : ((1u << count) - 1u));
    const __m512 one = _mm512_set1_ps(1.0f), floor_eps = _mm512_set1_ps(eps), zero = _mm512_setzero_ps();
    __m512 total = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < w; t0 += 8) {
        const int64_t span = w - t0 < 8 ? w - t0 : 8;
        __m512 cross[8];
        for (int i = 0; i < 8; ++i)
            cross[i] = _mm512_setzero_ps();
        if (span == 8) {
            for (int64_t a = 0; a < dim; ++a)
                for (int i = 0; i < 8; ++i)
                    cross[i] = _mm512_fmadd_ps(_mm512_set1_ps(projected[(t0 + i) * dim + a]), v[a], cross[i]);
        } else {
            for (int64_t a = 0; a < dim; ++a)
                for (int64_t i = 0; i < span; ++i)
                    cross[i] = _mm512_fmadd_ps(_mm512_set1_ps(projected[(t0 + i) * dim + a]), v[a], cross[i]);
        }
        for (int64_t i = 0; i < span; ++i) {
            const int64_t t = t0 + i;
            /* as the PyTorch path: (-2 cross + o G o') + v G v', clamped at 0, then the root */
            __m512 sq = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(cross[i], _mm512_set1_ps(-2.0f)),
                                                    _mm512_set1_ps(outputs_sq[t])), square);
            const __m512 distance = _mm512_sqrt_ps(_mm512_max_ps(sq, zero));
            const __m512 attention = _mm512_maskz_loadu_ps(present, rows + t * length + j0);
            const __m512 value = _mm512_div_ps(_mm512_mul_ps(distance, attention),
                                               _mm512_max_ps(_mm512_sub_ps(one, attention), floor_eps));
            _mm512_mask_storeu_ps(indicator + t * prefix + j0, present, value);
            total = _mm512_fmadd_ps(_mm512_set1_ps(weights[t]), value, total);
        }
    }
    _mm512_mask_storeu_ps(smoothed + j0, present, total);
}

/* A float32's bits as an unsigned key in the same order (negative numbers' bits reversed), without a branch. */
static inline uint32_t order_key(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint32_t negative = (uint32_t)((int32_t)bits >> 31);
    return bits ^ (negative | 0x80000000u);
}

/* The mean index of the k largest of scores[0 ... n - 1] (1 <= k < n; ties at the k-th value: the lowest indices):
 * a radix selection of the k-th largest key (its top 11 bits from a histogram of all n keys, then the keys in that
 * bin alone, gathered into `bin_keys`, for the next 11 and the last 10), then one pass summing the indices above it.
 * `keys` and `bin_keys` have room for n. */
static float top_mean_index(const float *scores, int64_t n, int64_t k, uint32_t *keys, uint32_t *bin_keys) {
    uint32_t count[2048];
    memset(count, 0, sizeof count);
    for (int64_t j = 0; j < n; ++j)
        keys[j] = order_key(scores[j]);
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
    const uint32_t threshold = prefix; /* the k-th largest key; `need` of its ties are taken, the lowest first */
    int64_t sum = 0, above = 0;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t over = keys[j] > threshold;
        sum += over * j;
        above += over;
    }
    for (int64_t j = 0; j < n && above < k; ++j)
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
#endif

/* rows: float32 (batch, q_heads, w, length) and outputs (o_t) float32 (batch, q_heads, w, dim), contiguous; values:
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
#if KVSIEVE_AVX512
    if (batch < 1 || kv_heads < 1 || groups < 1 || w < 1 || w > MOST_WINDOW || dim < 1 || dim > MOST_DIM
            || prefix < 0 || prefix > length || (kind != 0 && kind != 1)
            || (smooth && (!budgets || !(beta > 0.0) || base < 1 || (rule != 0 && rule != 1))))
        return -1;
    const int64_t q_heads = kv_heads * groups, heads = batch * q_heads;
    const int64_t chunks = (prefix + CHUNK - 1) / CHUNK;
    float *projected = malloc((size_t)(heads * w * dim) * 4), *outputs_sq = malloc((size_t)(heads * w) * 4);
    float *indicator = malloc((size_t)(heads * w * (prefix > 0 ? prefix : 1)) * 4);
    int64_t *widths = smooth ? malloc((size_t)heads * 16) : NULL, *shifts = widths ? widths + heads : NULL;
    if (!projected || !outputs_sq || !indicator || (smooth && !widths)) {
        free(projected), free(outputs_sq), free(indicator), free(widths);
        return -1;
    }
    int failed = 0, unchanged = 0;
#pragma omp parallel if (heads * prefix >= 4096)
    {
#pragma omp for schedule(static)
    for (int64_t row = 0; row < heads; ++row) { /* o_t G and o_t G o_t' */
        const float *o = outputs + row * w * dim, *g = gram ? gram + (row % q_heads) * dim * dim : NULL;
        float *p = projected + row * w * dim;
        for (int64_t t = 0; t < w; ++t) {
            for (int64_t c = 0; c < dim; ++c) {
                float sum = 0.0f;
                if (g)
                    for (int64_t a = 0; a < dim; ++a)
                        sum += o[t * dim + a] * g[a * dim + c];
                else
                    sum = o[t * dim + c];
                p[t * dim + c] = sum;
            }
            float square = 0.0f;
            for (int64_t a = 0; a < dim; ++a)
                square += p[t * dim + a] * o[t * dim + a];
            outputs_sq[row * w + t] = square;
        }
        memset(smoothed + row * length + prefix, 0, (size_t)(length - prefix) * 4);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < batch * kv_heads * chunks; ++u) { /* the indicator, block by block */
        const int64_t pair = u / chunks, chunk = u % chunks, b = pair / kv_heads, g = pair % kv_heads;
        const void *v = kind == 0 ? (const void *)((const float *)values + b * v_batch + g * v_head)
                                  : (const void *)((const uint16_t *)values + b * v_batch + g * v_head);
        const int64_t end = (chunk + 1) * CHUNK < prefix ? (chunk + 1) * CHUNK : prefix;
        __m512 transposed[MOST_DIM];
        for (int64_t j0 = chunk * CHUNK; j0 < end; j0 += LANES) {
            const int64_t count = end - j0 < LANES ? end - j0 : LANES;
            transpose_values(v, kind, v_row, dim, j0, count, transposed); /* once for the group's query heads */
            for (int64_t h = g * groups; h < (g + 1) * groups; ++h) {
                const int64_t row = b * q_heads + h;
                block_indicator(transposed, dim, w, j0, count, prefix, length, rows + row * w * length,
                                projected + row * w * dim, outputs_sq + row * w, gram ? gram + h * dim * dim : NULL,
                                weights, eps, indicator + row * w * prefix, smoothed + row * length);
            }
        }
    }
    if (budgets) {
        const int64_t room = prefix > 0 ? prefix : 1;
        uint32_t *keys = malloc((size_t)room * 8), *bin_keys = keys ? keys + room : NULL;
        if (!keys) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < heads * w; ++u) { /* each window query's top-k mean index */
            if (!keys)
                continue;
            const int64_t row = u / w, t = u % w, k = budgets[row];
            float mean = 0.0f;
            if (k > 0 && prefix > 0)
                mean = k >= prefix ? (float)(prefix * (prefix - 1) / 2) / (float)prefix /* all of them */
                                   : top_mean_index(indicator + (row * w + t) * prefix, prefix, k, keys, bin_keys);
            per_query[u] = mean;
        }
        free(keys);
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
    }
    free(projected), free(outputs_sq), free(indicator), free(widths);
    return failed ? -1 : 0;
#else
    (void)batch, (void)kv_heads, (void)groups, (void)w, (void)length, (void)dim, (void)prefix, (void)rows;
    (void)outputs, (void)values, (void)kind, (void)v_batch, (void)v_head, (void)v_row, (void)gram, (void)weights;
    (void)budgets, (void)eps, (void)smooth, (void)beta, (void)base, (void)rule, (void)smoothed, (void)per_query;
    return -1;
#endif
}
