/* Thread pool for cf_parallel_for (see native/kernels/pool.h). Workers are created on first use
 * and live for the process.
 *
 * A job is published with one atomic store of the job word, which packs a sequence number and the
 * number of workers taking part (so a worker reads both in one load and never acts on half of a
 * job), and joined on a counter. Both sides wait by spinning with the CPU's pause hint for a
 * bounded time, then sleeping on a condition variable; a sleeper is woken only if one exists (a
 * seq_cst count of sleepers read after the store: no lost wake-up, no syscall when nobody
 * sleeps). Inside a team (cf_team_begin .. cf_team_end, e.g. one compiled plan run) a worker spins
 * up to TEAM_SPIN_NS between the plan's steps, so back-to-back kernels cost about a microsecond of
 * synchronization; outside, IDLE_SPIN_NS (back-to-back calls from Python), then it sleeps.
 *
 * A machine that is not idle: a spinning thread holds a core that a preempted team member (or
 * another process) could run on, so the spin budgets adapt. Each waiting thread keeps its own
 * budget: a wait that the spin covered doubles it (up to the limit above), a wait that ran it out
 * and had to sleep quarters it (down to MIN_SPIN_NS). On a quiet machine the steps of a plan follow
 * each other within microseconds and the budgets stay at their limits; on a busy one the waits are
 * long, the budgets collapse and the team sleeps instead of spinning against its own members. A team
 * larger than the cores this process may run on (sched_getaffinity, read when a team or job starts)
 * spins not at all: its threads take turns on the cores, and a spinner only delays the thread it
 * waits for. None of this changes which chunk a thread runs or what a chunk computes. Waiting
 * threads also prefetch the weights their next chunk reads when a decode step names them
 * (cf_pool_hints, below). Compiled with the baseline flags. */
#define _GNU_SOURCE
#include "../kernels/pool.h"
#include "../cdef.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define TEAM_SPIN_NS 2000000ull /* a team's workers between jobs: 2 ms */
#define IDLE_SPIN_NS 50000ull   /* a worker between jobs outside a team */
#define JOIN_SPIN_NS 200000ull  /* the caller waiting for the workers of its job */
#define MIN_SPIN_NS 20000ull    /* the least an adapted budget falls to (a few wake-up latencies) */

/* CPUFUSE_POOL_IDLE_US=N (an A/B knob, read once per process, 0..100000): a worker's spin between jobs outside a
 * team, in µs, in place of IDLE_SPIN_NS. Between two decode steps Python runs for 80-180 µs, longer than the
 * default, so the team sleeps there and the next step's first job wakes it. No chunk or bit depends on it. */
static uint64_t idle_spin_ns(void) {
  static atomic_llong v = -1;
  long long x = atomic_load_explicit(&v, memory_order_relaxed);
  if (x < 0) {
    const char *e = getenv("CPUFUSE_POOL_IDLE_US");
    const long long us = e && *e ? atoll(e) : -1;
    x = us >= 0 && us <= 100000 ? us * 1000 : (long long)IDLE_SPIN_NS;
    atomic_store_explicit(&v, x, memory_order_relaxed);
  }
  return (uint64_t)x;
}

static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER; /* one parallel job (or team) at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_start = PTHREAD_COND_INITIALIZER;
static pthread_cond_t cv_done = PTHREAD_COND_INITIALIZER;
static int n_workers = 0;

#define WORD(seq, active) (((unsigned long long)(seq) << 16) | (unsigned long long)(active))
#define ACTIVE(w) ((int)((w) & 0xffff))

/* The job's fields on three lines of their own (128 bytes apart, beyond the adjacent-line prefetch): what the
 * caller writes once a job and the waiting workers poll (the word); the chunk counter, which the working threads
 * take chunks from; the count of workers still at work, which the caller polls in its join. On one line, every
 * chunk taken and every worker's end pulled the line away from the threads polling it, and back. */
