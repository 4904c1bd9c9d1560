/* ---- the thread pool ------------------------------------------------------------------------ */
/* One job at a time. The caller publishes it, takes row chunks itself like any worker, and waits
 * only until every row is done: a worker that the OS has not scheduled yet (another process, a web
 * thread) holds nothing up, since it has claimed nothing. Claims go through one 64-bit counter that
 * carries the job's generation beside the next row, so a worker that wakes late can never claim rows
 * of a newer job with an older job's fields. Idle workers spin for `spin_ns` (a decode step calls
 * ~120 products microseconds apart) before sleeping on the condition variable. */

enum { MAX_THREADS = 64 };

/* A thread's buffer, grown when a call needs more and reused after. */
typedef struct {
  void *data;
  size_t bytes;
} scratch_t;

static void *at_least(scratch_t *s, size_t bytes) {
  if (bytes > s->bytes) {
    free(s->data);
    s->data = malloc(bytes);
    s->bytes = bytes;
  }
  return s->data;
}

/* A job: run(ctx, first, last) over items [0, items), handed out `chunk` at a time. */
typedef struct {
  void (*run)(const void *ctx, int first, int last);
  const void *ctx;
  int items, chunk;
} job_t;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER, job_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int n_workers, started;
static long spin_ns = SPIN_US * 1000L;
static job_t jobs[2];            /* the current job and the one before, indexed by generation */
static unsigned generation;      /* bumped to publish a job */
static uint64_t claim;           /* generation << 32 | next unclaimed row */
static int items_done;

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

#if defined(__x86_64__)
static inline void relax(void) { __builtin_ia32_pause(); }
#else
static inline void relax(void) {}
#endif

/* Claim and run chunks of generation g's job until none is left (or a newer job was published). */
static void take_items(unsigned g) {
  const job_t j = jobs[g & 1];
  for (;;) {
    uint64_t c = __atomic_load_n(&claim, __ATOMIC_ACQUIRE);
    const int first = (int)(c & 0xffffffffu);
    if ((unsigned)(c >> 32) != g || first >= j.items) return;
    const int last = first + j.chunk < j.items ? first + j.chunk : j.items;
    if (!__atomic_compare_exchange_n(&claim, &c, ((uint64_t)g << 32) | (uint64_t)last, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    j.run(j.ctx, first, last);
    __atomic_fetch_add(&items_done, last - first, __ATOMIC_RELEASE);
  }
}

static void *worker(void *unused) {
  (void)unused;
  unsigned seen = 0;
  for (;;) {
    unsigned g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    if (g == seen) {
      const long until = now_ns() + spin_ns;
      for (int i = 0; g == seen; i++) {
        relax();
        g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        if ((i & 255) == 255 && now_ns() > until) break;
      }
      if (g == seen) {
        pthread_mutex_lock(&pool_lock);
        while ((g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&wake, &pool_lock);
        pthread_mutex_unlock(&pool_lock);
      }
    }
    seen = g;
    take_items(g);
  }
  return 0;
}

void tq_start(long threads, long spin_us) {
  pthread_mutex_lock(&job_lock);
  if (!started) {
    started = 1;
    spin_ns = spin_us * 1000;
    for (long i = 1; i < threads && i < MAX_THREADS; i++) {
      pthread_t tid;
      if (pthread_create(&tid, 0, worker, 0) != 0) break;
      pthread_detach(tid);
      n_workers++;
    }
  }
  pthread_mutex_unlock(&job_lock);
}

static void run_job(const job_t *j) {
  pthread_mutex_lock(&job_lock); /* jobs from two tinygrad devices would otherwise share the pool */
  const unsigned g = generation + 1;
  jobs[g & 1] = *j;
  __atomic_store_n(&items_done, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&claim, (uint64_t)g << 32, __ATOMIC_RELEASE);
  pthread_mutex_lock(&pool_lock);
  __atomic_store_n(&generation, g, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&pool_lock);
  take_items(g);
  while (__atomic_load_n(&items_done, __ATOMIC_ACQUIRE) < j->items) relax();
  pthread_mutex_unlock(&job_lock);
}
