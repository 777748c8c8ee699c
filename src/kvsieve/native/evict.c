/* Every-step decoding eviction in place (kvsieve_evict_lowest): one accumulated-attention update, the lowest score
 * of each head and the drop of that entry, in one call over a uniform store's buffers.
 *
 * kvsieve.native.build builds this file on first use; kvsieve.native.evict_lowest calls it through ctypes for
 * kvsieve.cache.store_compaction.StoreCompaction.drop_lowest. It computes what the engine's general decoding step
 * computes for a scorer whose score is an accumulator of attention rows (H2O, Zhang et al. 2023, arXiv:2306.14048,
 * Sec. 3.2: the score of entry j is sum_t A[t, j] over every query so far), bit for bit:
 *
 *   observation   acc[s, j] += (row[g0, j] + ... + row[g0 + groups - 1, j]) / groups   (torch's mean: sum, then a
 *                 division; the sum in head order from the first), for every held entry j of segment s (batch item
 *                 s / kv_heads, KV head s % kv_heads, query heads g0 = (s % kv_heads) * groups ...);
 *   plan          the entry with the lowest accumulator among j < candidates (the older entries: the newest
 *                 ones are protected), when it is the only one with that value (torch's min, checked unique);
 *   action        every buffer's rows j + 1 ... length - 1 of the segment move down by one row (the kept entries
 *                 in their order, as the gather of StoreCompaction.drop_one leaves them); the freed last row keeps
 *                 what it held (a free row's content is never read).
 *
 * A segment whose lowest score is tied or NaN makes the call return 1 before anything moves (the accumulators are
 * updated): the caller then plans on the general path, whose top-k decides ties. No vector code: a few hundred
 * entries per head, plain loops and memmove.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KVSIEVE_ABI 1

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

/* rows: (batch, kv_heads * groups, length) float32, contiguous. acc: float32, entry j of segment s at s * capacity + j.
 * buffers[b]: row r of buffer b at buffers[b] + r * row_bytes[b] (keys, values, positions, side data; acc among them).
 * dropped: (batch * kv_heads) int64, written. Returns 0 (dropped), 1 (a tie or NaN: nothing moved), -1 (bad sizes). */
int kvsieve_evict_lowest(int64_t batch, int64_t kv_heads, int64_t groups, int64_t length, const float *rows,
                         float *acc, int64_t capacity, int64_t candidates, int n_buffers, char *const *buffers,
                         const int64_t *row_bytes, int64_t *dropped) {
    if (batch < 1 || kv_heads < 1 || groups < 1 || length < 1 || candidates < 1 || candidates > length
        || capacity < length || n_buffers < 0)
        return -1;
    const int64_t segments = batch * kv_heads;
    int unique = 1;
    for (int64_t s = 0; s < segments; ++s) {
        const float *first = rows + (s * groups) * length; /* query heads of KV head s % kv_heads of item s / kv_heads */
        float *scores = acc + s * capacity;
        for (int64_t j = 0; j < length; ++j) {
            float sum = first[j];
            for (int64_t g = 1; g < groups; ++g)
                sum += first[g * length + j];
            scores[j] = scores[j] + sum / (float)groups;
        }
        float lowest = scores[0];
        int64_t at = 0, ties = 1;
        if (isnan(lowest))
            unique = 0;
        for (int64_t j = 1; j < candidates; ++j) {
            const float v = scores[j];
            if (isnan(v))
                unique = 0;
            else if (v < lowest) {
                lowest = v;
                at = j;
                ties = 1;
            } else if (v == lowest)
                ++ties;
        }
        if (ties != 1)
            unique = 0;
        dropped[s] = at;
    }
    if (!unique)
        return 1;
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t j = dropped[s], moved = length - 1 - j;
        if (moved <= 0)
            continue;
        for (int b = 0; b < n_buffers; ++b) {
            char *row = buffers[b] + (s * capacity + j) * row_bytes[b];
            memmove(row, row + row_bytes[b], (size_t)(moved * row_bytes[b]));
        }
    }
    return 0;
}
