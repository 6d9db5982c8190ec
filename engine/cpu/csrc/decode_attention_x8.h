// The AVX2 passes of paged_decode_attention.cpp (included there, after its block walk):
// eight keys scored at once, and V weighed in register tiles of eight accumulators.
//
// Scores: the fp32 path's per-key dot ends in a horizontal sum per query head (about five
// instructions beside a 64-dim head's eight FMAs), and its group's four dot chains leave the
// two FMA pipes half idle on FMA latency. Here one query head meets eight keys at a time:
// eight independent accumulators, one per key, then sum_each_of_8 turns them into the eight
// scores in one vector. The query chunk is loaded once for the eight keys. The passes take
// fp32 caches only: converting a bf16 block's K rows first cost more than the passes gained.
//
// Values: weigh_rows' per-chunk loop kept one accumulator per query head (four chains at
// GQA 4, again FMA latency); here a tile of kG heads by kC vectors (kG * kC = 8 chains, 14
// of AVX2's 16 registers with the V vectors and the broadcast weights) walks the block's
// rows, the tiles covering the group and the head. Every V element is loaded once per
// tile row of heads: once in all for groups of up to four.
#pragma once

#if defined(CPU_CAPABILITY_AVX2)
constexpr bool kHasX8 = true;

// scores[g * n] (g < kGroup) = q[g] . k[0 .. 8) rows: 8 keys' scores per query head.
template <int kGroup>
inline void score_8_keys(const float* q_buf, const float* k, int64_t head_dim, int64_t n, float* scores) {
  for (int g = 0; g < kGroup; ++g) {
    const float* q = q_buf + g * head_dim;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + i * head_dim + d), acc[i]);
    }
    _mm256_storeu_ps(scores + g * n, tokenloom_cpu::sum_each_of_8(acc));
  }
}

// score_rows with eight keys at a time, on an fp32 cache (kUsesX8 in paged_decode_attention.cpp);
// a block's last (up to 7) keys one by one.
template <int kGroup>
void score_rows_x8(const float* q_buf, const float* k_cache, const int32_t* block_table, int64_t seq_len,
                   const TaskShape& s, float* scores) {
  const int64_t n = num_keys(seq_len, s);
  const int64_t hd = s.head_dim;
  for_each_block(k_cache, block_table, seq_len, s, [&](const float* rows, int64_t start, int64_t num_tokens) {
    int64_t t = 0;
    for (; t + 8 <= num_tokens; t += 8) score_8_keys<kGroup>(q_buf, rows + t * hd, hd, n, scores + start + t);
    for (; t < num_tokens; ++t) {
      for (int g = 0; g < kGroup; ++g) {
        Vec dot(0.f);
        for (int64_t d = 0; d < hd; d += Vec::size()) {
          dot = at::vec::fmadd(Vec::loadu(q_buf + g * hd + d), Vec::loadu(rows + t * hd + d), dot);
        }
        scores[g * n + start + t] = tokenloom_cpu::reduce_add(dot);
      }
    }
  });
}

// acc[g][c] += sum over the block's rows t of p[g * n + t] * v[t][c] for a tile of kG heads by
// kC vectors (p, v and acc already offset to the tile's first head and vector).
template <typename scalar_t, int kG, int kC>
inline void weigh_tile(const float* p, int64_t n, const scalar_t* v, int64_t head_dim, int64_t num_tokens,
                       float* acc) {
  Vec sums[kG][kC];
  for (int g = 0; g < kG; ++g) {
    for (int c = 0; c < kC; ++c) sums[g][c] = Vec::loadu(acc + g * head_dim + c * Vec::size());
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    Vec vt[kC];
    for (int c = 0; c < kC; ++c) vt[c] = load_float(v + t * head_dim + c * Vec::size());
    for (int g = 0; g < kG; ++g) {
      const Vec pg(p[g * n + t]);
      for (int c = 0; c < kC; ++c) sums[g][c] = at::vec::fmadd(pg, vt[c], sums[g][c]);
    }
  }
  for (int g = 0; g < kG; ++g) {
    for (int c = 0; c < kC; ++c) sums[g][c].store(acc + g * head_dim + c * Vec::size());
  }
}

// Vectors a tile of kG heads takes: eight accumulators in all (one head: 8, two: 4, three or four: 2).
constexpr int tile_vectors(int kG) { return kG == 1 ? 8 : kG == 2 ? 4 : 2; }

// Tiles of kG heads (rows g0 .. g0 + kG) over the whole head: kC vectors at a time, the rest one by one.
template <typename scalar_t, int kG>
inline void weigh_heads(const float* p, int64_t n, const scalar_t* v, int64_t head_dim, int64_t num_tokens,
                        float* acc) {
  constexpr int kC = tile_vectors(kG);
  const int64_t num_chunks = head_dim / Vec::size();
  int64_t c = 0;
  for (; c + kC <= num_chunks; c += kC) {
    weigh_tile<scalar_t, kG, kC>(p, n, v + c * Vec::size(), head_dim, num_tokens, acc + c * Vec::size());
  }
  for (; c < num_chunks; ++c) {
    weigh_tile<scalar_t, kG, 1>(p, n, v + c * Vec::size(), head_dim, num_tokens, acc + c * Vec::size());
  }
}

// weigh_rows in tiles: the group four heads at a time (a group of 5..8 ends with a tile of the rest).
template <typename scalar_t, int kGroup>
void weigh_rows_x8(const float* weights, const scalar_t* v_cache, const int32_t* block_table, int64_t seq_len,
                   const TaskShape& s, float* acc) {
  constexpr int kG = kGroup < 4 ? kGroup : 4;
  constexpr int kRest = kGroup - kG;
  const int64_t n = num_keys(seq_len, s);
  std::fill(acc, acc + s.group * s.head_dim, 0.f);
  for_each_block(v_cache, block_table, seq_len, s, [&](const scalar_t* block, int64_t start, int64_t num_tokens) {
    weigh_heads<scalar_t, kG>(weights + start, n, block, s.head_dim, num_tokens, acc);
    if constexpr (kRest > 0) {
      weigh_heads<scalar_t, kRest>(weights + kG * n + start, n, block, s.head_dim, num_tokens, acc + kG * s.head_dim);
    }
  });
}
#else
constexpr bool kHasX8 = false;
#endif
