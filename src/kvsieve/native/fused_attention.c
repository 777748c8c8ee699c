/* A causal bfloat16 prompt's attention output and its column sums from one pass over the logits, on AMX tiles
 * (kvsieve_causal_attention_with_column_sums).
 *
 * kvsieve.native.build builds this file on first use; kvsieve.native.fused_attention calls it through ctypes for
 * LayerStep.output_with_column_sums (fuse_statistics=True), whose PyTorch passes are the reference. For query head h
 * of batch item b over its KV head's keys and values (h / groups), query t seeing the keys j <= t:
 *
 *   p[t, j]     = exp(s * q_t . k_j - m_t)                      m_t = max_j s * q_t . k_j
 *   lse[t]      = m_t + log(sum_j p[t, j])
 *   out[t]      = (sum_j bf16(p[t, j]) v_j) / sum_j p[t, j]    (rounded to bfloat16)
 *   sums[j]     = sum_{t >= j} p[t, j] / sum_j' p[t, j']
 *
 * the attention (Vaswani et al. 2017) and H2O's and EMS's statistic (Zhang et al. 2023, arXiv:2306.14048, Sec. 3.2;
 * Li et al. 2024, arXiv:2412.08521, Sec. 3.3: attention accumulated over every query of the prompt), which the paper of
 * EMS computes inside its attention kernel. Each probability's exponential is taken once and serves the output, the
 * log-sum-exp and the sums: where SDPA followed by a statistics pass takes every exponential twice and reads the
 * logits twice.
 *
 * Not SDPA's output bit for bit. Like PyTorch's CPU flash kernel it multiplies bfloat16 probabilities by the values
 * into float32 sums, but it takes each query's exact maximum first (its sixteen queries' logits are kept, float32,
 * over the keys they see) instead of a running maximum, so the probabilities round to bfloat16 at other points: the
 * output differs from SDPA's by bfloat16 rounding. The sums use the float32 probabilities: within float32 rounding of
 * the float64 softmax. exp is 2^n * 2^f with a degree-6 polynomial for 2^f (relative error <= 1.2e-7).
 *
 * Work: a unit is sixteen queries of one (batch item, query head), the largest first, shared among torch's OpenMP
 * threads. Its logits against the keys up to its last query come from the tiles (16 queries x 64 keys a round, the
 * keys packed once per call as bfloat16 pairs), its probabilities from the vector units, its output from the tiles
 * again (16 queries x 64 dimensions a round over the values packed as key pairs), and its sums are added to the row's
 * under that row's lock. Needs AMX-BF16 (and a head size that is a multiple of 32, up to 256); returns -1 otherwise,
 * and the caller keeps its other routes.
 *
 * kvsieve_causal_attention_with_column_sums_f32 is the same pass for float32 prompts with AVX-512 fused
 * multiply-adds in place of the tiles (four queries x 64 keys, then four queries x 64 dimensions, in registers), the
 * probabilities kept in float32 for P.V: its output within float32 rounding of the exact attention. A build without
 * AVX-512 but with AVX2 and FMA (an AVX2-only CPU) takes it on eight lanes (four queries x 16 keys, then four queries
 * x 16 dimensions; 2^x's 2^n set in the exponent bits, so an exponent below -127 gives 0 where AVX-512's scalef gives a
 * subnormal): the same products and sums, in another grouping.
 *
 * Both entry points check their arguments and hand a Call to run_pass with their Pass (TILES or VECTORS): the packing
 * of the keys and values, the unit and the per-thread set-up, the only things that differ. run_pass holds the
 * scheduling, the rooms and the row locks once.
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
#define KVSIEVE_VECTORS (KVSIEVE_AVX512 || KVSIEVE_AVX2) /* the float32 pass's vector code */
#if KVSIEVE_AVX512 && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVSIEVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a feature's register state (asm/prctl.h) */
#define XFEATURE_XTILEDATA 18      /* the AMX tiles' data */
#else
#define KVSIEVE_AMX 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define KVSIEVE_ABI 1
#define ROWS 16       /* queries per unit: a tile's rows */
#define KEYS 16       /* keys per block: a float32 tile's columns, the vector's lanes */
#define ROUND 64      /* keys per round of the tiles (four blocks) */
#define MOST_DIM 256  /* head size */
#define VALUE_CHUNK 256 /* keys per chunk of the float32 pass's P.V */
#define LOG2E 1.44269504088896341f

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

/* Whether the build has the AMX tiles this pass needs. */
int kvsieve_fused_attention_tiles(void) { return KVSIEVE_AMX; }

/* Whether the build has the vector code the float32 pass needs: AVX-512, or AVX2 and FMA. */
int kvsieve_fused_attention_vector_code(void) { return KVSIEVE_VECTORS; }

#if KVSIEVE_VECTORS
#if KVSIEVE_AVX512
/* 2^x (statistics.c's polynomial): 2^n by scalef times the degree-6 Taylor polynomial of 2^f, |f| <= 1/2. */
static inline __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The lanes of the block at key j0 that query t sees (j0 + l <= t). */
static inline __mmask16 seen_by(int64_t t, int64_t j0) {
    const int64_t last = t - j0;
    if (last < 0)
        return 0;
    return last >= KEYS - 1 ? (__mmask16)0xFFFFu : (__mmask16)((1u << (last + 1)) - 1u);
}

/* Each of the unit's queries t0 + r (r < rows) from its logits (row r at logits + r * stride, float32): its exact
 * maximum over the keys it sees, one exponential per logit it sees (zero past it, up to span), written back in place
 * and, where probs is given, rounded to bfloat16 at probs + r * narrow; inverse[r] = 1 / its total, lse[r] its
 * log-sum-exp. The rows from `rows` to 15 are zeroed (inverse 0). */
