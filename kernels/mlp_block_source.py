"""CUDA C of the MLP block kernel (kernels/mlp_block_cuda.py): one launch for a decode
layer's o projection (+ residual), gate/up (+ row scale, SiLU-and-mul) and down
(+ residual), with every phase's weights streamed into shared memory from the start.

The host prepends the tile sizes as `#define`s (`MlpBlockConfig.defines`). Layout of one
program (one per SM, 256 threads):

- shared memory: region A holds the o tile, then the down tile (its copy starts when the
  o product is done); region B the gate/up tile; region X the current phase's input rows;
  each weight row padded by 16 bytes so that `ldmatrix` reads eight rows in eight banks.
- a phase: wait for its inputs (a grid-wide counter), copy the input slice to X, multiply
  (warp w owns 16 weight rows, `mma.m16n8k16` over the whole K slice, 32 batch rows), write
  the fp32 partial; the programs that split one output tile's K wait for each other and
  each sums a strided share of the features in split order (deterministic), then applies
  the epilogue with the Triton skinny kernel's rounding points.
- counters only grow (64-bit): a launch adds a known count to each, so a waiter's target
  is the next multiple of that count above its own arrival; nothing is reset. Every spin
  traps after ~2^28 polls (a bug, not a wait).
"""

SOURCE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define THREADS 256
#ifndef WEIGHTS_MODE
#define WEIGHTS_MODE 0  // 0: stream ahead; 1: each phase's copy at its start; 2: none (timing)
#endif
#define COPY (WEIGHTS_MODE != 2)
#define ROWS 32
#define SPIN_LIMIT (1LL << 28)

#if IS_BF16
typedef __nv_bfloat16 elem_t;
__device__ __forceinline__ float to_f(elem_t v) { return __bfloat162float(v); }
__device__ __forceinline__ elem_t from_f(float v) { return __float2bfloat16_rn(v); }
#define MMA_TYPE "bf16"
#else
typedef __half elem_t;
__device__ __forceinline__ float to_f(elem_t v) { return __half2float(v); }
__device__ __forceinline__ elem_t from_f(float v) { return __float2half_rn(v); }
#define MMA_TYPE "f16"
#endif
__device__ __forceinline__ float rnd(float v) { return to_f(from_f(v)); }

typedef unsigned long long u64;

// ---- grid-wide counters ------------------------------------------------------------
__device__ __forceinline__ u64 load_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// ---- clusters: the K splits of one o / down tile share their partials in shared memory
#ifndef CLUSTER
#define CLUSTER 0
#endif
__device__ __forceinline__ void cluster_sync() {  // every thread of every program in the cluster
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

#ifndef GU_MULTICAST
#define GU_MULTICAST 0  // needs CLUSTER and unsplit gate/up tiles
#endif

#ifndef BARRIER_MODE
#define BARRIER_MODE 0  // 0: fence + atomic, acquire polls + fence; 1: release atomic, acquire polls
#endif

// Thread 0 only: count this program in (its CTA's stores ordered before by bar.sync).
__device__ __forceinline__ u64 count_in(u64* counter) {
#if BARRIER_MODE == 0
  __threadfence();
  return atomicAdd(counter, 1ULL);
#else
  u64 old;
  asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(counter)
               : "memory");
  return old;
#endif
}

// Thread 0 only: spin until `counter` reaches `target`.
__device__ __forceinline__ void poll(u64* counter, u64 target) {
  long long spins = 0;
  while (load_acquire(counter) < target) {
    if (++spins > SPIN_LIMIT) __trap();
  }
#if BARRIER_MODE == 0
  __threadfence();
#endif
}

// Called by every thread: this program's stores are published, then it counts itself in
// on `counter` (which gets `per_launch` arrivals a launch) and waits for the rest.
__device__ void arrive_and_wait(u64* counter, u64 per_launch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const u64 old = count_in(counter);
    poll(counter, (old / per_launch + 1) * per_launch);
  }
  __syncthreads();
}

