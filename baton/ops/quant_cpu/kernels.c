/* The CPU kernels of baton.ops.quant_cpu: matmuls on GGUF Q4_1 / Q8_0 weights kept in their block format, and the
 * decode step of a Llama decoder layer on them, all in fp32 (no activation is rounded to a lower precision).
 *
 * Built at first use by baton/ops/quant_cpu/native.py with the system C compiler (-O3 -march=native) into baton's
 * cache directory and loaded with ctypes. Three code paths chosen at compile time: AVX-512, AVX2 + FMA + F16C, and
 * portable C (any other CPU); BQ_NO_AVX512 / BQ_NO_AVX2 force the narrower ones (the tests build all three). Every
 * path computes what the plain-PyTorch references of naive.py compute.
 *
 * Threads: a pool of its own (pthreads), not OpenMP. Each parallel step ("job") is cut into small chunks that any
 * thread claims from one atomic counter; the calling thread works too and waits only for chunks already claimed. A
 * worker that the OS has descheduled (a busy machine: other processes on the cores) therefore delays nothing until
 * it holds a chunk, where a barrier would wait for it at every step; at worst the caller does all the work itself.
 * Idle workers spin briefly, then sleep on a futex.
 *
 * Layout ("x4", repacked once at load from the file's blocks, the same bytes per weight as the file): the rows are
 * grouped by 4 (the last group zero-padded) and each group is one contiguous run of memory, its scales first, so a
 * tile of 4 rows reads one sequential stream (decode is bound by the bytes read per token). With B = K / 32 blocks:
 *   Q4_1: B x 16 bytes (per block: fp16 d of the 4 rows, fp16 m of the 4 rows), then B x 64 bytes (per block: the 4
 *         rows' 16 code bytes, as the file has them: weight j < 16 of the block in the low nibble of byte j,
 *         weight j >= 16 in the high nibble of byte j - 16); w = d q + m.
 *   Q8_0: B x 8 bytes (per block: fp16 d of the 4 rows), then B x 128 bytes (the 4 rows' 32 int8 codes); w = d q.
 * d * q is exact in fp32 (an 11-bit by 4- or 8-bit product), so fma(q, d, m) rounds d q + m once, as the reference's
 * q * d + m does: every kernel multiplies x by the dequantised fp32 weights bit for bit; only the order of the sums
 * differs from x @ W.T. A row's sum is computed in the same order whatever the number of rows of x (up to the GEMV
 * limit) and the thread that computes it, so a verify row equals the decode row bit for bit.
 *
 * Q4_1 on AVX-512 dequantises through a table: per block and row t = d * [0..15] + m (one FMA); the block's 16 code
 * bytes are broadcast to the four 128-bit lanes and shifted per lane (vpsrlvd) so that vpermps picks the low (then
 * the high) nibbles as 16 weights: 7 vector ops per 32 weights, two of them on the shuffle port. That puts weight
 * 4 (L % 4) + L / 4 in lane L, so x is permuted the same way once per call (xperm). */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) && !defined(BQ_NO_AVX512)
#define BQ_ISA 3
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(BQ_NO_AVX2)
#define BQ_ISA 2
#include <immintrin.h>
#else
#define BQ_ISA 0
#endif

#define BQ_INLINE static inline __attribute__((always_inline))
#define BQ_UNROLL _Pragma("GCC unroll 8") /* the loops over the rows of a register tile: all in registers */
#define MC 4 /* rows of x per register tile */
#define MT 6 /* AVX-512: up to this many rows of x take one direct tile (4 x 6 accumulators); out arrays [NR][MT] */
#define NR 4 /* rows of W per group (the layout) */
#define Q41_BYTES 80  /* bytes per block of a group: 16 of scales, 64 of codes */
#define Q80_BYTES 136 /* 8 of scales, 128 of codes */
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead in the weight stream (measured: 512 to 8192, 4096 best here) */
#endif

int bq_version(void) { return 4; }
int bq_isa(void) { return BQ_ISA; }

/* ---- the thread pool ---- */

#define MAX_THREADS 256
#define SPIN_NS 50000 /* an idle worker spins this long (50 us) for the next job, then sleeps */

typedef void (*job_fn)(void* ctx, int64_t chunk, int tid);

/* state: generation (24 bits) | chunks (20 bits) | next chunk (20 bits), so that a claim is checked against the
 * job it was meant for in one compare-and-swap */
#define GEN_SHIFT 40
#define N_SHIFT 20
#define FIELD ((1ull << 20) - 1)

static struct {
    _Atomic uint64_t state;
    _Atomic int64_t done;
    _Atomic uint32_t wake; /* futex word: bumped with every job */
    _Atomic int sleeping, stop;
    job_fn fn;
    void* ctx;
    int workers; /* threads besides the caller */
    pthread_t th[MAX_THREADS];
    pthread_mutex_t lock; /* serialises callers (one job at a time) and pool resizes */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void futex_wait(_Atomic uint32_t* word, uint32_t seen) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    (void)word, (void)seen;
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
#endif
}

static void futex_wake_all(_Atomic uint32_t* word) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* claim and run chunks of the job of generation gen until none is left */
static void run_chunks(uint64_t gen, int tid) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool.state, memory_order_acquire);
        if ((v >> GEN_SHIFT) != gen || (v & FIELD) >= ((v >> N_SHIFT) & FIELD)) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.state, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        pool.fn(pool.ctx, (int64_t)(v & FIELD), tid); /* stable: the job cannot end before this chunk is done */
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void* worker(void* arg) {
    const int tid = (int)(intptr_t)arg;
    uint64_t seen = atomic_load(&pool.state) >> GEN_SHIFT;
    for (;;) {
        int64_t t0 = 0;
        for (int spins = 0;; spins++) {
            if (atomic_load_explicit(&pool.stop, memory_order_relaxed)) return NULL;
            const uint64_t gen = atomic_load_explicit(&pool.state, memory_order_acquire) >> GEN_SHIFT;
            if (gen != seen) {
                seen = gen;
                break;
            }
            if ((spins & 63) == 63) {
                sched_yield(); /* a busy machine: let a runnable thread (the caller, say) have this core */
                if (!t0) t0 = now_ns();
                if (now_ns() - t0 > SPIN_NS) {
                    const uint32_t w = atomic_load(&pool.wake);
                    atomic_fetch_add(&pool.sleeping, 1);
                    if ((atomic_load(&pool.state) >> GEN_SHIFT) == seen && !atomic_load(&pool.stop))
                        futex_wait(&pool.wake, w);
                    atomic_fetch_sub(&pool.sleeping, 1);
                    t0 = 0;
                }
            }
            cpu_relax();
        }
        run_chunks(seen, tid);
    }
}