static void softmax_rows(float *logits, int64_t stride, uint16_t *probs, int64_t narrow, int64_t t0, int64_t rows,
                         int64_t span, float scaling, float *inverse, float *lse) {
    const __m512 scale = _mm512_set1_ps(scaling * LOG2E);
    for (int64_t r = 0; r < ROWS; ++r) {
        float *row = logits + r * stride;
        if (r >= rows) { /* a query past n: nothing seen */
            memset(row, 0, (size_t)span * 4);
            if (probs)
                memset(probs + r * narrow, 0, (size_t)span * 2);
            inverse[r] = 0.0f;
            continue;
        }
        const int64_t t = t0 + r;
        __m512 most = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j <= t; j += KEYS)
            most = _mm512_mask_max_ps(most, seen_by(t, j), most, _mm512_load_ps(row + j));
        const float maximum = _mm512_reduce_max_ps(most);
        const __m512 shift = _mm512_set1_ps(maximum * scaling * LOG2E);
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < span; j += KEYS) {
            const __mmask16 seen = seen_by(t, j);
            const __m512 p = _mm512_maskz_mov_ps(seen, exp2_16(_mm512_fmsub_ps(_mm512_load_ps(row + j), scale,
                                                                                shift)));
            total = _mm512_add_ps(total, p);
            _mm512_store_ps(row + j, p);
#ifdef __AVX512BF16__
            if (probs)
                _mm256_store_si256((__m256i *)(probs + r * narrow + j), (__m256i)_mm512_cvtneps_pbh(p));
#endif
        }
        const float sum = _mm512_reduce_add_ps(total);
        inverse[r] = 1.0f / sum;
        lse[r] = maximum * scaling + logf(sum);
    }
}
#else /* AVX2 and FMA: the float32 pass only, eight lanes */
/* 2^x as exp2_16 computes it, 2^n put in the exponent's bits: x below -127 gives 0 (exp2_16 gives a subnormal, below
 * 2^-126, which no sum of probabilities that includes its maximum's 1 can see). */
static inline __m256 exp2_8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* The lanes below `count` (clamped to 0 ... 8) all ones, the rest zero: the lanes j0 + l <= t of a query t are
 * lanes_below(t - j0 + 1). */
static inline __m256i lanes_below(int64_t count) {
    const int32_t c = count < 0 ? 0 : count > 8 ? 8 : (int32_t)count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float sum_lanes(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float max_lanes(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* softmax_rows (above, AVX-512) on eight lanes for the float32 pass (no bfloat16 probabilities). */
static void softmax_rows(float *logits, int64_t stride, uint16_t *probs, int64_t narrow, int64_t t0, int64_t rows,
                         int64_t span, float scaling, float *inverse, float *lse) {
    (void)probs, (void)narrow;
    const __m256 scale = _mm256_set1_ps(scaling * LOG2E);
    for (int64_t r = 0; r < ROWS; ++r) {
        float *row = logits + r * stride;
        if (r >= rows) {
            memset(row, 0, (size_t)span * 4);
            inverse[r] = 0.0f;
            continue;
        }
        const int64_t t = t0 + r;
        __m256 most = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j <= t; j += 8)
            most = _mm256_max_ps(most, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(row + j),
                                                         _mm256_castsi256_ps(lanes_below(t - j + 1))));
        const float maximum = max_lanes(most);
        const __m256 shift = _mm256_set1_ps(maximum * scaling * LOG2E);
        __m256 total = _mm256_setzero_ps();
        for (int64_t j = 0; j < span; j += 8) {
            const __m256 p = _mm256_and_ps(_mm256_castsi256_ps(lanes_below(t - j + 1)),
                                           exp2_8(_mm256_fmsub_ps(_mm256_load_ps(row + j), scale, shift)));
            total = _mm256_add_ps(total, p);
            _mm256_store_ps(row + j, p);
        }
        const float sum = sum_lanes(total);
        inverse[r] = 1.0f / sum;
        lse[r] = maximum * scaling + logf(sum);
    }
}
#endif

#ifdef _OPENMP
typedef omp_lock_t RowLock;
#else
typedef char RowLock; /* no threads: nothing to lock */
#endif

/* One lock per row of sums, initialised; NULL without memory. */
static RowLock *row_locks(int64_t rows) {
    RowLock *locks = malloc((size_t)rows * sizeof(RowLock));
#ifdef _OPENMP
    if (locks)
        for (int64_t r = 0; r < rows; ++r)
            omp_init_lock(locks + r);
#endif
    return locks;
}

static void free_row_locks(RowLock *locks, int64_t rows) {
#ifdef _OPENMP
    if (locks)
        for (int64_t r = 0; r < rows; ++r)
            omp_destroy_lock(locks + r);
#else
    (void)rows;
#endif
    free(locks);
}

#if KVSIEVE_AVX512
/* The unit's share of the sums: each key's probabilities over its queries, each divided by its query's total, added
 * to the row's sums under that row's lock (units of one row run on different threads). */
static void add_column_sums(const float *probs, int64_t stride, const float *inverse, int64_t rows, int64_t seen_keys,
                            float *sums, RowLock *lock) {
#ifdef _OPENMP
    omp_set_lock(lock);
#else
    (void)lock;
#endif
    for (int64_t j = 0; j < seen_keys; j += KEYS) {
        __m512 column = _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r)
            column = _mm512_fmadd_ps(_mm512_load_ps(probs + r * stride + j), _mm512_set1_ps(inverse[r]), column);
        const __mmask16 inside = seen_keys - j >= KEYS ? (__mmask16)0xFFFFu : (__mmask16)((1u << (seen_keys - j)) - 1u);
        _mm512_mask_storeu_ps(sums + j, inside, _mm512_add_ps(_mm512_maskz_loadu_ps(inside, sums + j), column));
    }
#ifdef _OPENMP
    omp_unset_lock(lock);
#endif
}
#else
/* add_column_sums (above, AVX-512) on eight lanes. */
static void add_column_sums(const float *probs, int64_t stride, const float *inverse, int64_t rows, int64_t seen_keys,
                            float *sums, RowLock *lock) {
#ifdef _OPENMP
    omp_set_lock(lock);
#else
    (void)lock;
#endif
    for (int64_t j = 0; j < seen_keys; j += 8) {
        __m256 column = _mm256_setzero_ps();
        for (int64_t r = 0; r < rows; ++r)
            column = _mm256_fmadd_ps(_mm256_load_ps(probs + r * stride + j), _mm256_set1_ps(inverse[r]), column);
        const __m256i inside = lanes_below(seen_keys - j);
        _mm256_maskstore_ps(sums + j, inside, _mm256_add_ps(_mm256_maskload_ps(sums + j, inside), column));
    }
#ifdef _OPENMP
    omp_unset_lock(lock);
#endif
}
#endif

