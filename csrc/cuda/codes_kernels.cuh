// The kernels of the integer codes (int8, int4, int2; one fp32 scale per block): quantize,
// dequantize (a sum of rows) and unpack, each as a vector kernel and the scalar kernel for the
// layouts it cannot take (the packed scalar quantize is in packed_kernels.cuh). The chunks,
// 16-byte accesses and warp loops are kernels.cuh's; the element math is fastddp/rounding.h's,
// as in the CPU loops. Compiled like kernels.cuh, by nvcc and by the grid emulator.
#pragma once

#include "kernels.cuh"

namespace fastddp::kernels {

// ------------------------------------------------------------------ int8 / int4 / int2 codes

// A chunk's 4 codes of kBits bits are a piece of kBits / 2 bytes; kGroup = 32 / kBits lanes
// hold the pieces of 16 consecutive bytes.
template <int kBits>
struct Pieces {
  static constexpr int kBytes = kBits / 2;
  static constexpr int kGroup = 32 / kBits;
  static constexpr uint32_t kMask = kBits == 8 ? 0xffffffffu : (1u << (4 * kBits)) - 1u;
};

// The layout of codes with its two divisors, set up once at the launch (Divider): every chunk
// divides a flat element index by the row length (its row) and by the block length (its
// scale).
struct Codes {
  Int8Rows rows;
  Divider by_row;
  Divider by_block;

  static Codes of(const Int8Rows& rows, int64_t block) {
    return {rows, Divider::of(rows.row_len), Divider::of(block)};
  }