static void pool_stop(void) {
    atomic_store(&pool.stop, 1);
    atomic_fetch_add(&pool.wake, 1);
    futex_wake_all(&pool.wake);
    for (int i = 0; i < pool.workers; i++) pthread_join(pool.th[i], NULL);
    pool.workers = 0;
    atomic_store(&pool.stop, 0);
}

/* Threads the kernels use, the caller included (default 1). */
int bq_set_threads(int n) {
    n = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    pthread_mutex_lock(&pool.lock);
    if (n - 1 != pool.workers) {
        pool_stop();
        for (int i = 0; i < n - 1; i++) {
            if (pthread_create(&pool.th[i], NULL, worker, (void*)(intptr_t)(i + 1))) break;
            pool.workers = i + 1;
        }
    }
    const int got = pool.workers + 1;
    pthread_mutex_unlock(&pool.lock);
    return got;
}

int bq_threads(void) { return pool.workers + 1; }

/* fn(ctx, c, tid) for every chunk c < n, over the pool; tid < bq_threads() (0: the caller). Returns when all are
 * done. One job at a time (callers from several threads queue on the lock). */
static void run_job(job_fn fn, void* ctx, int64_t n) {
    if (n <= 0) return;
    pthread_mutex_lock(&pool.lock);
    if (pool.workers == 0 || n == 1) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c, 0);
        pthread_mutex_unlock(&pool.lock);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const uint64_t gen = ((atomic_load(&pool.state) >> GEN_SHIFT) + 1) & ((1ull << 24) - 1);
    atomic_store_explicit(&pool.state, (gen << GEN_SHIFT) | ((uint64_t)n << N_SHIFT), memory_order_release);
    atomic_fetch_add(&pool.wake, 1);
    if (atomic_load(&pool.sleeping)) futex_wake_all(&pool.wake);
    run_chunks(gen, 0);
    for (int spins = 1; atomic_load_explicit(&pool.done, memory_order_acquire) < n; spins++) {
        cpu_relax(); /* the chunks other threads hold; yield now and then, in case their thread waits for a core */
        if ((spins & 255) == 0) sched_yield();
    }
    pthread_mutex_unlock(&pool.lock);
}

#define MAX_CHUNKS ((int64_t)FIELD)

/* ---- an optional per-phase profile of the calls (bq_profile): wall time on the calling thread ---- */

enum { P_NORM, P_QKV, P_ROPE, P_ATTN, P_O, P_MLP, P_DOWN, P_Q4_LINEAR, P_Q8_LINEAR, P_DEQUANT, P_ARGMAX, P_N };
static const char* const prof_names[P_N] = {
    "rmsnorm + rope angles + x permute", "q/k/v GEMV", "rope + cache write", "attention", "o_proj GEMV + residual",
    "gate/up GEMV + silu*up", "down GEMV + residual", "q4_1 linear (outside layers)", "q8_0 linear (lm_head)",
    "dequantise (prefill sgemm)", "argmax"};
static int prof_on;
static int64_t prof_ns[P_N], prof_calls[P_N];

#define PROF_BEGIN(p) const int64_t prof_t0_##p = prof_on ? now_ns() : 0
#define PROF_END(p)                              \
    do {                                         \
        if (prof_on) {                           \
            prof_ns[p] += now_ns() - prof_t0_##p; \
            prof_calls[p]++;                     \
        }                                        \
    } while (0)

/* on != 0: start (and zero) the profile; 0: stop it. */
void bq_profile(int on) {
    if (on) {
        memset(prof_ns, 0, sizeof prof_ns);
        memset(prof_calls, 0, sizeof prof_calls);
    }
    prof_on = on;
}

/* Phase i of the profile: its name, and the nanoseconds and calls so far (NULL past the last phase). */
const char* bq_profile_entry(int i, int64_t* ns, int64_t* calls) {
    if (i < 0 || i >= P_N) return NULL;
    *ns = prof_ns[i];
    *calls = prof_calls[i];
    return prof_names[i];
}

static float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        uint32_t mm = man;
        do {
            e++;
            mm <<= 1;
        } while (!(mm & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mm & 1023) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* n fp16 -> fp32 (the scales of one group of rows, once per tile) */
static void scales_to_fp32(const uint8_t* src, int64_t stride, int per, int blocks, float* dst) {
    for (int b = 0; b < blocks; b++) {
        const uint8_t* s = src + (int64_t)b * stride;
#if BQ_ISA >= 2
        if (per == 8) {
            _mm256_storeu_ps(dst + b * 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)));
            continue;
        }
        if (per == 4) {
            _mm_storeu_ps(dst + b * 4, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)s)));
            continue;
        }
#endif
        for (int i = 0; i < per; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[b * per + i] = fp16_to_fp32(h);
        }
    }
}

#if BQ_ISA == 3
BQ_INLINE float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#elif BQ_ISA == 2
BQ_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The rows of x as the Q4_1 kernel reads them (AVX-512: lanes permuted, see the top): a copy in buf, or x itself. */
static const float* q41_x(const float* x, int64_t ldx, int M, int K, float* buf) {
#if BQ_ISA == 3
    for (int r = 0; r < M; r++)
        for (int k0 = 0; k0 < K; k0 += 16)
            for (int L = 0; L < 16; L++) buf[(int64_t)r * K + k0 + L] = x[r * ldx + k0 + 4 * (L % 4) + L / 4];
    return buf;
#else
    (void)M, (void)K, (void)buf, (void)ldx;
    return x;
#endif
}

/* Two ways to multiply a group of 4 rows of W by up to MC rows of x, with the same arithmetic (the same fp32
 * weights, the same FMAs in the same order, so the same bits):
 *   direct (AVX-512, M <= MT: decode, short verifies): each block is dequantised in registers and used at once;
 *   buffered (more rows, and every M on the other ISAs): the group is dequantised once into wb [4][K], which the
 *   tiles of MC rows of x then read (L1-resident), so dequantisation is paid once per group, not per MC rows. */

