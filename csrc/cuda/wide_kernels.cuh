// The wide quantize: 16 elements a lane, for quantize and requantize of int8, int4 and int2
// codes where a lane's 16 codes are one aligned access (16, 8 or 4 bytes) and its fp32 values
// four 16-byte ones. Compiled like kernels.cuh, by nvcc and by the grid emulator.
//
// Not for dequantize and unpack: with a lane's 16 fp32 results as four 16-byte stores, 64
// bytes apart lane to lane, each store of a warp wrote half of 32 sectors, and on the H200
// unpack fell from 0.87 to 0.38 of a copy and dequantize from 0.91 to 0.72 (run 10). Their
// vector kernels store a warp's 512 consecutive bytes at a time.
//
// Why: quantize_vec_kernel gives a lane 4 elements a run (a chunk), so its int8 codes are 4
// bytes a lane: requantize's rows of codes were loaded 4 bytes at a time, a few such loads in
// flight a lane, and on the H200 it reached 0.37-0.46 of a copy waiting on them (quantize 0.66,
// bound by the shuffles and stores of its 4-byte pieces). Here a lane's 16 codes of each row
// are one 16-byte load, its fp32 values and residual four, its codes one 16-byte store with no
// shuffle, and a block's maximum takes log2(block / 16) shuffle rounds among its lanes. The
// packed codes had the same two costs on the H200 (quantize 0.60-0.64 of a copy, requantize
// 0.37-0.41, where the int8 ones reached 0.98 and 0.94 wide): their lanes' 16 codes are 8
// bytes (int4) or 4 (int2), one access each.
#pragma once

#include "values.cuh"

namespace fastddp::kernels {

constexpr int kWide = 16;  // elements a lane of the wide kernel takes a step
// Its blocks a multiprocessor holds: 3 (80 registers; at 64, error feedback's instance spilled
// to local memory). 24 warps with 128 bytes a lane in flight (its 16 values and residual, or 4
// rows' codes and the residual) keep more in flight than the 4-element kernels' 32 warps did.
constexpr int kWideBlocksPerSm = 3;

// The `count` fp32 values at element e (16-byte aligned) of quantize's source, zeros past them:
// four loads where all 16 exist (kWhole: in every lane of the step), one by one otherwise.
template <bool kWhole>
__device__ __forceinline__ void load_wide(
    const FlatValues& s, int64_t e, int count, float (&x)[kWide]) {
  if (!kWhole && count < kWide) {
    FASTDDP_UNROLL
    for (int j = 0; j < kWide; ++j) {
      x[j] = j < count ? s.src[e + j] : 0.0f;
    }
    return;
  }
  FASTDDP_UNROLL
  for (int h = 0; h < kWide / 4; ++h) {
    const float4 v = load16(reinterpret_cast<const float4*>(s.src + e) + h);
    x[4 * h] = v.x;
    x[4 * h + 1] = v.y;
    x[4 * h + 2] = v.z;
    x[4 * h + 3] = v.w;
  }
}

// A lane's 16 codes of kBits bits: code j in bits [j * kBits, (j + 1) * kBits) of the words
// taken in order, byte after byte (pack_code's order), so that the words are the codes' bytes.
template <int kBits>
struct WideCodes {
  static constexpr int kWords = kWide * kBits / 32;  // 4, 2, 1
  static constexpr int kBytes = 4 * kWords;          // 16, 8, 4: one access
  static constexpr int kPerWord = 32 / kBits;
  uint32_t w[kWords];

  // Code j (0..15), as a float.
  __device__ __forceinline__ float code(int j) const {
    return piece_code<kBits>(w[j / kPerWord], j % kPerWord);
  }

  __device__ __forceinline__ void put(int j, int8_t q) {
    w[j / kPerWord] |= pack_code(q, kBits, j % kPerWord);
  }

  // The codes at `at` (aligned to kBytes): one load.
  __device__ __forceinline__ void load(const uint8_t* at) {
    if constexpr (kWords == 4) {
      const uint4 v = load16(reinterpret_cast<const uint4*>(at));
      w[0] = v.x;
      w[1] = v.y;
      w[2] = v.z;
      w[3] = v.w;
    } else if constexpr (kWords == 2) {
      const uint2 v = load8(reinterpret_cast<const uint2*>(at));
      w[0] = v.x;
      w[1] = v.y;
    } else {
      w[0] = load4(reinterpret_cast<const uint32_t*>(at));
    }
  }