  // The index of the scale of flat element e (the first of its block or not).
  __device__ __forceinline__ int64_t scale_index(int64_t e) const {
    const int64_t row = by_row.div(e);
    return row * rows.s_stride + by_block.div(e - row * rows.row_len);
  }
};

// Where the codes of chunk c (flat elements 4c ..) lie in `rows`, whose row r starts at byte
// q + r * q_stride: the piece's address, and whether its group's 16 bytes are one aligned
// access that holds only codes of elements below `limit`, in one row.
struct CodeSpot {
  uint8_t* at;
  bool group_whole;
};

template <int kBits>
__device__ __forceinline__ uint8_t* code_byte(const Codes& codes, uint8_t* q, int64_t e) {
  const int64_t row = codes.by_row.div(e);
  return q + row * codes.rows.q_stride + (e - row * codes.rows.row_len) * kBits / 8;
}

template <int kBits>
__device__ __forceinline__ CodeSpot code_spot(
    const Codes& codes, uint8_t* q, int64_t c, int64_t limit) {
  using P = Pieces<kBits>;
  const int64_t g0 = (c & ~int64_t{P::kGroup - 1}) * kChunk;  // the group's first element
  const int64_t g1 = g0 + P::kGroup * kChunk - 1;              // and its last
  bool whole = g1 < limit && codes.by_row.div(g0) == codes.by_row.div(g1);
  if (whole) {
    whole = reinterpret_cast<uintptr_t>(code_byte<kBits>(codes, q, g0)) % 16 == 0;
  }
  return {code_byte<kBits>(codes, q, c * kChunk), whole};
}

// Where chunk c's codes and its block's scale lie, and whether it is its block's first chunk.
// The lanes of a warp take a run of 32 consecutive chunks (c - lane ..); when the run's 128
// elements lie below `limit` in one row, as they do but where a row ends inside it, their row
// is worked out once for the run and each chunk's place from its offset in the row, with one
// division (by the block); otherwise as code_spot and scale_index do, with seven.
struct Place {
  CodeSpot spot;
  int64_t scale;
  bool block_first;
};

template <int kBits>
__device__ __forceinline__ Place place_of(const Codes& codes, uint8_t* q, int64_t c, int64_t limit) {
  using P = Pieces<kBits>;
  const int64_t e = c * kChunk;
  const int64_t e0 = (c - lane_index()) * kChunk;
  const int64_t row = codes.by_row.div(e0);
  const int64_t start = row * codes.rows.row_len;
  const int64_t block = codes.by_block.d;
  if (e0 + 32 * kChunk <= limit && e0 + 32 * kChunk <= start + codes.rows.row_len) {
    uint8_t* row_q = q + row * codes.rows.q_stride;
    const int64_t offset = e - start;
    // The group's first element, as code_spot takes it (groups align in c, not in the row).
    const int64_t g0 = (c & ~int64_t{P::kGroup - 1}) * kChunk - start;
    const int64_t b = codes.by_block.div(offset);
    const bool whole = reinterpret_cast<uintptr_t>(row_q + g0 * kBits / 8) % 16 == 0;
    return {{row_q + offset * kBits / 8, whole}, row * codes.rows.s_stride + b, offset == b * block};
  }
  return {code_spot<kBits>(codes, q, c, limit), codes.scale_index(e),
          e - codes.by_block.div(e) * block == 0};
}

// The piece of the chunk whose codes start at `at` (count of them exist): the group's 16 bytes
// in one access that all its lanes make, or the piece alone.
template <int kBits>
__device__ __forceinline__ uint32_t load_piece(const uint8_t* at, int64_t c, int count, bool whole) {
  using P = Pieces<kBits>;
  if (whole) {
    const int byte = static_cast<int>(c & (P::kGroup - 1)) * P::kBytes;
    const uint4 v = load16(reinterpret_cast<const uint4*>(at - byte));
    const uint32_t word = byte < 8 ? (byte < 4 ? v.x : v.y) : (byte < 12 ? v.z : v.w);
    return (word >> (8 * (byte % 4))) & P::kMask;
  }
  const int nbytes = (count * kBits + 7) / 8;
  if (nbytes == P::kBytes) {  // a whole piece, aligned to its size
    if (P::kBytes == 4) {
      return *reinterpret_cast<const uint32_t*>(at);
    }
    if (P::kBytes == 2) {
      return *reinterpret_cast<const uint16_t*>(at);
    }
    return *at;
  }
  uint32_t piece = 0;
  FASTDDP_UNROLL
  for (int b = 0; b < P::kBytes; ++b) {
    if (b < nbytes) {
      piece |= static_cast<uint32_t>(at[b]) << (8 * b);
    }
  }
  return piece;
}

// Stores the chunk's piece at `at`: the group's pieces gather by shuffles in its first lane,
// which stores the 16 bytes in one access when `whole`; otherwise each lane stores its own
// piece (count codes of it exist). Every lane of the warp must call it.
template <int kBits>
__device__ __forceinline__ void store_piece(
    uint8_t* at, uint32_t piece, int64_t c, int count, bool whole) {
  using P = Pieces<kBits>;
  constexpr int kPieceBits = 4 * kBits;
  constexpr int kLanesPerWord = 32 / kPieceBits;
  uint32_t word = piece;
  FASTDDP_UNROLL
  for (int bits = kPieceBits; bits < 32; bits *= 2) {
    // Lanes with bit (bits / kPieceBits) of their slot clear take their neighbour's half.
    word |= __shfl_xor_sync(kAllLanes, word, bits / kPieceBits) << bits;
  }
  const int lane = lane_index();
  const int lead = lane & ~(P::kGroup - 1);
  uint4 v;
  v.x = word;
  v.y = __shfl_sync(kAllLanes, word, lead + kLanesPerWord);
  v.z = __shfl_sync(kAllLanes, word, lead + 2 * kLanesPerWord);
  v.w = __shfl_sync(kAllLanes, word, lead + 3 * kLanesPerWord);
  if (whole) {
    if ((c & (P::kGroup - 1)) == 0) {
      store16(reinterpret_cast<uint4*>(at), v);
    }
    return;
  }
  const int nbytes = (count * kBits + 7) / 8;
  if (nbytes == P::kBytes) {
    if (P::kBytes == 4) {
      *reinterpret_cast<uint32_t*>(at) = piece;
    } else if (P::kBytes == 2) {
      *reinterpret_cast<uint16_t*>(at) = static_cast<uint16_t>(piece);
    } else {
      *at = static_cast<uint8_t>(piece);
    }
    return;
  }
  FASTDDP_UNROLL
  for (int b = 0; b < P::kBytes; ++b) {
    if (b < nbytes) {
      at[b] = static_cast<uint8_t>(piece >> (8 * b));
    }
  }
}

// Code j (0..3) of a piece, as a float; or of any 32-bit word of codes (j < 32 / kBits).
// Code j sits in bits [j * kBits, (j + 1) * kBits) of the piece (unpack_code's order, byte
// after byte): shifted to the top of the word, then back with its sign, two shifts.
template <int kBits>
__device__ __forceinline__ float piece_code(uint32_t piece, int j) {
  const auto top = static_cast<int32_t>(piece << (32 - kBits * (j + 1)));
  return static_cast<float>(top >> (32 - kBits));
}

// Chunk c of a quantize's n elements; kWhole: the caller knows it is whole.
template <bool kWhole>
__device__ __forceinline__ Chunk quantize_chunk_at(int64_t n, int64_t c) {
  return kWhole ? Chunk{c, c * kChunk, kChunk, true} : chunk_at(0, n, c);
}

// The rounding inputs of chunk c of a quantize: 4c .. 4c + 3, zeros past n. `source` gives
// what is rounded (values.cuh: a.src, or the sums of requantize's rows).
template <bool kWhole = false, class Values>
__device__ __forceinline__ Chunk quantize_inputs(
    const QuantizeArgs& a, const Values& source, const math::Mode& mode, int64_t c,
    float (&v)[kChunk]) {
  const Chunk k = quantize_chunk_at<kWhole>(a.n, c);
  float x[kChunk];
  float r[kChunk] = {0.0f, 0.0f, 0.0f, 0.0f};
  source.load(k, x);
  if (mode.feedback) {
    load_chunk<true>(mode.residual, k, r);
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    v[j] = j < k.count ? math::rounding_input_of(mode, x[j], a.scale, r[j]) : 0.0f;
  }
  return k;
}

// Quantises chunk c (inputs v) of a block with the given scale: its codes, its residuals
// (16 bytes at a time), and the block's scale if c is the block's first chunk. Every lane of
// the warp must call it.
template <int kBits, bool kWhole = false>
__device__ __forceinline__ void quantize_chunk(
    const QuantizeArgs& a, const Place& place, const math::Mode& mode, int64_t c,
    const float (&v)[kChunk], float step, float inverse, bool block_bad) {
  const float qmax = code_max(kBits);
  const Chunk k = quantize_chunk_at<kWhole>(a.n, c);
  const CodeSpot& spot = place.spot;
  // The first chunk of a block stores its scale.
  if (k.count > 0 && place.block_first) {
    a.scales[place.scale] = step;
  }
  // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
  uint32_t piece = 0;
  float r[kChunk];
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    const int64_t i = k.first + j;
    int8_t code = 0;
    if (j < k.count && !block_bad) {
      code = math::quantize_code(v[j], inverse, qmax, mode.stochastic, math::random_for(mode, i));
    }
    r[j] = math::quantize_dropped(v[j], code, step);
    piece |= pack_code(code, kBits, j);
  }
  if (mode.feedback && !block_bad) {
    store_chunk(mode.residual, k, r);
  }
  store_piece<kBits>(spot.at, piece, c, k.count, spot.group_whole);
}