BQ_INLINE void store_out(const float out[NR][MT], int mc, int64_t g, int N, float* y, int64_t ldy, const float* res,
                         int64_t ldr) {
    for (int i = 0; i < NR; i++) {
        const int64_t n = g * NR + i;
        if (n >= N) break;
        for (int r = 0; r < mc; r++) y[r * ldy + n] = res ? res[r * ldr + n] + out[i][r] : out[i][r];
    }
}

#if BQ_ISA == 3
#define Q41_SETUP                                                                                      \
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);          \
    const __m512i sh_lo = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24); \
    const __m512i sh_hi = _mm512_add_epi32(sh_lo, _mm512_set1_epi32(4))
/* the 32 weights of row i of the block at t (codes) as (wl, wh): lanes in the xperm order */
#define Q41_DEQ(t, b, i, wl, wh)                                                                                  \
    const __m512 tb_ = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[(b) * 8 + (i)]), _mm512_set1_ps(sc[(b) * 8 + 4 + (i)])); \
    const __m512i v_ = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)((t) + 16 * (i))));               \
    const __m512 wl = _mm512_permutexvar_ps(_mm512_srlv_epi32(v_, sh_lo), tb_);                                  \
    const __m512 wh = _mm512_permutexvar_ps(_mm512_srlv_epi32(v_, sh_hi), tb_)
#define Q80_DEQ(t, b, i, wl, wh)                                                                                  \
    const __m512 dv_ = _mm512_set1_ps(sc[(b) * 4 + (i)]);                                                        \
    const __m512 wl = _mm512_mul_ps(                                                                              \
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((t) + 32 * (i))))), dv_);     \
    const __m512 wh = _mm512_mul_ps(                                                                              \
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((t) + 32 * (i) + 16)))), dv_)

/* direct tiles: y[r][n] (+)= sum_k x[r][k] w[n][k] for rows r < mc (<= MT) of x and the 4 rows of group g */
BQ_INLINE void q41_tile(const float* x, int64_t ldx, int mc, int K, const uint8_t* w, int64_t g, int N, float* y,
                        int64_t ldy, const float* res, int64_t ldr, float* sc) {
    const int B = K / 32;
    const uint8_t* t = w + (size_t)g * B * Q41_BYTES + (size_t)B * 16; /* the codes; the scales before them */
    float out[NR][MT];
    Q41_SETUP;
    scales_to_fp32(t - (size_t)B * 16, 16, 8, B, sc); /* sc[b * 8 + i] = d_i, sc[b * 8 + 4 + i] = m_i */
    __m512 acc[NR][MT];
    BQ_UNROLL
    for (int i = 0; i < NR; i++)
        BQ_UNROLL
        for (int r = 0; r < mc; r++) acc[i][r] = _mm512_setzero_ps();
    for (int b = 0; b < B; b++, t += 64) {
        _mm_prefetch((const char*)t + PREFETCH, _MM_HINT_T0);
        BQ_UNROLL
        for (int i = 0; i < NR; i++) {
            Q41_DEQ(t, b, i, wl, wh);
            BQ_UNROLL
            for (int r = 0; r < mc; r++) {
                const float* xr = x + r * ldx + b * 32;
                acc[i][r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xr), acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xr + 16), acc[i][r]);
            }
        }
    }
    BQ_UNROLL
    for (int i = 0; i < NR; i++)
        BQ_UNROLL
        for (int r = 0; r < mc; r++) out[i][r] = hsum(acc[i][r]);
    store_out(out, mc, g, N, y, ldy, res, ldr);
}

BQ_INLINE void q80_tile(const float* x, int64_t ldx, int mc, int K, const uint8_t* w, int64_t g, int N, float* y,
                        int64_t ldy, float* sc) {
    const int B = K / 32;
    const uint8_t* t = w + (size_t)g * B * Q80_BYTES + (size_t)B * 8;
    float out[NR][MT];
    scales_to_fp32(t - (size_t)B * 8, 8, 4, B, sc); /* sc[b * 4 + i] = d_i */
    __m512 acc[NR][MT];
    BQ_UNROLL
    for (int i = 0; i < NR; i++)
        BQ_UNROLL
        for (int r = 0; r < mc; r++) acc[i][r] = _mm512_setzero_ps();
    for (int b = 0; b < B; b++, t += 128) {
        _mm_prefetch((const char*)t + PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char*)t + PREFETCH + 64, _MM_HINT_T0);
        BQ_UNROLL
        for (int i = 0; i < NR; i++) {
            Q80_DEQ(t, b, i, wl, wh);
            BQ_UNROLL
            for (int r = 0; r < mc; r++) {
                const float* xr = x + r * ldx + b * 32;
                acc[i][r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xr), acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xr + 16), acc[i][r]);
            }
        }
    }
    BQ_UNROLL
    for (int i = 0; i < NR; i++)
        BQ_UNROLL
        for (int r = 0; r < mc; r++) out[i][r] = hsum(acc[i][r]);
    store_out(out, mc, g, N, y, ldy, NULL, 0);
}
#endif

/* group g of a Q4_1 / Q8_0 matrix -> wb [4][K] (AVX-512 Q4_1: each block's lanes in the xperm order) */
static void q41_group_to_buf(const uint8_t* w, int64_t g, int K, float* sc, float* wb) {
    const int B = K / 32;
    const uint8_t* t = w + (size_t)g * B * Q41_BYTES + (size_t)B * 16;
    scales_to_fp32(t - (size_t)B * 16, 16, 8, B, sc);
#if BQ_ISA == 3
    Q41_SETUP;
#endif
    for (int b = 0; b < B; b++, t += 64) {
        for (int i = 0; i < NR; i++) {
            float* o = wb + (int64_t)i * K + b * 32;
#if BQ_ISA == 3
            Q41_DEQ(t, b, i, wl, wh);
            _mm512_storeu_ps(o, wl);
            _mm512_storeu_ps(o + 16, wh);
#else
            const uint8_t* c = t + 16 * i;
            for (int j = 0; j < 16; j++) {
                o[j] = fmaf((float)(c[j] & 15), sc[b * 8 + i], sc[b * 8 + 4 + i]);
                o[16 + j] = fmaf((float)(c[j] >> 4), sc[b * 8 + i], sc[b * 8 + 4 + i]);
            }
#endif
        }
    }
}

