// Paged attention on the CPU, reading K and V where they sit in the block pool.
//
// One work item is (sequence, kv head, tile of up to 16 of its queries, slice of its keys):
// the query heads that share the kv head (GQA) are packed into the item's rows, so each key
// and value row is read once per step however many heads use it. A long context is cut into
// slices run by different threads, each keeping its own running max, sum and fp32 output
// (FlashAttention's online softmax), merged at the end (flash-decoding). Threads take items
// from a shared counter, largest first, so one long prompt does not leave the others idle.
// Batch-invariant mode (`invariant`, compiled_decode.py): slices cut at fixed multiples of
// INVARIANT_SLICE keys whatever the threads or other items, every item merged the same way (one
// slice or many), decode rows in the prompt rows' loop: a row's result is its query's and keys' alone.
// Only keys a query may see are read (position <= its own, inside the window), so nothing a
// slot held before its token was written (another request's NaN) can reach an output.
//
// A draft tree (llmopt/spec/draft_tree.py) is verified in the same call: `tree_bits` holds, per
// query row, which of its sequence's last 64 keys it may see (bit j: the key at seq_len - 64 + j;
// -1: all, i.e. a plain causal row; keys before those 64 are always seen), so a node sees the
// context and its own ancestors only. Rows with a mask take the general loop over the blocks that
// hold those keys; everything else is unchanged.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "common.h"
#include "int_kv.h"
#include "paged_attention_avx512.h"
#include "paged_attention_prompt.h"

namespace llmopt {

constexpr int64_t QUERY_TILE = 16;   // new tokens per item: keeps a prompt's rows in L1/L2
constexpr int64_t MIN_SLICE = 128;   // keys per slice, at least: below this merging costs more
// Below this much work (query tokens x keys, summed over the items) one thread does it all: waking
// the others costs more than they save (measured on SmolLM2's shape, one sequence of 3 items, 1
// against 2 threads: benchmarks/README.md, "Measurements behind the code's choices").
constexpr int64_t SERIAL_MAX_COST = 512;
constexpr int64_t TREE_KEYS = 64;    // a tree row's mask covers its sequence's last 64 keys
constexpr int64_t INVARIANT_SLICE = 256;  // batch-invariant mode's slice (long contexts still spread)
enum KVFormat { KV_F32, KV_BF16, KV_E4M3, KV_E5M2, KV_I8, KV_I4 };  // int8 / int4: int_kv.h

static float fp8_value(uint8_t b, bool e4m3) {
  const int sign = b >> 7;
  float v;
  if (e4m3) {
    const int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  } else {
    const int e = (b >> 2) & 31, m = b & 3;
    if (e == 31) return m ? NAN : (sign ? -INFINITY : INFINITY);
    v = e == 0 ? std::ldexp(float(m), -16) : std::ldexp(1.0f + m / 4.0f, e - 15);
  }
  return sign ? -v : v;
}

// A row of D numbers from the pool, in fp32, times the pool's scale.
static inline void load_row(const void* src, KVFormat fmt, const float* lut, float scale, int64_t D, float* dst) {
  switch (fmt) {
    case KV_F32: std::memcpy(dst, src, D * sizeof(float)); break;
    case KV_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t j = 0; j < D; ++j) dst[j] = bf16_to_float(s[j]);
      break;
    }
    default: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (int64_t j = 0; j < D; ++j) dst[j] = lut[s[j]] * scale;
    }
  }
}

static inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < D; ++j) s += a[j] * b[j];
  return s;
}

