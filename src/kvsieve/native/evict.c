/* Every-step decoding eviction in place (kvsieve_evict_lowest): each head's lowest score, the drop of that entry
 * and, for an accumulated score, the score's update first, in one call over a uniform store's buffers.
 *
 * kvsieve.native.build builds this file on first use; kvsieve.native.evict_lowest calls it through ctypes for
 * kvsieve.cache.store_compaction.StoreCompaction.drop_lowest. It computes what the engine's general decoding step
 * computes, bit for bit:
 *
 *   observation   (rows given: a score accumulated over every query, H2O, Zhang et al. 2023, arXiv:2306.14048,
 *                 Sec. 3.2) score[s, j] += (row[g0, j] + ... + row[g0 + groups - 1, j]) / groups — torch's mean:
 *                 a sum in head order from the first, then a division — for every held entry j of segment s
 *                 (batch item s / kv_heads, KV head s % kv_heads, query heads g0 = (s % kv_heads) * groups ...);
 *                 without rows the scores are given (TOVA's last-query attention, computed by the caller);
 *   plan          the entry with the lowest score among j < candidates (the older entries: the newest ones are
 *                 protected), when it is the only one with that value (torch's min, checked unique);
 *   action        every buffer's rows j + 1 ... length - 1 of the segment move down by one row (the kept entries
 *                 in their order, as the gather of StoreCompaction.drop_one leaves them); the freed last row keeps
 *                 what it held (a free row's content is never read).
 *
 * Scores shared by the KV heads of a batch item (a zero head stride: TOVA's average over every query head) are the
 * general path's only where the item's heads hold the same positions; with `aligned` (the positions buffer) the call
 * checks that first and returns -1 otherwise, nothing changed. A segment whose lowest score is tied or NaN makes the
 * call return 1 before anything moves (accumulated scores are updated): the caller then plans on the general path,
 * whose top-k decides ties. No vector code: a few hundred entries per head, plain loops and memmove.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KVSIEVE_ABI 1

int kvsieve_native_abi(void) { return KVSIEVE_ABI; }

/* Whether every KV head of each batch item holds the same positions in its first `length` rows. */
static int heads_aligned(const int64_t *positions, int64_t batch, int64_t kv_heads, int64_t length, int64_t capacity) {
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t *first = positions + b * kv_heads * capacity;
        for (int64_t h = 1; h < kv_heads; ++h)
            if (memcmp(first, first + h * capacity, (size_t)length * sizeof(int64_t)) != 0)
                return 0;
    }
    return 1;
}

/* rows: (batch, kv_heads * groups, length) float32, contiguous, or NULL (scores given). scores: float32, entry j of
 * segment s at scores + (s / kv_heads) * score_batch + (s % kv_heads) * score_head + j. aligned: the int64 positions
 * buffer (row s * capacity + j) when shared scores need aligned heads, else NULL. buffers[b]: row r of buffer b at
 * buffers[b] + r * row_bytes[b] (keys, values, positions, side data). dropped: (batch * kv_heads) int64, written.
 * Returns 0 (dropped), 1 (a tie or NaN: nothing moved), -1 (bad sizes or heads not aligned: nothing changed). */
int kvsieve_evict_lowest(int64_t batch, int64_t kv_heads, int64_t groups, int64_t length, const float *rows,
                         float *scores, int64_t score_batch, int64_t score_head, int64_t capacity, int64_t candidates,
                         const int64_t *aligned, int n_buffers, char *const *buffers, const int64_t *row_bytes,
                         int64_t *dropped) {
    if (batch < 1 || kv_heads < 1 || groups < 1 || length < 1 || candidates < 1 || candidates > length
        || capacity < length || n_buffers < 0)
        return -1;
    if (aligned != NULL && !heads_aligned(aligned, batch, kv_heads, length, capacity))
        return -1;
    const int64_t segments = batch * kv_heads;
    int unique = 1;
    for (int64_t s = 0; s < segments; ++s) {
        float *score = scores + (s / kv_heads) * score_batch + (s % kv_heads) * score_head;
        if (rows != NULL) {
            const float *first = rows + (s * groups) * length; /* query heads of KV head s % kv_heads of s / kv_heads */
            for (int64_t j = 0; j < length; ++j) {
                float sum = first[j];
                for (int64_t g = 1; g < groups; ++g)
                    sum += first[g * length + j];
                score[j] = score[j] + sum / (float)groups;
            }
        }
        float lowest = score[0];
        int64_t at = 0, ties = 1;
        if (isnan(lowest))
            unique = 0;
        for (int64_t j = 1; j < candidates; ++j) {
            const float v = score[j];
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