static void q80_group_to_buf(const uint8_t* w, int64_t g, int K, float* sc, float* wb) {
    const int B = K / 32;
    const uint8_t* t = w + (size_t)g * B * Q80_BYTES + (size_t)B * 8;
    scales_to_fp32(t - (size_t)B * 8, 8, 4, B, sc);
    for (int b = 0; b < B; b++, t += 128) {
        for (int i = 0; i < NR; i++) {
            float* o = wb + (int64_t)i * K + b * 32;
#if BQ_ISA == 3
            Q80_DEQ(t, b, i, wl, wh);
            _mm512_storeu_ps(o, wl);
            _mm512_storeu_ps(o + 16, wh);
#else
            const int8_t* c = (const int8_t*)(t + 32 * i);
            for (int j = 0; j < 32; j++) o[j] = (float)c[j] * sc[b * 4 + i];
#endif
        }
    }
}

/* buffered tile: the rows of group g from wb [4][K] times rows r < mc of x */
BQ_INLINE void buf_tile(const float* x, int64_t ldx, int mc, int K, const float* wb, int64_t g, int N, float* y,
                        int64_t ldy, const float* res, int64_t ldr) {
    const int B = K / 32;
    float out[NR][MT];
#if BQ_ISA == 3
    __m512 acc[NR][MC];
    for (int i = 0; i < NR; i++)
        for (int r = 0; r < mc; r++) acc[i][r] = _mm512_setzero_ps();
    for (int b = 0; b < B; b++) {
        for (int i = 0; i < NR; i++) {
            const __m512 wl = _mm512_loadu_ps(wb + (int64_t)i * K + b * 32);
            const __m512 wh = _mm512_loadu_ps(wb + (int64_t)i * K + b * 32 + 16);
            for (int r = 0; r < mc; r++) {
                const float* xr = x + r * ldx + b * 32;
                acc[i][r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xr), acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xr + 16), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int r = 0; r < mc; r++) out[i][r] = hsum(acc[i][r]);
#elif BQ_ISA == 2
    __m256 acc[NR][MC];
    for (int i = 0; i < NR; i++)
        for (int r = 0; r < mc; r++) acc[i][r] = _mm256_setzero_ps();
    for (int b = 0; b < B; b++) {
        for (int i = 0; i < NR; i++) {
            const float* wr = wb + (int64_t)i * K + b * 32;
            const __m256 w0 = _mm256_loadu_ps(wr), w1 = _mm256_loadu_ps(wr + 8), w2 = _mm256_loadu_ps(wr + 16),
                         w3 = _mm256_loadu_ps(wr + 24);
            for (int r = 0; r < mc; r++) {
                const float* xr = x + r * ldx + b * 32;
                __m256 a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[i][r]);
                a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a);
                a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a);
                acc[i][r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int r = 0; r < mc; r++) out[i][r] = hsum(acc[i][r]);
#else
    float acc[NR][MC][16];
    memset(acc, 0, sizeof acc);
    for (int b = 0; b < B; b++) {
        for (int i = 0; i < NR; i++) {
            const float* wr = wb + (int64_t)i * K + b * 32;
            for (int r = 0; r < mc; r++) {
                const float* xr = x + r * ldx + b * 32;
                for (int j = 0; j < 16; j++) {
                    acc[i][r][j] = fmaf(wr[j], xr[j], acc[i][r][j]);
                    acc[i][r][j] = fmaf(wr[16 + j], xr[16 + j], acc[i][r][j]);
                }
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int r = 0; r < mc; r++) {
            float s = 0;
            for (int j = 0; j < 16; j++) s += acc[i][r][j];
            out[i][r] = s;
        }
#endif
    store_out(out, mc, g, N, y, ldy, res, ldr);
}

static void buf_tiles(const float* x, int64_t ldx, int M, int K, const float* wb, int64_t g, int N, float* y,
                      int64_t ldy, const float* res, int64_t ldr) {
    for (int r0 = 0; r0 < M; r0 += MC) {
        const int mc = M - r0 < MC ? M - r0 : MC;
        const float* xr = x + r0 * ldx;
        float* yr = y + r0 * ldy;
        const float* rr = res ? res + r0 * ldr : NULL;
        switch (mc) { /* constant tile shapes: the compiler unrolls each */
            case 1: buf_tile(xr, ldx, 1, K, wb, g, N, yr, ldy, rr, ldr); break;
            case 2: buf_tile(xr, ldx, 2, K, wb, g, N, yr, ldy, rr, ldr); break;
            case 3: buf_tile(xr, ldx, 3, K, wb, g, N, yr, ldy, rr, ldr); break;
            default: buf_tile(xr, ldx, 4, K, wb, g, N, yr, ldy, rr, ldr); break;
        }
    }
}

/* Groups [g0, g1) of y = x @ W.T (+ res) for M rows (x as q41_x returns it); sc: 8 * K / 32 floats, wb: 4 * K. */
static void q41_groups(const float* x, int64_t ldx, int M, int K, const uint8_t* w, int N, int64_t g0, int64_t g1,
                       float* y, int64_t ldy, const float* res, int64_t ldr, float* sc, float* wb) {
    for (int64_t g = g0; g < g1; g++) {
#if BQ_ISA == 3
        if (M <= MT) {
            switch (M) { /* constant tile shapes: the compiler unrolls each into registers */
                case 1: q41_tile(x, ldx, 1, K, w, g, N, y, ldy, res, ldr, sc); break;
                case 2: q41_tile(x, ldx, 2, K, w, g, N, y, ldy, res, ldr, sc); break;
                case 3: q41_tile(x, ldx, 3, K, w, g, N, y, ldy, res, ldr, sc); break;
                case 4: q41_tile(x, ldx, 4, K, w, g, N, y, ldy, res, ldr, sc); break;
                case 5: q41_tile(x, ldx, 5, K, w, g, N, y, ldy, res, ldr, sc); break;
                default: q41_tile(x, ldx, 6, K, w, g, N, y, ldy, res, ldr, sc); break;
            }
            continue;
        }
#endif
        q41_group_to_buf(w, g, K, sc, wb);
        buf_tiles(x, ldx, M, K, wb, g, N, y, ldy, res, ldr);
    }
}

static void q80_groups(const float* x, int64_t ldx, int M, int K, const uint8_t* w, int N, int64_t g0, int64_t g1,
                       float* y, int64_t ldy, float* sc, float* wb) {
    for (int64_t g = g0; g < g1; g++) {
#if BQ_ISA == 3
        if (M <= MT) {
            switch (M) {
                case 1: q80_tile(x, ldx, 1, K, w, g, N, y, ldy, sc); break;
                case 2: q80_tile(x, ldx, 2, K, w, g, N, y, ldy, sc); break;
                case 3: q80_tile(x, ldx, 3, K, w, g, N, y, ldy, sc); break;
                case 4: q80_tile(x, ldx, 4, K, w, g, N, y, ldy, sc); break;
                case 5: q80_tile(x, ldx, 5, K, w, g, N, y, ldy, sc); break;
                default: q80_tile(x, ldx, 6, K, w, g, N, y, ldy, sc); break;
            }
            continue;
        }
#endif
        q80_group_to_buf(w, g, K, sc, wb);
        buf_tiles(x, ldx, M, K, wb, g, N, y, ldy, NULL, 0);
    }
}

/* ---- entry points: repacking, matmuls, dequantisation, rows ---- */

/* y [M][N] = x [M][K] @ dequantize(W).T (+ res [M][N] when res is not NULL); threads split the row groups. */
/* per thread: the scales of one group (8 * K / 32 floats) and one dequantised group (4 * K) */
#define THREAD_FLOATS(K) ((int64_t)(K) / 4 + (int64_t)NR * (K))

/* One matmul as a job: chunk c is row groups [c * per, (c + 1) * per). */
typedef struct {
    int q8; /* 0: Q4_1, 1: Q8_0 */
    const float* x;
    int64_t ldx;
    int M, K, N;
    const uint8_t* w;
    float* y;
    int64_t ldy;
    const float* res;
    int64_t ldr;
    int64_t per, groups;
    float* thread_buf; /* [threads][stride]: each thread's scales and dequantised group (THREAD_FLOATS(K)) */
    int64_t stride;
} mm_job;

static void mm_chunk(void* p, int64_t c, int tid) {
    const mm_job* j = p;
    const int64_t g0 = c * j->per, g1 = g0 + j->per < j->groups ? g0 + j->per : j->groups;
    float* sc = j->thread_buf + (int64_t)tid * j->stride;
    if (j->q8)
        q80_groups(j->x, j->ldx, j->M, j->K, j->w, j->N, g0, g1, j->y, j->ldy, sc, sc + j->K / 4);
    else
        q41_groups(j->x, j->ldx, j->M, j->K, j->w, j->N, g0, g1, j->y, j->ldy, j->res, j->ldr, sc, sc + j->K / 4);
}

/* groups per chunk: about 64 K-long rows (a few microseconds of work) per chunk */
static int64_t chunk_groups(int64_t groups, int K, int M) {
    int64_t per = (int64_t)16 * 576 / ((int64_t)K * (M < 4 ? M : 4));
    per = per < 1 ? 1 : per;
    while ((groups + per - 1) / per > MAX_CHUNKS) per *= 2;
    return per;
}

static void run_mm(mm_job* j) {
    j->groups = (j->N + NR - 1) / NR;
    j->per = chunk_groups(j->groups, j->K, j->M);
    run_job(mm_chunk, j, (j->groups + j->per - 1) / j->per);
}

/* y [M][N] = x [M][K] @ dequantize(W).T (+ res [M][N] when res is not NULL). 1: out of memory. */
int bq_q4_1_linear(const float* x, int M, int K, const uint8_t* w, int N, float* y, const float* res) {
    const int nt = bq_threads();
    float* buf = malloc(sizeof(float) * ((size_t)M * K + (size_t)nt * THREAD_FLOATS(K)));
    if (!buf) return 1;
    PROF_BEGIN(P_Q4_LINEAR);
    mm_job j = {0, q41_x(x, K, M, K, buf), K, M, K, N, w, y, N, res, N, 0, 0, buf + (size_t)M * K, THREAD_FLOATS(K)};
    run_mm(&j);
    PROF_END(P_Q4_LINEAR);
    free(buf);
    return 0;
}

int bq_q8_0_linear(const float* x, int M, int K, const uint8_t* w, int N, float* y) {
    float* buf = malloc(sizeof(float) * (size_t)bq_threads() * THREAD_FLOATS(K));
    if (!buf) return 1;
    PROF_BEGIN(P_Q8_LINEAR);
    mm_job j = {1, x, K, M, K, N, w, y, N, NULL, 0, 0, 0, buf, THREAD_FLOATS(K)};
    run_mm(&j);
    PROF_END(P_Q8_LINEAR);
    free(buf);
    return 0;
}

/* out [N][K] fp32 = the dequantised rows of W (prefill: the matrix of one sgemm, a transient buffer) */
typedef struct {
    int q8, N, K;
    const uint8_t* w;
    float* out;
} dq_job;

static void dq_chunk(void* p, int64_t g, int tid) {
    (void)tid;
    const dq_job* j = p;
    const int B = j->K / 32, K = j->K, N = j->N;
    for (int b = 0; b < B; b++) {
        float sc[8];
        if (j->q8) {
            const uint8_t* base = j->w + (size_t)g * B * Q80_BYTES;
            scales_to_fp32(base + (size_t)b * 8, 8, 4, 1, sc);
            for (int i = 0; i < NR && g * NR + i < N; i++) {
                const int8_t* c = (const int8_t*)(base + (size_t)B * 8 + (size_t)b * 128 + 32 * i);
                float* o = j->out + (size_t)(g * NR + i) * K + b * 32;
                for (int e = 0; e < 32; e++) o[e] = (float)c[e] * sc[i];
            }
            continue;
        }
        const uint8_t* base = j->w + (size_t)g * B * Q41_BYTES;
        scales_to_fp32(base + (size_t)b * 16, 16, 8, 1, sc);
        for (int i = 0; i < NR && g * NR + i < N; i++) {
            const uint8_t* c = base + (size_t)B * 16 + (size_t)b * 64 + 16 * i;
            float* o = j->out + (size_t)(g * NR + i) * K + b * 32;
#if BQ_ISA == 3
            const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512 tb = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[i]), _mm512_set1_ps(sc[4 + i]));
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c));
            _mm512_storeu_ps(o, _mm512_permutexvar_ps(v, tb));
            _mm512_storeu_ps(o + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tb));
#else
            for (int e = 0; e < 16; e++) {
                o[e] = fmaf((float)(c[e] & 15), sc[i], sc[4 + i]);
                o[16 + e] = fmaf((float)(c[e] >> 4), sc[i], sc[4 + i]);
            }
#endif
        }
    }
}