// Where a step of quantize lies whole in one row (its kCodeUnroll runs of 32 chunks below n,
// starting at a block's first element, codes 16-byte aligned), each chunk's place follows from
// the step's, with shifts: `row_q` is the step's first code byte, `scale0` the index of its first
// scale. `whole` is false where the step is not such a step (the same for every lane); then each
// chunk goes by place_of. Blocks here are a power of two of elements, 2^block_log2.
struct WholeStep {
  bool whole;
  uint8_t* row_q;
  int64_t scale0;
};

template <int kBits>
__device__ __forceinline__ WholeStep whole_step_of(
    const QuantizeArgs& a, const Codes& codes, int64_t first, int block_log2) {
  const int64_t e0 = first * kChunk;
  const int64_t e1 = e0 + 32 * kCodeUnroll * kChunk;
  if (e1 > a.n) {
    return {false, nullptr, 0};
  }
  if (a.rows.rows == 1) {  // a flat bucket, the usual case: no row to find, nothing to multiply
    uint8_t* at = reinterpret_cast<uint8_t*>(a.dst) + e0 * kBits / 8;
    const int64_t b0 = e0 >> block_log2;
    const bool whole = e1 <= a.rows.row_len && (b0 << block_log2) == e0 &&
                       reinterpret_cast<uintptr_t>(at) % 16 == 0;
    return {whole, at, b0};
  }
  const int64_t row = codes.by_row.div(e0);
  const int64_t offset = e0 - row * a.rows.row_len;
  const int64_t b0 = offset >> block_log2;
  uint8_t* at = reinterpret_cast<uint8_t*>(a.dst) + row * a.rows.q_stride + offset * kBits / 8;
  const bool whole = offset + (e1 - e0) <= a.rows.row_len && (b0 << block_log2) == offset &&
                     reinterpret_cast<uintptr_t>(at) % 16 == 0;
  return {whole, at, row * a.rows.s_stride + b0};
}

// The place of the chunk `index` chunks into a whole step, in blocks of 2^per_block_log2 chunks.
template <int kBits>
__device__ __forceinline__ Place whole_place(const WholeStep& w, int index, int per_block_log2) {
  return {{w.row_q + index * Pieces<kBits>::kBytes, true}, w.scale0 + (index >> per_block_log2),
          (index & ((1 << per_block_log2) - 1)) == 0};
}

// The scales (absmax / qmax) and inverses of a step's blocks, each worked out once: lane L
// divides for value L of the step (block L / 2; its scale when L is even, its inverse when
// odd), and the lanes of block b take its two from lanes 2b and 2b + 1 (step_value). Every lane
// dividing for its own block took 2 * kCodeUnroll IEEE divisions a lane, a quarter of
// quantize's instructions. A run of 32 chunks holds 32 / width blocks: this needs
// 2 * kCodeUnroll * 32 / width <= 32 values, blocks of at least 2 * kCodeUnroll chunks. Every
// lane of the warp must call it.
template <int kBits>
__device__ __forceinline__ float step_values(const uint32_t (&absmax)[kCodeUnroll], int width_log2) {
  const int lane = lane_index();
  const int per_run_log2 = 5 - width_log2;  // blocks in a run, as a power of two
  const int block = lane >> 1;
  const int lead = (block & ((1 << per_run_log2) - 1)) << width_log2;  // its first lane
  uint32_t bits = 0;
  FASTDDP_UNROLL
  for (int u = 0; u < kCodeUnroll; ++u) {
    const uint32_t other = __shfl_sync(kAllLanes, absmax[u], lead);
    bits = (block >> per_run_log2) == u ? other : bits;
  }
  return math::block_scale_or_inverse(bits, code_max(kBits), (lane & 1) != 0);
}

