/* A causal bfloat16 prompt's column sums from the flash kernel's log-sum-exp (kvsieve_causal_column_sums), with the
 * CPU's bfloat16 dot products (AVX512-BF16).
 *
 * kvsieve.native.build builds this file on first use; kvsieve.native.column_sums calls it through ctypes for
 * kvsieve.attention.flash_statistics, whose PyTorch path is the reference. For query head h of batch item b over its
 * KV head's keys (h / groups) it computes H2O's and EMS's statistic (Zhang et al. 2023, arXiv:2306.14048, Sec. 3.2;
 * Li et al. 2024, arXiv:2412.08521, Sec. 3.3: attention accumulated over every query of the prompt)
 *
 *   out[b, h, j] = sum over t >= j of exp(scaling * (q[b, h, t] . k[b, h / groups, j]) - lse[b, h, t])
 *
 * where lse[b, h, t] is the query's log-sum-exp the flash kernel returned with its output, so no softmax is taken
 * again. The dot products multiply bfloat16 pairs exactly into float32 sums (vdpbf16ps): the float32 products of
 * the PyTorch path, summed in another order; the exponential is taken in base 2 (the scaling and log2(e) folded
 * into one multiply-subtract) as 2^n * 2^f with a degree-6 polynomial for 2^f. Within float32 rounding of the PyTorch
 * path.
 *
 * Work: sixteen keys at a time, one per vector lane, each lane summing its key's column over the queries at or after
 * it (the keys packed once per unit as bfloat16 pairs). With AMX tiles a unit is a span of 128 keys and the products
 * come sixteen queries x 64 keys at a time, the tiles computing one round while the vector units take the previous
 * round's exponentials; without them a unit is one block of 16 keys, four queries at a time for four independent dot
 * chains. The units of every (batch item, query head) are shared among torch's OpenMP threads, largest first (a
 * unit's queries are the ones after it). Without AVX512-BF16 in the build (-march=native on a CPU without it) the
 * function returns -1 and the caller keeps PyTorch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVSIEVE_BF16_DOT 1
#else
#define KVSIEVE_BF16_DOT 0
#endif
#if KVSIEVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVSIEVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a feature's register state (asm/prctl.h) */
#define XFEATURE_XTILEDATA 18      /* the AMX tiles' data */
#else
#define KVSIEVE_AMX 0
#endif

#define KVSIEVE_ABI 1
#define KEYS 16        /* keys per block: the vector's lanes */
#define MOST_PAIRS 128 /* head size up to 256 */
#define QUERIES 4      /* queries per dot-product round */
#define SPAN 128       /* keys per unit of work on the tiles */
#define SPAN_BLOCKS (SPAN / KEYS)
#define GROUP_BLOCKS 4 /* the blocks of keys one round of the tiles takes */
#define LOG2E 1.44269504088896341f

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

/* Whether the build has the bfloat16 dot products (the column sums run). */
int kvsieve_bf16_dot(void) { return KVSIEVE_BF16_DOT; }

#if KVSIEVE_BF16_DOT
/* 2^x for x = the logit in base 2 (scaled by log2(e) with the scaling folded in): 2^n by the exponent (scalef) times
 * 2^f, |f| <= 1/2, from its Taylor polynomial of degree 6 (relative error <= 1.2e-7, float32's own order); 0 where
 * 2^x underflows. */
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

static inline __m512i pair(const uint16_t *row, int64_t p) {
    uint32_t bits;
    memcpy(&bits, row + 2 * p, 4);
    return _mm512_set1_epi32((int)bits);
}

/* The lanes (keys j0 + l, l < count) that query t sees: j0 + l <= t. */
static inline __mmask16 seen_by(int64_t t, int64_t j0, __mmask16 present) {
    const int64_t last = t - j0; /* the last lane at or before t */
    if (last < 0)
        return 0;
    return last >= KEYS - 1 ? present : (__mmask16)(present & ((1u << (last + 1)) - 1u));
}

/* One block: the column sums of keys j0 ... j0 + count - 1 of one (batch item, query head) over the queries first ...
 * n - 1 (j0 and on: every query that sees one of them), written to out[0 ... count - 1]. */
