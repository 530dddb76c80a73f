/* Thread pool for cf_parallel_for (see native/kernels/pool.h). Workers are created on first use
 * and live for the process.
 *
 * Two modes. Outside a team, a parallel job is published under a mutex and the workers are woken
 * by a condition variable; between jobs a worker that took part spins briefly (back-to-back
 * kernels), then sleeps. Inside a team (cf_team_begin .. cf_team_end, e.g. one compiled plan run),
 * the team's workers spin on the job word with the CPU's pause hint and never sleep: a job is
 * published with one atomic store and joined by spinning on a counter, so the steps of a plan cost
 * about a microsecond of synchronization each instead of a wake-up.
 *
 * The job word packs a sequence number and the number of workers taking part, so a worker reads
 * both in one load and never acts on half of a job. Compiled with the baseline flags. */
#define _GNU_SOURCE
#include "../kernels/pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER; /* one parallel job (or team) at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_start = PTHREAD_COND_INITIALIZER;
static pthread_cond_t cv_done = PTHREAD_COND_INITIALIZER;
static int n_workers = 0;

#define WORD(seq, active) (((unsigned long long)(seq) << 16) | (unsigned long long)(active))
#define ACTIVE(w) ((int)((w) & 0xffff))

static struct {
  cf_task_fn fn;
  void *ctx;
  int64_t n;
  atomic_llong next;
  atomic_int remaining;
  atomic_ullong word;   /* WORD(sequence, workers taking part: tids 1..active) */
  atomic_int team;      /* 0, or the team size while a team is active: workers 1..team-1 spin */
  int team_owner;       /* this thread holds job_lock for the team (set by the owner only) */
  unsigned long long seq;
} job;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static void run_chunks(int tid) {
  for (;;) {
    const int64_t c = atomic_fetch_add(&job.next, 1);
    if (c >= job.n) break;
    job.fn(job.ctx, c, tid);
  }
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static struct { int tid; unsigned long long word0; } spawn[CF_MAX_THREADS];

static void *worker(void *arg) {
  /* word0 is the job word before the job this worker was created for, read by the creator under
   * the lock, so a worker that starts late still sees that job as new */
  const int tid = ((int *)arg)[0];
  unsigned long long seen = spawn[tid].word0;
  int worked = 1;
  for (;;) {
    unsigned long long w = atomic_load_explicit(&job.word, memory_order_acquire);
    /* in a team this worker belongs to: spin until the next job */
    while (w == seen && tid < atomic_load_explicit(&job.team, memory_order_relaxed)) {
      cpu_relax();
      w = atomic_load_explicit(&job.word, memory_order_acquire);
    }
    if (w == seen) {
      /* outside a team: a worker that took part in the last job spins ~50 us for the next one,
       * then sleeps; one that sat it out sleeps at once */
      const uint64_t t0 = now_ns();
      while (worked && w == seen && now_ns() - t0 < 50000) {
        sched_yield();
        w = atomic_load_explicit(&job.word, memory_order_acquire);
      }
      if (w == seen) {
        pthread_mutex_lock(&mu);
        while ((w = atomic_load(&job.word)) == seen && tid >= atomic_load(&job.team)) pthread_cond_wait(&cv_start, &mu);
        pthread_mutex_unlock(&mu);
        if (w == seen) continue; /* woken to join a team: spin above */
      }
    }
    seen = w;
    worked = tid <= ACTIVE(w);
    if (!worked) continue;
    run_chunks(tid);
    if (atomic_fetch_sub(&job.remaining, 1) == 1 && !atomic_load(&job.team)) {
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
  job.team_owner = 0;
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

static __thread int in_team; /* this thread owns the active team */

int cf_team_begin(int nth) {
  if (nth > CF_MAX_THREADS) nth = CF_MAX_THREADS;
  if (nth <= 1 || in_team) return 0;
  pthread_once(&atfork_once, register_atfork);
  if (pthread_mutex_trylock(&job_lock) != 0) return 0; /* another thread's job or team: run as usual */
  pthread_mutex_lock(&mu);
  nth = ensure_workers(nth);
  atomic_store(&job.team, nth);
  pthread_cond_broadcast(&cv_start); /* sleeping team members start spinning */
  pthread_mutex_unlock(&mu);
  in_team = 1;
  return 1;
}

void cf_team_end(void) {
  if (!in_team) return;
  in_team = 0;
  atomic_store(&job.team, 0); /* members fall back to the sleep-after-spin waiting */
  pthread_mutex_unlock(&job_lock);
}

void cf_parallel_for(int nth, int64_t nchunks, cf_task_fn fn, void *ctx) {
  if (nth > nchunks) nth = (int)nchunks;
  if (nth > CF_MAX_THREADS) nth = CF_MAX_THREADS;
  if (in_team) {
    const int team = atomic_load(&job.team);
    if (nth > team) nth = team;
    if (nth <= 1) {
      for (int64_t c = 0; c < nchunks; c++) fn(ctx, c, 0);
      return;
    }
    /* the team spins: publish with one store, join by spinning */
    job.fn = fn;
    job.ctx = ctx;
    job.n = nchunks;
    atomic_store_explicit(&job.next, 0, memory_order_relaxed);
    atomic_store_explicit(&job.remaining, nth - 1, memory_order_relaxed);
    atomic_store_explicit(&job.word, WORD(++job.seq, nth - 1), memory_order_release);
    run_chunks(0);
    while (atomic_load_explicit(&job.remaining, memory_order_acquire) > 0) cpu_relax();
    return;
  }
  if (nth > 1) pthread_once(&atfork_once, register_atfork);
  if (nth <= 1 || pthread_mutex_trylock(&job_lock) != 0) {
    for (int64_t c = 0; c < nchunks; c++) fn(ctx, c, 0);
    return;
  }
  pthread_mutex_lock(&mu);
  nth = ensure_workers(nth);
  job.fn = fn;
  job.ctx = ctx;
  job.n = nchunks;
  atomic_store(&job.next, 0);
  atomic_store(&job.remaining, nth - 1);
  atomic_store_explicit(&job.word, WORD(++job.seq, nth - 1), memory_order_release);
  pthread_cond_broadcast(&cv_start);
  pthread_mutex_unlock(&mu);
  run_chunks(0);
  const uint64_t t0 = now_ns();
  while (atomic_load(&job.remaining) > 0 && now_ns() - t0 < 200000) sched_yield();
  pthread_mutex_lock(&mu);
  while (atomic_load(&job.remaining) > 0) pthread_cond_wait(&cv_done, &mu);
  pthread_mutex_unlock(&mu);
  pthread_mutex_unlock(&job_lock);
}
