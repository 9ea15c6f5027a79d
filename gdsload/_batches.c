/* gdsload's native batcher: one pthread that assembles a pipeline's batches out of its window buffers, so
 * that no Python thread runs beside the consumer's between two training steps (gdsload/batcher.py documents
 * the contract). Part of _stage.c's translation unit (included at its end): it shares the driver API table,
 * load_cuda, set_msg and cu_name.
 *
 * Python hands it, in order: passes (a program: per batch, the windows it reads, which of them it is the
 * last reader of, and its copy and gather operations), windows as they are filled (buffer and "filled"
 * event), and output slots (device memory plus a "ready" event each) the consumer no longer holds. Per
 * batch the thread waits for its windows, takes a free slot, makes its stream wait for the consumer's queued
 * work (the slot may have been read by it), queues the operations, records the slot's "ready" event, records
 * "released" for each window read for the last time and hands that buffer back, and publishes the slot.
 *
 * Concurrency: one mutex guards every queue and the state; the thread drops it around CUDA calls. Waits are
 * condition variables with timeouts the callers choose (a caller in Python polls its own stop flag).
 * Host mode: addresses are host memory, operations are memcpy, events are not used (tests without CUDA).
 */

#define BATCHER_MAX_SLOTS 4096
#define BATCHER_MAX_BUFS 256
#define BATCHER_ANN_CAP 1024
#define OP_WORDS 11 /* kind, fn, src_window, src, idx, idx_bytes, out_off, rows, row_bytes, words, blocks */
#define OP_GATHER 0
#define OP_COPY 1
#define WIN_FAILED (-1)
#define WIN_END (-2)
#define BATCHER_THREADS 256
#define BATCHER_POLL_NS 100000L /* waiting for room: the consumer's takes wake nobody, the thread looks again */

enum { B_RUNNING, B_STOPPED, B_FAILED, B_READER_FAILED };

typedef struct pass {
    int64_t k, first, nbatches;
    int64_t *op_start, *ops, *win_start, *win_w, *win_rel;
    uint64_t index_ready;
    struct pass *next;
} pass_t;

typedef struct {
    int64_t k, w;
    int buf;
    uint64_t filled;
} ann_t;

typedef struct gds_batcher {
    int mode, device;
    cuda_api cu;
    void *libcuda;
    CUdevice dev;
    CUcontext ctx;
    int ctx_retained;
    CUstream work;
    uint64_t consumer; /* the consumer's stream, read and written atomically */
    CUevent fence;
    int nbufs;
    uint64_t buf_base[BATCHER_MAX_BUFS];
    CUevent released[BATCHER_MAX_BUFS];
    int released_recorded[BATCHER_MAX_BUFS];
    int nslots, ahead;
    uint64_t slot_base[BATCHER_MAX_SLOTS], slot_ready[BATCHER_MAX_SLOTS];
    int free_slots[BATCHER_MAX_SLOTS], free_head, free_count;
    int ready[BATCHER_MAX_SLOTS], ready_head, ready_count;
    int free_bufs[BATCHER_MAX_BUFS], fb_head, fb_count;
    ann_t ann[BATCHER_ANN_CAP];
    int ann_head, ann_count;
    ann_t held[BATCHER_MAX_BUFS];
    int nheld;
    pass_t *pass_head, *pass_tail;
    int64_t next_pass, published;
    int state, stopping, started, joined;
    int64_t last_take_ns, delay_ns; /* the consumer's latest take; how long after it the thread may queue work */
    char msg[MSG_LEN];
    pthread_mutex_t mu;
    pthread_cond_t cv_thread, cv_bufs, cv_ready;
    pthread_t tid;
} gds_batcher;

static void free_pass(pass_t *p) {
    if (p == NULL) return;
    free(p->op_start);
    free(p->ops);
    free(p->win_start);
    free(p->win_w);
    free(p->win_rel);
    free(p);
}

/* The thread's failure (under b->mu): the first one is kept; everyone waiting wakes. */
static void batcher_fail(gds_batcher *b, int state, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void batcher_fail(gds_batcher *b, int state, const char *fmt, ...) {
    if (b->state == B_RUNNING) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->msg, sizeof b->msg, fmt, ap);
        va_end(ap);
        b->state = state;
    }
    pthread_cond_broadcast(&b->cv_thread);
    pthread_cond_broadcast(&b->cv_bufs);
    pthread_cond_broadcast(&b->cv_ready);
}