// The scale (odd false) or inverse (odd true) of the lane's block in run u, from step_values'
// `values`. Every lane of the warp must call it.
__device__ __forceinline__ float step_value(float values, int u, int width_log2, bool odd) {
  const int block = (u << (5 - width_log2)) + (lane_index() >> width_log2);
  return __shfl_sync(kAllLanes, values, 2 * block + (odd ? 1 : 0));
}

// Each run's absolute maximum over its block's `width` lanes (a power of two up to 32), by
// shuffles. kFixed: five rounds whatever the width, unrolled; a round at or past the width
// exchanges with the lane itself (its lane mask, the round's offset masked by width - 1, is 0).
// The loop over the width's rounds alone, left rolled (the width is a run-time value), took 12
// instructions a round on sm_90 (its counter, its branch, a check of the warp's convergence);
// these take 5. Error feedback with stochastic rounding keeps the loop: with the five rounds
// it spilled to local memory. Every lane of the warp must call it.
template <bool kFixed>
__device__ __forceinline__ void block_absmax(uint32_t (&absmax)[kCodeUnroll], int width) {
  if (kFixed) {
    FASTDDP_UNROLL
    for (int round = 0; round < 5; ++round) {
      const int lanes = (16 >> round) & (width - 1);
      FASTDDP_UNROLL
      for (int u = 0; u < kCodeUnroll; ++u) {
        const uint32_t other = __shfl_xor_sync(kAllLanes, absmax[u], lanes);
        absmax[u] = other > absmax[u] ? other : absmax[u];
      }
    }
    return;
  }
  for (int offset = width / 2; offset > 0; offset /= 2) {
    FASTDDP_UNROLL
    for (int u = 0; u < kCodeUnroll; ++u) {
      const uint32_t other = __shfl_xor_sync(kAllLanes, absmax[u], offset);
      absmax[u] = other > absmax[u] ? other : absmax[u];
    }
  }
}

// A step of quantize for blocks of 2^width_log2 chunks (up to 32): kCodeUnroll runs of 32
// chunks from `first` (of `source`), all loaded before any is reduced, each block's absolute
// maximum shared by shuffles among its lanes. place(index, c) places chunk c, `index` chunks
// into the step;
// kWhole: every chunk of the step is whole; kShare: whole steps take their scales from
// step_values, and every step its blocks' maxima from block_absmax's five fixed rounds.
// Returns whether a block held inf or NaN. Every lane of the warp must call it.
template <int kBits, bool kWhole, bool kShare, class Values, class PlaceOf>
__device__ __forceinline__ bool quantize_runs(
    const QuantizeArgs& a, const Values& source, const math::Mode& mode, int64_t first,
    int width_log2, PlaceOf place) {
  const float qmax = code_max(kBits);
  const int width = 1 << width_log2;
  float v[kCodeUnroll][kChunk];
  uint32_t absmax[kCodeUnroll];
  FASTDDP_UNROLL
  for (int u = 0; u < kCodeUnroll; ++u) {
    quantize_inputs<kWhole>(a, source, mode, first + 32 * u + lane_index(), v[u]);
    absmax[u] = 0;
    FASTDDP_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      absmax[u] = math::abs_bits_max(absmax[u], v[u][j]);
    }
  }
  block_absmax<kShare>(absmax, width);
  const bool shared = kShare && kWhole && width >= 2 * kCodeUnroll;  // the same in every lane
  const float values = shared ? step_values<kBits>(absmax, width_log2) : 0.0f;
  bool bad = false;
  FASTDDP_UNROLL
  for (int u = 0; u < kCodeUnroll; ++u) {
    const bool block_bad = math::block_nonfinite(absmax[u]);
    bad |= block_bad;
    const float step = shared ? step_value(values, u, width_log2, false)
                              : math::block_scale(absmax[u], qmax);
    const float inverse = shared ? step_value(values, u, width_log2, true)
                                 : math::block_inverse(absmax[u], qmax);
    const int64_t c = first + 32 * u + lane_index();
    quantize_chunk<kBits, kWhole>(a, place(32 * u + lane_index(), c), mode, c, v[u], step,
                                  inverse, block_bad);
  }
  return bad;
}