// This program's stores published, thread 0 counts it in; the old count is thread 0's.
__device__ __forceinline__ u64 arrive(u64* counter) {
  __syncthreads();
  return threadIdx.x == 0 ? count_in(counter) : 0;
}

// Thread 0 waits until `counter` reaches its `target`; the others wait for thread 0.
__device__ void wait_for(u64* counter, u64 target) {
  if (threadIdx.x == 0) poll(counter, target);
  __syncthreads();
}

// ---- bulk copies into shared memory ------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(u64* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect(u64* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(u64* bar) {
  unsigned done = 0;
  long long spins = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n"
                 " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_addr(bar)) : "memory");
    if (++spins > SPIN_LIMIT) __trap();
  }
}

__device__ __forceinline__ void bulk_row(void* dst, const void* src, unsigned bytes, u64* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Rows [0, nrows) of a weight tile into padded shared rows; row r of the tile is weight row
// `row0 + r`, or `row1 + r - split_row` from `split_row` on (the gate/up tile's up half).
// Called by warp 0 after thread 0 set the barrier's byte count.
__device__ void copy_tile(char* dst, const elem_t* w, int ld, int k0, int bk, int nrows,
                          int row0, int split_row, int row1, u64* bar) {
  const int lane = threadIdx.x & 31;
  const unsigned bytes = bk * sizeof(elem_t);
  const int stride = bk * sizeof(elem_t) + 16;
  for (int r = lane; r < nrows; r += 32) {
    const long long row = r < split_row ? row0 + r : row1 + r - split_row;
    bulk_row(dst + r * stride, w + row * ld + k0, bytes, bar);
  }
}

// ---- the tile product --------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned& r0, unsigned& r1,
                                            unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void mma(float* c, unsigned a0, unsigned a1, unsigned a2,
                                    unsigned a3, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Warp w multiplies weight rows [16 (w % mt), +16) of the tile (mt = nrows / 16 row tiles)
// by the 32 input rows over its share (w / mt) of the `khalves` K ranges, and writes that
// fp32 partial [nrows, 32] at `part + (w / mt) * nrows * 32`. Several K ranges a tile keep
// every warp busy and halve each accumulator's chain of dependent MMAs. With
// `sync_before_store` all warps finish reading X before any writes (the partial may
// overwrite X in shared memory); every thread must call it then.
__device__ void tile_product(const char* wt, const char* xs, int bk, int nrows, int khalves,
                             float* part, bool sync_before_store) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int mt = nrows / 16;
  const int row_tile = warp % mt, half = warp / mt;
  const bool active = half < khalves;
  const int stride = bk * sizeof(elem_t) + 16;
  const int steps = bk / 16, per = (steps + khalves - 1) / khalves;
  const int k_begin = half * per * 16, k_end = min(steps, (half + 1) * per) * 16;
  float acc[4][4] = {};
  if (active) {
    const unsigned a_addr =
        smem_addr(wt + (row_tile * 16 + (lane & 15)) * stride + (lane >> 4) * 16);
    const int bi = lane >> 3;
    const unsigned b_addr =
        smem_addr(xs + ((bi >> 1) * 8 + (lane & 7)) * stride + (bi & 1) * 16);
#pragma unroll 4
    for (int k = k_begin; k < k_end; k += 16) {
      unsigned a0, a1, a2, a3, b0, b1, b2, b3, b4, b5, b6, b7;
      ldmatrix_x4(a_addr + k * 2, a0, a1, a2, a3);
      ldmatrix_x4(b_addr + k * 2, b0, b1, b2, b3);
      ldmatrix_x4(b_addr + 16 * stride + k * 2, b4, b5, b6, b7);
      mma(acc[0], a0, a1, a2, a3, b0, b1);
      mma(acc[1], a0, a1, a2, a3, b2, b3);
      mma(acc[2], a0, a1, a2, a3, b4, b5);
      mma(acc[3], a0, a1, a2, a3, b6, b7);
    }
  }
  if (sync_before_store) __syncthreads();
  if (!active) return;
  const int g = lane >> 2, t = lane & 3;
  const int r = row_tile * 16 + g;
  float* p = part + half * nrows * ROWS;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int col = n * 8 + 2 * t;
    *reinterpret_cast<float2*>(p + r * ROWS + col) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(p + (r + 8) * ROWS + col) = make_float2(acc[n][2], acc[n][3]);
  }
}