static void block_sums(const uint32_t *packed, int64_t pairs, const uint16_t *query, int64_t q_row, const float *lse,
                       float scaling, int64_t first, int64_t j0, int64_t count, int64_t n, float *out) {
    const __mmask16 present = (__mmask16)(count >= KEYS ? 0xFFFFu : ((1u << count) - 1u));
    const __m512 scale = _mm512_set1_ps(scaling * LOG2E); /* logits in base 2 */
    __m512 total = _mm512_setzero_ps();
    int64_t t = first;
    for (; t + QUERIES <= n; t += QUERIES) {
        const uint16_t *q0 = query + t * q_row, *q1 = q0 + q_row, *q2 = q1 + q_row, *q3 = q2 + q_row;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t p = 0; p < pairs; ++p) {
            const __m512bh k = (__m512bh)_mm512_load_si512((const void *)(packed + p * KEYS));
            a0 = _mm512_dpbf16_ps(a0, k, (__m512bh)pair(q0, p));
            a1 = _mm512_dpbf16_ps(a1, k, (__m512bh)pair(q1, p));
            a2 = _mm512_dpbf16_ps(a2, k, (__m512bh)pair(q2, p));
            a3 = _mm512_dpbf16_ps(a3, k, (__m512bh)pair(q3, p));
        }
        const __m512 acc[QUERIES] = {a0, a1, a2, a3};
        for (int i = 0; i < QUERIES; ++i) {
            const __m512 logit = _mm512_fmsub_ps(acc[i], scale, _mm512_set1_ps(lse[t + i] * LOG2E));
            total = _mm512_mask_add_ps(total, seen_by(t + i, j0, present), total, exp2_16(logit));
        }
    }
    for (; t < n; ++t) {
        const uint16_t *q0 = query + t * q_row;
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_load_si512((const void *)(packed + p * KEYS)),
                                  (__m512bh)pair(q0, p));
        const __m512 logit = _mm512_fmsub_ps(a0, scale, _mm512_set1_ps(lse[t] * LOG2E));
        total = _mm512_mask_add_ps(total, seen_by(t, j0, present), total, exp2_16(logit));
    }
    _mm512_mask_storeu_ps(out, present, total);
}
#endif

#if KVSIEVE_AMX
/* The tiles' shape: seven tiles of 16 rows x 64 bytes (tiles 0 ... 3 the float32 logits of 16 queries x 16 keys, tile
 * 4 16 queries x 32 dimensions, tiles 5 and 6 16 dimension pairs x 16 keys: the packed keys' layout, AMX's pair
 * layout of its second operand). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileShape;

/* Whether this process may use the tiles (Linux grants their register state on request; torch's oneDNN asks too). */
static int tiles_granted(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

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

/* One round of the tiles: the float32 logits of 16 queries (t ... t + 15) against the GROUP_BLOCKS blocks of keys
 * packed one after another from packed, block b in tile b; tile 4 the queries' chunk of 16 dimension pairs, tiles 5
 * and 6 the blocks' chunks in turn. */
static inline void span_products(const uint32_t *packed, int64_t pairs, const uint16_t *query, int64_t q_row,
                                 int64_t t) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t block = pairs * KEYS; /* one block's packed pairs */
    for (int64_t chunk = 0; chunk < pairs / 16; ++chunk) {
        const uint32_t *k = packed + chunk * 16 * KEYS;
        _tile_loadd(4, query + t * q_row + chunk * 32, q_row * 2);
        _tile_loadd(5, k, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, k + block, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, k + 2 * block, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, k + 3 * block, 64);
        _tile_dpbf16ps(3, 4, 6);
    }
}

/* block_sums for the keys j0 ... j0 + count - 1 of a span (count <= SPAN, their packed pairs one block after another)
 * with the products on the tiles (dim a multiple of 32): rounds of 16 queries x GROUP_BLOCKS blocks, the next round's
 * products running on the tiles while this round's exponentials run on the vector units (its logits stored first, two
 * buffers in turn). A span of eight blocks reads each query tile once from memory for its two rounds: the queries'
 * traffic, not the tiles' products, bounds this pass. The last queries that do not fill a tile take block_sums's
 * vector loop, block by block. */
