"""The defects planted in copies of the CUDA kernels' sources, one at a time, by
``tests/ops/test_emu.py``: each must make the emulator's checks of its op fail.

Without torch: ``tests/emu_objects.py`` compiles the copies' objects before the tests start.
"""

import shutil
from pathlib import Path
from typing import Optional

# How the copies are built (``fastddp.testing.emu_build.build``'s options; ``only`` is the op).
PLANTED_BUILD = {"debug": False}

# (name, file under csrc, the text, what replaces it, the op whose checks must fail); a defect
# of several edits gives a tuple of each of the middle three.
DEFECTS = [
    # place_of: the run of a warp's chunks taken as one row where a row ends inside it; a
    # group's first element taken from the row's start, not from the chunk index; a block's
    # scale at the wrong row's place.
    ("a run across a row's end taken as one row", "cuda/codes_kernels.cuh",
     "e0 + 32 * kChunk <= start + codes.rows.row_len", "e0 < start + codes.rows.row_len",
     "unpack_int8"),
    ("a group of codes aligned to the row, not to the lanes", "cuda/codes_kernels.cuh",
     "(c & ~int64_t{P::kGroup - 1}) * kChunk - start",
     "(e - start) & ~int64_t{P::kGroup * kChunk - 1}", "quantize_packed"),
    ("a block's scale placed by the row's length, not its stride", "cuda/codes_kernels.cuh",
     "row * codes.rows.s_stride + b, offset", "row * (codes.rows.row_len / block) + b, offset",
     "quantize_int8"),
    ("grid stride off by one block", "cuda/kernels.cuh",
     "const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;",
     "const int64_t stride = static_cast<int64_t>(gridDim.x + 1) * blockDim.x;", "unpack_int8"),
    ("warp stride off by one warp", "cuda/kernels.cuh",
     "first += warps * span) {", "first += (warps + 1) * span) {", "compress"),
    ("a warp-shuffle step dropped", "cuda/codes_kernels.cuh",
     "for (int offset = 16; offset > 0; offset /= 2) {",
     "for (int offset = 16; offset > 1; offset /= 2) {", "quantize_int8"),
    ("a shuffle step of a block's lanes dropped", "cuda/codes_kernels.cuh",
     "for (int round = 0; round < 5; ++round) {", "for (int round = 0; round < 4; ++round) {",
     "quantize_int8"),
    ("a shuffle step of a block's lanes dropped with feedback and stochastic rounding",
     "cuda/codes_kernels.cuh", "for (int offset = width / 2; offset > 0; offset /= 2) {",
     "for (int offset = width / 2; offset > 1; offset /= 2) {", "quantize_int8"),
    ("a shuffle step of a warp-long block dropped", "cuda/codes_kernels.cuh",
     "for (int offset = 32 / 2; offset > 0; offset /= 2) {",
     "for (int offset = 32 / 2; offset > 1; offset /= 2) {", "quantize_int8"),
    ("an unrolled step of unpack taking one chunk twice", "cuda/codes_kernels.cuh",
     "k[u] = chunk_at(0, n, first + 32 * u + lane_index());",
     "k[u] = chunk_at(0, n, first + lane_index());", "unpack_int8"),
    ("a divergent shuffle", "cuda/codes_kernels.cuh",
     "for (int offset = 16; offset > 0; offset /= 2) {",
     "for (int offset = 16; offset > 0 && lane < 16; offset /= 2) {", "quantize_int8"),
    ("a shuffle skipped by lanes past the end", "cuda/kernels.cuh",
     "const uint32_t odd_lo = __shfl_xor_sync(kAllLanes, lo, 1);",
     "const uint32_t odd_lo = k.count > 0 ? __shfl_xor_sync(kAllLanes, lo, 1) : 0u;",
     "compress"),
    ("loop bound < made <=", "cuda/kernels.cuh",
     "for (int64_t i = begin + thread_index(); i < end; i += stride) {",
     "for (int64_t i = begin + thread_index(); i <= end; i += stride) {", "unpack_int8"),
    # Two edits (file, text and replacement each a tuple): the values past a short chunk's end
    # loaded, and taken into its block's absmax.
    ("a short chunk read past its count into a block's absmax",
     ("cuda/kernels.cuh", "cuda/codes_kernels.cuh"),
     ("x[j] = j < k.count ? p[k.first + j] : 0.0f;",
      "v[j] = j < k.count ? math::rounding_input_of(mode, x[j], a.scale, r[j]) : 0.0f;"),
     ("x[j] = k.count > 0 ? p[k.first + j] : 0.0f;",
      "v[j] = math::rounding_input_of(mode, x[j], a.scale, r[j]);"),
     "quantize_int8"),
    ("a short chunk taken as whole", "cuda/kernels.cuh",
     "const int count = left <= 0 ? 0 : (left >= kChunk ? kChunk : static_cast<int>(left));",
     "const int count = left <= 0 ? 0 : kChunk;", "decompress"),
    ("__syncthreads_or replaced by the thread's own flag", "cuda/kernels.cuh",
     "if (flag != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) {",
     "if (flag != nullptr && bad && threadIdx.x == 0) {", "compress"),
    ("the residual of a rounded chunk not written", "cuda/kernels.cuh",
     "    store_chunk(mode.residual, k, r);\n  }\n  store_wire(dst, k, w);",
     "  }\n  store_wire(dst, k, w);", "compress"),
    ("an octet's residual stored twice in its first half", "cuda/kernels.cuh",
     "store16(reinterpret_cast<float4*>(mode.residual + e) + h,",
     "store16(reinterpret_cast<float4*>(mode.residual + e) + 0 * h,", "sum_chunks"),
    # The row sum, four rows a step: the last row added again past the end of the rows; every
    # row of a step read from its first; the octets past the whole ones left out.
    ("the last row of a sum added again past the rows' end",
     ("cuda/kernels.cuh", "cuda/kernels.cuh"),
     ("if (p + r < chunks) {\n        v[r] = load16(reinterpret_cast<const uint4*>(src + (p + r)",
      "if (p + r < chunks) {\n        FASTDDP_UNROLL"),
     ("{\n        v[r] = load16(reinterpret_cast<const uint4*>(src + (p + r < chunks ? p + r : "
      "chunks - 1)", "{\n        FASTDDP_UNROLL"),
     "sum_chunks"),
    ("every row of a step read from its first", "cuda/kernels.cuh",
     "src + (p + r) * m + e", "src + p * m + e", "widen_sum"),
    # The elements past the last whole octet: left out; the first of them left to no thread
    # (they are counted from the grid's last thread).
    ("the elements past the last whole octet left out", "cuda/kernels.cuh",
     "    element(i);\n  }\n  grid_stride_loop(0, octets", "  }\n  grid_stride_loop(0, octets",
     "sum_chunks"),
    ("the first element past the last whole octet left to no thread", "cuda/kernels.cuh",
     "(threads - 1 - thread_index())", "(threads - thread_index())", "widen_sum"),
    # Each block's scale and inverse worked out once and shared (step_values, step_value).
    ("a block's inverse taken from its scale's lane", "cuda/codes_kernels.cuh",
     "2 * block + (odd ? 1 : 0)", "2 * block + (odd ? 0 : 0)", "quantize_int8"),
    ("every block's maximum taken from the first run", "cuda/codes_kernels.cuh",
     "bits = (block >> per_run_log2) == u ? other : bits;", "bits = u == 0 ? other : bits;",
     "quantize_packed"),
    ("a shared scale near FLT_MAX not taken one step down", "include/fastddp/rounding.h",
     "bits_of(mul(quotient, qmax)) < 0x7f800000u ? quotient : float_of(q - 1u)", "quotient",
     "quantize_int8"),
    ("a shared inverse past FLT_MAX kept", "include/fastddp/rounding.h",
     "absmax_bits == 0 || q >= 0x7f800000u", "absmax_bits == 0", "quantize_int8"),
    ("the codes of a packed byte in reverse order", "cuda/packed_kernels.cuh",
     "byte |= pack_code(math::quantize_element(mode, v, inverse, step, i, qmax), kBits, j);",
     "byte |= pack_code(math::quantize_element(mode, v, inverse, step, i, qmax), kBits, "
     "kPer - 1 - j);", "quantize_packed"),
    ("the codes of a chunk in reverse order", "cuda/codes_kernels.cuh",
     "piece |= pack_code(code, kBits, j);", "piece |= pack_code(code, kBits, kChunk - 1 - j);",
     "quantize_packed"),
    ("the last byte of a packed row left out", "cuda/packed_kernels.cuh",
     "const int64_t end_byte = (hi - row_first + kPer - 1) / kPer;",
     "const int64_t end_byte = (hi - row_first) / kPer;", "quantize_packed"),
    ("the last short piece of codes left out", "cuda/codes_kernels.cuh",
     "  const int nbytes = (count * kBits + 7) / 8;\n  if (nbytes == P::kBytes) {\n    if "
     "(P::kBytes == 4) {\n      *reinterpret_cast<uint32_t*>(at) = piece;",
     "  const int nbytes = (count * kBits) / 8;\n  if (nbytes == P::kBytes) {\n    if "
     "(P::kBytes == 4) {\n      *reinterpret_cast<uint32_t*>(at) = piece;", "quantize_packed"),
    ("a group's 16 bytes read from the wrong lane's slot", "cuda/codes_kernels.cuh",
     "return (word >> (8 * (byte % 4))) & P::kMask;", "return word & P::kMask;",
     "unpack_packed"),
    ("a 16-byte code store without its alignment check", "cuda/codes_kernels.cuh",
     "whole = reinterpret_cast<uintptr_t>(code_byte<kBits>(codes, q, g0)) % 16 == 0;",
     "whole = true;", "quantize_int8"),
    ("a divider's magic number one too small", "include/fastddp/layout.h",
     "(uint64_t{1} << 32) * ((uint64_t{1} << shift) - ud) / ud + 1;",
     "(uint64_t{1} << 32) * ((uint64_t{1} << shift) - ud) / ud;", "unpack_int8"),
    # dequantize's whole step: groups of kDequantRows rows, then the rest one by one; each
    # row's codes and scales an offset from row 0's.
    ("a group of rows of a dequantised sum reaching past the last", "cuda/codes_kernels.cuh",
     "for (; p + kR <= rows; p += kR) {", "for (; p < rows; p += kR) {", "dequantize_int8"),
    ("the rows of a dequantised sum past the last group left out", "cuda/codes_kernels.cuh",
     "for (; p < rows; ++p) {", "for (; p < rows && false; ++p) {", "dequantize_packed"),
    ("each group of rows of dequantize scaled by the first group's scales",
     "cuda/codes_kernels.cuh", "const int64_t row_s = (p + r) * rows.s_stride;",
     "const int64_t row_s = r * rows.s_stride;", "dequantize_packed"),
    ("an unrolled chunk of dequantize scaled by its neighbour's block", "cuda/codes_kernels.cuh",
     "(kBits == 8 ? codes.by_block.div(e + 32 * u * kChunk)",
     "(kBits == 8 ? codes.by_block.div(e)", "dequantize_int8"),
    ("an unrolled chunk of packed dequantize scaled by its neighbour's block",
     "cuda/codes_kernels.cuh", ": b + codes.by_block.div_small(at_b + 32 * u * kChunk));",
     ": b + codes.by_block.div_small(at_b));", "dequantize_packed"),
    ("a packed piece of a whole step of unpack read from its group's wrong half",
     "cuda/codes_kernels.cuh", "return (w >> (8 * (byte % 4))) & Pieces<kBits>::kMask;",
     "return (w >> (8 * (byte % 2))) & Pieces<kBits>::kMask;", "unpack_packed"),
    # dequantize's whole step: each lane loads its own piece of each row.
    ("a lane of dequantize loading the next lane's int8 piece", "cuda/codes_kernels.cuh",
     "return load4(reinterpret_cast<const uint32_t*>(at));",
     "return load4(reinterpret_cast<const uint32_t*>(at) + 1);", "dequantize_int8"),
    ("a lane of dequantize loading the next lane's int4 piece", "cuda/codes_kernels.cuh",
     "return load2(reinterpret_cast<const uint16_t*>(at));",
     "return load2(reinterpret_cast<const uint16_t*>(at) + 1);", "dequantize_packed"),
    ("a whole step of unpack taking each chunk's scale from the chunk before",
     "cuda/codes_kernels.cuh", "const int64_t e = offset + lane * kChunk;",
     "const int64_t e = offset + (lane - 1) * kChunk;", "unpack_int8"),
    ("a whole step of unpack taking the second chunk's block for every later one",
     "cuda/codes_kernels.cuh", "div_small(at_b + 32 * u * kChunk)",
     "div_small(at_b + 32 * (u > 0) * kChunk)", "unpack_packed"),
    ("a whole step of unpack placing a chunk by its block's start, not the lane's",
     "cuda/codes_kernels.cuh", "static_cast<uint32_t>(e - b * codes.by_block.d)",
     "static_cast<uint32_t>(0 * e)", "unpack_int8"),
    ("a whole step of unpack across a row's end", "cuda/codes_kernels.cuh",
     "if (offset + (e1 - e0) <= s.rows.row_len && reinterpret_cast",
     "if (true && reinterpret_cast", "unpack_packed"),
    ("a whole step of quantize across a row's end", "cuda/codes_kernels.cuh",
     "const bool whole = offset + (e1 - e0) <= a.rows.row_len && (b0",
     "const bool whole = (b0", "quantize_int8"),
    ("a whole step of quantize placing scales as if a block were a warp's",
     "cuda/codes_kernels.cuh", "w.scale0 + (index >> per_block_log2)", "w.scale0 + (index >> 5)",
     "quantize_packed"),
    ("a whole step of quantize without its alignment check", "cuda/codes_kernels.cuh",
     "(b0 << block_log2) == offset &&\n" + " " * 21 + "reinterpret_cast<uintptr_t>(at) % 16 == 0;",
     "(b0 << block_log2) == offset;", "quantize_int8"),
    ("a vector access at an offset that is not a multiple of its width", "cuda/launch.h",
     "if ((aligned_at(i, p) && ...)) {", "if (((aligned_at(i, p) || true) && ...)) {",
     "compress"),
    # requantize's sums of rows (values.cuh): rows two at a time in the vector kernel, one at a
    # time in the scalar ones.
    ("the lone last row of a requantized sum added twice", "cuda/values.cuh",
     "if (p0 + 1 < rows) {", "if (p0 + 1 <= rows) {", "requantize"),
    ("the second row of a requantized pair read from the first", "cuda/values.cuh",
     "const uint32_t piece1 = piece_at(p1);", "const uint32_t piece1 = piece_at(p0);",
     "requantize"),
    ("a row of codes left out of the scalar kernels' sums", "cuda/values.cuh",
     "for (int64_t p = 1; p < src.rows.rows; ++p) {",
     "for (int64_t p = 2; p < src.rows.rows; ++p) {", "requantize"),
    # The wide kernel (wide_kernels.cuh): a round of its blocks' shuffles dropped; every
    # row summed with the first row's scale; the scale placed by the lane, not the block; the
    # last lane's residual not written.
    ("a round of a wide block's shuffles dropped", "cuda/wide_kernels.cuh",
     "for (int round = 0; round < 5; ++round) {", "for (int round = 0; round < 4; ++round) {",
     "quantize_int8"),
    ("every row of a wide sum scaled by the first row's scale", "cuda/wide_kernels.cuh",
     "step[r] = scales[(p + r) * s.src.rows.s_stride];", "step[r] = scales[0];", "requantize"),
    ("a wide block's scale placed by its first lane's 16", "cuda/wide_kernels.cuh",
     "(offset >> out.block_log2)] = step;", "(offset >> 4)] = step;", "quantize_int8"),
    ("the last wide lane's residual not written", "cuda/wide_kernels.cuh",
     "        mode.residual[e + j] = r[j];\n", "", "quantize_int8"),
    # Its residual stored in pairs of lanes: the odd lane's stores placed from its own start;
    # the odd lane's values stored where the even lane's block is finite; the even lane storing
    # its partner's values of a non-finite block.
    ("a wide pair's odd lane storing from its own start", "cuda/wide_kernels.cuh",
     "float* pair = residual + e - (odd ? kWide : 0) + (odd ? 4 : 0);",
     "float* pair = residual + e + (odd ? 4 : 0);", "quantize_int8"),
    ("a wide pair's stores made where the even lane's block is finite", "cuda/wide_kernels.cuh",
     "const bool odd_writes = odd ? write : partner;",
     "const bool odd_writes = odd ? partner : write;", "quantize_int8"),
    ("a wide pair's even lane storing whatever its partner's block", "cuda/wide_kernels.cuh",
     "const bool odd_writes = odd ? write : partner;",
     "const bool odd_writes = odd ? write : true;", "quantize_int8"),
    # Its packed codes: a row's codes read at the element's index rather than its byte; a code
    # placed by its index in its byte; the last lane's short last byte not written.
    ("a wide row of packed codes read at the element's index", "cuda/wide_kernels.cuh",
     "reinterpret_cast<const uint8_t*>(s.src.q) + e * kBits / 8;",
     "reinterpret_cast<const uint8_t*>(s.src.q) + e;", "requantize"),
    ("a wide code placed by its index in its byte, not in its word", "cuda/wide_kernels.cuh",
     "w[j / kPerWord] |= pack_code(q, kBits, j % kPerWord);",
     "w[j / kPerWord] |= pack_code(q, kBits, j % (8 / kBits));", "quantize_packed"),
    ("the last wide lane's short last byte not written", "cuda/wide_kernels.cuh",
     "return (count * kBits + 7) / 8;", "return count * kBits / 8;", "quantize_packed"),
    ("a vector kernel for unaligned fp32 codes' data", "cuda/launch.h",
     "return aligned16(fp32) && (residual == nullptr",
     "return fp32 != nullptr && (residual == nullptr", "unpack_int8"),
]  # fmt: skip


def planted_copy(csrc: Path, dest: Path, edit: Optional[tuple] = None) -> Path:
    """A copy of ``csrc`` at ``dest`` with ``edit`` (file under csrc, text, what replaces it;
    or a tuple of each) applied once; ``dest``."""
    shutil.copytree(csrc, dest)
    if edit is not None:
        edits = zip(*edit) if isinstance(edit[0], tuple) else [edit]
        for rel, old, new in edits:
            path = dest / rel
            text = path.read_text()
            assert old in text, f"the defect's target text is gone from {rel}: update DEFECTS"
            path.write_text(text.replace(old, new, 1))
    return dest