static int halted(const gds_batcher *b) { return b->stopping || b->state != B_RUNNING; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_ns(int64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    nanosleep(&ts, NULL);
}

/* Wait (under b->mu) until a slot is free and fewer than `ahead` batches wait for the consumer. The consumer's
 * takes and frees signal nothing (a wake-up would be a system call between two of its steps): the thread
 * looks again every BATCHER_POLL_NS. Once there is room, and while the consumer has batches to take, the
 * thread queues nothing until delay_ns after the consumer's latest take: its CUDA calls then fall inside the
 * consumer's training step, not between the step's end and the next launch, where the driver would take
 * them in turn with the consumer's. 0, or -1 once halted. */
static int wait_for_room(gds_batcher *b) {
    for (;;) {
        if (halted(b)) return -1;
        if (b->free_count > 0 && b->ready_count < b->ahead) {
            int64_t early = b->ready_count > 0 ? b->last_take_ns + b->delay_ns - now_ns() : 0;
            if (early <= 0) return 0;
            pthread_mutex_unlock(&b->mu);
            sleep_ns(early);
            pthread_mutex_lock(&b->mu);
            continue;
        }
        pthread_mutex_unlock(&b->mu);
        sleep_ns(BATCHER_POLL_NS);
        pthread_mutex_lock(&b->mu);
    }
}

/* Window (k, w)'s buffer, taking announcements until it is there; -1 once halted (under b->mu). */
static int window_buffer(gds_batcher *b, int64_t k, int64_t w, uint64_t *filled) {
    for (;;) {
        for (int i = 0; i < b->nheld; i++)
            if (b->held[i].k == k && b->held[i].w == w) {
                *filled = b->held[i].filled;
                b->held[i].filled = 0; /* waited on once */
                return b->held[i].buf;
            }
        while (b->ann_count == 0 && !halted(b)) pthread_cond_wait(&b->cv_thread, &b->mu);
        if (halted(b)) return -1;
        ann_t a = b->ann[b->ann_head];
        b->ann_head = (b->ann_head + 1) % BATCHER_ANN_CAP;
        b->ann_count--;
        if (a.buf == WIN_FAILED) {
            batcher_fail(b, B_READER_FAILED, "a read failed before window %lld of pass %lld",
                         (long long)w, (long long)k);
            return -1;
        }
        if (a.buf == WIN_END || b->nheld == BATCHER_MAX_BUFS) {
            batcher_fail(b, B_FAILED, "internal error: the reader finished before the plan did (window %lld of "
                         "pass %lld was due)", (long long)w, (long long)k);
            return -1;
        }
        b->held[b->nheld++] = a;
    }
}

static void drop_held(gds_batcher *b, int buf) {
    for (int i = 0; i < b->nheld; i++)
        if (b->held[i].buf == buf) {
            b->held[i] = b->held[--b->nheld];
            return;
        }
}

/* Queue one operation; 0 or a CUDA error (host mode: done on return). */
static CUresult run_op(gds_batcher *b, const int64_t *op, const int *bufs) {
    uint64_t src = (uint64_t)op[3] + (op[2] >= 0 ? b->buf_base[bufs[op[2]]] : 0);
    uint64_t idx = (uint64_t)op[4], out = (uint64_t)op[6];
    int64_t rows = op[7], row_bytes = op[8], words = op[9];
    if (b->mode == MODE_HOST) {
        if (op[0] == OP_COPY) {
            memcpy((void *)(uintptr_t)out, (const void *)(uintptr_t)src, (size_t)(rows * row_bytes));
            return 0;
        }
        for (int64_t r = 0; r < rows; r++) {
            int64_t at = op[5] == 4 ? ((const int32_t *)(uintptr_t)idx)[r] : ((const int64_t *)(uintptr_t)idx)[r];
            memcpy((void *)(uintptr_t)(out + (uint64_t)(r * row_bytes)),
                   (const void *)(uintptr_t)(src + (uint64_t)(at * row_bytes)), (size_t)row_bytes);
        }
        return 0;
    }
    if (op[0] == OP_COPY) return b->cu.MemcpyDtoDAsync((CUdeviceptr)out, (CUdeviceptr)src, (size_t)(rows * row_bytes),
                                                       b->work);
    void *args[] = {&src, &idx, &out, &rows, &words};
    return b->cu.LaunchKernel((CUfunction)(uintptr_t)op[1], (unsigned)op[10], 1, 1, BATCHER_THREADS, 1, 1, 0, b->work,
                              args, NULL);
}

/* One batch of pass p: 0, or -1 once halted or failed (under b->mu on entry and return). */
static int run_batch(gds_batcher *b, pass_t *p, int64_t i) {
    int bufs[BATCHER_MAX_BUFS];
    uint64_t filled[BATCHER_MAX_BUFS];
    int64_t w0 = p->win_start[i], nw = p->win_start[i + 1] - w0;
    if (nw > BATCHER_MAX_BUFS) {
        batcher_fail(b, B_FAILED, "internal error: batch %lld reads %lld windows", (long long)i, (long long)nw);
        return -1;
    }
    for (int64_t j = 0; j < nw; j++)
        if ((bufs[j] = window_buffer(b, p->k, p->win_w[w0 + j], &filled[j])) < 0) return -1;
    if (wait_for_room(b) != 0) return -1;
    int slot = b->free_slots[b->free_head];
    b->free_head = (b->free_head + 1) % BATCHER_MAX_SLOTS;
    b->free_count--;
    uint64_t out_base = b->slot_base[slot];
    CUstream consumer = (CUstream)(uintptr_t)__atomic_load_n(&b->consumer, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&b->mu);

    CUresult r = 0;
    const char *what = "";
    int64_t failed_op = -1;
    if (b->mode == MODE_CUDA) {
        for (int64_t j = 0; j < nw && r == 0; j++)
            if (filled[j] && (r = b->cu.StreamWaitEvent(b->work, (CUevent)(uintptr_t)filled[j], 0)) != 0)
                what = "waiting for a window's reads";
        /* The slot's memory may be what the consumer read until it dropped it: its queued work comes first. */
        if (r == 0 && ((r = b->cu.EventRecord(b->fence, consumer)) != 0 ||
                       (r = b->cu.StreamWaitEvent(b->work, b->fence, 0)) != 0))
            what = "ordering after the consumer's work";
    }
    for (int64_t o = p->op_start[i]; o < p->op_start[i + 1] && r == 0; o++) {
        int64_t op[OP_WORDS];
        memcpy(op, p->ops + o * OP_WORDS, sizeof op);
        op[6] += (int64_t)out_base;
        if ((r = run_op(b, op, bufs)) != 0) {
            what = op[0] == OP_COPY ? "a device-to-device copy" : "a gather kernel launch";
            failed_op = o - p->op_start[i];
        }
    }
    if (r == 0 && b->mode == MODE_CUDA && (r = b->cu.EventRecord((CUevent)(uintptr_t)b->slot_ready[slot], b->work)) != 0)
        what = "recording a batch's ready event";
    for (int64_t j = 0; j < nw && r == 0; j++)
        if (p->win_rel[w0 + j] && b->mode == MODE_CUDA) {
            if ((r = b->cu.EventRecord(b->released[bufs[j]], b->work)) != 0) what = "recording a window's release";
        }

    pthread_mutex_lock(&b->mu);
    if (r != 0) {
        batcher_fail(b, B_FAILED, "batch %lld of pass %lld: %s failed%s: %s", (long long)i, (long long)p->k, what,
                     failed_op >= 0 ? " (operation)" : "", cu_name(&b->cu, r));
        return -1;
    }
    for (int64_t j = 0; j < nw; j++)
        if (p->win_rel[w0 + j]) {
            b->released_recorded[bufs[j]] = 1;
            drop_held(b, bufs[j]);
            b->free_bufs[(b->fb_head + b->fb_count) % BATCHER_MAX_BUFS] = bufs[j];
            b->fb_count++;
            pthread_cond_broadcast(&b->cv_bufs);
        }
    b->ready[(b->ready_head + b->ready_count) % BATCHER_MAX_SLOTS] = slot;
    b->ready_count++;
    b->published++;
    pthread_cond_broadcast(&b->cv_ready);
    return 0;
}

static void *batcher_main(void *arg) {
    gds_batcher *b = arg;
    if (b->mode == MODE_CUDA) {
        CUresult r = b->cu.CtxSetCurrent(b->ctx);
        if (r != 0) {
            pthread_mutex_lock(&b->mu);
            batcher_fail(b, B_FAILED, "cuCtxSetCurrent (device %d) failed: %s", b->device, cu_name(&b->cu, r));
            pthread_mutex_unlock(&b->mu);
            return NULL;
        }
    }
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (b->pass_head == NULL && !halted(b)) pthread_cond_wait(&b->cv_thread, &b->mu);
        if (halted(b)) break;
        pass_t *p = b->pass_head;
        if (p->index_ready && b->mode == MODE_CUDA) {
            pthread_mutex_unlock(&b->mu);
            CUresult r = b->cu.StreamWaitEvent(b->work, (CUevent)(uintptr_t)p->index_ready, 0);
            pthread_mutex_lock(&b->mu);
            if (r != 0) {
                batcher_fail(b, B_FAILED, "waiting for pass %lld's index upload failed: %s", (long long)p->k,
                             cu_name(&b->cu, r));
                break;
            }
        }
        int64_t i = p->first;
        while (i < p->nbatches && run_batch(b, p, i) == 0) i++;
        if (i < p->nbatches) break;
        b->pass_head = p->next;
        if (b->pass_head == NULL) b->pass_tail = NULL;
        free_pass(p);
    }
    pthread_cond_broadcast(&b->cv_ready);
    pthread_cond_broadcast(&b->cv_bufs);
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

int gds_batcher_abi(void) { return GDS_STAGER_ABI; }

void gds_batcher_stop(gds_batcher *b) {
    pthread_mutex_lock(&b->mu);
    b->stopping = 1;
    pthread_cond_broadcast(&b->cv_thread);
    pthread_cond_broadcast(&b->cv_bufs);
    pthread_cond_broadcast(&b->cv_ready);
    pthread_mutex_unlock(&b->mu);
}

/* Stop and join the thread (the caller's thread must not be it); idempotent. */
void gds_batcher_join(gds_batcher *b) {
    gds_batcher_stop(b);
    pthread_mutex_lock(&b->mu);
    int join = b->started && !b->joined;
    b->joined = 1;
    pthread_mutex_unlock(&b->mu);
    if (join) pthread_join(b->tid, NULL);
}

void gds_batcher_destroy(gds_batcher *b) {
    if (b == NULL) return;
    gds_batcher_join(b);
    while (b->pass_head) {
        pass_t *p = b->pass_head;
        b->pass_head = p->next;
        free_pass(p);
    }
    if (b->ctx_retained) {
        CUcontext saved = NULL;
        if (b->cu.CtxGetCurrent(&saved) != 0) saved = NULL;
        b->cu.CtxSetCurrent(b->ctx);
        if (b->fence) b->cu.EventDestroy(b->fence);
        for (int i = 0; i < b->nbufs; i++)
            if (b->released[i]) b->cu.EventDestroy(b->released[i]);
        b->cu.CtxSetCurrent(saved);
        b->cu.DevicePrimaryCtxRelease(b->dev);
    }
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv_thread);
    pthread_cond_destroy(&b->cv_bufs);
    pthread_cond_destroy(&b->cv_ready);
    free(b);
}