// quantize (int8, int4, int2): the lanes of a block share its absolute maximum by shuffles.
// A block of up to 128 elements (block / 4 lanes, a power of two) takes part of a warp, so that
// a warp quantises 128 elements at a time, kCodeUnroll such runs a step, all loaded before any
// is reduced; a step that lies whole in one row (nearly all of them) places its chunks without
// a division. A longer block (a multiple of 128) takes a warp, each lane block / 128 chunks,
// which it reads again after the maximum is known.
// At most 64 registers, so that 4 blocks fit on a multiprocessor (66 gave 3; requantize's
// instances, whose sums hold more, take 3 blocks: see values.cuh). An instance for
// each mode (kFeedback: error feedback; kStochastic: stochastic rounding), which the launch
// picks: as constants they leave no branch on the mode, and no other mode's code, in the loop.
// Error feedback with stochastic rounding keeps its divisions in every lane and the rolled
// loop of block_absmax (kShare false): with step_values it needed a 65th register, and spilled
// one to local memory. Values (values.cuh) is what is rounded: quantize's fp32 src, or
// requantize's sums of rows.
template <int kBits, bool kFeedback, bool kStochastic, class Values>
__global__ void __launch_bounds__(kThreads, Values::kBlocksPerSm)
    quantize_vec_kernel(QuantizeArgs a, Codes codes, Values source) {
  constexpr bool kShare = !(kFeedback && kStochastic);
  math::Mode mode = a.rounding.mode();
  mode.feedback = kFeedback;
  // (Values::kStochasticAtRun: one instance rounds either way, as a.rounding says.)
  mode.stochastic = Values::kStochasticAtRun ? mode.stochastic : kStochastic;
  const float qmax = code_max(kBits);
  const int64_t per_block = a.block / kChunk;
  const int64_t chunks = (a.n + kChunk - 1) / kChunk;
  auto* q = reinterpret_cast<uint8_t*>(a.dst);
  bool bad = false;
  if (per_block <= 32) {
    const int width = static_cast<int>(per_block);
    int per_block_log2 = 0;
    while ((1 << per_block_log2) < width) {
      ++per_block_log2;
    }
    warp_loop(chunks, 32 * kCodeUnroll, [&](int64_t first) {
      // Two copies of the step, so that each is register-allocated alone: one that holds both
      // ways of placing a chunk spilled to local memory for int4 and int2.
      const WholeStep w = whole_step_of<kBits>(a, codes, first, per_block_log2 + 2);
      if (w.whole) {
        bad |= quantize_runs<kBits, true, kShare>(
            a, source, mode, first, per_block_log2,
            [&](int index, int64_t) { return whole_place<kBits>(w, index, per_block_log2); });
      } else {
        bad |= quantize_runs<kBits, false, kShare>(
            a, source, mode, first, per_block_log2,
            [&](int, int64_t c) { return place_of<kBits>(codes, q, c, a.n); });
      }
    });
    raise_flag(bad, a.rounding.flag);
    return;
  }
  warp_loop(chunks, per_block, [&](int64_t first) {
    const int64_t c = first + lane_index();
    float v[kChunk];
    uint32_t absmax = 0;
    quantize_inputs(a, source, mode, c, v);
    FASTDDP_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      absmax = math::abs_bits_max(absmax, v[j]);
    }
    for (int64_t more = c + 32; more < first + per_block; more += 32) {
      float w[kChunk];
      quantize_inputs(a, source, mode, more, w);
      FASTDDP_UNROLL
      for (int j = 0; j < kChunk; ++j) {
        absmax = math::abs_bits_max(absmax, w[j]);
      }
    }
    FASTDDP_UNROLL
    for (int offset = 32 / 2; offset > 0; offset /= 2) {  // a block takes the whole warp
      const uint32_t other = __shfl_xor_sync(kAllLanes, absmax, offset);
      absmax = other > absmax ? other : absmax;
    }
    const float step = math::block_scale(absmax, qmax);
    const float inverse = math::block_inverse(absmax, qmax);
    const bool block_bad = math::block_nonfinite(absmax);
    bad |= block_bad;
    quantize_chunk<kBits>(a, place_of<kBits>(codes, q, c, a.n), mode, c, v, step, inverse,
                          block_bad);
    for (int64_t more = c + 32; more < first + per_block; more += 32) {
      float w[kChunk];
      quantize_inputs(a, source, mode, more, w);
      quantize_chunk<kBits>(a, place_of<kBits>(codes, q, more, a.n), mode, more, w, step,
                            inverse, block_bad);
    }
  });
  raise_flag(bad, a.rounding.flag);
}

// The piece of a lane from its group's 16 bytes v, at byte `byte` of them.
template <int kBits>
__device__ __forceinline__ uint32_t piece_of_group(const uint4& v, int byte) {
  const uint32_t w = byte < 8 ? (byte < 4 ? v.x : v.y) : (byte < 12 ? v.z : v.w);
  return (w >> (8 * (byte % 4))) & Pieces<kBits>::kMask;
}

// unpack's values of a chunk: its codes times its block's scale `step`, times `scale`.
template <int kBits>
__device__ __forceinline__ void unpack_piece(
    uint32_t piece, float step, float scale, float (&x)[kChunk]) {
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    x[j] = math::mul(math::mul(piece_code<kBits>(piece, j), step), scale);
  }
}