void bq_q4_1_dequant(const uint8_t* w, int N, int K, float* out) {
    PROF_BEGIN(P_DEQUANT);
    dq_job j = {0, N, K, w, out};
    run_job(dq_chunk, &j, (N + NR - 1) / NR);
    PROF_END(P_DEQUANT);
}

void bq_q8_0_dequant(const uint8_t* w, int N, int K, float* out) {
    PROF_BEGIN(P_DEQUANT);
    dq_job j = {1, N, K, w, out};
    run_job(dq_chunk, &j, (N + NR - 1) / NR);
    PROF_END(P_DEQUANT);
}

int bq_q8_0_rows(const int64_t* ids, int n, const uint8_t* w, int N, int K, float* out) {
    const int B = K / 32;
    for (int r = 0; r < n; r++) {
        if (ids[r] < 0 || ids[r] >= N) return 1;
    }
    for (int r = 0; r < n; r++) {
        const int64_t g = ids[r] / NR, i = ids[r] % NR;
        const uint8_t* base = w + (size_t)g * B * Q80_BYTES;
        for (int b = 0; b < B; b++) {
            uint16_t h;
            memcpy(&h, base + (size_t)b * 8 + 2 * i, 2);
            const float dd = fp16_to_fp32(h);
            const int8_t* c = (const int8_t*)(base + (size_t)B * 8 + (size_t)b * 128 + 32 * i);
            for (int j = 0; j < 32; j++) out[(size_t)r * K + b * 32 + j] = (float)c[j] * dd;
        }
    }
    return 0;
}