/* mode 0 host / 1 cuda; `work`: the stream every operation goes on (borrowed); `bufs`: the window buffers'
 * addresses, all free at first; `ahead`: batches published and not taken at most. The thread starts at once
 * and waits for a pass. */
gds_batcher *gds_batcher_create(int mode, int device, uint64_t work, int nbufs, const uint64_t *bufs, int ahead,
                                int64_t delay_ns, char *err, size_t errlen) {
    if (mode != MODE_HOST && mode != MODE_CUDA) {
        set_msg(err, errlen, "mode must be 0 (host) or 1 (cuda), not %d", mode);
        return NULL;
    }
    if (nbufs < 1 || nbufs > BATCHER_MAX_BUFS) {
        set_msg(err, errlen, "nbufs must be 1..%d, not %d", BATCHER_MAX_BUFS, nbufs);
        return NULL;
    }
    gds_batcher *b = calloc(1, sizeof *b);
    if (b == NULL) {
        set_msg(err, errlen, "out of memory");
        return NULL;
    }
    b->mode = mode;
    b->device = device;
    b->ahead = ahead < 1 ? 1 : ahead;
    b->delay_ns = delay_ns < 0 ? 0 : delay_ns;
    b->work = (CUstream)(uintptr_t)work;
    b->nbufs = nbufs;
    for (int i = 0; i < nbufs; i++) {
        b->buf_base[i] = bufs[i];
        b->free_bufs[i] = i;
    }
    b->fb_count = nbufs;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv_thread, NULL);
    pthread_cond_init(&b->cv_bufs, NULL);
    pthread_cond_init(&b->cv_ready, NULL);
    if (mode == MODE_CUDA) {
        if (load_cuda(&b->cu, &b->libcuda, device, &b->dev, &b->ctx, &b->ctx_retained, err, errlen) != 0) goto fail;
        if (b->cu.MemcpyDtoDAsync == NULL || b->cu.LaunchKernel == NULL) {
            set_msg(err, errlen, "libcuda.so.1 lacks cuMemcpyDtoDAsync_v2 or cuLaunchKernel (driver too old?)");
            goto fail;
        }
        CUcontext saved = NULL;
        CUresult r = b->cu.CtxGetCurrent(&saved);
        if (r == 0 && (r = b->cu.CtxSetCurrent(b->ctx)) == 0) {
            r = b->cu.EventCreate(&b->fence, CU_EVENT_DISABLE_TIMING);
            for (int i = 0; i < nbufs && r == 0; i++) /* the submitter sleeps on these instead of spinning */
                r = b->cu.EventCreate(&b->released[i], CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
            b->cu.CtxSetCurrent(saved);
        }
        if (r != 0) {
            set_msg(err, errlen, "cuEventCreate (device %d) failed: %s", device, cu_name(&b->cu, r));
            goto fail;
        }
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with Python's main thread */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, WORKER_STACK);
    int rc = pthread_create(&b->tid, &attr, batcher_main, b);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        set_msg(err, errlen, "pthread_create failed: %s", strerror(rc));
        goto fail;
    }
    b->started = 1;
    return b;
fail:
    gds_batcher_destroy(b);
    return NULL;
}