// A step of unpack where the warp's kUnpackUnroll runs of 32 chunks are whole, lie in one row,
// and its groups of codes start 16-byte aligned (at: the first group's bytes): no branch, and
// one division a chunk (its block).
template <int kBits>
__device__ __forceinline__ void unpack_whole_step(
    const Int8Source& s, const Codes& codes, const uint8_t* at, int64_t row, int64_t offset,
    int64_t first, float* __restrict__ dst, float scale) {
  using P = Pieces<kBits>;
  constexpr int kU = kUnpackUnroll;
  const int lane = lane_index();
  const uint8_t* group = at + (lane & ~(P::kGroup - 1)) * P::kBytes;
  const int byte = (lane & (P::kGroup - 1)) * P::kBytes;
  const float* row_s = s.scales + row * s.rows.s_stride;
  // The block of the lane's first chunk, then of each next one from its place in that block:
  // below 2^20 + 4 * 32 * kU, a division without a branch.
  const int64_t e = offset + lane * kChunk;
  const int64_t b = codes.by_block.div(e);
  const auto at_b = static_cast<uint32_t>(e - b * codes.by_block.d);
  uint32_t piece[kU];
  float step[kU];
  FASTDDP_UNROLL
  for (int u = 0; u < kU; ++u) {
    piece[u] = piece_of_group<kBits>(
        load16(reinterpret_cast<const uint4*>(group + u * 32 * P::kBytes)), byte);
    step[u] = row_s[b + codes.by_block.div_small(at_b + 32 * u * kChunk)];
  }
  FASTDDP_UNROLL
  for (int u = 0; u < kU; ++u) {
    float x[kChunk];
    unpack_piece<kBits>(piece[u], step[u], scale, x);
    store16(reinterpret_cast<float4*>(dst + (first + 32 * u + lane) * kChunk),
            make_float4(x[0], x[1], x[2], x[3]));
  }
}

// unpack (int8, int4, int2): the flat sequence of n values the rows hold, dequantised; a lane
// takes kUnpackUnroll chunks a step, their codes and scales all loaded before any is stored:
// unpack_whole_step where it can, otherwise each chunk placed by place_of.
template <int kBits>
__global__ void unpack_vec_kernel(
    Int8Source s, Codes codes, int64_t n, float* __restrict__ dst, float scale) {
  auto* q = const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(s.q));
  warp_loop((n + kChunk - 1) / kChunk, 32 * kUnpackUnroll, [&](int64_t first) {
    const int64_t e0 = first * kChunk;
    const int64_t e1 = (first + 32 * kUnpackUnroll) * kChunk;
    if (e1 <= n) {  // the same for every lane, as is all of this
      const int64_t row = codes.by_row.div(e0);
      const int64_t offset = e0 - row * s.rows.row_len;
      const uint8_t* at = q + row * s.rows.q_stride + offset * kBits / 8;
      if (offset + (e1 - e0) <= s.rows.row_len && reinterpret_cast<uintptr_t>(at) % 16 == 0) {
        unpack_whole_step<kBits>(s, codes, at, row, offset, first, dst, scale);
        return;
      }
    }
    Chunk k[kUnpackUnroll];
    uint32_t piece[kUnpackUnroll];
    float step[kUnpackUnroll];
    FASTDDP_UNROLL
    for (int u = 0; u < kUnpackUnroll; ++u) {
      k[u] = chunk_at(0, n, first + 32 * u + lane_index());
      piece[u] = 0;
      step[u] = 0.0f;
      if (k[u].count > 0) {
        const Place place = place_of<kBits>(codes, q, k[u].index, n);
        piece[u] = load_piece<kBits>(place.spot.at, k[u].index, k[u].count,
                                     place.spot.group_whole);
        step[u] = s.scales[place.scale];
      }
    }
    FASTDDP_UNROLL
    for (int u = 0; u < kUnpackUnroll; ++u) {
      float x[kChunk];
      unpack_piece<kBits>(piece[u], step[u], scale, x);
      store_chunk(dst, k[u], x);
    }
  });
}

// The piece of kBits / 2 bytes at `at` (aligned to its size), loaded by its lane alone: a
// warp's load is 32 consecutive pieces, every byte of them used. Loading the group's 16 bytes
// instead, the same number of loads, held 4 registers each until the piece was picked: nvcc
// then left 2 of int8's 8 loads in flight, and the packed codes took 80 registers.
template <int kBits>
__device__ __forceinline__ uint32_t load_own_piece(const uint8_t* at) {
  if constexpr (kBits == 8) {
    return load4(reinterpret_cast<const uint32_t*>(at));
  } else if constexpr (kBits == 4) {
    return load2(reinterpret_cast<const uint16_t*>(at));
  } else {
    return load1(at);
  }
}