#define POOL_LINE 128
static struct {
  _Alignas(POOL_LINE) cf_task_fn fn;
  void *ctx;
  int64_t n;
  int64_t first;        /* cf_parallel_for_hinted: chunks 0..first-1 run on tids 0..first-1, the rest by the counter */
  atomic_ullong word;   /* WORD(sequence, workers taking part: tids 1..active) */
  atomic_int team;      /* 0, or the team size while a team is active */
  atomic_int sleepers;  /* workers asleep on cv_start (or about to be) */
  atomic_int joiner;    /* the caller is asleep on cv_done (or about to be) */
  atomic_int oversub;   /* the team or job has more threads than this process's cores: no spinning */
  unsigned long long seq;
  _Alignas(POOL_LINE) atomic_llong next;
  _Alignas(POOL_LINE) atomic_int remaining;
  char pad_[POOL_LINE - sizeof(atomic_int)];
} job;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int affinity_mask_cpus(void) {
  static _Thread_local uint64_t when;
  static _Thread_local int cpus;
  const uint64_t t = now_ns();
  if (!cpus || t - when > 100000000ull) {
    cpu_set_t set;
    cpus = sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0 ? CPU_COUNT(&set)
                                                                              : CF_MAX_THREADS; /* unknown */
    when = t;
  }
  return cpus;
}

/* a cgroup CPU quota's CPUs (cf_pool_cpu_limit; 0: none) */
static atomic_int cpu_limit;
void cf_pool_cpu_limit(int n) { atomic_store(&cpu_limit, n > 0 ? n : 0); }

/* the cores this process may run on (its affinity mask, at least 1, at most cf_pool_cpu_limit's count),
 * the mask read again after 100 ms */
static int affinity_cpus(void) {
  const int lim = atomic_load_explicit(&cpu_limit, memory_order_relaxed);
  const int cpus = affinity_mask_cpus();
  return lim > 0 && lim < cpus ? lim : cpus;
}

/* A thread's adapted spin budget (see the top): `spun` is the budget's state, `cap` the limit now. */
static inline uint64_t budget_of(uint64_t spun, uint64_t cap) { return spun < cap ? spun : cap; }
static inline uint64_t adapt(uint64_t spun, uint64_t cap, int slept) {
  if (slept) return spun / 4 > MIN_SPIN_NS ? spun / 4 : MIN_SPIN_NS;
  return spun * 2 < cap ? spun * 2 : cap;
}

/* Prefetch hints (cf_pool_hints): per thread up to two byte ranges, the weights its first chunk of a
 * coming job will read. A thread that waits (a worker between jobs, the caller joining its job) pulls
 * its ranges toward L2 with prefetch instructions, HINT_LINES cache lines at a time between looks at
 * the job word, so the memory system keeps streaming through the joins and the serial steps of a
 * decode token. The table is written by the team's owner only and published by one generation
 * counter (odd while written), which is all a waiting thread polls. A hint changes no result: a
 * stale or torn one costs only useless prefetches, which never fault. */
#define HINT_LINES 8
static __thread int in_team; /* this thread owns the active team */
static struct { atomic_uintptr_t p[2]; atomic_size_t n[2]; } hint_tab[CF_MAX_THREADS];
static atomic_ullong hint_gen __attribute__((aligned(64)));
static __thread struct { unsigned long long gen; int r; size_t off; uintptr_t p[2]; size_t n[2]; } pf;

void cf_pool_hints(int nth, const cf_hint *h) {
  if (!in_team) return; /* only the team's owner writes the table */
  if (nth > CF_MAX_THREADS) nth = CF_MAX_THREADS;
  int same = 1;
  for (int t = 0; t < nth && same; t++)
    for (int r = 0; r < 2; r++)
      same &= atomic_load_explicit(&hint_tab[t].p[r], memory_order_relaxed) == (uintptr_t)h[t].p[r] &&
              atomic_load_explicit(&hint_tab[t].n[r], memory_order_relaxed) == h[t].n[r];
  if (same) return; /* already published: threads part-way through their ranges go on */
  const unsigned long long g = atomic_load_explicit(&hint_gen, memory_order_relaxed);
  atomic_store_explicit(&hint_gen, g + 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  for (int t = 0; t < nth; t++)
    for (int r = 0; r < 2; r++) {
      atomic_store_explicit(&hint_tab[t].p[r], (uintptr_t)h[t].p[r], memory_order_relaxed);
      atomic_store_explicit(&hint_tab[t].n[r], h[t].n[r], memory_order_relaxed);
    }
  atomic_store_explicit(&hint_gen, g + 2, memory_order_release);
}

/* prefetch the next HINT_LINES lines of this thread's ranges; 0 when none are left */
static int hint_step(int tid) {
  const unsigned long long g = atomic_load_explicit(&hint_gen, memory_order_acquire);
  if (g != pf.gen) {
    if (g & 1) return 0;
    for (int r = 0; r < 2; r++) {
      pf.p[r] = atomic_load_explicit(&hint_tab[tid].p[r], memory_order_relaxed);
      pf.n[r] = atomic_load_explicit(&hint_tab[tid].n[r], memory_order_relaxed);
    }
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&hint_gen, memory_order_relaxed) != g) return 0; /* rewritten meanwhile */
    pf.gen = g;
    pf.r = 0;
    pf.off = 0;
  }
  while (pf.r < 2 && pf.off >= pf.n[pf.r]) {
    pf.r++;
    pf.off = 0;
  }
  if (pf.r >= 2) return 0;
  const char *p = (const char *)pf.p[pf.r] + pf.off;
  size_t m = pf.n[pf.r] - pf.off;
  if (m > HINT_LINES * 64) m = HINT_LINES * 64;
  for (size_t o = 0; o < m; o += 64) __builtin_prefetch(p + o, 0, 2);
  pf.off += m;
  return 1;
}