/* One call's tensors: query (batch, kv_heads * groups, n, dim), keys and values (batch, kv_heads, n, dim) with strides
 * in elements (unit stride over dim); out (batch, n, kv_heads * groups, dim) with strides (unit over dim); lse and sums
 * float32 (batch, kv_heads * groups, n), contiguous. The elements are bfloat16 or float32 (the Pass's). */
typedef struct {
    int64_t batch, kv_heads, groups, dim, n;
    const void *query;
    int64_t q_batch, q_head, q_row;
    const void *keys;
    int64_t k_batch, k_head, k_row;
    const void *values;
    int64_t v_batch, v_head, v_row;
    float scaling;
    void *out;
    int64_t o_batch, o_row, o_head;
    float *lse, *sums;
} Call;

/* Per-thread room for one unit: its logits, then probabilities (float32, ROWS x (padded + 16)), the probabilities in
 * bfloat16 where the Pass multiplies them so (ROWS x (padded + 32); NULL otherwise), the queries (ROWS x dim, the
 * input's elements) and the output's float32 sums (ROWS x dim). */
typedef struct {
    float *logits;
    uint16_t *probs;
    void *queries;
    float *output;
} Room;

/* What differs between the bfloat16 pass (tiles) and the float32 one (vector FMAs); run_pass holds the rest. */
typedef struct {
    size_t element;        /* bytes of an input element: 2 or 4 */
    int bf16_probabilities; /* whether the unit needs the Room's bfloat16 probabilities */
    /* one (batch item, KV head)'s keys and values in the unit's layouts, zero past n up to padded (padded * dim
     * elements each) */
    void (*pack_keys)(const void *keys, int64_t k_row, int64_t n, int64_t padded, int64_t dim, void *packed);
    void (*pack_values)(const void *values, int64_t v_row, int64_t n, int64_t padded, int64_t dim, void *packed);
    void (*enter)(void); /* each thread's set-up before its units (the tiles' shape), and after them; may be NULL */
    void (*leave)(void);
    /* queries t0 ... t0 + 15 (those below n) of one (batch item, query head) */
    void (*unit)(const void *keys, const void *values, int64_t dim, int64_t n, int64_t padded, const void *query,
                 int64_t q_row, float scaling, int64_t t0, Room room, void *out, int64_t o_row, float *lse,
                 float *sums, RowLock *lock);
} Pass;

static void free_room(Room *room) {
    free(room->logits), free(room->probs), free(room->queries), free(room->output);
}

/* The pass over a call, both kinds: each (batch item, KV head)'s keys and values packed once, then the units, the
 * largest first, on torch's OpenMP threads (one thread below 128 tokens), each thread with its own Room. Returns 0, or
 * -1 without memory (nothing but the sums written). */
static int run_pass(const Pass *pass, const Call *c) {
    const int64_t dim = c->dim, n = c->n, q_heads = c->kv_heads * c->groups, rows = c->batch * q_heads;
    const int64_t padded = (n + ROUND - 1) / ROUND * ROUND, heads = c->batch * c->kv_heads;
    const size_t element = pass->element, per_head = (size_t)(padded * dim);
    char *packed_keys = aligned_alloc(64, heads * per_head * element);
    char *packed_values = pass->pack_values ? aligned_alloc(64, heads * per_head * element) : NULL;
    RowLock *locks = row_locks(rows);
    if (!packed_keys || (pass->pack_values && !packed_values) || !locks) {
        free(packed_keys), free(packed_values), free_row_locks(locks, rows);
        return -1;
    }
    memset(c->sums, 0, (size_t)(rows * n) * 4);
    const int64_t units_per_row = (n + ROWS - 1) / ROWS, units = rows * units_per_row;
    const char *query = c->query, *keys = c->keys, *values = c->values;
    char *out = c->out;
    int failed = 0;
#pragma omp parallel if (n >= 128)
    {
#pragma omp for schedule(static)
    for (int64_t head = 0; head < heads; ++head) {
        const int64_t b = head / c->kv_heads, g = head % c->kv_heads;
        pass->pack_keys(keys + (b * c->k_batch + g * c->k_head) * element, c->k_row, n, padded, dim,
                        packed_keys + head * per_head * element);
        if (pass->pack_values)
            pass->pack_values(values + (b * c->v_batch + g * c->v_head) * element, c->v_row, n, padded, dim,
                              packed_values + head * per_head * element);
    }
    Room room = {aligned_alloc(64, (size_t)(ROWS * (padded + KEYS)) * 4),
                 pass->bf16_probabilities ? aligned_alloc(64, (size_t)(ROWS * (padded + 2 * KEYS)) * 2) : NULL,
                 aligned_alloc(64, (size_t)(ROWS * dim) * element), aligned_alloc(64, (size_t)(ROWS * dim) * 4)};
    const int ready = room.logits && (room.probs || !pass->bf16_probabilities) && room.queries && room.output;
    if (!ready) {
#pragma omp atomic write
        failed = 1;
    }
    if (pass->enter)
        pass->enter();
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
        if (!ready)
            continue;
        const int64_t tile = units_per_row - 1 - u / rows, row = u % rows; /* the longest units first */
        const int64_t b = row / q_heads, h = row % q_heads, head = b * c->kv_heads + h / c->groups;
        pass->unit(packed_keys + head * per_head * element,
                   packed_values ? packed_values + head * per_head * element : NULL, dim, n, padded,
                   query + (b * c->q_batch + h * c->q_head) * element, c->q_row, c->scaling, tile * ROWS, room,
                   out ? out + (b * c->o_batch + h * c->o_head) * element : NULL, c->o_row,
                   c->lse + row * n + tile * ROWS,
                   c->sums + row * n, locks + row);
    }
    if (pass->leave)
        pass->leave();
    free_room(&room);
    }
    free(packed_keys), free(packed_values), free_row_locks(locks, rows);
    return failed ? -1 : 0;
}
#endif