  // The codes to `at` (aligned to kBytes): one store.
  __device__ __forceinline__ void store(uint8_t* at) const {
    if constexpr (kWords == 4) {
      store16(reinterpret_cast<uint4*>(at), make_uint4(w[0], w[1], w[2], w[3]));
    } else if constexpr (kWords == 2) {
      store8(reinterpret_cast<uint2*>(at), make_uint2(w[0], w[1]));
    } else {
      store4(reinterpret_cast<uint32_t*>(at), w[0]);
    }
  }
};

// The bytes that hold the first `count` of a lane's codes of kBits bits.
template <int kBits>
__device__ __forceinline__ int wide_bytes(int count) {
  return (count * kBits + 7) / 8;
}

// The first `count` of a lane's 16 codes at `at`, what lies past them in their last byte
// included: one load where all 16 exist (kWhole: in every lane of the step), byte by byte
// otherwise.
template <int kBits, bool kWhole>
__device__ __forceinline__ WideCodes<kBits> load_codes(const uint8_t* at, int count) {
  WideCodes<kBits> v = {};
  if (kWhole || count == kWide) {
    v.load(at);
  } else {
    FASTDDP_UNROLL
    for (int b = 0; b < WideCodes<kBits>::kBytes; ++b) {
      if (b < wide_bytes<kBits>(count)) {
        v.w[b / 4] |= static_cast<uint32_t>(at[b]) << (8 * (b % 4));
      }
    }
  }
  return v;
}

// The column sums at columns e .. e + count - 1 (count from 1 to 16) of requantize's rows of
// codes, as SummedRows<kBits>::at sums them (in row order, times `scale`): each row's 16 codes
// one load, kSumRows rows' loads issued before any is added (those past the last row
// predicated off). The 16 lie in one block of the rows' scales (a multiple of 16 long).
template <bool kWhole, int kBits>
__device__ __forceinline__ void load_wide(
    const SummedRows<kBits>& s, int64_t e, int count, float (&x)[kWide]) {
  const int64_t rows = s.src.rows.rows;
  const auto* q = reinterpret_cast<const uint8_t*>(s.src.q) + e * kBits / 8;
  const float* scales = s.src.scales + s.by_block.div(e);
  float acc[kWide];
  for (int64_t p = 0; p < rows; p += kSumRows) {
    WideCodes<kBits> v[kSumRows] = {};
    float step[kSumRows] = {};
    FASTDDP_UNROLL
    for (int r = 0; r < kSumRows; ++r) {
      if (p + r < rows) {
        v[r] = load_codes<kBits, kWhole>(q + (p + r) * s.src.rows.q_stride, count);
        step[r] = scales[(p + r) * s.src.rows.s_stride];
      }
    }
    FASTDDP_UNROLL
    for (int r = 0; r < kSumRows; ++r) {
      if (p + r < rows) {
        FASTDDP_UNROLL
        for (int j = 0; j < kWide; ++j) {
          const float term = math::mul(v[r].code(j), step[r]);
          acc[j] = p + r == 0 ? term : math::add(acc[j], term);
        }
      }
    }
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kWide; ++j) {
    x[j] = math::mul(acc[j], s.scale);
  }
}

// The residual of the `count` elements at e (16-byte aligned), zeros past them: four loads
// where all 16 exist (kWhole: in every lane of the step), one by one otherwise.
template <bool kWhole>
__device__ __forceinline__ void load_residual(
    const float* residual, int64_t e, int count, float (&r)[kWide]) {
  if (kWhole || count == kWide) {
    FASTDDP_UNROLL
    for (int h = 0; h < kWide / 4; ++h) {
      const float4 v = load16_rw(reinterpret_cast<const float4*>(residual + e) + h);
      r[4 * h] = v.x;
      r[4 * h + 1] = v.y;
      r[4 * h + 2] = v.z;
      r[4 * h + 3] = v.w;
    }
  } else {
    FASTDDP_UNROLL
    for (int j = 0; j < kWide; ++j) {
      r[j] = j < count ? residual[e + j] : 0.0f;
    }
  }
}

// A lane's 16 residuals r to residual + e (16-byte aligned) where `write`, with the warp's lanes in
// pairs, so that each of the four stores of a warp writes whole 32-byte sectors where the
// residual is 32-byte aligned (torch's allocations are; else each pair's 32 bytes straddle
// two, still twice as full as without the pairs' exchange): a lane's own
// four 16-byte stores, 64 bytes from the next lane's, fill half of every sector they touch (on
// the H200 such stores of the wide unpack used 16 of each sector's 32 bytes, and it ran at 0.38
// of a copy). In each of two rounds the pair's lanes swap one chunk of 4 values (the even lane
// sends its second, the odd lane its first), then each stores one chunk of the even lane's and
// one of the odd lane's, each beside the other lane's. A round's chunks only are held twice
// (with all 8 at once, requantize's int8 instance spilled). Every lane of the warp must call it.
__device__ __forceinline__ void store_residual_in_pairs(
    float* residual, int64_t e, const float (&r)[kWide], bool write) {
  const bool odd = (lane_index() & 1) != 0;
  const bool partner = __shfl_xor_sync(kAllLanes, static_cast<uint32_t>(write), 1) != 0;
  // Whose values each store holds: the even lane's (the first of a round) or the odd lane's.
  const bool even_writes = odd ? partner : write;
  const bool odd_writes = odd ? write : partner;
  // The even lane's first element; this lane's chunk of a round lies 4 on in the odd lane.
  float* pair = residual + e - (odd ? kWide : 0) + (odd ? 4 : 0);
  FASTDDP_UNROLL
  for (int round = 0; round < 2; ++round) {
    // The round's chunks: the even lane keeps its first and sends its second, the odd lane the
    // other way round (selected, not indexed by the lane: an index known only at run time
    // would put r in local memory).
    const int c = 8 * round;
    float own[4];
    float got[4];
    FASTDDP_UNROLL
    for (int k = 0; k < 4; ++k) {
      own[k] = odd ? r[c + 4 + k] : r[c + k];
      got[k] = __shfl_xor_sync(kAllLanes, odd ? r[c + k] : r[c + 4 + k], 1);
    }
    const float4 mine = make_float4(own[0], own[1], own[2], own[3]);
    const float4 other = make_float4(got[0], got[1], got[2], got[3]);
    if (even_writes) {
      store16(reinterpret_cast<float4*>(pair + 8 * round), odd ? other : mine);
    }
    if (odd_writes) {
      store16(reinterpret_cast<float4*>(pair + kWide + 8 * round), odd ? mine : other);
    }
  }
}

// Where the wide kernel writes: the blocks' lanes and the codes' layout.
struct WideOut {
  Divider by_row;  // by the row length (rows > 1)
  int lanes;       // a block's lanes: 1, 2, 4, .., 32
  int block_log2;
};

// A lane's step of quantize_wide_kernel: its 16 elements from e (count of them below n;
// kWhole: 16 in every lane of the warp, so that no access asks). Returns whether its block
// held inf or NaN. Every lane of the warp must call it.
template <int kBits, bool kWhole, bool kFeedback, class Values>
__device__ __forceinline__ bool wide_step(
    const QuantizeArgs& a, const math::Mode& mode, const Values& source, const WideOut& out,
    int64_t e, int count) {
  const float qmax = code_max(kBits);
  float x[kWide] = {};
  float r[kWide] = {};
  if (kWhole || count > 0) {
    load_wide<kWhole>(source, e, count, x);
  }
  // (Issued before the rows' codes, the residual's loads overlapped them, but requantize's
  // instance spilled to local memory, with 2 rows' loads at a time too.)
  if (kFeedback) {
    load_residual<kWhole>(mode.residual, e, count, r);
  }
  float v[kWide];
  uint32_t absmax = 0;
  FASTDDP_UNROLL
  for (int j = 0; j < kWide; ++j) {
    v[j] = kWhole || j < count ? math::rounding_input_of(mode, x[j], a.scale, r[j]) : 0.0f;
    absmax = math::abs_bits_max(absmax, v[j]);
  }
  // The block's lanes (aligned in the warp, a power of two of them) exchange their maxima; a
  // round at or past their count exchanges with the lane itself.
  FASTDDP_UNROLL
  for (int round = 0; round < 5; ++round) {
    const uint32_t other = __shfl_xor_sync(kAllLanes, absmax, (16 >> round) & (out.lanes - 1));
    absmax = other > absmax ? other : absmax;
  }
  const bool block_bad = math::block_nonfinite(absmax);
  const float step = math::block_scale(absmax, qmax);
  const float inverse = math::block_inverse(absmax, qmax);
  // Where the lane's codes go: a block, and a lane's 16 codes, lie in one row.
  const int64_t row = a.rows.rows == 1 ? 0 : out.by_row.div(e);
  const int64_t offset = e - row * a.rows.row_len;
  uint8_t* at = reinterpret_cast<uint8_t*>(a.dst) + row * a.rows.q_stride + offset * kBits / 8;
  if ((kWhole || count > 0) && (lane_index() & (out.lanes - 1)) == 0) {  // the block's first
    a.scales[row * a.rows.s_stride + (offset >> out.block_log2)] = step;
  }
  // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
  WideCodes<kBits> codes = {};
  FASTDDP_UNROLL
  for (int j = 0; j < kWide; ++j) {
    int8_t code = 0;
    if ((kWhole || j < count) && !block_bad) {
      code = math::quantize_code(v[j], inverse, qmax, mode.stochastic,
                                 math::random_for(mode, e + j));
    }
    r[j] = math::quantize_dropped(v[j], code, step);
    codes.put(j, code);
  }
  if (kWhole || count == kWide) {
    codes.store(at);
    if (kFeedback) {
      if constexpr (kWhole) {
        store_residual_in_pairs(mode.residual, e, r, !block_bad);
      } else if (!block_bad) {
        FASTDDP_UNROLL
        for (int h = 0; h < kWide / 4; ++h) {
          store16(reinterpret_cast<float4*>(mode.residual + e) + h,
                  make_float4(r[4 * h], r[4 * h + 1], r[4 * h + 2], r[4 * h + 3]));
        }
      }
    }
  } else {
    // The last lane's codes: the bytes that hold them, zeros past them in the last one (as the
    // scalar kernels write it).
    FASTDDP_UNROLL
    for (int b = 0; b < WideCodes<kBits>::kBytes; ++b) {
      if (b < wide_bytes<kBits>(count)) {
        at[b] = static_cast<uint8_t>(codes.w[b / 4] >> (8 * (b % 4)));
      }
    }
    FASTDDP_UNROLL
    for (int j = 0; j < kWide; ++j) {
      if (j < count && kFeedback && !block_bad) {
        mode.residual[e + j] = r[j];
      }
    }
  }
  return block_bad;
}

// quantize (int8, int4, int2) with 16 elements a lane: a block of 2^k * 16 elements (16 to 512) is its
// block / 16 consecutive lanes, which share its absolute maximum by shuffles. A warp's step is
// 512 elements; where all of them lie below n (all steps but the last), wide_step<true>, whose
// accesses are all whole, else wide_step<false>, whose lanes ask. A lane stores its codes, its
// residual and (the block's first lane) the scale.
// The layout (launch.h, wide_layout): fp32 values and residual 16-byte aligned, codes aligned
// to a lane's 16 (16, 8 or 4 bytes), one row or rows of whole blocks as far apart, so that a
// lane's 16 codes are in one row. Values: quantize's FlatValues or requantize's
// SummedRows<kBits>.
template <int kBits, bool kFeedback, bool kStochastic, class Values>
__global__ void __launch_bounds__(kThreads, kWideBlocksPerSm)
    quantize_wide_kernel(QuantizeArgs a, Divider by_row, Values source) {
  static_assert(kBits == 8 || kBits == 4 || kBits == 2, "codes of 8, 4 or 2 bits");
  math::Mode mode = a.rounding.mode();
  mode.feedback = kFeedback;
  mode.stochastic = Values::kStochasticAtRun ? mode.stochastic : kStochastic;
  WideOut out{by_row, static_cast<int>(a.block / kWide), 4};
  while ((int64_t{1} << out.block_log2) < a.block) {
    ++out.block_log2;
  }
  bool bad = false;
  warp_loop((a.n + kWide - 1) / kWide, 32, [&](int64_t first) {
    const int64_t e = (first + lane_index()) * kWide;
    if ((first + 32) * kWide <= a.n) {  // the same in every lane
      bad |= wide_step<kBits, true, kFeedback>(a, mode, source, out, e, kWide);
      return;
    }
    const int count = e >= a.n ? 0 : (a.n - e >= kWide ? kWide : static_cast<int>(a.n - e));
    bad |= wide_step<kBits, false, kFeedback>(a, mode, source, out, e, count);
  });
  raise_flag(bad, a.rounding.flag);
}

}  // namespace fastddp::kernels