/* Profile counters (cf_pool_profile): off unless asked for, then per parallel region its wall time on
 * the caller and every thread's time inside its tasks, so a benchmark can split a step into serial
 * time, task time and the idle and synchronization time inside the regions. */
static atomic_int prof_on;
static atomic_ullong prof_region_ns, prof_regions, prof_slot[CF_PROF_SLOTS], prof_ext[CF_PROF_EXT];
/* each thread's task time on a line of its own: one shared counter took 16 contended adds at every region's end,
 * which the profiled tokens then carried */
static struct { _Alignas(POOL_LINE) atomic_ullong ns; } prof_busy[CF_MAX_THREADS];
int cf_prof_on(void) { return atomic_load_explicit(&prof_on, memory_order_relaxed); }
uint64_t cf_now_ns(void) { return now_ns(); }
uint64_t cf_thread_cpu_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
void cf_prof_add(int slot, uint64_t ns) {
  if (slot >= 0 && slot < CF_PROF_SLOTS) atomic_fetch_add_explicit(&prof_slot[slot], ns, memory_order_relaxed);
}
void cf_prof_ext_add(int i, uint64_t v) {
  if (i >= 0 && i < CF_PROF_EXT) atomic_fetch_add_explicit(&prof_ext[i], v, memory_order_relaxed);
}
uint64_t cf_prof_ext_get(int i) {
  return i >= 0 && i < CF_PROF_EXT ? atomic_load_explicit(&prof_ext[i], memory_order_relaxed) : 0;
}
void cf_prof_regions(uint64_t *ns, uint64_t *n) {
  *ns = atomic_load_explicit(&prof_region_ns, memory_order_relaxed);
  *n = atomic_load_explicit(&prof_regions, memory_order_relaxed);
}
void cf_pool_profile_ext(uint64_t *out) {
  for (int i = 0; i < CF_PROF_EXT; i++) out[i] = atomic_load(&prof_ext[i]);
}
static void run_chunks(int tid) {
  const uint64_t t0 = atomic_load_explicit(&prof_on, memory_order_relaxed) ? now_ns() : 0;
  if (tid < job.first) job.fn(job.ctx, tid, tid); /* the chunk its prefetch hint named */
  for (;;) {
    const int64_t c = job.first + atomic_fetch_add(&job.next, 1);
    if (c >= job.n) break;
    job.fn(job.ctx, c, tid);
  }
  if (t0) atomic_fetch_add_explicit(&prof_busy[tid].ns, now_ns() - t0, memory_order_relaxed);
}
void cf_pool_profile(int on, uint64_t *out) {
  if (out) {
    uint64_t busy = 0;
    for (int t = 0; t < CF_MAX_THREADS; t++) busy += atomic_load_explicit(&prof_busy[t].ns, memory_order_relaxed);
    out[0] = busy;
    out[1] = atomic_load(&prof_region_ns);
    out[2] = atomic_load(&prof_regions);
    for (int i = 0; i < CF_PROF_SLOTS; i++) out[3 + i] = atomic_load(&prof_slot[i]);
  }
  if (on >= 0) {
    for (int t = 0; t < CF_MAX_THREADS; t++) atomic_store_explicit(&prof_busy[t].ns, 0, memory_order_relaxed);
    atomic_store(&prof_region_ns, 0);
    atomic_store(&prof_regions, 0);
    for (int i = 0; i < CF_PROF_SLOTS; i++) atomic_store(&prof_slot[i], 0);
    for (int i = 0; i < CF_PROF_EXT; i++) atomic_store(&prof_ext[i], 0);
    atomic_store(&prof_on, on);
  }
}