struct Item {
  int64_t seq, kv_head, q0, q1, k0, k1;  // queries q0..q1 (rows of q), keys k0..k1 (positions)
  int64_t part;                           // -1: write the output; else its slot in the scratch
  int64_t cost;
};

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& block_table, const at::Tensor& query_start_loc,
                              const at::Tensor& seq_lens, double scale, int64_t window,
                              double k_scale, double v_scale, const at::Tensor& tree_bits, bool invariant,
                              const at::Tensor& k_scales, const at::Tensor& v_scales) {
  RECORD_FUNCTION("llmopt::paged_attention", std::vector<c10::IValue>());  // a named row in torch.profiler
  TORCH_CHECK_VALUE(q.dim() == 3 && q.is_contiguous() &&
                    (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                    "q must be contiguous [T, Hq, D] float32 or bfloat16, got ", q.sizes(), " ", q.scalar_type());
  TORCH_CHECK_VALUE(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                    v_pool.is_contiguous() && k_pool.scalar_type() == v_pool.scalar_type(),
                    "k_pool and v_pool must be contiguous [num_blocks, block_size, Hkv, D] of one shape and dtype");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = k_pool.size(0), BS = k_pool.size(1), Hkv = k_pool.size(2);
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, "num query heads ", Hq, " is not a multiple of num kv heads ", Hkv);
  KVFormat fmt;
  switch (k_pool.scalar_type()) {
    case at::kFloat: fmt = KV_F32; break;
    case at::kBFloat16: fmt = KV_BF16; break;
    case at::kFloat8_e4m3fn: fmt = KV_E4M3; break;
    case at::kFloat8_e5m2: fmt = KV_E5M2; break;
    case at::kChar: fmt = KV_I8; break;
    case at::kByte: fmt = KV_I4; break;
    default: TORCH_CHECK_VALUE(false, "pools must be float32, bfloat16, float8 (e4m3fn, e5m2), int8 or uint8 (int4 "
                               "codes two a byte), got ", k_pool.scalar_type());
  }
  const bool ints = fmt == KV_I8 || fmt == KV_I4;
  const int64_t W = fmt == KV_I4 ? D / 2 : D;   // a row's stored width (int4: two codes a byte)
  TORCH_CHECK_VALUE(k_pool.size(3) == W, "head_dim differs: q has ", D, ", the pools hold ", k_pool.size(3),
                    fmt == KV_I4 ? " bytes a row (int4: head_dim / 2)" : "");
  const int64_t VG = intkv::value_group(fmt == KV_I4), per_group = fmt == KV_I4 ? 2 : 1;  // int4: (scale, min)
  const auto gd = fmt == KV_I4 ? at::kHalf : at::kByte;
  TORCH_CHECK_VALUE(!ints || (D % VG == 0 && k_scales.scalar_type() == gd && v_scales.scalar_type() == gd &&
                              k_scales.is_contiguous() && v_scales.is_contiguous() && k_scales.numel() == NB * Hkv * D *
                              per_group && v_scales.numel() == NB * BS * Hkv * (D / VG) * per_group),
                    "an int8 / int4 pool needs k_scales and v_scales as llmopt/kernels/int_kv_ref.py's scale_shapes "
                    "gives them (int8: uint8 [NB, Hkv, D], [NB, BS, Hkv, D/32]; int4: float16 [.., D, 2], [.., D/64, 2])");
  for (const auto* t : {&block_table, &query_start_loc, &seq_lens})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->is_contiguous(),
                      "block_table, query_start_loc and seq_lens must be contiguous int32");
  TORCH_CHECK_VALUE(block_table.dim() == 2 && seq_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                    query_start_loc.size(0) == seq_lens.size(0) + 1 && block_table.size(0) >= seq_lens.size(0),
                    "expected block_table [B, max_blocks], seq_lens [B], query_start_loc [B + 1]");
  const int64_t B = seq_lens.size(0), max_blocks = block_table.size(1), G = Hq / Hkv;
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qsl[0] == 0 && qsl[B] == T, "query_start_loc must run from 0 to the number of queries ", T);
  for (int64_t i = 0; i < B; ++i) {   // every block a query will read must exist
    const int64_t n = qsl[i + 1] - qsl[i], L = lens[i];
    TORCH_CHECK_VALUE(n >= 0 && L >= n, "sequence ", i, ": ", n, " queries but seq_len ", L);
    TORCH_CHECK_VALUE((L + BS - 1) / BS <= max_blocks, "sequence ", i, " needs more blocks than block_table has");
    for (int64_t b = 0; b < (L + BS - 1) / BS; ++b)
      TORCH_CHECK_VALUE(table[i * max_blocks + b] >= 0 && table[i * max_blocks + b] < NB,
                        "sequence ", i, ": block_table entry ", table[i * max_blocks + b], " out of [0, ", NB, ")");
  }

  const bool masked = tree_bits.defined() && tree_bits.numel() > 0;
  TORCH_CHECK_VALUE(!masked || (tree_bits.scalar_type() == at::kLong && tree_bits.is_contiguous() &&
                                tree_bits.dim() == 1 && tree_bits.size(0) == T),
                    "tree_bits must be contiguous int64 [T] (a mask of the last 64 keys per query row), got ",
                    tree_bits.sizes(), " ", tree_bits.scalar_type());
  TORCH_CHECK_VALUE(!masked || window == 0, "draft-tree steps do not support sliding-window attention");
  const int64_t* bits = masked ? tree_bits.data_ptr<int64_t>() : nullptr;
  auto row_masked = [&](const Item& it) {  // any query of the item under a tree mask
    if (!masked) return false;
    for (int64_t t = it.q0; t < it.q1; ++t)
      if (bits[t] != -1) return true;
    return false;
  };

  // Work items; slice the keys only when there are too few items for the threads.
  std::vector<Item> items;
  int64_t total_cost = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = qsl[i + 1] - qsl[i], ctx = lens[i] - n;
    for (int64_t t0 = 0; t0 < n; t0 += QUERY_TILE) {
      const int64_t t1 = std::min(n, t0 + QUERY_TILE);
      const int64_t hi = ctx + t1, lo = window > 0 ? std::max<int64_t>(0, ctx + t0 - window + 1) : 0;
      for (int64_t h = 0; h < Hkv; ++h) {
        items.push_back({i, h, qsl[i] + t0, qsl[i] + t1, lo, hi, -1, (hi - lo) * (t1 - t0)});
        total_cost += items.back().cost;
      }
    }
  }
  const int64_t threads = total_cost <= SERIAL_MAX_COST ? 1 : at::get_num_threads();
  const int64_t base = items.size();
  struct Merge { int64_t first, count; Item whole; };
  std::vector<Merge> merges;
  int64_t parts = 0;
  if (invariant) {   // every item cut at multiples of INVARIANT_SLICE and merged, even when whole
    std::vector<Item> sliced;
    for (const Item& it : items) {
      const int64_t first = it.k0 / INVARIANT_SLICE, last = (it.k1 - 1) / INVARIANT_SLICE;
      merges.push_back({parts, last - first + 1, it});
      for (int64_t j = first; j <= last; ++j) {
        Item p = it;
        p.k0 = std::max(it.k0, j * INVARIANT_SLICE); p.k1 = std::min(it.k1, (j + 1) * INVARIANT_SLICE);
        p.part = parts++; p.cost = (p.k1 - p.k0) * (it.q1 - it.q0);
        sliced.push_back(p);
      }
    }
    items.swap(sliced);
  } else if (threads > 1 && base > 0 && base < 2 * threads) {
    const int64_t want = (2 * threads + base - 1) / base;
    std::vector<Item> sliced;
    for (const Item& it : items) {
      const int64_t keys = it.k1 - it.k0;
      const int64_t s = std::max<int64_t>(1, std::min(want, keys / MIN_SLICE));
      if (s == 1) { sliced.push_back(it); continue; }
      merges.push_back({parts, s, it});
      const int64_t step = (keys + s - 1) / s;
      for (int64_t k = it.k0; k < it.k1; k += step) {
        Item p = it;
        p.k0 = k; p.k1 = std::min(it.k1, k + step); p.part = parts++; p.cost = (p.k1 - p.k0) * (it.q1 - it.q0);
        sliced.push_back(p);
      }
    }
    items.swap(sliced);
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t rows_max = QUERY_TILE * G;
  std::vector<float> scratch(parts * rows_max * (D + 2));   // per part: m, l [rows], acc [rows, D]

  at::Tensor out = at::empty_like(q);
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const size_t elem = k_pool.element_size();
  const char* kbase = static_cast<const char*>(k_pool.data_ptr());
  const char* vbase = static_cast<const char*>(v_pool.data_ptr());
  float lut[256];
  if (fmt == KV_E4M3 || fmt == KV_E5M2)
    for (int b = 0; b < 256; ++b) lut[b] = fp8_value(uint8_t(b), fmt == KV_E4M3);
  const float ks = fmt >= KV_E4M3 ? float(k_scale) : 1.0f, vs = fmt >= KV_E4M3 ? float(v_scale) : 1.0f;
  const size_t row_bytes = W * elem;
  const char *kgroups = ints ? static_cast<const char*>(k_scales.data_ptr()) : nullptr,
             *vgroups = ints ? static_cast<const char*>(v_scales.data_ptr()) : nullptr;
  const size_t group_bytes = fmt == KV_I4 ? 4 : 1;
  // Pool row `row`'s ((block * BS + offset) * Hkv + head) key and value in float32; kg: the thread's decoded key groups.
  auto load_kv = [&](size_t row, float* kdst, float* vdst, intkv::KeyGroups& kg) {
    if (!ints) {
      load_row(kbase + row * row_bytes, fmt, lut, ks, D, kdst);
      load_row(vbase + row * row_bytes, fmt, lut, vs, D, vdst);
      return;
    }
    const size_t block = row / (BS * Hkv), head = row % Hkv;
    kg.decode(kgroups, block * Hkv + head, fmt == KV_I4, D);
    intkv::load_key(kbase + row * W, kg, fmt == KV_I4, D, kdst);
    intkv::load_value(vbase + row * W, vgroups + row * (D / VG) * group_bytes, fmt == KV_I4, D, vdst);
  };
  const float fscale = float(scale);
  const void* qp = q.data_ptr();
  void* op = out.data_ptr();
  std::atomic<int64_t> next{0};

  auto work = [&](int64_t, int64_t) {
    std::vector<float> qf(rows_max * D), acc(rows_max * D), kf(BS * D), vf(BS * D), s(BS);
    std::vector<float> m(rows_max), l(rows_max);
    std::vector<int32_t> lo(rows_max), hi(rows_max);
    intkv::KeyGroups kg;
    for (int64_t idx; (idx = next.fetch_add(1)) < int64_t(items.size());) {
      const Item& it = items[idx];
      const int64_t nq = it.q1 - it.q0, rows = nq * G, L = lens[it.seq];
      const int64_t first_pos = L - (qsl[it.seq + 1] - qsl[it.seq]) + (it.q0 - qsl[it.seq]);
      for (int64_t t = 0; t < nq; ++t)            // rows: (query token, head in the group)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t src = ((it.q0 + t) * Hq + it.kv_head * G + g) * D;
          float* dst = qf.data() + (t * G + g) * D;
          for (int64_t j = 0; j < D; ++j)
            dst[j] = (q_bf16 ? bf16_to_float(static_cast<const uint16_t*>(qp)[src + j])
                             : static_cast<const float*>(qp)[src + j]);
        }
      const bool tree = row_masked(it);
      const int64_t masked_from = L - TREE_KEYS;  // a tree row's bits cover the keys from here
      bool in_registers = false;  // one new token's rows (paged_attention_avx512.h, 1)
#ifdef LLMOPT_ATTN_AVX512
      if (nq == 1 && !tree && !invariant && (fmt == KV_F32 || fmt == KV_BF16)) {
        const int32_t* blocks = table + it.seq * max_blocks;
        auto block_at = [&](int64_t b) { return (size_t(blocks[b]) * BS * Hkv + it.kv_head) * D * elem; };
        const size_t key_stride = Hkv * D * elem;
        in_registers = fmt == KV_BF16
            ? attn::decode_item_any<true>(rows, D, qf.data(), kbase, vbase, it.k0, it.k1, BS, fscale, block_at,
                                          key_stride, m.data(), l.data(), acc.data())
            : attn::decode_item_any<false>(rows, D, qf.data(), kbase, vbase, it.k0, it.k1, BS, fscale, block_at,
                                           key_stride, m.data(), l.data(), acc.data());
      }
#endif
      int64_t p_first = in_registers ? it.k1 : it.k0;  // the general loop's keys: p_first .. k1
#ifdef LLMOPT_ATTN_PROMPT
      // the rest, rows in vector lanes (paged_attention_prompt.h), up to a tree's masked blocks
      const int64_t k_end = tree ? std::clamp(std::max<int64_t>(masked_from, 0) / BS * BS, it.k0, it.k1) : it.k1;
      if (!in_registers && k_end > it.k0) {
        for (int64_t r = 0; r < rows; ++r) {   // row r sees positions lo <= p < hi
          const int64_t pos = first_pos + r / G;
          lo[r] = int32_t(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
          hi[r] = int32_t(pos + 1);
        }
        auto fetch = [&](int64_t p, int64_t n) {  // keys p .. p + n of one block, in float32
          const size_t row = (size_t(table[it.seq * max_blocks + p / BS]) * BS + p % BS) * Hkv + it.kv_head;
          if (fmt == KV_F32)
            return attn::KeyRows{reinterpret_cast<const float*>(kbase) + row * D,
                                 reinterpret_cast<const float*>(vbase) + row * D, Hkv * D};
          for (int64_t i = 0; i < n; ++i) load_kv(row + i * Hkv, kf.data() + i * D, vf.data() + i * D, kg);
          return attn::KeyRows{kf.data(), vf.data(), D};
        };
        if (attn::prompt_item(qf.data(), rows, D, lo.data(), hi.data(), it.k0, k_end, BS, fscale, fetch, m.data(),
                              l.data(), acc.data()))
          p_first = k_end;
      }
#endif
      if (!in_registers && p_first == it.k0) {
        std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.begin() + rows, 0.0f);
        std::fill(acc.begin(), acc.begin() + rows * D, 0.0f);
      }
      for (int64_t p0 = p_first; p0 < it.k1;) {
        const int64_t blk = p0 / BS, p1 = std::min(it.k1, (blk + 1) * BS);
        const int64_t phys = table[it.seq * max_blocks + blk];
        for (int64_t p = p0; p < p1; ++p) {
          load_kv((size_t(phys) * BS + p % BS) * Hkv + it.kv_head, kf.data() + (p - p0) * D, vf.data() + (p - p0) * D, kg);
        }
        auto range = [&](int64_t r) {  // row r's visible keys in this block: up to its own position, in the window
          const int64_t pos = first_pos + r / G;
          return std::pair<int64_t, int64_t>(std::max(p0, window > 0 ? pos - window + 1 : int64_t(0)),
                                             std::min(p1, pos + 1));
        };
        const bool tree_block = tree && p1 > masked_from;  // holds keys some row may not see
        for (int64_t r = 0; r < rows; ++r) {
          const auto [a, b] = range(r);
          if (a >= b) continue;
          const float* qr = qf.data() + r * D;
          float mx = m[r];
          const int64_t rb = tree_block ? bits[it.q0 + r / G] : -1;
          for (int64_t p = a; p < b; ++p) {
            const int64_t j = p - masked_from;  // hidden from a tree row unless its bit j is set
            s[p - p0] = rb != -1 && j >= 0 && !((uint64_t(rb) >> j) & 1)
                            ? -std::numeric_limits<float>::infinity()
                            : dot(qr, kf.data() + (p - p0) * D, D) * fscale;
            mx = std::max(mx, s[p - p0]);
          }
          if (mx == -std::numeric_limits<float>::infinity()) continue;  // nothing visible here yet
          float* ar = acc.data() + r * D;
          const float corr = std::exp(m[r] - mx);   // 0 on the first keys (m = -inf)
          if (corr != 1.0f) {
            l[r] *= corr;
            for (int64_t j = 0; j < D; ++j) ar[j] *= corr;
          }
          exp_shifted_add(s.data() + (a - p0), b - a, mx, l[r]);
          for (int64_t p = a; p < b; ++p) {
            const float e = s[p - p0];
            const float* vr = vf.data() + (p - p0) * D;
#pragma omp simd
            for (int64_t j = 0; j < D; ++j) ar[j] += e * vr[j];
          }
          m[r] = mx;
        }
        p0 = p1;
      }
      if (it.part >= 0) {
        float* sp = scratch.data() + it.part * rows_max * (D + 2);
        std::copy(m.begin(), m.begin() + rows, sp);
        std::copy(l.begin(), l.begin() + rows, sp + rows_max);
        std::copy(acc.begin(), acc.begin() + rows * D, sp + 2 * rows_max);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t dst = ((it.q0 + r / G) * Hq + it.kv_head * G + r % G) * D;
        const float inv = 1.0f / l[r];
        for (int64_t j = 0; j < D; ++j) {
          const float v = acc[r * D + j] * inv;
          if (q_bf16) static_cast<uint16_t*>(op)[dst + j] = float_to_bf16(v);
          else static_cast<float*>(op)[dst + j] = v;
        }
      }
    }
  };
  if (threads == 1) work(0, 1);   // on this thread, without entering a parallel region
  else at::parallel_for(0, threads, 1, work);

  // flash-decoding's merge: rescale each slice to the common max, add, divide by the total sum
  at::parallel_for(0, int64_t(merges.size()), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t mi = b0; mi < b1; ++mi) {
      const Merge& mg = merges[mi];
      const int64_t rows = (mg.whole.q1 - mg.whole.q0) * G;
      for (int64_t r = 0; r < rows; ++r) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < mg.count; ++k)
          mx = std::max(mx, scratch[(mg.first + k) * rows_max * (D + 2) + r]);
        std::vector<float> o(D, 0.0f);
        float total = 0.0f;
        for (int64_t k = 0; k < mg.count; ++k) {
          const float* sp = scratch.data() + (mg.first + k) * rows_max * (D + 2);
          if (sp[rows_max + r] == 0.0f) continue;   // a slice with no key this query sees
          const float w = std::exp(sp[r] - mx);
          total += sp[rows_max + r] * w;
          for (int64_t j = 0; j < D; ++j) o[j] += sp[2 * rows_max + r * D + j] * w;
        }
        const int64_t dst = ((mg.whole.q0 + r / G) * Hq + mg.whole.kv_head * G + r % G) * D;
        for (int64_t j = 0; j < D; ++j) {
          const float v = o[j] / total;
          if (q_bf16) static_cast<uint16_t*>(op)[dst + j] = float_to_bf16(v);
          else static_cast<float*>(op)[dst + j] = v;
        }
      }
    }
  });
  return out;
}

}  // namespace llmopt