/* ---- the decode step of a Llama layer (a few rows: decode, verify, drafts) ---- */

#if BQ_ISA == 3
/* exp(x) for the softmax and SiLU: Cephes' polynomial on [-ln2/2, ln2/2] times 2^n, ~1 ulp. */
BQ_INLINE __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.72283f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

static void exp_inplace(float* v, int n) {
    int i = 0;
#if BQ_ISA == 3
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, exp512(_mm512_loadu_ps(v + i)));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(v + i, k, exp512(_mm512_maskz_loadu_ps(k, v + i)));
        i = n;
    }
#endif
    for (; i < n; i++) v[i] = expf(v[i]);
}

/* y = weight * (x * rsqrt(mean(x^2) + eps)) over a row of K */
static void rms_norm_row(const float* x, const float* w, float eps, int K, float* y) {
    float ss = 0;
    for (int k = 0; k < K; k++) ss += x[k] * x[k];
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    for (int k = 0; k < K; k++) y[k] = w[k] * (x[k] * r);
}

static float dot(const float* a, const float* b, int n) {
    int i = 0;
    float s = 0;
#if BQ_ISA == 3
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = hsum(acc);
#elif BQ_ISA == 2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = hsum(acc);
#else
    float acc[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; j++) s += acc[j];
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    float eps_in, eps_post, scale;
    const float *norm_in, *norm_post, *inv_freq;
    const uint8_t *qkv, *o, *gu, *dn; /* x4 Q4_1 weights */
} bq_layer;

static int64_t layer_max_k(const bq_layer* L) {
    int64_t k = L->hidden;
    if (L->heads * L->head_dim > k) k = L->heads * L->head_dim;
    if (L->inter > k) k = L->inter;
    return k;
}

/* Floats per thread of private scratch: the scales and the dequantised rows of one group, the attention scores. */
static int64_t layer_private(const bq_layer* L, int kv_len) { return THREAD_FLOATS(layer_max_k(L)) + kv_len + 16; }

/* Floats of scratch bq_llama_layer needs for M rows and kv_len cache rows (with the pool's threads). */
int64_t bq_layer_scratch(const bq_layer* L, int M, int kv_len) {
    const int64_t qkv = (int64_t)(L->heads + 2 * L->kv_heads) * L->head_dim;
    return (int64_t)M * (2 * L->hidden + qkv + L->heads * L->head_dim + 3 * L->inter + L->head_dim + layer_max_k(L)) +
           (int64_t)bq_threads() * layer_private(L, kv_len);
}

typedef struct {
    const bq_layer* L;
    int M;
    const int64_t* pos;
    const float *kc, *vc;
    const float* qkv;
    float* att;
    float* priv;
    int64_t priv_n;
} att_job;

#if BQ_ISA == 3
/* lane i = the sum of the 16 lanes of a[i]: four levels of pairing (30 permutes, 15 adds for 16 sums, where 16
 * separate horizontal sums take twice the shuffles) */
BQ_INLINE __m512 reduce16(const __m512 a[16]) {
    const __m512i lo = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i hi = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], lo, a[2 * i + 1]),
                             _mm512_permutex2var_ps(a[2 * i], hi, a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * i], lo, b[2 * i + 1]),
                             _mm512_permutex2var_ps(b[2 * i], hi, b[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_permutex2var_ps(c[2 * i], lo, c[2 * i + 1]),
                             _mm512_permutex2var_ps(c[2 * i], hi, c[2 * i + 1]));
    return _mm512_add_ps(_mm512_permutex2var_ps(d[0], lo, d[1]), _mm512_permutex2var_ps(d[0], hi, d[1]));
}

/* softmax(q k^T * scale) v over keys 0..S-1 of one KV head (rows `stride` floats apart), D = 16 * DC: q, the
 * running sums and the output stay in registers */
BQ_INLINE void attend_avx512(const float* q, const float* kc, const float* vc, int64_t stride, int S, float scale,
                             float* scores, float* o, const int DC) {
    __m512 qv[8], ov[2][8];
    for (int c = 0; c < DC; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    float mx = -INFINITY;
    int s0 = 0;
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    for (; s0 + 16 <= S; s0 += 16) { /* 16 keys at a time: one tree reduces their 16 partial vectors */
        __m512 a[16];
        for (int u = 0; u < 16; u++) {
            const float* k = kc + (int64_t)(s0 + u) * stride;
            a[u] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
            for (int c = 1; c < DC; c++) a[u] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a[u]);
        }
        const __m512 v = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
        _mm512_storeu_ps(scores + s0, v);
        mxv = _mm512_max_ps(mxv, v);
    }
    mx = _mm512_reduce_max_ps(mxv);
    for (int s = s0; s < S; s++) {
        const float* k = kc + (int64_t)s * stride;
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int c = 1; c < DC; c++) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
        const float v = hsum(a) * scale;
        scores[s] = v;
        mx = v > mx ? v : mx;
    }
    for (int s = 0; s < S; s++) scores[s] -= mx;
    exp_inplace(scores, S);
    float sum = 0;
    for (int s = 0; s < S; s++) sum += scores[s];
    const float inv = 1.0f / sum;
    for (int c = 0; c < DC; c++) ov[0][c] = ov[1][c] = _mm512_setzero_ps();
    int s = 0;
    for (; s + 2 <= S; s += 2) { /* two chains: the FMA latency per key halves */
        const __m512 p0 = _mm512_set1_ps(scores[s] * inv), p1 = _mm512_set1_ps(scores[s + 1] * inv);
        const float *v0 = vc + (int64_t)s * stride, *v1 = v0 + stride;
        for (int c = 0; c < DC; c++) {
            ov[0][c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), ov[0][c]);
            ov[1][c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), ov[1][c]);
        }
    }
    if (s < S) {
        const __m512 p0 = _mm512_set1_ps(scores[s] * inv);
        for (int c = 0; c < DC; c++)
            ov[0][c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vc + (int64_t)s * stride + 16 * c), ov[0][c]);
    }
    for (int c = 0; c < DC; c++) _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(ov[0][c], ov[1][c]));
}
#endif