#if KVSIEVE_AMX
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

/* Seven tiles of 16 rows x 64 bytes: 0 ... 3 float32 sums (16 x 16), 4 the first operand (16 rows x 32 bfloat16),
 * 5 and 6 the second (16 pairs x 16 columns x 2). */
static void shape_tiles(void) {
    TileShape shape;
    memset(&shape, 0, sizeof shape);
    shape.palette = 1;
    for (int tile = 0; tile < 7; ++tile) {
        shape.bytes_per_row[tile] = 64;
        shape.rows[tile] = 16;
    }
    /* ldtilecfg with the whole 64-byte shape as its operand: GCC 12's _tile_loadconfig names only its first 8 bytes,
     * so the compiler may drop the stores of the rest (it did once this function was no longer inlined) */
    __asm__ volatile("ldtilecfg %0" : : "m"(shape));
}

/* The keys of one (batch item, KV head) as the tiles' second operand of q.k: blocks of 16 keys, each block's dimension
 * pairs one after another (pair p of key l at [block][p][l]), zero past n up to `padded`. */
static void pack_keys(const void *input, int64_t k_row, int64_t n, int64_t padded, int64_t dim, void *output) {
    const uint16_t *keys = input;
    uint32_t *packed = output;
    const int64_t pairs = dim / 2;
    for (int64_t block = 0; block < padded / KEYS; ++block)
        for (int64_t l = 0; l < KEYS; ++l) {
            const int64_t j = block * KEYS + l;
            for (int64_t p = 0; p < pairs; ++p) {
                uint32_t bits = 0;
                if (j < n)
                    memcpy(&bits, keys + j * k_row + 2 * p, 4);
                packed[(block * pairs + p) * KEYS + l] = bits;
            }
        }
}

/* The values of one (batch item, KV head) as the second operand of p.v: key pairs, each pair's dimensions one after
 * another with the two keys' values side by side ([pair][d][2]), zero past n up to `padded`. */
static void pack_values(const void *input, int64_t v_row, int64_t n, int64_t padded, int64_t dim, void *output) {
    const uint16_t *values = input;
    uint16_t *packed = output;
    for (int64_t j = 0; j < padded; ++j)
        for (int64_t d = 0; d < dim; ++d)
            packed[((j / 2) * dim + d) * 2 + j % 2] = j < n ? values[j * v_row + d] : 0;
}