static struct { int tid; unsigned long long word0; } spawn[CF_MAX_THREADS];

/* spin until the job word differs from `seen` or `budget` ns pass; returns the word */
static unsigned long long spin_for_job(int tid, unsigned long long seen, uint64_t budget) {
  unsigned long long w = atomic_load_explicit(&job.word, memory_order_acquire);
  if (w != seen || !budget) return w;
  const uint64_t t0 = now_ns();
  for (unsigned i = 1;; i++) {
    if (!hint_step(tid)) cpu_relax();
    w = atomic_load_explicit(&job.word, memory_order_acquire);
    if (w != seen) return w;
    if (!(i & 63) && now_ns() - t0 > budget) return w;
  }
}

static void *worker(void *arg) {
  /* word0 is the job word before the job this worker was created for, read by the creator under
   * the lock, so a worker that starts late still sees that job as new */
  const int tid = ((int *)arg)[0];
  unsigned long long seen = spawn[tid].word0;
  int worked = 1;
  uint64_t spun = TEAM_SPIN_NS; /* this worker's adapted budget */
  for (;;) {
    const int member = tid < atomic_load_explicit(&job.team, memory_order_relaxed);
    const uint64_t cap = atomic_load_explicit(&job.oversub, memory_order_relaxed) ? 0
                         : member ? TEAM_SPIN_NS : (worked ? idle_spin_ns() : 0);
    unsigned long long w = spin_for_job(tid, seen, budget_of(spun, cap));
    const int slept = w == seen;
    if (slept) { /* sleep until a new job (the publisher wakes sleepers after its store) */
      pthread_mutex_lock(&mu);
      atomic_fetch_add(&job.sleepers, 1);
      while ((w = atomic_load(&job.word)) == seen) pthread_cond_wait(&cv_start, &mu);
      atomic_fetch_sub(&job.sleepers, 1);
      pthread_mutex_unlock(&mu);
    }
    if (member && cap) spun = adapt(spun, TEAM_SPIN_NS, slept); /* learn from the team's waits only */
    seen = w;
    worked = tid <= ACTIVE(w);
    if (!worked) continue;
    run_chunks(tid);
    if (atomic_fetch_sub(&job.remaining, 1) == 1 && atomic_load(&job.joiner)) {
      pthread_mutex_lock(&mu);
      pthread_cond_signal(&cv_done);
      pthread_mutex_unlock(&mu);
    }
  }
  return NULL;
}

/* A forked child has none of the parent's workers: start over with an empty pool (fresh locks,
 * since a worker may have held one at the fork). Registered once, on the first parallel call. */