// Input rows [0, num_rows) x [k0, k0 + bk) into X (rows past num_rows zero-filled), as
// asynchronous 16-byte copies read at L2 (other programs of this launch wrote them): a
// load-then-store loop would stall each thread on one L2 round trip per vector.
__device__ void load_rows_async(char* xs, const elem_t* src, int ld, int k0, int bk,
                                int num_rows) {
  const int vecs = bk * sizeof(elem_t) / 16;
  const int stride = bk * sizeof(elem_t) + 16;
  for (int i = threadIdx.x; i < ROWS * vecs; i += THREADS) {
    const int m = i / vecs, v = i % vecs;
    const int row = m < num_rows ? m : 0;
    const void* from = reinterpret_cast<const uint4*>(src + (long long)row * ld + k0) + v;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(xs + m * stride + v * 16)), "l"(from),
                    "r"(m < num_rows ? 16 : 0) : "memory");
  }
}

__device__ void load_rows(char* xs, const elem_t* src, int ld, int k0, int bk, int num_rows) {
  load_rows_async(xs, src, ld, k0, bk, num_rows);
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// `local` (this program's shared address) in cluster peer `rank`.
__device__ __forceinline__ float ld_peer(const float* local, int rank) {
  unsigned addr = (unsigned)__cvta_generic_to_shared(local), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// One output tile's split-K partials summed for this program's share of its features
// (feature j with j % splits == split), in (split, K half) order; `add` adds the residual and writes
// the new stream and this share's sums of squares (part index `sq_part`).
// CLUSTERED: split s's partial is peer s's, at this program's `part_tile` address.
template <bool CLUSTERED>
__device__ void merge_residual(const float* part_tile, int splits, int halves, int split,
                               int bn, int n0,
                               const elem_t* res, int ld_res, elem_t* out, int ld_out,
                               float* sq, int sq_stride, int sq_part, int num_rows,
                               float* sq_smem) {
  const int m = threadIdx.x & 31, lane_group = threadIdx.x >> 5;
  float sum_sq = 0.f;
  for (int j = split + lane_group * splits; j < bn; j += splits * (THREADS / 32)) {
    const int n = n0 + j;
    const float r = m < num_rows ? to_f(__ldcg(res + (long long)m * ld_res + n)) : 0.f;
    float acc = 0.f;
    for (int s = 0; s < splits * halves; ++s) {
      if (CLUSTERED)
        acc += ld_peer(part_tile + ((long long)(s % halves) * bn + j) * ROWS + m, s / halves);
      else
        acc += __ldcg(part_tile + ((long long)s * bn + j) * ROWS + m);
    }
    if (m < num_rows) {
      const float y = rnd(rnd(acc) + r);
      out[(long long)m * ld_out + n] = from_f(y);
      sum_sq += y * y;
    }
  }
  sq_smem[lane_group * ROWS + m] = sum_sq;
  __syncthreads();
  if (threadIdx.x < ROWS && threadIdx.x < num_rows) {
    float total = 0.f;
    for (int gi = 0; gi < THREADS / 32; ++gi) total += sq_smem[gi * ROWS + threadIdx.x];
    sq[sq_part * sq_stride + threadIdx.x] = total;
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mlp_block(
    const elem_t* __restrict__ attn_out,  // [num_rows, KO]
    const elem_t* __restrict__ residual,  // [num_rows, H]
    const elem_t* __restrict__ w_o,       // [H, KO]
    const elem_t* __restrict__ w_gu,      // [2 I, H]: gate rows, then up rows
    const elem_t* __restrict__ w_d,       // [H, I]
    elem_t* r_mid,                        // [num_rows, H]: the stream after o
    elem_t* act,                          // [num_rows, I]: silu(gate) * up
    elem_t* r_out,                        // [num_rows, H]: the stream after down
    float* part,                          // fp32 partials: o, then gate/up, then down
    float* sq_mid,                        // [O_NT * O_KS, ROWS] squares of r_mid
    float* sq_out,                        // [D_NT * D_KS, SQ_STRIDE] squares of r_out
    u64* counters,                        // [2 + O_NT + GU_NT + D_NT], only grow
    int num_rows, int ld_attn, int ld_res, float eps,
    u64* stamps)                          // [grid, 16] globaltimer ns per phase point, or null
{
#define STAMP(i) if (stamps != nullptr && threadIdx.x == 0) { u64 t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); stamps[blockIdx.x * 16 + (i)] = t_; }
  STAMP(0)
  extern __shared__ __align__(128) char smem[];
  char* region_a = smem;
  char* region_b = region_a + REGION_A;
  char* region_x = region_b + REGION_B;
  float* scratch = reinterpret_cast<float*>(region_x + REGION_X);  // [THREADS / 32, ROWS]
  float* scale = scratch + (THREADS / 32) * ROWS;                     // [ROWS]
  u64* bars = reinterpret_cast<u64*>(scale + ROWS);                    // 4 mbarriers

  const int b = blockIdx.x;
  const bool has_o = b < O_NT * O_KS, has_gu = b < GU_NT * GU_KS, has_d = b < D_NT * D_KS;
  const int o_tile = b / O_KS, o_split = b % O_KS;
  const int gu_tile = b / GU_KS, gu_split = b % GU_KS;
  const int d_tile = b / D_KS, d_split = b % D_KS;
  u64* done_o = counters;
  u64* done_gu = counters + 1;
  u64* cnt_o = counters + 2;
  u64* cnt_gu = cnt_o + O_NT;
  u64* cnt_d = cnt_gu + GU_NT;
  float* part_o = part;
  float* part_gu = part_o + O_NT * O_KS * O_KH * O_BN * ROWS;
  float* part_d = part_gu + GU_NT * GU_KS * GU_KH * 2 * GU_BF * ROWS;

  // The o phase's input rows are asked for first, then every weight this program
  // multiplies, o's first: requests are served roughly in order, so the small input does
  // not queue behind 17 MB of weights, and the weights stream while the phases before
  // their use run.
  if (has_o) load_rows_async(region_x, attn_out, ld_attn, o_split * O_BK, O_BK, num_rows);
  if (threadIdx.x == 0) {
    for (int i = 0; i < 4; ++i) mbar_init(&bars[i]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if (has_o && COPY) mbar_expect(&bars[0], O_BN * O_BK * sizeof(elem_t));
    if (has_gu && WEIGHTS_MODE == 0) mbar_expect(&bars[1], 2 * GU_BF * GU_BK * sizeof(elem_t));
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (has_o && COPY) copy_tile(region_a, w_o, KO, o_split * O_BK, O_BK, O_BN, o_tile * O_BN, O_BN, 0, &bars[0]);
    if (has_gu && WEIGHTS_MODE == 0) copy_tile(region_b, w_gu, H, gu_split * GU_BK, GU_BK, 2 * GU_BF, gu_tile * GU_BF,
                          GU_BF, I + gu_tile * GU_BF, &bars[1]);
  }

  // ---- o projection + residual -> r_mid, squares of r_mid ----
  if (has_o) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    STAMP(1)
    if (COPY) mbar_wait(&bars[0]);
    STAMP(2)
#if CLUSTER
    tile_product(region_a, region_x, O_BK, O_BN, O_KH, reinterpret_cast<float*>(region_x), true);
#else
    tile_product(region_a, region_x, O_BK, O_BN, O_KH,
                 part_o + (long long)b * O_KH * O_BN * ROWS, false);
#endif
    __syncthreads();
    STAMP(3)
  }
  // Region A is free: the down tile's copy starts (async proxy after generic reads).
  if (has_d && WEIGHTS_MODE == 0) {
    if (threadIdx.x == 0) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      mbar_expect(&bars[2], D_BN * D_BK * sizeof(elem_t));
    }
    __syncthreads();
    if (threadIdx.x < 32)
      copy_tile(region_a, w_d, I, d_split * D_BK, D_BK, D_BN, d_tile * D_BN, D_BN, 0, &bars[2]);
  }
  if (has_o) {
#if CLUSTER
    cluster_sync();
    STAMP(4)
    // Peers read this partial until the grid barrier below; X is refilled only after it.
    merge_residual<true>(reinterpret_cast<float*>(region_x), O_KS, O_KH, o_split, O_BN,
                         o_tile * O_BN, residual, ld_res, r_mid, H, sq_mid, ROWS, b, num_rows,
                         scratch);
#else
    if (O_KS > 1) arrive_and_wait(&cnt_o[o_tile], O_KS);
    STAMP(4)
    merge_residual<false>(part_o + (long long)o_tile * O_KS * O_KH * O_BN * ROWS, O_KS, O_KH,
                          o_split, O_BN, o_tile * O_BN, residual, ld_res, r_mid, H, sq_mid,
                          ROWS, b, num_rows, scratch);
#endif
  }
#if GU_MULTICAST
  // r_mid was written through the generic proxy; the peers read it with bulk copies.
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
  const u64 o_arrival = arrive(done_o);
  STAMP(5)

  // ---- gate/up with the RMSNorm factor and SiLU-and-mul -> act ----
  if (has_gu) {
    wait_for(done_o, (o_arrival / gridDim.x + 1) * gridDim.x);  // thread 0's value counts
    if (WEIGHTS_MODE == 1) {
      if (threadIdx.x == 0) mbar_expect(&bars[1], 2 * GU_BF * GU_BK * sizeof(elem_t));
      __syncthreads();
      if (threadIdx.x < 32)
        copy_tile(region_b, w_gu, H, gu_split * GU_BK, GU_BK, 2 * GU_BF, gu_tile * GU_BF, GU_BF,
                  I + gu_tile * GU_BF, &bars[1]);
    }
    STAMP(6)
#if GU_MULTICAST
    // The cluster's programs share this input (unsplit tiles: all of r_mid): each asks for
    // every 8th row once, multicast into all peers' X, so L2 serves it once a cluster.
    if (threadIdx.x == 0) mbar_expect(&bars[3], num_rows * GU_BK * sizeof(elem_t));
    for (int i = threadIdx.x; i < (ROWS - num_rows) * GU_BK / 8; i += THREADS) {
      const int m = num_rows + i / (GU_BK / 8), v = i % (GU_BK / 8);
      *reinterpret_cast<uint4*>(region_x + m * (GU_BK * 2 + 16) + v * 16) = make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      for (int m = o_split + threadIdx.x * O_KS; m < num_rows; m += 32 * O_KS) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1], %2, [%3], %4;"
            :: "r"(smem_addr(region_x + m * (GU_BK * 2 + 16))), "l"(r_mid + (long long)m * H),
               "r"(GU_BK * 2), "r"(smem_addr(&bars[3])), "h"((unsigned short)((1 << O_KS) - 1))
            : "memory");
      }
    }
#else
    load_rows_async(region_x, r_mid, H, gu_split * GU_BK, GU_BK, num_rows);
#endif
    {  // sum of the o phase's square parts, 8 groups of parts then the groups in order
      const int m = threadIdx.x & 31, grp = threadIdx.x >> 5;
      float s = 0.f;
      for (int p = grp; p < O_NT * O_KS; p += THREADS / 32) s += __ldcg(sq_mid + p * ROWS + m);
      scratch[grp * ROWS + m] = s;
    }
#if GU_MULTICAST
    mbar_wait(&bars[3]);
#else
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
    __syncthreads();
    STAMP(7)
    if (threadIdx.x < ROWS) {
      float s = 0.f;
      for (int gi = 0; gi < THREADS / 32; ++gi) s += scratch[gi * ROWS + threadIdx.x];
      scale[threadIdx.x] = rsqrtf(s / H + eps);
    }
    if (COPY) mbar_wait(&bars[1]);
    STAMP(8)
    // Unsplit tiles keep their partials in shared memory (over X, once every warp is done
    // with it); split ones exchange them through L2.
    float* tile_part;
    if (GU_KS == 1) {
      tile_part = reinterpret_cast<float*>(region_x);
      tile_product(region_b, region_x, GU_BK, 2 * GU_BF, GU_KH, tile_part, true);
      __syncthreads();
    } else {
      tile_product(region_b, region_x, GU_BK, 2 * GU_BF, GU_KH,
                   part_gu + (long long)b * GU_KH * 2 * GU_BF * ROWS, false);
      arrive_and_wait(&cnt_gu[gu_tile], GU_KS);
      tile_part = part_gu + (long long)gu_tile * GU_KS * GU_KH * 2 * GU_BF * ROWS;
    }
    STAMP(9)
    const int m = threadIdx.x & 31;
    const float s_m = scale[m];
    for (int j = gu_split + (threadIdx.x >> 5) * GU_KS; j < GU_BF; j += GU_KS * (THREADS / 32)) {
      float g = 0.f, u = 0.f;
      for (int sp = 0; sp < GU_KS * GU_KH; ++sp) {
        const float* gp = tile_part + ((long long)sp * 2 * GU_BF + j) * ROWS + m;
        g += GU_KS == 1 ? gp[0] : __ldcg(gp);
        u += GU_KS == 1 ? gp[GU_BF * ROWS] : __ldcg(gp + GU_BF * ROWS);
      }
      if (m < num_rows) {
        const float gate = rnd(g * s_m), up = rnd(u * s_m);
        const float silu = rnd(gate / (1.f + expf(-gate)));
        act[(long long)m * I + gu_tile * GU_BF + j] = from_f(silu * up);
      }
    }
  }
  const u64 gu_arrival = arrive(done_gu);
  STAMP(10)

  // ---- down projection + residual -> r_out, squares of r_out ----
  if (has_d) {
    wait_for(done_gu, (gu_arrival / gridDim.x + 1) * gridDim.x);
    if (WEIGHTS_MODE == 1) {
      if (threadIdx.x == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        mbar_expect(&bars[2], D_BN * D_BK * sizeof(elem_t));
      }
      __syncthreads();
      if (threadIdx.x < 32)
        copy_tile(region_a, w_d, I, d_split * D_BK, D_BK, D_BN, d_tile * D_BN, D_BN, 0, &bars[2]);
    }
    STAMP(11)
    load_rows(region_x, act, I, d_split * D_BK, D_BK, num_rows);
    __syncthreads();
    STAMP(12)
    if (COPY) mbar_wait(&bars[2]);
    STAMP(13)
#if CLUSTER
    tile_product(region_a, region_x, D_BK, D_BN, D_KH, reinterpret_cast<float*>(region_x), true);
    cluster_sync();
    STAMP(14)
    merge_residual<true>(reinterpret_cast<float*>(region_x), D_KS, D_KH, d_split, D_BN,
                         d_tile * D_BN, r_mid, H, r_out, H, sq_out, SQ_STRIDE, b, num_rows,
                         scratch);
#else
    float* my_part = part_d + (long long)b * D_KH * D_BN * ROWS;
    tile_product(region_a, region_x, D_BK, D_BN, D_KH, my_part, false);
    if (D_KS > 1) arrive_and_wait(&cnt_d[d_tile], D_KS);
    else __syncthreads();
    STAMP(14)
    merge_residual<false>(part_d + (long long)d_tile * D_KS * D_KH * D_BN * ROWS, D_KS, D_KH,
                          d_split, D_BN, d_tile * D_BN, r_mid, H, r_out, H, sq_out, SQ_STRIDE,
                          b, num_rows, scratch);
#endif
  }
#if CLUSTER
  cluster_sync();  // no program leaves while a peer may still read its partial
#endif
  STAMP(15)
}
"""