/* One unit: queries t0 ... t0 + 15 (those below n) of one (batch item, query head). */
static void unit(const void *packed_keys, const void *packed_values, int64_t dim, int64_t n, int64_t padded,
                 const void *input, int64_t q_row, float scaling, int64_t t0, Room room, void *output, int64_t o_row,
                 float *lse, float *sums, RowLock *lock) {
    const uint32_t *keys = packed_keys;
    const uint16_t *values = packed_values, *query = input;
    uint16_t *out = output, *queries = room.queries;
    const int64_t pairs = dim / 2, rows = n - t0 < ROWS ? n - t0 : ROWS;
    const int64_t last = t0 + rows - 1;                               /* the last query */
    const int64_t span = (last + 1 + ROUND - 1) / ROUND * ROUND;     /* the keys the tiles take, <= padded */
    const int64_t stride = padded + KEYS, narrow = padded + 2 * KEYS; /* rows of logits, of bfloat16 probabilities:
                                                                        64 bytes past a multiple of 64 keys, so the
                                                                        sixteen rows fall in different cache sets */
    float *logits = room.logits;
    memset(queries, 0, (size_t)(ROWS * dim) * 2);
    for (int64_t r = 0; r < rows; ++r)
        memcpy(queries + r * dim, query + (t0 + r) * q_row, (size_t)dim * 2);
    /* the logits: 16 queries x 64 keys a round */
    for (int64_t j0 = 0; j0 < span; j0 += ROUND) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint32_t *k = keys + (j0 / KEYS) * pairs * KEYS;
        for (int64_t chunk = 0; chunk < pairs / 16; ++chunk) {
            const uint32_t *kc = k + chunk * 16 * KEYS;
            _tile_loadd(4, queries + chunk * 32, dim * 2);
            _tile_loadd(5, kc, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, kc + pairs * KEYS, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, kc + 2 * pairs * KEYS, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, kc + 3 * pairs * KEYS, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, logits + j0, stride * 4);
        _tile_stored(1, logits + j0 + KEYS, stride * 4);
        _tile_stored(2, logits + j0 + 2 * KEYS, stride * 4);
        _tile_stored(3, logits + j0 + 3 * KEYS, stride * 4);
    }
    /* the probabilities: each query's maximum, then one exponential per logit it sees (zero elsewhere) */
    float inverse[ROWS];
    softmax_rows(logits, stride, room.probs, narrow, t0, rows, span, scaling, inverse, lse);
    /* the output: 16 queries x 64 dimensions a round, over the key pairs of the probabilities */
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int64_t chunks = dim - d0 >= 64 ? 4 : (dim - d0) / 16;
        for (int64_t c = 0; c < chunks; ++c)
            switch (c) { /* the tile's number is an immediate */
            case 0: _tile_zero(0); break;
            case 1: _tile_zero(1); break;
            case 2: _tile_zero(2); break;
            default: _tile_zero(3); break;
            }
        for (int64_t j0 = 0; j0 < span; j0 += 32) {
            _tile_loadd(4, room.probs + j0, narrow * 2);
            const uint16_t *v = values + (j0 / 2) * dim * 2 + d0 * 2;
            _tile_loadd(5, v, dim * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (chunks > 1) {
                _tile_loadd(6, v + 32, dim * 4);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (chunks > 2) {
                _tile_loadd(5, v + 64, dim * 4);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (chunks > 3) {
                _tile_loadd(6, v + 96, dim * 4);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        _tile_stored(0, room.output + d0, dim * 4);
        if (chunks > 1)
            _tile_stored(1, room.output + d0 + 16, dim * 4);
        if (chunks > 2)
            _tile_stored(2, room.output + d0 + 32, dim * 4);
        if (chunks > 3)
            _tile_stored(3, room.output + d0 + 48, dim * 4);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 by = _mm512_set1_ps(inverse[r]);
        for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(out + (t0 + r) * o_row + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(room.output + r * dim + d),
                                                                          by)));
    }
    /* the sums: each key's probabilities over these queries, each divided by its query's total */
    add_column_sums(logits, stride, inverse, rows, last + 1, sums, lock);
}

static void release_tiles(void) { _tile_release(); }

/* The bfloat16 pass: keys as bfloat16 pairs, values as key pairs, each thread's tiles shaped before its units. */
static const Pass TILES = {2, 1, pack_keys, pack_values, shape_tiles, release_tiles, unit};
#endif

/* query: bfloat16 (batch, kv_heads * groups, n, dim) with strides in elements (unit stride over dim); keys, values:
 * bfloat16 (batch, kv_heads, n, dim) likewise; out: bfloat16 (batch, n, kv_heads * groups, dim) with strides (unit
 * over dim), written; lse and sums: float32 (batch, kv_heads * groups, n), contiguous, written. Returns 0, or -1 (no
 * AMX in the build or the CPU, a head size it does not take, no memory: nothing written). */
int kvsieve_causal_attention_with_column_sums(int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t n,
                                              const uint16_t *query, int64_t q_batch, int64_t q_head, int64_t q_row,
                                              const uint16_t *keys, int64_t k_batch, int64_t k_head, int64_t k_row,
                                              const uint16_t *values, int64_t v_batch, int64_t v_head, int64_t v_row,
                                              float scaling, uint16_t *out, int64_t o_batch, int64_t o_row,
                                              int64_t o_head, float *lse, float *sums) {
#if KVSIEVE_AMX
    if (batch < 1 || kv_heads < 1 || groups < 1 || dim < 32 || dim % 32 || dim > MOST_DIM || n < 1
            || !tiles_granted())
        return -1;
    const Call call = {batch, kv_heads, groups, dim, n, query, q_batch, q_head, q_row, keys, k_batch, k_head, k_row,
                       values, v_batch, v_head, v_row, scaling, out, o_batch, o_row, o_head, lse, sums};
    return run_pass(&TILES, &call);
#else
    (void)batch, (void)kv_heads, (void)groups, (void)dim, (void)n, (void)query, (void)q_batch, (void)q_head;
    (void)q_row, (void)keys, (void)k_batch, (void)k_head, (void)k_row, (void)values, (void)v_batch, (void)v_head;
    (void)v_row, (void)scaling, (void)out, (void)o_batch, (void)o_row, (void)o_head, (void)lse, (void)sums;
    return -1;
#endif
}

#if KVSIEVE_VECTORS
/* The float32 pass (no tiles): the keys of one (batch item, KV head) transposed by blocks of 16 (dimension a of key
 * block b's keys at [b][a][0 ... 15], one vector), zero past n up to `padded`. */
static void transpose_keys(const void *input, int64_t k_row, int64_t n, int64_t padded, int64_t dim, void *output) {
    const float *keys = input;
    float *packed = output;
    for (int64_t block = 0; block < padded / KEYS; ++block)
        for (int64_t a = 0; a < dim; ++a)
            for (int64_t l = 0; l < KEYS; ++l) {
                const int64_t j = block * KEYS + l;
                packed[(block * dim + a) * KEYS + l] = j < n ? keys[j * k_row + a] : 0.0f;
            }
}

/* The values of one (batch item, KV head) as contiguous rows, zero past n up to `padded`. */
static void copy_values(const void *input, int64_t v_row, int64_t n, int64_t padded, int64_t dim, void *output) {
    const float *values = input;
    float *packed = output;
    for (int64_t j = 0; j < padded; ++j)
        for (int64_t a = 0; a < dim; ++a)
            packed[j * dim + a] = j < n ? values[j * v_row + a] : 0.0f;
}

#if KVSIEVE_AVX512
/* The float32 logits q_t . k_j of queries t0 ... t0 + rows - 1 (rows <= 16; copied to `queries`, zero rows after) over
 * the keys below span (packed by transpose_keys), row r at logits + r * stride: four queries x four key blocks at a
 * time (sixteen sums in registers, each dimension one load per key block and one broadcast per query). */
static void logits_f32(const float *keys, int64_t dim, const float *query, int64_t q_row, int64_t t0, int64_t rows,
                       int64_t span, int64_t stride, float *queries, float *logits) {
    memset(queries, 0, (size_t)(ROWS * dim) * 4);
    for (int64_t r = 0; r < rows; ++r)
        memcpy(queries + r * dim, query + (t0 + r) * q_row, (size_t)dim * 4);
    for (int64_t j0 = 0; j0 < span; j0 += 4 * KEYS) { /* each round's keys read once, for the four query groups */
        for (int64_t r0 = 0; r0 < ROWS; r0 += 4) {
            const float *q0 = queries + r0 * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
            __m512 acc[4][4];
            for (int i = 0; i < 4; ++i)
                for (int b = 0; b < 4; ++b)
                    acc[i][b] = _mm512_setzero_ps();
            const float *k = keys + (j0 / KEYS) * dim * KEYS;
            for (int64_t a = 0; a < dim; ++a) {
                const __m512 k0 = _mm512_load_ps(k + a * KEYS), k1 = _mm512_load_ps(k + (dim + a) * KEYS);
                const __m512 k2 = _mm512_load_ps(k + (2 * dim + a) * KEYS), k3 = _mm512_load_ps(k + (3 * dim + a) * KEYS);
                const __m512 x[4] = {_mm512_set1_ps(q0[a]), _mm512_set1_ps(q1[a]), _mm512_set1_ps(q2[a]),
                                     _mm512_set1_ps(q3[a])};
                for (int i = 0; i < 4; ++i) {
                    acc[i][0] = _mm512_fmadd_ps(x[i], k0, acc[i][0]);
                    acc[i][1] = _mm512_fmadd_ps(x[i], k1, acc[i][1]);
                    acc[i][2] = _mm512_fmadd_ps(x[i], k2, acc[i][2]);
                    acc[i][3] = _mm512_fmadd_ps(x[i], k3, acc[i][3]);
                }
            }
            for (int i = 0; i < 4; ++i)
                for (int b = 0; b < 4; ++b)
                    _mm512_store_ps(logits + (r0 + i) * stride + j0 + b * KEYS, acc[i][b]);
        }
    }
}

/* Each of the rows' probabilities from its given log-sum-exp, in place: exp(scaling * logit - lse[r]) for the keys
 * query t0 + r sees, zero past them up to span and in the rows from `rows` to 15. */
static void probabilities_from_lse(float *logits, int64_t stride, int64_t t0, int64_t rows, int64_t span,
                                   float scaling, const float *lse) {
    const __m512 scale = _mm512_set1_ps(scaling * LOG2E);
    for (int64_t r = 0; r < ROWS; ++r) {
        float *row = logits + r * stride;
        if (r >= rows) {
            memset(row, 0, (size_t)span * 4);
            continue;
        }
        const __m512 shift = _mm512_set1_ps(lse[r] * LOG2E);
        for (int64_t j = 0; j < span; j += KEYS)
            _mm512_store_ps(row + j, _mm512_maskz_mov_ps(seen_by(t0 + r, j), exp2_16(_mm512_fmsub_ps(
                _mm512_load_ps(row + j), scale, shift))));
    }
}

/* One unit of the float32 pass: queries t0 ... t0 + 15 (those below n) of one (batch item, query head). Its logits
 * (logits_f32), the shared softmax, then the output four queries x 64 dimensions at a time over the keys. */
static void unit_f32(const void *packed_keys, const void *packed_values, int64_t dim, int64_t n, int64_t padded,
                     const void *input, int64_t q_row, float scaling, int64_t t0, Room room, void *result,
                     int64_t o_row, float *lse, float *sums, RowLock *lock) {
    const float *keys = packed_keys, *values = packed_values, *query = input;
    float *logits = room.logits, *output = room.output, *out = result;
    const int64_t rows = n - t0 < ROWS ? n - t0 : ROWS, last = t0 + rows - 1;
    const int64_t span = (last + 1 + ROUND - 1) / ROUND * ROUND, stride = padded + KEYS;
    logits_f32(keys, dim, query, q_row, t0, rows, span, stride, room.queries, logits);
    float inverse[ROWS];
    softmax_rows(logits, stride, NULL, 0, t0, rows, span, scaling, inverse, lse);
    /* the output: P . V over chunks of keys (each chunk's values read once from memory, then from the cache for
     * every group of four queries), the sums kept between chunks in `output`, then divided by each row's total */
    memset(output, 0, (size_t)(ROWS * dim) * 4);
    const int64_t seen = last + 1; /* keys past a row's own are zero in its probabilities */
    for (int64_t k0 = 0; k0 < seen; k0 += VALUE_CHUNK) {
        const int64_t k1 = seen - k0 < VALUE_CHUNK ? seen : k0 + VALUE_CHUNK;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const float *p0 = logits + r0 * stride, *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                const int64_t width = dim - d0 >= 64 ? 4 : (dim - d0) / KEYS;
                __m512 acc[4][4];
                for (int i = 0; i < 4; ++i)
                    for (int64_t c = 0; c < width; ++c)
                        acc[i][c] = _mm512_load_ps(output + (r0 + i) * dim + d0 + c * KEYS);
                if (width == 4) { /* 64 dimensions: the loop the compiler keeps in sixteen registers */
                    for (int64_t j = k0; j < k1; ++j) {
                        const float *v = values + j * dim + d0;
                        const __m512 x[4] = {_mm512_set1_ps(p0[j]), _mm512_set1_ps(p1[j]), _mm512_set1_ps(p2[j]),
                                             _mm512_set1_ps(p3[j])};
                        for (int c = 0; c < 4; ++c) {
                            const __m512 vc = _mm512_loadu_ps(v + c * KEYS);
                            for (int i = 0; i < 4; ++i)
                                acc[i][c] = _mm512_fmadd_ps(x[i], vc, acc[i][c]);
                        }
                    }
                } else {
                    for (int64_t j = k0; j < k1; ++j) {
                        const float *v = values + j * dim + d0;
                        const __m512 x[4] = {_mm512_set1_ps(p0[j]), _mm512_set1_ps(p1[j]), _mm512_set1_ps(p2[j]),
                                             _mm512_set1_ps(p3[j])};
                        for (int64_t c = 0; c < width; ++c) {
                            const __m512 vc = _mm512_loadu_ps(v + c * KEYS);
                            for (int i = 0; i < 4; ++i)
                                acc[i][c] = _mm512_fmadd_ps(x[i], vc, acc[i][c]);
                        }
                    }
                }
                for (int i = 0; i < 4; ++i)
                    for (int64_t c = 0; c < width; ++c)
                        _mm512_store_ps(output + (r0 + i) * dim + d0 + c * KEYS, acc[i][c]);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 by = _mm512_set1_ps(inverse[r]);
        for (int64_t d = 0; d < dim; d += KEYS)
            _mm512_storeu_ps(out + (t0 + r) * o_row + d, _mm512_mul_ps(_mm512_load_ps(output + r * dim + d), by));
    }
    add_column_sums(logits, stride, inverse, rows, last + 1, sums, lock);
}
#else
/* logits_f32 (above, AVX-512) on eight lanes: four queries x one block of 16 keys at a time (eight sums in
 * registers). */
static void logits_f32(const float *keys, int64_t dim, const float *query, int64_t q_row, int64_t t0, int64_t rows,
                       int64_t span, int64_t stride, float *queries, float *logits) {
    memset(queries, 0, (size_t)(ROWS * dim) * 4);
    for (int64_t r = 0; r < rows; ++r)
        memcpy(queries + r * dim, query + (t0 + r) * q_row, (size_t)dim * 4);
    for (int64_t j0 = 0; j0 < span; j0 += KEYS) {
        const float *k = keys + (j0 / KEYS) * dim * KEYS;
        for (int64_t r0 = 0; r0 < ROWS; r0 += 4) {
            const float *q0 = queries + r0 * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
            __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
            for (int64_t a = 0; a < dim; ++a) {
                const __m256 lo = _mm256_load_ps(k + a * KEYS), hi = _mm256_load_ps(k + a * KEYS + 8);
                __m256 x = _mm256_broadcast_ss(q0 + a);
                a0 = _mm256_fmadd_ps(x, lo, a0), b0 = _mm256_fmadd_ps(x, hi, b0);
                x = _mm256_broadcast_ss(q1 + a);
                a1 = _mm256_fmadd_ps(x, lo, a1), b1 = _mm256_fmadd_ps(x, hi, b1);
                x = _mm256_broadcast_ss(q2 + a);
                a2 = _mm256_fmadd_ps(x, lo, a2), b2 = _mm256_fmadd_ps(x, hi, b2);
                x = _mm256_broadcast_ss(q3 + a);
                a3 = _mm256_fmadd_ps(x, lo, a3), b3 = _mm256_fmadd_ps(x, hi, b3);
            }
            float *l = logits + r0 * stride + j0;
            _mm256_store_ps(l, a0), _mm256_store_ps(l + 8, b0);
            _mm256_store_ps(l + stride, a1), _mm256_store_ps(l + stride + 8, b1);
            _mm256_store_ps(l + 2 * stride, a2), _mm256_store_ps(l + 2 * stride + 8, b2);
            _mm256_store_ps(l + 3 * stride, a3), _mm256_store_ps(l + 3 * stride + 8, b3);
        }
    }
}

/* probabilities_from_lse (above, AVX-512) on eight lanes. */
static void probabilities_from_lse(float *logits, int64_t stride, int64_t t0, int64_t rows, int64_t span,
                                   float scaling, const float *lse) {
    const __m256 scale = _mm256_set1_ps(scaling * LOG2E);
    for (int64_t r = 0; r < ROWS; ++r) {
        float *row = logits + r * stride;
        if (r >= rows) {
            memset(row, 0, (size_t)span * 4);
            continue;
        }
        const __m256 shift = _mm256_set1_ps(lse[r] * LOG2E);
        for (int64_t j = 0; j < span; j += 8)
            _mm256_store_ps(row + j, _mm256_and_ps(_mm256_castsi256_ps(lanes_below(t0 + r - j + 1)), exp2_8(
                _mm256_fmsub_ps(_mm256_load_ps(row + j), scale, shift))));
    }
}

/* unit_f32 (above, AVX-512) on eight lanes: its logits (logits_f32), the shared softmax, the output four queries x 16
 * dimensions at a time over chunks of VALUE_CHUNK_8 keys. */
#define VALUE_CHUNK_8 128 /* keys per chunk of P.V: a chunk's values stay in L1 for the four query groups */
static void unit_f32(const void *packed_keys, const void *packed_values, int64_t dim, int64_t n, int64_t padded,
                     const void *input, int64_t q_row, float scaling, int64_t t0, Room room, void *result,
                     int64_t o_row, float *lse, float *sums, RowLock *lock) {
    const float *keys = packed_keys, *values = packed_values, *query = input;
    float *logits = room.logits, *output = room.output, *out = result;
    const int64_t rows = n - t0 < ROWS ? n - t0 : ROWS, last = t0 + rows - 1;
    const int64_t span = (last + 1 + ROUND - 1) / ROUND * ROUND, stride = padded + KEYS;
    logits_f32(keys, dim, query, q_row, t0, rows, span, stride, room.queries, logits);
    float inverse[ROWS];
    softmax_rows(logits, stride, NULL, 0, t0, rows, span, scaling, inverse, lse);
    memset(output, 0, (size_t)(ROWS * dim) * 4);
    const int64_t seen = last + 1;
    for (int64_t k0 = 0; k0 < seen; k0 += VALUE_CHUNK_8) {
        const int64_t k1 = seen - k0 < VALUE_CHUNK_8 ? seen : k0 + VALUE_CHUNK_8;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const float *p0 = logits + r0 * stride, *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
            for (int64_t d0 = 0; d0 < dim; d0 += 16) {
                float *o = output + r0 * dim + d0;
                __m256 a0 = _mm256_load_ps(o), b0 = _mm256_load_ps(o + 8);
                __m256 a1 = _mm256_load_ps(o + dim), b1 = _mm256_load_ps(o + dim + 8);
                __m256 a2 = _mm256_load_ps(o + 2 * dim), b2 = _mm256_load_ps(o + 2 * dim + 8);
                __m256 a3 = _mm256_load_ps(o + 3 * dim), b3 = _mm256_load_ps(o + 3 * dim + 8);
                for (int64_t j = k0; j < k1; ++j) {
                    const float *v = values + j * dim + d0;
                    const __m256 lo = _mm256_loadu_ps(v), hi = _mm256_loadu_ps(v + 8);
                    __m256 x = _mm256_broadcast_ss(p0 + j);
                    a0 = _mm256_fmadd_ps(x, lo, a0), b0 = _mm256_fmadd_ps(x, hi, b0);
                    x = _mm256_broadcast_ss(p1 + j);
                    a1 = _mm256_fmadd_ps(x, lo, a1), b1 = _mm256_fmadd_ps(x, hi, b1);
                    x = _mm256_broadcast_ss(p2 + j);
                    a2 = _mm256_fmadd_ps(x, lo, a2), b2 = _mm256_fmadd_ps(x, hi, b2);
                    x = _mm256_broadcast_ss(p3 + j);
                    a3 = _mm256_fmadd_ps(x, lo, a3), b3 = _mm256_fmadd_ps(x, hi, b3);
                }
                _mm256_store_ps(o, a0), _mm256_store_ps(o + 8, b0);
                _mm256_store_ps(o + dim, a1), _mm256_store_ps(o + dim + 8, b1);
                _mm256_store_ps(o + 2 * dim, a2), _mm256_store_ps(o + 2 * dim + 8, b2);
                _mm256_store_ps(o + 3 * dim, a3), _mm256_store_ps(o + 3 * dim + 8, b3);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const __m256 by = _mm256_set1_ps(inverse[r]);
        for (int64_t d = 0; d < dim; d += 8)
            _mm256_storeu_ps(out + (t0 + r) * o_row + d, _mm256_mul_ps(_mm256_load_ps(output + r * dim + d), by));
    }
    add_column_sums(logits, stride, inverse, rows, last + 1, sums, lock);
}
#endif

/* The float32 pass: keys transposed by blocks, values as rows, no tiles. */
static const Pass VECTORS = {4, 0, transpose_keys, copy_values, NULL, NULL, unit_f32};

/* One unit of the float32 column sums from a given log-sum-exp (kvsieve_causal_column_sums_f32): the unit's logits
 * (logits_f32), its probabilities exp(scaling * logit - lse) (probabilities_from_lse) and their column sums. No
 * values, no output. */
static void unit_sums_f32(const void *packed_keys, const void *packed_values, int64_t dim, int64_t n, int64_t padded,
                          const void *input, int64_t q_row, float scaling, int64_t t0, Room room, void *result,
                          int64_t o_row, float *lse, float *sums, RowLock *lock) {
    (void)packed_values, (void)result, (void)o_row;
    const int64_t rows = n - t0 < ROWS ? n - t0 : ROWS, last = t0 + rows - 1;
    const int64_t span = (last + 1 + ROUND - 1) / ROUND * ROUND, stride = padded + KEYS;
    logits_f32(packed_keys, dim, input, q_row, t0, rows, span, stride, room.queries, room.logits);
    probabilities_from_lse(room.logits, stride, t0, rows, span, scaling, lse);
    float ones[ROWS];
    for (int r = 0; r < ROWS; ++r)
        ones[r] = 1.0f;
    add_column_sums(room.logits, stride, ones, rows, last + 1, sums, lock);
}

/* The float32 column sums: keys transposed by blocks, no values. */
static const Pass SUMS = {4, 0, transpose_keys, NULL, NULL, NULL, unit_sums_f32};
#endif

/* kvsieve_causal_attention_with_column_sums for float32 tensors, with AVX-512 (or AVX2) fused multiply-adds instead of
 * the tiles (a head size that is a multiple of 16, up to 256): the same arguments, every tensor float32. The
 * probabilities multiply the values in float32 (no rounding to bfloat16), so the output is within float32 rounding of
 * the exact attention. Returns 0, or -1 (neither AVX-512 nor AVX2 and FMA in the build, a head size it does not take,
 * no memory: nothing written). */
int kvsieve_causal_attention_with_column_sums_f32(int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim,
                                                  int64_t n, const float *query, int64_t q_batch, int64_t q_head,
                                                  int64_t q_row, const float *keys, int64_t k_batch, int64_t k_head,
                                                  int64_t k_row, const float *values, int64_t v_batch, int64_t v_head,
                                                  int64_t v_row, float scaling, float *out, int64_t o_batch,
                                                  int64_t o_row, int64_t o_head, float *lse, float *sums) {
#if KVSIEVE_VECTORS
    if (batch < 1 || kv_heads < 1 || groups < 1 || dim < 16 || dim % 16 || dim > MOST_DIM || n < 1)
        return -1;
    const Call call = {batch, kv_heads, groups, dim, n, query, q_batch, q_head, q_row, keys, k_batch, k_head, k_row,
                       values, v_batch, v_head, v_row, scaling, out, o_batch, o_row, o_head, lse, sums};
    return run_pass(&VECTORS, &call);
#else
    (void)batch, (void)kv_heads, (void)groups, (void)dim, (void)n, (void)query, (void)q_batch, (void)q_head;
    (void)q_row, (void)keys, (void)k_batch, (void)k_head, (void)k_row, (void)values, (void)v_batch, (void)v_head;
    (void)v_row, (void)scaling, (void)out, (void)o_batch, (void)o_row, (void)o_head, (void)lse, (void)sums;
    return -1;
#endif
}

/* The column sums sums[b, h, j] = sum over t >= j of exp(scaling * q_t . k_j - lse[b, h, t]) of a causal float32
 * prompt, from each query's log-sum-exp given (the flash kernel's, which returned SDPA's output): the float32 pass's
 * logits and probabilities without the output (no values, no P.V). query (batch, kv_heads * groups, n, dim) and keys
 * (batch, kv_heads, n, dim) float32 with strides in elements (unit stride over dim); lse float32 (batch, kv_heads *
 * groups, n), contiguous, read; sums likewise, written. The arguments of statistics.c's kvsieve_causal_column_sums
 * (bfloat16). Within float32 rounding of the PyTorch path (flash_statistics._column_sums: the products summed in
 * another order, exp2_16's polynomial). Returns 0, or -1 (no vector code in the build, a head size it does not take,
 * no memory: nothing to use). */
int kvsieve_causal_column_sums_f32(int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t n,
                                   const float *query, int64_t q_batch, int64_t q_head, int64_t q_row,
                                   const float *keys, int64_t k_batch, int64_t k_head, int64_t k_row, const float *lse,
                                   float scaling, float *sums) {
#if KVSIEVE_VECTORS
    if (batch < 1 || kv_heads < 1 || groups < 1 || dim < 16 || dim % 16 || dim > MOST_DIM || n < 1)
        return -1;
    const Call call = {batch, kv_heads, groups, dim, n, query, q_batch, q_head, q_row, keys, k_batch, k_head, k_row,
                       NULL, 0, 0, 0, scaling, NULL, 0, 0, 0, (float *)lse, sums};
    return run_pass(&SUMS, &call);
#else
    (void)batch, (void)kv_heads, (void)groups, (void)dim, (void)n, (void)query, (void)q_batch, (void)q_head;
    (void)q_row, (void)keys, (void)k_batch, (void)k_head, (void)k_row, (void)lse, (void)scaling, (void)sums;
    return -1;
#endif
}