/* the same for any D (the AVX2 and portable builds, and head sizes the AVX-512 one does not cover) */
static void attend(const float* q, const float* kc, const float* vc, int64_t stride, int S, int D, float scale,
                   float* scores, float* o) {
    float mx = -INFINITY;
    for (int s = 0; s < S; s++) {
        const float v = dot(q, kc + (int64_t)s * stride, D) * scale;
        scores[s] = v;
        mx = v > mx ? v : mx;
    }
    for (int s = 0; s < S; s++) scores[s] -= mx;
    exp_inplace(scores, S);
    float sum = 0;
    for (int s = 0; s < S; s++) sum += scores[s];
    const float inv = 1.0f / sum;
    float acc[256];
    for (int e0 = 0; e0 < D; e0 += 256) { /* local accumulators: no aliasing with the cache, so it vectorises */
        const int n = D - e0 < 256 ? D - e0 : 256;
        for (int e = 0; e < n; e++) acc[e] = 0;
        for (int s = 0; s < S; s++) {
            const float p = scores[s] * inv;
            const float* v = vc + (int64_t)s * stride + e0;
            for (int e = 0; e < n; e++) acc[e] += p * v[e];
        }
        memcpy(o + e0, acc, sizeof(float) * n);
    }
}

/* one (row, head): softmax(q k^T * scale) v over keys 0..pos[t] (the causal mask) */
static void att_chunk(void* p, int64_t task, int tid) {
    const att_job* j = p;
    const bq_layer* L = j->L;
    const int D = L->head_dim, nh = L->heads, nkv = L->kv_heads, nq = nh * D, nqkv = nq + 2 * nkv * D;
    const int t = (int)(task / nh), hd = (int)(task % nh), g = hd / (nh / nkv);
    float* scores = j->priv + (int64_t)tid * j->priv_n + THREAD_FLOATS(layer_max_k(L));
    const float* q = j->qkv + (int64_t)t * nqkv + (int64_t)hd * D;
    float* o = j->att + (int64_t)t * nq + (int64_t)hd * D;
    const int S = (int)j->pos[t] + 1;
    const float *kc = j->kc + (int64_t)g * D, *vc = j->vc + (int64_t)g * D;
#if BQ_ISA == 3
    if (D == 64) {
        attend_avx512(q, kc, vc, (int64_t)nkv * D, S, L->scale, scores, o, 4);
        return;
    }
    if (D == 128) {
        attend_avx512(q, kc, vc, (int64_t)nkv * D, S, L->scale, scores, o, 8);
        return;
    }
#endif
    attend(q, kc, vc, (int64_t)nkv * D, S, D, L->scale, scores, o);
}

typedef struct {
    const bq_layer* L;
    int M;
    const float* xp; /* the normed rows, as q41_x returns them */
    float *gu, *act;
    float* priv;
    int64_t priv_n, per;
} mlp_job;

/* gate groups [c * per, ...) and the up groups I / 4 later, then act = silu(gate) * up on those rows */
static void mlp_chunk(void* p, int64_t c, int tid) {
    const mlp_job* j = p;
    const bq_layer* L = j->L;
    const int H = L->hidden, I = L->inter, M = j->M;
    const int64_t g0 = c * j->per, g1 = g0 + j->per < I / NR ? g0 + j->per : I / NR;
    float* sc = j->priv + (int64_t)tid * j->priv_n;
    float* wb = sc + layer_max_k(L) / 4;
    q41_groups(j->xp, H, M, H, L->gu, 2 * I, g0, g1, j->gu, 2 * I, NULL, 0, sc, wb);
    q41_groups(j->xp, H, M, H, L->gu, 2 * I, I / NR + g0, I / NR + g1, j->gu, 2 * I, NULL, 0, sc, wb);
    for (int t = 0; t < M; t++) {
        const float* gt = j->gu + (int64_t)t * 2 * I;
        float* a = j->act + (int64_t)t * I;
        const int64_t lo = g0 * NR, hi = g1 * NR;
        for (int64_t e = lo; e < hi; e++) a[e] = -gt[e];
        exp_inplace(a + lo, (int)(hi - lo));
        for (int64_t e = lo; e < hi; e++) a[e] = gt[e] / (1.0f + a[e]) * gt[I + e];
    }
}

/* y (+)= x @ W.T for a Q4_1 matrix of the layer, over the pool, on the layer's per-thread scratch */
static void layer_mm(const float* xp, int M, int K, const uint8_t* w, int N, float* y, const float* res,
                     float* priv, int64_t priv_n) {
    mm_job j = {0, xp, K, M, K, N, w, y, N, res, N, 0, 0, priv, priv_n};
    run_mm(&j);
}

/* out [M][hidden] = the decoder layer on x [M][hidden] at positions pos [M], writing RoPE(k) and v at those
 * positions of the caches [S][kv_heads][head_dim] and attending over their first kv_len rows (query row t sees cache
 * rows <= pos[t]): RMSNorm, q/k/v, RoPE (rotate-half), GQA attention, o_proj + residual, RMSNorm, gate/up,
 * SiLU(gate) * up, down + residual. The matmuls and the attention run over the pool, the rest on the caller.
 * Returns 1 (and does nothing) if a position is outside [0, kv_len). */