// kN rows of dequantize_whole_step from row p on: their codes and scales all loaded before any
// is added. q and scale[u] are the lane's codes and its chunks' scales in row 0; row p's lie
// p strides on, an offset the same for every lane, so that each load costs one 64-bit add
// (indices scaled per load took four instructions a load, as many as a code's arithmetic).
template <int kBits, int kN>
__device__ __forceinline__ void dequantize_rows(
    const uint8_t* q, const float* const (&scale)[kDequantUnroll], const Int8Rows& rows,
    int64_t p, float (&acc)[kDequantUnroll][kChunk]) {
  using P = Pieces<kBits>;
  constexpr int kU = kDequantUnroll;
  uint32_t piece[kN][kU];
  float step[kN][kU];
  FASTDDP_UNROLL
  for (int r = 0; r < kN; ++r) {
    const uint8_t* row_q = q + (p + r) * rows.q_stride;
    const int64_t row_s = (p + r) * rows.s_stride;
    FASTDDP_UNROLL
    for (int u = 0; u < kU; ++u) {
      piece[r][u] = load_own_piece<kBits>(row_q + u * 32 * P::kBytes);
      step[r][u] = scale[u][row_s];
    }
  }
  FASTDDP_UNROLL
  for (int r = 0; r < kN; ++r) {
    FASTDDP_UNROLL
    for (int u = 0; u < kU; ++u) {
      FASTDDP_UNROLL
      for (int j = 0; j < kChunk; ++j) {
        const float term = math::mul(piece_code<kBits>(piece[r][u], j), step[r][u]);
        acc[u][j] = p + r == 0 ? term : math::add(acc[u][j], term);
      }
    }
  }
}

// A step of dequantize where every chunk of the warp's kDequantUnroll runs of 32 is whole and
// every row starts 16-byte aligned, so that a chunk's group of lanes holds 16 bytes of codes of
// one row: no branch. The lane's piece lies at the same place in each of its groups (they are
// 32 chunks apart), and a chunk's block is the same in every row; kDequantRows rows' codes and
// scales are in flight together, and the rows past the last multiple of kDequantRows one by
// one.
template <int kBits>
__device__ __forceinline__ void dequantize_whole_step(
    const Int8Source& s, const Codes& codes, int64_t first, float* __restrict__ dst, float scale) {
  using P = Pieces<kBits>;
  constexpr int kU = kDequantUnroll;
  constexpr int kR = kDequantRows<kBits>;
  const int lane = lane_index();
  const auto* q = reinterpret_cast<const uint8_t*>(s.q) + (first + lane) * P::kBytes;
  // The block of the lane's first chunk, then of each next one from its place in that block
  // (as unpack_whole_step's). Not for int8: sm_90's code then took 72 registers, not 64,
  // which leaves 3 blocks a multiprocessor, not 4.
  const int64_t e = (first + lane) * kChunk;
  const int64_t b = codes.by_block.div(e);
  const auto at_b = static_cast<uint32_t>(e - b * codes.by_block.d);
  const float* scales[kU];
  FASTDDP_UNROLL
  for (int u = 0; u < kU; ++u) {
    scales[u] = s.scales + (kBits == 8 ? codes.by_block.div(e + 32 * u * kChunk)
                                       : b + codes.by_block.div_small(at_b + 32 * u * kChunk));
  }
  const int64_t rows = s.rows.rows;
  float acc[kU][kChunk];
  int64_t p = 0;
  for (; p + kR <= rows; p += kR) {
    dequantize_rows<kBits, kR>(q, scales, s.rows, p, acc);
  }
  for (; p < rows; ++p) {
    dequantize_rows<kBits, 1>(q, scales, s.rows, p, acc);
  }
  FASTDDP_UNROLL
  for (int u = 0; u < kU; ++u) {
    const float4 x = make_float4(math::mul(acc[u][0], scale), math::mul(acc[u][1], scale),
                                 math::mul(acc[u][2], scale), math::mul(acc[u][3], scale));
    store16(reinterpret_cast<float4*>(dst + (first + 32 * u + lane) * kChunk), x);
  }
}

// dequantize of one chunk c of the rows, seen each as one row of m codes, for any layout.
template <int kBits>
__device__ __forceinline__ void dequantize_chunk(
    const Int8Source& s, const Codes& codes, int64_t c, float* __restrict__ dst, float scale) {
  using P = Pieces<kBits>;
  const int64_t m = s.rows.row_len;
  const Chunk k = chunk_at(0, m, c);
  if (k.count == 0) {
    return;
  }
  const auto* q = reinterpret_cast<const uint8_t*>(s.q);
  const int64_t b = codes.by_block.div(k.first);  // the chunk's block, in every row
  const int64_t g0 = (c & ~int64_t{P::kGroup - 1}) * kChunk;  // its group's first element
  const bool group_in = g0 + P::kGroup * kChunk <= m;
  float acc[kChunk];
  for (int64_t p = 0; p < s.rows.rows; ++p) {
    const uint8_t* row_q = q + p * s.rows.q_stride;
    const bool whole = group_in && reinterpret_cast<uintptr_t>(row_q) % 16 == 0;
    const uint32_t piece = load_piece<kBits>(row_q + c * P::kBytes, c, k.count, whole);
    const float step = s.scales[p * s.rows.s_stride + b];
    FASTDDP_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      const float term = math::mul(piece_code<kBits>(piece, j), step);
      acc[j] = p == 0 ? term : math::add(acc[j], term);
    }
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    acc[j] = math::mul(acc[j], scale);
  }
  store_chunk(dst, k, acc);
}