static void pool_after_fork_child(void) {
  pthread_mutex_init(&job_lock, NULL);
  pthread_mutex_init(&mu, NULL);
  pthread_cond_init(&cv_start, NULL);
  pthread_cond_init(&cv_done, NULL);
  n_workers = 0;
  atomic_store(&job.remaining, 0);
  atomic_store(&job.team, 0);
  atomic_store(&job.sleepers, 0);
  atomic_store(&job.joiner, 0);
  atomic_store(&job.oversub, 0);
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

/* make sure nth - 1 workers exist (under mu); returns the thread count available */
static int ensure_workers(int nth) {
  while (n_workers < nth - 1) {
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    spawn[n_workers + 1].tid = n_workers + 1;
    spawn[n_workers + 1].word0 = atomic_load(&job.word);
    const int ok = pthread_create(&t, &at, worker, &spawn[n_workers + 1].tid) == 0;
    pthread_attr_destroy(&at);
    if (!ok) break;
    n_workers++;
  }
  return nth - 1 > n_workers ? n_workers + 1 : nth;
}

int cf_team_begin(int nth) {
  if (nth > CF_MAX_THREADS) nth = CF_MAX_THREADS;
  if (nth <= 1 || in_team) return 0;
  pthread_once(&atfork_once, register_atfork);
  if (pthread_mutex_trylock(&job_lock) != 0) return 0; /* another thread's job or team: run as usual */
  pthread_mutex_lock(&mu);
  nth = ensure_workers(nth);
  pthread_mutex_unlock(&mu);
  atomic_store(&job.oversub, nth > affinity_cpus());
  atomic_store(&job.team, nth);
  in_team = 1;
  return 1;
}

void cf_team_end(void) {
  if (!in_team) return;
  in_team = 0;
  atomic_store(&job.team, 0); /* the members fall back to the short spin, then sleep */
  pthread_mutex_unlock(&job_lock);
}

static void parallel_for(int nth, int64_t nchunks, cf_task_fn fn, void *ctx, int hinted) {
  if (nth > nchunks) nth = (int)nchunks;
  if (nth > CF_MAX_THREADS) nth = CF_MAX_THREADS;
  int locked = 0;
  if (in_team) {
    const int team = atomic_load(&job.team);
    if (nth > team) nth = team;
  } else if (nth > 1) {
    pthread_once(&atfork_once, register_atfork);
    if (pthread_mutex_trylock(&job_lock) == 0) { /* else another thread's job: run serially here */
      locked = 1;
      pthread_mutex_lock(&mu);
      nth = ensure_workers(nth);
      pthread_mutex_unlock(&mu);
      atomic_store(&job.oversub, nth > affinity_cpus());
    } else {
      nth = 1;
    }
  }
  if (nth <= 1) {
    for (int64_t c = 0; c < nchunks; c++) fn(ctx, c, 0);
    if (locked) pthread_mutex_unlock(&job_lock);
    return;
  }
  const uint64_t r0 = atomic_load_explicit(&prof_on, memory_order_relaxed) ? now_ns() : 0;
  /* publish: the job's fields, then the word (release), then wake sleepers if any */
  job.fn = fn;
  job.ctx = ctx;
  job.n = nchunks;
  job.first = hinted && in_team ? nth : 0;
  atomic_store_explicit(&job.next, 0, memory_order_relaxed);
  atomic_store_explicit(&job.remaining, nth - 1, memory_order_relaxed);
  atomic_store(&job.word, WORD(++job.seq, nth - 1));
  if (atomic_load(&job.sleepers)) {
    pthread_mutex_lock(&mu);
    pthread_cond_broadcast(&cv_start);
    pthread_mutex_unlock(&mu);
  }
  const uint64_t r1 = r0 ? now_ns() : 0;
  run_chunks(0);
  const uint64_t r2 = r0 ? now_ns() : 0;
  /* join: spin (this thread's adapted budget), then sleep until the last worker signals */
  static __thread uint64_t join_spun = JOIN_SPIN_NS;
  if (atomic_load_explicit(&job.remaining, memory_order_acquire) > 0) {
    const uint64_t budget = atomic_load_explicit(&job.oversub, memory_order_relaxed) ? 0 : join_spun;
    const uint64_t t0 = now_ns();
    int slept = 0;
    for (unsigned i = 1; atomic_load_explicit(&job.remaining, memory_order_acquire) > 0; i++) {
      if (!hint_step(0)) cpu_relax();
      if (!budget || (!(i & 63) && now_ns() - t0 > budget)) {
        pthread_mutex_lock(&mu);
        atomic_store(&job.joiner, 1);
        while (atomic_load(&job.remaining) > 0) pthread_cond_wait(&cv_done, &mu);
        atomic_store(&job.joiner, 0);
        pthread_mutex_unlock(&mu);
        slept = 1;
        break;
      }
    }
    if (budget) join_spun = adapt(join_spun, JOIN_SPIN_NS, slept);
  }
  if (r0) {
    const uint64_t r3 = now_ns();
    atomic_fetch_add(&prof_region_ns, r3 - r0);
    atomic_fetch_add(&prof_regions, 1);
    cf_prof_ext_add(CF_PX_DISPATCH, r1 - r0);
    cf_prof_ext_add(CF_PX_OWN, r2 - r1);
    cf_prof_ext_add(CF_PX_JOIN, r3 - r2);
  }
  if (locked) pthread_mutex_unlock(&job_lock);
}

void cf_parallel_for(int nth, int64_t nchunks, cf_task_fn fn, void *ctx) { parallel_for(nth, nchunks, fn, ctx, 0); }
void cf_parallel_for_hinted(int nth, int64_t nchunks, cf_task_fn fn, void *ctx) { parallel_for(nth, nchunks, fn, ctx, 1); }