int bq_llama_layer(const bq_layer* L, const float* x, float* out, int M, const int64_t* pos, float* kc, float* vc,
                   int kv_len, float* scratch) {
    const int H = L->hidden, D = L->head_dim, nh = L->heads, nkv = L->kv_heads, I = L->inter;
    const int nq = nh * D, nkvd = nkv * D, nqkv = nq + 2 * nkvd, half = D / 2;
    const int64_t kmax = layer_max_k(L);
    float* h = scratch;                    /* [M][H] a normed input */
    float* qkv = h + (int64_t)M * H;        /* [M][nqkv] */
    float* att = qkv + (int64_t)M * nqkv;   /* [M][nq] */
    float* x2 = att + (int64_t)M * nq;      /* [M][H] */
    float* gu = x2 + (int64_t)M * H;        /* [M][2I] */
    float* act = gu + (int64_t)M * 2 * I;   /* [M][I] */
    float* cs = act + (int64_t)M * I;       /* [M][D]: cos | sin of each row's angles */
    float* xp_buf = cs + (int64_t)M * D;    /* [M][kmax]: rows of x as the Q4_1 kernel reads them */
    float* priv = xp_buf + (int64_t)M * kmax; /* [threads][layer_private] */
    const int64_t priv_n = layer_private(L, kv_len);
    for (int t = 0; t < M; t++) {
        if (pos[t] < 0 || pos[t] >= kv_len) return 1;
    }
    PROF_BEGIN(P_NORM);
    for (int t = 0; t < M; t++) {
        rms_norm_row(x + (int64_t)t * H, L->norm_in, L->eps_in, H, h + (int64_t)t * H);
        for (int e = 0; e < half; e++) {
            const float a = (float)pos[t] * L->inv_freq[e];
            cs[t * D + e] = cosf(a);
            cs[t * D + half + e] = sinf(a);
        }
    }
    const float* hp = q41_x(h, H, M, H, xp_buf);
    PROF_END(P_NORM);
    PROF_BEGIN(P_QKV);
    layer_mm(hp, M, H, L->qkv, nqkv, qkv, NULL, priv, priv_n);
    PROF_END(P_QKV);
    /* RoPE on q (in place) and k; k and v into the caches */
    PROF_BEGIN(P_ROPE);
    for (int t = 0; t < M; t++) {
        const float* c = cs + t * D;
        const float* sn = c + half;
        for (int hd = 0; hd < nh + nkv; hd++) {
            float* src = qkv + (int64_t)t * nqkv + (int64_t)hd * D; /* q heads, then k heads */
            float* dst = hd < nh ? src : kc + ((int64_t)pos[t] * nkv + (hd - nh)) * D;
            for (int e = 0; e < half; e++) {
                const float x1 = src[e], x2v = src[half + e];
                const float a = x1 * c[e], b = x2v * sn[e], f = x2v * c[e], g = x1 * sn[e];
                dst[e] = a - b;
                dst[half + e] = f + g;
            }
        }
        memcpy(vc + (int64_t)pos[t] * nkvd, qkv + (int64_t)t * nqkv + nq + nkvd, sizeof(float) * nkvd);
    }
    PROF_END(P_ROPE);
    PROF_BEGIN(P_ATTN);
    att_job aj = {L, M, pos, kc, vc, qkv, att, priv, priv_n};
    run_job(att_chunk, &aj, (int64_t)M * nh);
    PROF_END(P_ATTN);
    PROF_BEGIN(P_O);
    layer_mm(q41_x(att, nq, M, nq, xp_buf), M, nq, L->o, H, x2, x, priv, priv_n);
    PROF_END(P_O);
    PROF_BEGIN(P_MLP);
    for (int t = 0; t < M; t++) rms_norm_row(x2 + (int64_t)t * H, L->norm_post, L->eps_post, H, h + (int64_t)t * H);
    mlp_job mj = {L, M, q41_x(h, H, M, H, xp_buf), gu, act, priv, priv_n, 0};
    mj.per = chunk_groups(I / NR, H, M);
    run_job(mlp_chunk, &mj, (I / NR + mj.per - 1) / mj.per);
    PROF_END(P_MLP);
    PROF_BEGIN(P_DOWN);
    layer_mm(q41_x(act, I, M, I, xp_buf), M, I, L->dn, H, out, x2, priv, priv_n);
    PROF_END(P_DOWN);
    return 0;
}

/* The whole decoder stack for a few rows: the layers L[0..n) in turn (each bq_llama_layer), the outputs of the
 * layers whose capture[i] >= 0 copied to captured + capture[i] * M * hidden, then the final RMSNorm (final_norm,
 * final_eps) into out. kc / vc: each layer's caches. Scratch: bq_layer_scratch of the largest layer plus 2 * M *
 * hidden floats. Returns 1 (having done nothing) if a position is outside [0, kv_len). */
int bq_llama_stack(const bq_layer* L, int n, const float* x, float* out, int M, const int64_t* pos, float* const* kc,
                   float* const* vc, int kv_len, float* scratch, const int* capture, float* captured,
                   const float* final_norm, float final_eps) {
    const int H = L[0].hidden;
    for (int t = 0; t < M; t++) {
        if (pos[t] < 0 || pos[t] >= kv_len) return 1;
    }
    float* bufs[2] = {scratch, scratch + (int64_t)M * H};
    float* rest = scratch + 2 * (int64_t)M * H;
    const float* cur = x;
    for (int i = 0; i < n; i++) {
        float* dst = bufs[i & 1];
        bq_llama_layer(&L[i], cur, dst, M, pos, kc[i], vc[i], kv_len, rest);
        if (capture[i] >= 0) memcpy(captured + (int64_t)capture[i] * M * H, dst, sizeof(float) * M * H);
        cur = dst;
    }
    for (int t = 0; t < M; t++) rms_norm_row(cur + (int64_t)t * H, final_norm, final_eps, H, out + (int64_t)t * H);
    return 0;
}

/* ids[r] = argmax of row r of logits [M][V] (the lowest index among ties; a NaN counts as the largest, as in
 * torch.argmax) */
void bq_argmax_rows(const float* logits, int M, int64_t V, int64_t* ids) {
    PROF_BEGIN(P_ARGMAX);
    for (int r = 0; r < M; r++) {
        const float* v = logits + (int64_t)r * V;
        int64_t best = 0;
        float bv = v[0];
        if (!isnan(bv)) {
            for (int64_t j = 1; j < V; j++) {
                if (v[j] > bv) {
                    bv = v[j];
                    best = j;
                } else if (isnan(v[j])) {
                    best = j;
                    break;
                }
            }
        }
        ids[r] = best;
    }
    PROF_END(P_ARGMAX);
}