/* A new output slot at device (or host) address `base`, with its ready event (0 in host mode); its index, or
 * -1 when the table is full. The slot is not free until gds_batcher_free_slot. */
int gds_batcher_add_slot(gds_batcher *b, uint64_t base, uint64_t ready) {
    pthread_mutex_lock(&b->mu);
    int s = b->nslots < BATCHER_MAX_SLOTS ? b->nslots++ : -1;
    if (s >= 0) {
        b->slot_base[s] = base;
        b->slot_ready[s] = ready;
    }
    pthread_mutex_unlock(&b->mu);
    return s;
}

void gds_batcher_free_slot(gds_batcher *b, int s) {
    pthread_mutex_lock(&b->mu);
    if (s >= 0 && s < b->nslots && b->free_count < BATCHER_MAX_SLOTS) {
        b->free_slots[(b->free_head + b->free_count) % BATCHER_MAX_SLOTS] = s;
        b->free_count++;
    }
    pthread_mutex_unlock(&b->mu);
}

void gds_batcher_set_stream(gds_batcher *b, uint64_t stream) {
    __atomic_store_n(&b->consumer, stream, __ATOMIC_RELEASE);
}

static int64_t *copy_i64(const int64_t *src, int64_t n) {
    int64_t *dst = malloc((size_t)(n > 0 ? n : 1) * sizeof *dst);
    if (dst != NULL && n > 0) memcpy(dst, src, (size_t)n * sizeof *dst);
    return dst;
}

