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
 * which kvsieve.ops.smoothing.adaptive_spatial_smoothing turns into the adaptive window. The PyTorch path computes the
 * same expansion in float32 with other summation orders, so the scores agree within float32 rounding (relative ~1e-6,
 * more where o_t ~ v_j, where the expansion cancels in both); where several entries tie at the k-th largest value the
 * lowest indices are taken (torch.topk takes any of them).
 *
 * Work: o_t G per (batch item, query head); then blocks of 16 entries, one per vector lane, the values of a block
 * transposed to float32 so that each of the d dimensions is one vector (v G v' from G's upper triangle, o_t G v' for
 * every window query); then one selection (quickselect) per (batch item, query head, window query). Each part's units
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

/* The k-th largest of a[0 ... n - 1] (1 <= k <= n), reordering a (Hoare's selection). */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t target = k - 1;
    while (lo < hi) {
        const float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        const float pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y)); /* the median */
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot)
                ++i;
            while (a[j] < pivot)
                --j;
            if (i <= j) {
                const float swap = a[i];
                a[i] = a[j];
                a[j] = swap;
                ++i;
                --j;
            }
        }
        if (target <= j)
            hi = j;
        else if (target >= i)
            lo = i;
        else
            break;
    }
    return a[target];
}

/* The indicator of one block of entries j0 ... j0 + count - 1 (count <= 16) of one (batch item, query head), every
 * window query's row written to indicator[t * prefix + j] and the weighted sum to smoothed[j]. */
static void block_indicator(const void *values, int kind, int64_t v_row, int64_t dim, int64_t w, int64_t j0,
                            int64_t count, int64_t prefix, int64_t length, const float *rows, const float *projected,
                            const float *outputs_sq, const float *gram, const float *weights, float eps,
                            float *indicator, float *smoothed) {
    __m512 v[MOST_DIM];
    for (int64_t a = 0; a < dim; ++a) {
        float lane[LANES] __attribute__((aligned(64))) = {0};
        for (int64_t l = 0; l < count; ++l)
            lane[l] = value_at(values, kind, (j0 + l) * v_row + a);
        v[a] = _mm512_load_ps(lane);
    }
    __m512 square = _mm512_setzero_ps(); /* v G v' */
    if (gram) {
        for (int64_t a = 0; a < dim; ++a) {
            const float *g = gram + a * dim;
            __m512 inner = _mm512_mul_ps(_mm512_set1_ps(g[a]), v[a]);
            __m512 off = _mm512_setzero_ps();
            for (int64_t c = a + 1; c < dim; ++c)
                off = _mm512_fmadd_ps(_mm512_set1_ps(g[c]), v[c], off);
            inner = _mm512_fmadd_ps(_mm512_set1_ps(2.0f), off, inner);
            square = _mm512_fmadd_ps(v[a], inner, square);
        }
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
        for (int64_t a = 0; a < dim; ++a)
            for (int64_t i = 0; i < span; ++i)
                cross[i] = _mm512_fmadd_ps(_mm512_set1_ps(projected[(t0 + i) * dim + a]), v[a], cross[i]);
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
#endif

/* rows: float32 (batch, q_heads, w, length) and outputs (o_t) float32 (batch, q_heads, w, dim), contiguous; values:
 * float32 (kind 0) or bfloat16 (kind 1) (batch, kv_heads, length, dim) with strides in elements (unit over dim);
 * gram: float32 (q_heads, dim, dim), contiguous, or NULL (the identity); weights: float32 (w); budgets: int64
 * (batch, q_heads), or NULL (per_query not written). Writes smoothed float32 (batch, q_heads, length) (0 from
 * prefix on) and per_query float32 (batch, q_heads, w). Returns 0, or -1 (no vector code, sizes it does not take, no
 * memory: nothing to use). */
int kvsieve_restkv_window_scores(int64_t batch, int64_t kv_heads, int64_t groups, int64_t w, int64_t length,
                                 int64_t dim, int64_t prefix, const float *rows, const float *outputs,
                                 const void *values, int kind, int64_t v_batch, int64_t v_head, int64_t v_row,
                                 const float *gram, const float *weights, const int64_t *budgets, float eps,
                                 float *smoothed, float *per_query) {
#if KVSIEVE_AVX512
    if (batch < 1 || kv_heads < 1 || groups < 1 || w < 1 || w > MOST_WINDOW || dim < 1 || dim > MOST_DIM
            || prefix < 0 || prefix > length || (kind != 0 && kind != 1))
        return -1;
    const int64_t q_heads = kv_heads * groups, heads = batch * q_heads;
    const int64_t chunks = (prefix + CHUNK - 1) / CHUNK;
    float *projected = malloc((size_t)(heads * w * dim) * 4), *outputs_sq = malloc((size_t)(heads * w) * 4);
    float *indicator = malloc((size_t)(heads * w * (prefix > 0 ? prefix : 1)) * 4);
    if (!projected || !outputs_sq || !indicator) {
        free(projected), free(outputs_sq), free(indicator);
        return -1;
    }
    int failed = 0;
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
    for (int64_t u = 0; u < heads * chunks; ++u) { /* the indicator, block by block */
        const int64_t row = u / chunks, chunk = u % chunks, b = row / q_heads, h = row % q_heads;
        const void *v = kind == 0 ? (const void *)((const float *)values + b * v_batch + (h / groups) * v_head)
                                  : (const void *)((const uint16_t *)values + b * v_batch + (h / groups) * v_head);
        const int64_t end = (chunk + 1) * CHUNK < prefix ? (chunk + 1) * CHUNK : prefix;
        for (int64_t j0 = chunk * CHUNK; j0 < end; j0 += LANES)
            block_indicator(v, kind, v_row, dim, w, j0, end - j0 < LANES ? end - j0 : LANES, prefix, length,
                            rows + row * w * length, projected + row * w * dim, outputs_sq + row * w,
                            gram ? gram + h * dim * dim : NULL, weights, eps, indicator + row * w * prefix,
                            smoothed + row * length);
    }
    if (budgets) {
        float *copy = malloc((size_t)(prefix > 0 ? prefix : 1) * 4);
        if (!copy) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < heads * w; ++u) { /* each window query's top-k mean index */
            if (!copy)
                continue;
            const int64_t row = u / w, t = u % w, k = budgets[row];
            float mean = 0.0f;
            if (k > 0 && prefix > 0) {
                const float *scores = indicator + (row * w + t) * prefix;
                if (k >= prefix) { /* fewer candidates than k: all of them */
                    mean = (float)(prefix * (prefix - 1) / 2) / (float)prefix;
                } else {
                    memcpy(copy, scores, (size_t)prefix * 4);
                    const float threshold = kth_largest(copy, prefix, k);
                    int64_t sum = 0, taken = 0;
                    for (int64_t j = 0; j < prefix; ++j)
                        if (scores[j] > threshold)
                            sum += j, ++taken;
                    for (int64_t j = 0; j < prefix && taken < k; ++j)
                        if (scores[j] == threshold)
                            sum += j, ++taken;
                    mean = (float)sum / (float)k;
                }
            }
            per_query[u] = mean;
        }
        free(copy);
    }
    }
    free(projected), free(outputs_sq), free(indicator);
    return failed ? -1 : 0;
#else
    (void)batch, (void)kv_heads, (void)groups, (void)w, (void)length, (void)dim, (void)prefix, (void)rows;
    (void)outputs, (void)values, (void)kind, (void)v_batch, (void)v_head, (void)v_row, (void)gram, (void)weights;
    (void)budgets, (void)eps, (void)smoothed, (void)per_query;
    return -1;
#endif
}
