/* A small fork-join thread pool shared by every ISA's kernels (native/src/pool.c).
 * cf_parallel_for runs fn(ctx, chunk, tid) for chunk = 0..nchunks-1 on up to nth threads, the
 * caller included (tid 0). Work is split into chunks the kernel chose without looking at nth, and
 * each chunk writes its own outputs, so results are bit-identical for every thread count.
 * One parallel job (or team) runs at a time: a call that finds the pool busy (another Python thread is in
 * a kernel) runs its chunks serially on its own thread, so threads never oversubscribe the pool. */
#ifndef CF_POOL_H
#define CF_POOL_H
#include <stddef.h>
#include <stdint.h>
typedef void (*cf_task_fn)(void *ctx, int64_t chunk, int tid);
void cf_parallel_for(int nth, int64_t nchunks, cf_task_fn fn, void *ctx);
/* A team: until cf_team_end, this thread's cf_parallel_for calls run on nth - 1 workers that spin
 * between jobs (publish and join without a wake-up). Returns 1 if it started one (then call
 * cf_team_end once), 0 if not (nth <= 1, a team already active, or another thread's job). */
int cf_team_begin(int nth);
void cf_team_end(void);
/* Prefetch hints for the next job of a team: per thread (0 = the caller) up to two byte ranges that
 * its first chunk will read. Waiting threads prefetch theirs toward L2 (pool.c); a job started with
 * cf_parallel_for_hinted inside a team runs chunk t < nth on tid t first, the rest in order, so each
 * thread's first chunk is the one it prefetched. Hints change no result. */
typedef struct { const void *p[2]; size_t n[2]; } cf_hint;
void cf_pool_hints(int nth, const cf_hint *h);
void cf_parallel_for_hinted(int nth, int64_t nchunks, cf_task_fn fn, void *ctx);
/* profile counters: out (if not NULL, 3 + CF_PROF_SLOTS entries) gets {busy ns: every thread's time in
 * the tasks of parallel regions, region ns: the regions' wall time on their callers, regions, then
 * the CF_PROF_SLOTS slots (the plan executor: wall ns per record opcode)}; then on >= 0 resets them
 * and turns counting on (1) or off (0). cf_prof_add adds to a slot. */
#define CF_PROF_SLOTS 64
void cf_pool_profile(int on, uint64_t *out);
int cf_prof_on(void);
uint64_t cf_now_ns(void);
uint64_t cf_thread_cpu_ns(void); /* this thread's CPU time (profiling: not counting time other processes hold the core) */
void cf_prof_add(int slot, uint64_t ns);
/* the calling thread's side of the same counting (bench/e2e/profile.py's serial table): out (CF_PROF_EXT
 * entries) gets, per record opcode, [op] the ns the plan executor spent on its calling thread outside
 * parallel regions and [CF_PROF_SLOTS + op] the regions it ran; then the regions' parts on their
 * callers: [CF_PX_DISPATCH] publishing the job and waking sleepers, [CF_PX_OWN] the caller's own
 * chunks, [CF_PX_JOIN] waiting for the workers after them; [CF_PX_PLAN] the plan runs' wall ns (team
 * start and end included) and [CF_PX_RUNS] their count; [CF_PX_JOIN_OPS + op] the part of CF_PX_JOIN in
 * that record opcode's regions. Reset and switched by cf_pool_profile. */
enum { CF_PX_DISPATCH = 2 * CF_PROF_SLOTS, CF_PX_OWN, CF_PX_JOIN, CF_PX_PLAN, CF_PX_RUNS, CF_PX_JOIN_OPS,
       CF_PROF_EXT = CF_PX_JOIN_OPS + CF_PROF_SLOTS };
void cf_pool_profile_ext(uint64_t *out);
/* the regions' caller wall ns and count so far (a record's serial time is its wall minus the change) */
void cf_prof_regions(uint64_t *ns, uint64_t *n);
void cf_prof_ext_add(int i, uint64_t v);
uint64_t cf_prof_ext_get(int i); /* one entry of cf_pool_profile_ext's, so far */
/* The CPUs a cgroup quota lets this process use (0: none; cpufuse._dispatch reads the quota at import): a team
 * or job larger than the affinity mask or this does not spin (pool.c) */
void cf_pool_cpu_limit(int n);
#define CF_MAX_THREADS 256
#endif