/* Pass k's program (copied), run from batch `first` on: batch i reads windows win_w[win_start[i] .. win_start[i+1]) (win_rel: it is their
 * last reader) and runs operations op_start[i] .. op_start[i+1] of `ops` (OP_WORDS each; out_off relative to the
 * slot). Passes come in order k = 0, 1, ...: 0, or -1 with a message. */
int gds_batcher_add_pass(gds_batcher *b, int64_t k, int64_t first, int64_t nbatches, const int64_t *op_start, const int64_t *ops,
                         const int64_t *win_start, const int64_t *win_w, const int64_t *win_rel, uint64_t index_ready,
                         char *err, size_t errlen) {
    pass_t *p = calloc(1, sizeof *p);
    int64_t nops = op_start[nbatches], nwin = win_start[nbatches];
    if (p == NULL) {
        set_msg(err, errlen, "out of memory");
        return -1;
    }
    p->k = k;
    p->first = first;
    p->nbatches = nbatches;
    p->index_ready = index_ready;
    p->op_start = copy_i64(op_start, nbatches + 1);
    p->ops = copy_i64(ops, nops * OP_WORDS);
    p->win_start = copy_i64(win_start, nbatches + 1);
    p->win_w = copy_i64(win_w, nwin);
    p->win_rel = copy_i64(win_rel, nwin);
    if (!p->op_start || !p->ops || !p->win_start || !p->win_w || !p->win_rel) {
        free_pass(p);
        set_msg(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_lock(&b->mu);
    int rc = 0;
    if (k != b->next_pass) {
        set_msg(err, errlen, "internal error: pass %lld added where pass %lld was due", (long long)k,
                (long long)b->next_pass);
        rc = -1;
    } else {
        b->next_pass++;
        if (b->pass_tail) b->pass_tail->next = p; else b->pass_head = p;
        b->pass_tail = p;
        pthread_cond_signal(&b->cv_thread);
    }
    pthread_mutex_unlock(&b->mu);
    if (rc != 0) free_pass(p);
    return rc;
}

/* Window w of pass k is in buffer `buf` once `filled` (an event; 0: already) has passed; buf WIN_FAILED: a read
 * failed there (the thread stops when it needs that window), WIN_END: the readers are done. */
int gds_batcher_announce(gds_batcher *b, int64_t k, int64_t w, int buf, uint64_t filled) {
    pthread_mutex_lock(&b->mu);
    int rc = 0;
    if (b->ann_count == BATCHER_ANN_CAP || buf >= b->nbufs || buf < WIN_END) {
        rc = -1;
    } else {
        ann_t *a = &b->ann[(b->ann_head + b->ann_count) % BATCHER_ANN_CAP];
        a->k = k;
        a->w = w;
        a->buf = buf;
        a->filled = filled;
        b->ann_count++;
        pthread_cond_signal(&b->cv_thread);
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static void deadline_in(struct timespec *ts, int timeout_ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += timeout_ms / 1000;
    ts->tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* A free window buffer, its last release waited for: its index, -1 on timeout, -2 once stopped or failed. */
int gds_batcher_free_buffer(gds_batcher *b, int timeout_ms) {
    struct timespec ts;
    deadline_in(&ts, timeout_ms);
    pthread_mutex_lock(&b->mu);
    while (b->fb_count == 0 && !halted(b))
        if (pthread_cond_timedwait(&b->cv_bufs, &b->mu, &ts) == ETIMEDOUT) break;
    int buf = halted(b) ? -2 : -1;
    int recorded = 0;
    if (buf == -1 && b->fb_count > 0) {
        buf = b->free_bufs[b->fb_head];
        b->fb_head = (b->fb_head + 1) % BATCHER_MAX_BUFS;
        b->fb_count--;
        recorded = b->released_recorded[buf];
        b->released_recorded[buf] = 0;
    }
    pthread_mutex_unlock(&b->mu);
    if (buf >= 0 && recorded && b->mode == MODE_CUDA) {
        CUresult r = b->cu.EventSynchronize(b->released[buf]);
        if (r != 0) {
            pthread_mutex_lock(&b->mu);
            batcher_fail(b, B_FAILED, "waiting for window buffer %d's last gather failed: %s", buf, cu_name(&b->cu, r));
            pthread_mutex_unlock(&b->mu);
            return -2;
        }
    }
    return buf;
}

/* The next published slot without waiting: its index; -1 when none is yet; -2 when none will come (stopped
 * or failed: gds_batcher_state says which). */
int gds_batcher_take(gds_batcher *b) {
    pthread_mutex_lock(&b->mu);
    int s = -1;
    if (b->ready_count > 0) {
        s = b->ready[b->ready_head];
        b->ready_head = (b->ready_head + 1) % BATCHER_MAX_SLOTS;
        b->ready_count--;
        b->last_take_ns = now_ns();
    } else if (halted(b)) {
        s = -2;
    }
    pthread_mutex_unlock(&b->mu);
    return s;
}

/* As gds_batcher_take, waiting up to timeout_ms for a slot. */
int gds_batcher_wait(gds_batcher *b, int timeout_ms) {
    struct timespec ts;
    deadline_in(&ts, timeout_ms);
    pthread_mutex_lock(&b->mu);
    while (b->ready_count == 0 && !halted(b))
        if (pthread_cond_timedwait(&b->cv_ready, &b->mu, &ts) == ETIMEDOUT) break;
    pthread_mutex_unlock(&b->mu);
    return gds_batcher_take(b);
}

/* 0 running, 1 stopped, 2 failed (message in err), 3 a read failed (the caller holds that error). */
int gds_batcher_state(gds_batcher *b, char *err, size_t errlen) {
    pthread_mutex_lock(&b->mu);
    int state = b->state != B_RUNNING ? b->state : (b->stopping ? B_STOPPED : B_RUNNING);
    set_msg(err, errlen, "%s", b->msg);
    pthread_mutex_unlock(&b->mu);
    return state;
}

/* Batches published so far, and those of them not taken yet. */
int64_t gds_batcher_published(gds_batcher *b, int *ready) {
    pthread_mutex_lock(&b->mu);
    int64_t n = b->published;
    *ready = b->ready_count;
    pthread_mutex_unlock(&b->mu);
    return n;
}