// dequantize (int8, int4, int2): the rows dequantised and summed per column in row order. A
// warp takes kDequantUnroll runs of 32 chunks a step: where all of them are whole and the rows
// start 16-byte aligned, dequantize_whole_step; otherwise (the last steps, other layouts) a
// chunk at a time.
template <int kBits>
__global__ void dequantize_vec_kernel(
    Int8Source s, Codes codes, float* __restrict__ dst, float scale) {
  const int64_t m = s.rows.row_len;
  const bool aligned = reinterpret_cast<uintptr_t>(s.q) % 16 == 0 && s.rows.q_stride % 16 == 0;
  warp_loop((m + kChunk - 1) / kChunk, 32 * kDequantUnroll, [&](int64_t first) {
    if (aligned && (first + 32 * kDequantUnroll) * kChunk <= m) {
      dequantize_whole_step<kBits>(s, codes, first, dst, scale);
      return;
    }
    for (int u = 0; u < kDequantUnroll; ++u) {
      dequantize_chunk<kBits>(s, codes, first + 32 * u + lane_index(), dst, scale);
    }
  });
}

// ------------------------------------------------------------------ scalar kernels

// The absolute maximum (as bits) of the rounding inputs of elements [lo, hi) of `source`, for
// one warp: the lanes stride over the range, then a butterfly of shuffles gives every lane the
// result.
template <class Values>
__device__ __forceinline__ uint32_t warp_absmax(
    const math::Mode& mode, const Values& source, float scale, int64_t lo, int64_t hi,
    int lane) {
  uint32_t absmax = 0;
  for (int64_t i = lo + lane; i < hi; i += 32) {
    absmax = math::abs_bits_max(absmax, math::rounding_input(mode, source.at(i), scale, i));
  }
  FASTDDP_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, absmax, offset);
    absmax = other > absmax ? other : absmax;
  }
  return absmax;
}

// quantize_int8 for the layouts quantize_vec_kernel cannot take: one warp per int8 block;
// every lane gets the block's absolute maximum (warp_absmax), then each lane quantises its
// elements. Rows of q and scales may lie apart (see Int8Rows in layout.h); a block lies in one
// row.
template <class Values>
__global__ void quantize_int8_kernel(
    Values source,
    int8_t* __restrict__ q,
    float* __restrict__ scales,
    float* __restrict__ residual,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  const math::Mode mode = mode_of(residual, seed);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = blocks_of(n, block);
  bool bad = false;
  for (int64_t b = thread_index() / 32; b < nblocks; b += warps) {
    const Int8Block blk = int8_block(rows, n, block, b, q, scales);
    const uint32_t absmax = warp_absmax(mode, source, scale, blk.lo, blk.hi, lane);
    const float step = math::block_scale(absmax);
    const float inverse = math::block_inverse(absmax);
    const bool block_bad = math::block_nonfinite(absmax);
    if (lane == 0) {
      blk.scales[b] = step;
    }
    bad |= block_bad;
    // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
    for (int64_t i = blk.lo + lane; i < blk.hi; i += 32) {
      const float v = math::rounding_input(mode, source.at(i), scale, i);
      blk.q[i] = block_bad ? int8_t{0} : math::quantize_element(mode, v, inverse, step, i);
    }
  }
  raise_flag(bad, flag);
}

// Reads int8 codes laid out as Int8Source says: code `col` of row `row`, times its block's
// scale. PackedCodes (packed_kernels.cuh) reads int4 and int2 codes the same way.
struct Int8Codes {
  Int8Source src;

  __device__ __forceinline__ float operator()(int64_t row, int64_t col) const {
    const float code = static_cast<float>(src.q[row * src.rows.q_stride + col]);
    return math::mul(code, src.scales[row * src.rows.s_stride + col / src.block]);
  }
};

// dequantize for the layouts dequantize_vec_kernel cannot take: the rows.rows rows of
// rows.row_len codes, dequantised and summed per column in row order.
template <class Codes>
__global__ void dequantize_kernel(Codes codes, float* __restrict__ dst, float scale) {
  const Int8Rows& rows = codes.src.rows;
  grid_stride_loop(0, rows.row_len, [&](int64_t i) {
    float acc = codes(0, i);
    for (int64_t p = 1; p < rows.rows; ++p) {
      acc = math::add(acc, codes(p, i));
    }
    dst[i] = math::mul(acc, scale);
  });
}

// unpack for the layouts unpack_vec_kernel cannot take: the flat sequence of n values the rows
// hold, dequantised.
template <class Codes>
__global__ void unpack_kernel(Codes codes, int64_t n, float* __restrict__ dst, float scale) {
  const int64_t row_len = codes.src.rows.row_len;
  grid_stride_loop(0, n, [&](int64_t i) {
    const int64_t row = i / row_len;
    dst[i] = math::mul(codes(row, i - row * row_len), scale);
  });
}

}  // namespace fastddp::kernels