static void span_sums_tiles(const uint32_t *packed, int64_t pairs, const uint16_t *query, int64_t q_row,
                            const float *lse, float scaling, int64_t j0, int64_t count, int64_t n, float *out) {
    const __m512 scale = _mm512_set1_ps(scaling * LOG2E); /* logits in base 2 */
    const __m512 log2e = _mm512_set1_ps(LOG2E);
    float logits[2][16 * GROUP_BLOCKS * KEYS] __attribute__((aligned(64)));
    __m512 total[SPAN_BLOCKS];
    __mmask16 present[SPAN_BLOCKS];
    for (int b = 0; b < SPAN_BLOCKS; ++b) {
        const int64_t in_block = count - b * KEYS;
        total[b] = _mm512_setzero_ps();
        present[b] = (__mmask16)(in_block >= KEYS ? 0xFFFFu : in_block <= 0 ? 0u : ((1u << in_block) - 1u));
    }
    const int64_t tiles = (n - j0) / 16; /* the query tiles that fill */
    const int64_t halves = SPAN_BLOCKS / GROUP_BLOCKS, rounds = tiles * halves;
    for (int64_t g = 0; g <= rounds; ++g) {
        if (g < rounds)
            span_products(packed + (g % halves) * GROUP_BLOCKS * pairs * KEYS, pairs, query, q_row,
                          j0 + 16 * (g / halves));
        if (g > 0) { /* the previous round: its exponentials while the tiles work */
            const float *rows = logits[(g - 1) & 1];
            const int64_t t0 = j0 + 16 * ((g - 1) / halves), first = ((g - 1) % halves) * GROUP_BLOCKS;
            for (int r = 0; r < 16; ++r) {
                const __m512 shift = _mm512_mul_ps(_mm512_set1_ps(lse[t0 + r]), log2e);
                for (int b = 0; b < GROUP_BLOCKS; ++b) {
                    const __m512 logit = _mm512_fmsub_ps(_mm512_load_ps(rows + (b * 16 + r) * KEYS), scale, shift);
                    total[first + b] = _mm512_mask_add_ps(total[first + b],
                                                          seen_by(t0 + r, j0 + (first + b) * KEYS, present[first + b]),
                                                          total[first + b], exp2_16(logit));
                }
            }
        }
        if (g < rounds) {
            float *rows = logits[g & 1];
            _tile_stored(0, rows, 64);
            _tile_stored(1, rows + 16 * KEYS, 64);
            _tile_stored(2, rows + 32 * KEYS, 64);
            _tile_stored(3, rows + 48 * KEYS, 64);
        }
    }
    const int64_t t = j0 + 16 * tiles;
    for (int b = 0; b < SPAN_BLOCKS; ++b) {
        if (!present[b])
            continue;
        if (t < n) { /* the rest: the vector loop's sums, added to these */
            float rest[KEYS] __attribute__((aligned(64))) = {0};
            block_sums(packed + b * pairs * KEYS, pairs, query, q_row, lse, scaling, t, j0 + b * KEYS,
                       count - b * KEYS >= KEYS ? KEYS : count - b * KEYS, n, rest);
            total[b] = _mm512_add_ps(total[b], _mm512_maskz_load_ps(present[b], rest));
        }
        _mm512_mask_storeu_ps(out + b * KEYS, present[b], total[b]);
    }
}
#endif

/* query: bfloat16 (batch, kv_heads * groups, n, dim) with strides in elements (unit stride over dim); keys: bfloat16
 * (batch, kv_heads, n, dim) likewise; lse: float32 (batch, kv_heads * groups, n), contiguous; out: float32 like lse,
 * written. Returns 0, or -1 (no AVX512-BF16 in the build, or sizes it does not take: nothing written). */
int kvsieve_causal_column_sums(int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t n,
                               const uint16_t *query, int64_t q_batch, int64_t q_head, int64_t q_row,
                               const uint16_t *keys, int64_t k_batch, int64_t k_head, int64_t k_row, const float *lse,
                               float scaling, float *out) {
#if KVSIEVE_BF16_DOT
    if (batch < 1 || kv_heads < 1 || groups < 1 || dim < 2 || dim % 2 || dim > 2 * MOST_PAIRS || n < 1)
        return -1;
    const int64_t pairs = dim / 2, q_heads = kv_heads * groups, rows = batch * q_heads;
#if KVSIEVE_AMX
    const int tiles = dim % 32 == 0 && tiles_granted();
#else
    const int tiles = 0;
#endif
    const int64_t width = tiles ? SPAN : KEYS; /* keys per unit of work */
    const int64_t blocks = (n + width - 1) / width, units = rows * blocks;
#pragma omp parallel if (n >= 256)
    {
#if KVSIEVE_AMX
    if (tiles)
        shape_tiles(); /* each thread's own tile shape */
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t block = u / rows, row = u % rows; /* block-major: the longest blocks first */
        const int64_t b = row / q_heads, h = row % q_heads, j0 = block * width;
        const int64_t count = n - j0 < width ? n - j0 : width;
        uint32_t packed[SPAN_BLOCKS * pairs * KEYS] __attribute__((aligned(64))); /* the unit's keys, block by block */
        const uint16_t *key_rows = keys + b * k_batch + (h / groups) * k_head + j0 * k_row;
        for (int64_t l = 0; l < width; ++l)
            for (int64_t p = 0; p < pairs; ++p) {
                uint32_t bits = 0;
                if (l < count)
                    memcpy(&bits, key_rows + l * k_row + 2 * p, 4);
                packed[(l / KEYS) * pairs * KEYS + p * KEYS + l % KEYS] = bits;
            }
        const uint16_t *rows_of_head = query + b * q_batch + h * q_head;
#if KVSIEVE_AMX
        if (tiles) {
            span_sums_tiles(packed, pairs, rows_of_head, q_row, lse + row * n, scaling, j0, count, n,
                            out + row * n + j0);
            continue;
        }
#endif
        block_sums(packed, pairs, rows_of_head, q_row, lse + row * n, scaling, j0, j0, count, n, out + row * n + j0);
    }
#if KVSIEVE_AMX
    if (tiles)
        _tile_release();
#endif
    }
    return 0;
#else
    (void)batch, (void)kv_heads, (void)groups, (void)dim, (void)n, (void)query, (void)q_batch, (void)q_head;
    (void)q_row, (void)keys, (void)k_batch, (void)k_head, (void)k_row, (void)lse, (void)scaling, (void)out;
    return -1;
#endif
}
