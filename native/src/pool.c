/* Thread pool for cf_parallel_for (see native/kernels/pool.h). Workers are created on first use
 * and live for the process; between jobs they spin briefly on the job generation, then sleep on a
 * condition variable. Compiled with the baseline flags. */
#define _GNU_SOURCE
#include "../kernels/pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER; /* one parallel job at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_start = PTHREAD_COND_INITIALIZER;
static pthread_cond_t cv_done = PTHREAD_COND_INITIALIZER;
static int n_workers = 0;

static struct {
  cf_task_fn fn;
  void *ctx;
  int64_t n;
  int active; /* workers taking part (tids 1..active) */
  atomic_llong next;
  atomic_int remaining;
  atomic_ullong gen;
} job;

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

static struct { int tid; unsigned long long gen0; } spawn[CF_MAX_THREADS];

static void *worker(void *arg) {
  /* gen0 is the generation before the job this worker was created for, read by the creator under
   * the lock, so a worker that starts late still sees that job as new */
  const int tid = ((int *)arg)[0];
  unsigned long long seen = spawn[tid].gen0;
  int worked = 1;
  for (;;) {
    /* a worker that took part in the last job spins up to ~50 us for the next one (back-to-back
     * kernels), then sleeps; one that sat the last job out sleeps at once */
    const uint64_t t0 = now_ns();
    while (worked && atomic_load_explicit(&job.gen, memory_order_acquire) == seen && now_ns() - t0 < 50000)
      sched_yield();
    pthread_mutex_lock(&mu);
    while (atomic_load(&job.gen) == seen) pthread_cond_wait(&cv_start, &mu);
    seen = atomic_load(&job.gen);
    const int part = tid <= job.active;
    pthread_mutex_unlock(&mu);
    worked = part;
    if (!part) continue;
    run_chunks(tid);
    if (atomic_fetch_sub(&job.remaining, 1) == 1) {
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
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

void cf_parallel_for(int nth, int64_t nchunks, cf_task_fn fn, void *ctx) {
  if (nth > nchunks) nth = (int)nchunks;
  if (nth > CF_MAX_THREADS) nth = CF_MAX_THREADS;
  if (nth > 1) pthread_once(&atfork_once, register_atfork);
  if (nth <= 1 || pthread_mutex_trylock(&job_lock) != 0) {
    for (int64_t c = 0; c < nchunks; c++) fn(ctx, c, 0);
    return;
  }
  pthread_mutex_lock(&mu);
  while (n_workers < nth - 1) {
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    spawn[n_workers + 1].tid = n_workers + 1;
    spawn[n_workers + 1].gen0 = atomic_load(&job.gen);
    const int ok = pthread_create(&t, &at, worker, &spawn[n_workers + 1].tid) == 0;
    pthread_attr_destroy(&at);
    if (!ok) break;
    n_workers++;
  }
  if (nth - 1 > n_workers) nth = n_workers + 1;
  job.fn = fn;
  job.ctx = ctx;
  job.n = nchunks;
  job.active = nth - 1;
  atomic_store(&job.next, 0);
  atomic_store(&job.remaining, nth - 1);
  atomic_fetch_add_explicit(&job.gen, 1, memory_order_release);
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
