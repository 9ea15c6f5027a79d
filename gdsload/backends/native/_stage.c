/* gdsload's native stager: worker pthreads read pieces of files into their own small staging buffers and
 * copy them to destination addresses (host memory with memcpy, or device memory with cuMemcpyHtoDAsync), so
 * no Python runs per piece. Loaded by ctypes (gdsload/stager.py documents the contract); no Python.h and
 * no CUDA headers: the few driver API entry points used are declared here and resolved with dlopen at
 * create time, so the library builds and runs (host mode) on machines without CUDA.
 *
 * Concurrency: one mutex guards the job table, the FIFO of jobs with pieces still to hand out, and every
 * job's counters; workers drop it around pread, memcpy and CUDA calls. Staging buffers belong to one worker
 * each, so they need no lock. Waits are condition variables or cuEventSynchronize, never polls.
 *
 * Runs: pieces whose destinations lie back to back (a compressed window's chunks, from many files) are read
 * one after the other into one staging buffer and copied with one memcpy or cuMemcpyHtoDAsync: each copy and
 * event costs driver calls that serialize across threads, which small pieces would otherwise pay one each.
 */
#define _GNU_SOURCE
#define _FILE_OFFSET_BITS 64
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define GDS_STAGER_ABI 5
#define MODE_HOST 0
#define MODE_CUDA 1
#define ALIGN 4096
#define MSG_LEN 256
#define WORKER_STACK (1024 * 1024) /* CUDA driver calls run on it too */

/* ---- the CUDA driver API, declared by hand ---- */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_BLOCKING_SYNC 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define STAGER_BLOCKING_SYNC 0x1 /* gds_stager_create flags: copy waits sleep instead of spinning */
#define CU_MEMHOSTREGISTER_PORTABLE 0x1

typedef struct {
    CUresult (*Init)(unsigned int);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*StreamCreate)(CUstream *, unsigned int);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned int);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*MemHostRegister)(void *, size_t, unsigned int);
    CUresult (*MemHostUnregister)(void *);
    CUresult (*GetErrorName)(CUresult, const char **);
} cuda_api;

/* ---- jobs ---- */
enum { JOB_RUNNING, JOB_DONE, JOB_FAILED, JOB_CANCELLED };

typedef struct {
    int fd;
    int64_t offset, size;
    uint64_t dest;
} piece_t;

typedef struct job {
    int64_t id;
    piece_t *pieces;
    int n;
    int next_piece;       /* dispatch cursor: the piece and offset in it of the next sub-piece */
    int64_t next_off;
    int64_t undispatched; /* sub-pieces not yet taken by a worker */
    int64_t remaining;    /* sub-pieces not yet complete (copied, skipped or dropped), undispatched included */
    int state;
    int has_error;
    int64_t err_piece, err_got;
    int err_no;
    char msg[MSG_LEN];
    int queued;           /* in the FIFO (iff RUNNING and undispatched > 0) */
    struct job *qprev, *qnext;
    struct job *tnext;    /* the job table, until wait() returned its final result */
    int waiters, reported;
} job_t;

typedef struct {
    unsigned char *ptr;
    CUevent ev;
    job_t *job;           /* non-NULL: a copy out of this buffer is outstanding, for sub-pieces of job */
    int piece;            /* the first piece of the copy (named if it fails) */
    int count;            /* the sub-pieces it completes */
} buf_t;

typedef struct gds_stager gds_stager;

typedef struct {
    gds_stager *s;
    pthread_t tid;
    int running;
    CUstream stream;
    buf_t *bufs;
    int next;
} worker_t;

struct gds_stager {
    int mode, device, nthreads, nbufs;
    unsigned int event_flags;
    size_t buf_bytes, mem_bytes;
    unsigned char *mem;
    int registered;
    cuda_api cu;
    void *libcuda;
    CUdevice dev;
    CUcontext ctx;
    int ctx_retained;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv, calls_cv;
    int sync_ready;
    job_t *qhead, *qtail, *jobs;
    int64_t next_id;
    int closing, joined, in_calls;
    int started, start_failed;
    char start_err[MSG_LEN];
    worker_t *workers;
    atomic_llong copies;  /* memcpy or cuMemcpyHtoDAsync calls issued, failed ones included */
};

static void set_msg(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_msg(char *buf, size_t len, const char *fmt, ...) {
    va_list ap;
    if (buf == NULL || len == 0) return;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
}

/* calloc(n, size), saying "out of memory" in err where it fails. */
static void *calloc_or_say(size_t n, size_t size, char *err, size_t errlen) {
    void *p = calloc(n, size);
    if (p == NULL) set_msg(err, errlen, "out of memory");
    return p;
}

/* 0 for MODE_HOST or MODE_CUDA; else -1, saying so in err. */
static int check_mode(int mode, char *err, size_t errlen) {
    if (mode == MODE_HOST || mode == MODE_CUDA) return 0;
    set_msg(err, errlen, "mode must be 0 (host) or 1 (cuda), not %d", mode);
    return -1;
}

static const char *cu_name(const cuda_api *cu, CUresult r) {
    const char *name = NULL;
    if (cu->GetErrorName == NULL || cu->GetErrorName(r, &name) != 0 || name == NULL) return "CUDA_ERROR_UNKNOWN";
    return name;
}

/* ---- job bookkeeping (all under s->mu) ---- */
static void queue_remove(gds_stager *s, job_t *j) {
    if (!j->queued) return;
    if (j->qprev) j->qprev->qnext = j->qnext; else s->qhead = j->qnext;
    if (j->qnext) j->qnext->qprev = j->qprev; else s->qtail = j->qprev;
    j->qprev = j->qnext = NULL;
    j->queued = 0;
}

static void queue_append(gds_stager *s, job_t *j) {
    j->qnext = NULL;
    j->qprev = s->qtail;
    if (s->qtail) s->qtail->qnext = j; else s->qhead = j;
    s->qtail = j;
    j->queued = 1;
}

static void complete(gds_stager *s, job_t *j, int64_t n) {
    j->remaining -= n;
    if (j->remaining == 0) {
        if (j->state == JOB_RUNNING) j->state = JOB_DONE;
        pthread_cond_broadcast(&s->done_cv);
    }
}

/* Sub-pieces never handed out count as complete: a failed or cancelled job ends without them. */
static void drop_undispatched(gds_stager *s, job_t *j) {
    int64_t n = j->undispatched;
    queue_remove(s, j);
    j->undispatched = 0;
    if (n > 0) complete(s, j, n);
}

/* The first error of a job is kept; a later short read of the same piece that ends earlier in the file
 * replaces it (sub-pieces of one piece are read in parallel, the one nearest the end may fail first). */
static void fail(gds_stager *s, job_t *j, int piece, int err_no, int64_t got, const char *msg) {
    if (j->state == JOB_RUNNING) {
        j->state = JOB_FAILED;
        drop_undispatched(s, j);
    } else if (!(j->state == JOB_FAILED && j->has_error && err_no == 0 && j->err_no == 0 &&
                 piece == j->err_piece && got < j->err_got)) {
        return;
    }
    j->has_error = 1;
    j->err_piece = piece;
    j->err_no = err_no;
    j->err_got = got;
    snprintf(j->msg, sizeof j->msg, "%s", msg);
}

static job_t *find(gds_stager *s, int64_t id) {
    for (job_t *j = s->jobs; j; j = j->tnext)
        if (j->id == id) return j;
    return NULL;
}

static void unlink_job(gds_stager *s, job_t *j) {
    for (job_t **p = &s->jobs; *p; p = &(*p)->tnext)
        if (*p == j) { *p = j->tnext; return; }
}

static void free_job(job_t *j) {
    free(j->pieces);
    free(j);
}

/* ---- the worker ---- */
/* A task: one sub-piece of piece `piece` (len bytes from sub_off), or a run of whole pieces piece..end-1
 * (size-0 ones among them skipped), `count` of them, destinations back to back, total bytes in all. */
typedef struct {
    job_t *job;
    int piece, end, count;
    int64_t sub_off, len, total;
} task_t;

/* The next sub-piece of the job at the FIFO's head (which has one); a piece taken whole that fits the buffer
 * goes on into a run: the following pieces while each starts where the last one's destination ended and the
 * run still fits the buffer. */
static void take(gds_stager *s, task_t *t) {
    job_t *j = s->qhead;
    while (j->pieces[j->next_piece].size == 0) j->next_piece++;
    piece_t *p = &j->pieces[j->next_piece];
    int64_t left = p->size - j->next_off, cap = (int64_t)s->buf_bytes;
    t->job = j;
    t->piece = j->next_piece;
    t->sub_off = j->next_off;
    t->len = left < cap ? left : cap;
    t->count = 1;
    j->next_off += t->len;
    if (j->next_off == p->size) { j->next_piece++; j->next_off = 0; }
    j->undispatched--;
    t->total = t->len;
    if (t->sub_off == 0 && t->len == p->size) {
        uint64_t end = p->dest + (uint64_t)p->size;
        int k = j->next_piece;
        while (j->undispatched > 0) {
            while (k < j->n && j->pieces[k].size == 0) k++;
            if (k == j->n) break;
            piece_t *q = &j->pieces[k];
            if (q->dest != end || q->size > cap - t->total) break;
            t->total += q->size;
            t->count++;
            end += (uint64_t)q->size;
            j->next_piece = ++k;
            j->undispatched--;
        }
    }
    t->end = j->next_off ? t->piece + 1 : j->next_piece;
    if (j->undispatched == 0) queue_remove(s, j);
}

/* Wait for the copy out of buffer b and complete its sub-pieces. */
static void settle(worker_t *w, buf_t *b) {
    gds_stager *s = w->s;
    CUresult r = s->cu.EventSynchronize(b->ev);
    pthread_mutex_lock(&s->mu);
    if (r != 0) {
        char msg[MSG_LEN];
        snprintf(msg, sizeof msg, "cuEventSynchronize after a host-to-device copy failed: %s", cu_name(&s->cu, r));
        fail(s, b->job, b->piece, -1, 0, msg);
    }
    complete(s, b->job, b->count);
    pthread_mutex_unlock(&s->mu);
    b->job = NULL;
}

static int has_outstanding(worker_t *w) {
    for (int i = 0; i < w->s->nbufs; i++)
        if (w->bufs[i].job) return 1;
    return 0;
}

static void settle_all(worker_t *w) {
    for (int i = 0; i < w->s->nbufs; i++)
        if (w->bufs[i].job) settle(w, &w->bufs[i]);
}

/* Read len bytes at off: 0 when all came, 1 when the file ended first, 2 on an error (*err_no). */
static int read_full(int fd, unsigned char *buf, int64_t len, int64_t off, int64_t *got, int *err_no) {
    int64_t g = 0;
    while (g < len) {
        ssize_t k = pread(fd, buf + g, (size_t)(len - g), (off_t)(off + g));
        if (k < 0) {
            if (errno == EINTR) continue;
            *err_no = errno;
            *got = g;
            return 2;
        }
        if (k == 0) { *got = g; return 1; }
        g += k;
    }
    *got = g;
    return 0;
}

/* Read the task's pieces back to back into b: 0, or -1 with the job failed naming the piece that fell short. */
static int read_task(gds_stager *s, buf_t *b, const task_t *t) {
    job_t *j = t->job;
    int64_t at = 0;
    for (int i = t->piece; i < t->end; i++) {
        const piece_t *p = &j->pieces[i]; /* fixed once submitted, and alive while the task is incomplete */
        if (p->size == 0) continue;
        int64_t off = i == t->piece ? t->sub_off : 0, len = i == t->piece ? t->len : p->size, got = 0;
        int err_no = 0;
        int rc = read_full(p->fd, b->ptr + at, len, p->offset + off, &got, &err_no);
        at += len;
        if (rc == 0) continue;
        char msg[MSG_LEN];
        got += off; /* bytes of the whole piece */
        if (rc == 1) {
            /* The file may end before this sub-piece even began (a sibling's range): say where it ends. */
            struct stat st;
            if (fstat(p->fd, &st) == 0 && st.st_size - p->offset < got)
                got = st.st_size > p->offset ? st.st_size - p->offset : 0;
            snprintf(msg, sizeof msg, "file ends after %lld bytes of the piece", (long long)got);
            err_no = 0;
        } else {
            snprintf(msg, sizeof msg, "pread failed (errno %d)", err_no);
        }
        pthread_mutex_lock(&s->mu);
        fail(s, j, i, err_no, got, msg);
        complete(s, j, t->count);
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    return 0;
}

/* Read the task and copy it out with one call; its sub-pieces complete here, or at settle() in CUDA mode. */
static void run_task(worker_t *w, buf_t *b, task_t *t) {
    gds_stager *s = w->s;
    job_t *j = t->job;
    pthread_mutex_lock(&s->mu);
    int live = j->state == JOB_RUNNING;
    if (!live) complete(s, j, t->count); /* failed or cancelled since it was taken: not started, dropped */
    pthread_mutex_unlock(&s->mu);
    if (!live || read_task(s, b, t) != 0) return;
    pthread_mutex_lock(&s->mu);
    live = j->state == JOB_RUNNING;
    if (!live) complete(s, j, t->count); /* read, but the job ended meanwhile: no copy */
    pthread_mutex_unlock(&s->mu);
    if (!live) return;

    uint64_t dest = j->pieces[t->piece].dest + (uint64_t)t->sub_off;
    atomic_fetch_add_explicit(&s->copies, 1, memory_order_relaxed);
    if (s->mode == MODE_HOST) {
        memcpy((void *)(uintptr_t)dest, b->ptr, (size_t)t->total);
        pthread_mutex_lock(&s->mu);
        complete(s, j, t->count);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    CUresult r = s->cu.MemcpyHtoDAsync((CUdeviceptr)dest, b->ptr, (size_t)t->total, w->stream);
    const char *what = "cuMemcpyHtoDAsync";
    if (r == 0) {
        r = s->cu.EventRecord(b->ev, w->stream);
        if (r == 0) { b->job = j; b->piece = t->piece; b->count = t->count; return; } /* done at settle() */
        what = "cuEventRecord";
        s->cu.StreamSynchronize(w->stream); /* the copy was queued: it must be over before the buffer is reused */
    }
    char msg[MSG_LEN];
    snprintf(msg, sizeof msg, "%s failed: %s", what, cu_name(&s->cu, r));
    pthread_mutex_lock(&s->mu);
    fail(s, j, t->piece, -1, 0, msg);
    complete(s, j, t->count);
    pthread_mutex_unlock(&s->mu);
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    gds_stager *s = w->s;
    CUresult r = 0;
    if (s->mode == MODE_CUDA) r = s->cu.CtxSetCurrent(s->ctx);
    pthread_mutex_lock(&s->mu);
    s->started++;
    if (r != 0 && !s->start_failed) {
        s->start_failed = 1;
        snprintf(s->start_err, sizeof s->start_err, "cuCtxSetCurrent in a worker failed: %s", cu_name(&s->cu, r));
    }
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
    if (r != 0) return NULL;

    for (;;) {
        task_t t;
        pthread_mutex_lock(&s->mu);
        while (s->qhead == NULL && !s->closing) {
            if (has_outstanding(w)) {
                /* No more work now: finish the copies in flight, so a job's last pieces do not wait for more
                 * work to arrive. */
                pthread_mutex_unlock(&s->mu);
                settle_all(w);
                pthread_mutex_lock(&s->mu);
                continue;
            }
            pthread_cond_wait(&s->work_cv, &s->mu);
        }
        if (s->qhead == NULL) { /* closing, and stop() emptied the queue */
            pthread_mutex_unlock(&s->mu);
            break;
        }
        take(s, &t);
        pthread_mutex_unlock(&s->mu);
        buf_t *b = &w->bufs[w->next];
        w->next = (w->next + 1) % s->nbufs;
        if (b->job) settle(w, b);
        run_task(w, b, &t);
    }
    settle_all(w);
    return NULL;
}

/* ---- CUDA set-up ---- */
/* libcuda opened, the entry points resolved, device `device`'s primary context retained (*retained = 1). */
static int load_cuda(cuda_api *cu, void **libcuda, int device, CUdevice *dev, CUcontext *ctx, int *retained,
                     char *err, size_t errlen) {
    *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (*libcuda == NULL) {
        const char *e = dlerror();
        set_msg(err, errlen, "cannot load the CUDA driver library libcuda.so.1 (%s)", e ? e : "dlopen failed");
        return -1;
    }
#define SYM(field, name)                                                                   \
    do {                                                                                   \
        *(void **)(&cu->field) = dlsym(*libcuda, name);                                    \
        if (cu->field == NULL) {                                                           \
            set_msg(err, errlen, "libcuda.so.1 lacks %s (driver too old?)", name);         \
            return -1;                                                                     \
        }                                                                                  \
    } while (0)
    SYM(GetErrorName, "cuGetErrorName");
    SYM(Init, "cuInit");
    SYM(DeviceGet, "cuDeviceGet");
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    SYM(CtxSetCurrent, "cuCtxSetCurrent");
    SYM(CtxGetCurrent, "cuCtxGetCurrent");
    SYM(StreamCreate, "cuStreamCreate");
    SYM(StreamDestroy, "cuStreamDestroy_v2");
    SYM(StreamSynchronize, "cuStreamSynchronize");
    SYM(EventCreate, "cuEventCreate");
    SYM(EventDestroy, "cuEventDestroy_v2");
    SYM(EventRecord, "cuEventRecord");
    SYM(EventSynchronize, "cuEventSynchronize");
    SYM(StreamWaitEvent, "cuStreamWaitEvent");
    SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    SYM(MemHostRegister, "cuMemHostRegister_v2");
    SYM(MemHostUnregister, "cuMemHostUnregister");
#undef SYM
    CUresult r;
    const char *what;
    if ((r = cu->Init(0)) != 0) { what = "cuInit"; goto fail; }
    if ((r = cu->DeviceGet(dev, device)) != 0) { what = "cuDeviceGet"; goto fail; }
    if ((r = cu->DevicePrimaryCtxRetain(ctx, *dev)) != 0) { what = "cuDevicePrimaryCtxRetain"; goto fail; }
    *retained = 1;
    return 0;
fail:
    set_msg(err, errlen, "%s (device %d) failed: %s", what, device, cu_name(cu, r));
    return -1;
}

/* Streams, events and pinned memory, made with the primary context current (the caller's restored). */
static int cuda_resources(gds_stager *s, char *err, size_t errlen) {
    CUcontext saved = NULL;
    CUresult r;
    const char *what;
    int rc = -1;
    if ((r = s->cu.CtxGetCurrent(&saved)) != 0) { what = "cuCtxGetCurrent"; goto fail; }
    if ((r = s->cu.CtxSetCurrent(s->ctx)) != 0) { what = "cuCtxSetCurrent"; goto fail; }
    if ((r = s->cu.MemHostRegister(s->mem, s->mem_bytes, CU_MEMHOSTREGISTER_PORTABLE)) != 0) {
        what = "cuMemHostRegister";
        goto restore;
    }
    s->registered = 1;
    for (int i = 0; i < s->nthreads; i++) {
        worker_t *w = &s->workers[i];
        if ((r = s->cu.StreamCreate(&w->stream, CU_STREAM_NON_BLOCKING)) != 0) {
            w->stream = NULL;
            what = "cuStreamCreate";
            goto restore;
        }
        for (int k = 0; k < s->nbufs; k++) {
            if ((r = s->cu.EventCreate(&w->bufs[k].ev, s->event_flags)) != 0) {
                w->bufs[k].ev = NULL;
                what = "cuEventCreate";
                goto restore;
            }
        }
    }
    rc = 0;
restore:
    s->cu.CtxSetCurrent(saved);
    if (rc == 0) return 0;
fail:
    set_msg(err, errlen, "%s failed: %s", what, cu_name(&s->cu, r));
    return -1;
}

/* ---- the API ---- */
int gds_stager_abi(void) { return GDS_STAGER_ABI; }

void gds_stager_stop(gds_stager *s) {
    pthread_mutex_lock(&s->mu);
    if (!s->closing) {
        s->closing = 1;
        for (job_t *j = s->jobs; j; j = j->tnext) {
            if (j->state == JOB_RUNNING) {
                j->state = JOB_CANCELLED;
                drop_undispatched(s, j);
            }
        }
        pthread_cond_broadcast(&s->work_cv);
        pthread_cond_broadcast(&s->done_cv);
    }
    pthread_mutex_unlock(&s->mu);
}

void gds_stager_destroy(gds_stager *s) {
    if (s == NULL) return;
    if (s->sync_ready) {
        gds_stager_stop(s);
        if (!s->joined) {
            for (int i = 0; i < s->nthreads; i++)
                if (s->workers && s->workers[i].running) pthread_join(s->workers[i].tid, NULL);
            s->joined = 1;
        }
        pthread_mutex_lock(&s->mu);
        while (s->in_calls > 0) pthread_cond_wait(&s->calls_cv, &s->mu); /* waiters leave with 3 */
        pthread_mutex_unlock(&s->mu);
        while (s->jobs) {
            job_t *j = s->jobs;
            s->jobs = j->tnext;
            free_job(j);
        }
    }
    CUcontext saved = NULL;
    int cuda = s->mode == MODE_CUDA && s->ctx_retained;
    if (cuda) {
        if (s->cu.CtxGetCurrent(&saved) != 0) saved = NULL;
        s->cu.CtxSetCurrent(s->ctx);
    }
    if (s->workers) {
        for (int i = 0; i < s->nthreads; i++) {
            worker_t *w = &s->workers[i];
            if (w->bufs && cuda)
                for (int k = 0; k < s->nbufs; k++)
                    if (w->bufs[k].ev) s->cu.EventDestroy(w->bufs[k].ev);
            if (w->stream && cuda) s->cu.StreamDestroy(w->stream);
            free(w->bufs);
        }
        free(s->workers);
    }
    if (s->registered) s->cu.MemHostUnregister(s->mem);
    if (cuda) {
        s->cu.CtxSetCurrent(saved);
        s->cu.DevicePrimaryCtxRelease(s->dev);
    }
    if (s->mem) {
        if (s->mode == MODE_CUDA) munmap(s->mem, s->mem_bytes); else free(s->mem);
    }
    /* libcuda stays loaded: unloading the driver under other users (CuPy, KvikIO) is asking for trouble. */
    if (s->sync_ready) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->work_cv);
        pthread_cond_destroy(&s->done_cv);
        pthread_cond_destroy(&s->calls_cv);
    }
    free(s);
}

/* A stager's staging memory: `count` buffers of `per_buf` bytes (buf_bytes rounded up to ALIGN). 0, or -1 with
 * the reason in err where a size is out of its range or the whole overflows the address space. */
static int staging_sizes(int nthreads, int bufs_per_thread, size_t buf_bytes, size_t *per_buf, size_t *count,
                         char *err, size_t errlen) {
    if (nthreads < 1 || nthreads > 4096 || bufs_per_thread < 1 || bufs_per_thread > 4096 || buf_bytes < 1 ||
        buf_bytes > ((size_t)1 << 40)) {
        set_msg(err, errlen, "bad sizes: nthreads %d (1..4096), bufs_per_thread %d (1..4096), buf_bytes %zu "
                "(1..2^40)", nthreads, bufs_per_thread, buf_bytes);
        return -1;
    }
    *per_buf = (buf_bytes + ALIGN - 1) / ALIGN * ALIGN;
    *count = (size_t)nthreads * (size_t)bufs_per_thread;
    if (*per_buf <= SIZE_MAX / *count) return 0;
    set_msg(err, errlen, "%zu buffers of %zu bytes overflow the address space", *count, *per_buf);
    return -1;
}

gds_stager *gds_stager_create(int mode, int device, int nthreads, size_t buf_bytes, int bufs_per_thread, int flags,
                              char *err, size_t errlen) {
    size_t per_buf, count;
    if (check_mode(mode, err, errlen) != 0 ||
        staging_sizes(nthreads, bufs_per_thread, buf_bytes, &per_buf, &count, err, errlen) != 0) return NULL;
    gds_stager *s = calloc_or_say(1, sizeof *s, err, errlen);
    if (s == NULL) return NULL;
    s->mode = mode;
    s->device = device;
    s->nthreads = nthreads;
    s->nbufs = bufs_per_thread;
    s->event_flags = CU_EVENT_DISABLE_TIMING | ((flags & STAGER_BLOCKING_SYNC) ? CU_EVENT_BLOCKING_SYNC : 0);
    s->buf_bytes = buf_bytes;
    s->mem_bytes = per_buf * count;
    atomic_init(&s->copies, 0);

    pthread_condattr_t ca;
    int e = pthread_condattr_init(&ca);
    if (e == 0) {
        e = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (e == 0 && (e = pthread_mutex_init(&s->mu, NULL)) == 0) {
            if ((e = pthread_cond_init(&s->done_cv, &ca)) == 0) {
                if ((e = pthread_cond_init(&s->work_cv, NULL)) == 0) {
                    if ((e = pthread_cond_init(&s->calls_cv, NULL)) == 0) s->sync_ready = 1;
                    else pthread_cond_destroy(&s->work_cv);
                }
                if (!s->sync_ready) pthread_cond_destroy(&s->done_cv);
            }
            if (!s->sync_ready) pthread_mutex_destroy(&s->mu);
        }
        pthread_condattr_destroy(&ca);
    }
    if (!s->sync_ready) {
        set_msg(err, errlen, "cannot make a mutex or condition variable (error %d)", e);
        free(s);
        return NULL;
    }
    if (mode == MODE_CUDA &&
        load_cuda(&s->cu, &s->libcuda, s->device, &s->dev, &s->ctx, &s->ctx_retained, err, errlen) != 0)
        goto fail;

    if (mode == MODE_HOST) {
        void *p = NULL;
        if ((e = posix_memalign(&p, ALIGN, s->mem_bytes)) != 0) {
            set_msg(err, errlen, "cannot allocate %zu bytes of staging buffers (error %d)", s->mem_bytes, e);
            goto fail;
        }
        s->mem = p;
    } else {
        void *p = mmap(NULL, s->mem_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (p == MAP_FAILED) {
            set_msg(err, errlen, "cannot map %zu bytes of staging buffers (errno %d)", s->mem_bytes, errno);
            goto fail;
        }
        s->mem = p;
    }
    s->workers = calloc_or_say((size_t)nthreads, sizeof *s->workers, err, errlen);
    if (s->workers == NULL) goto fail;
    for (int i = 0; i < nthreads; i++) {
        worker_t *w = &s->workers[i];
        w->s = s;
        w->bufs = calloc_or_say((size_t)bufs_per_thread, sizeof *w->bufs, err, errlen);
        if (w->bufs == NULL) goto fail;
        for (int k = 0; k < bufs_per_thread; k++) w->bufs[k].ptr = s->mem + ((size_t)i * bufs_per_thread + k) * per_buf;
    }
    if (mode == MODE_CUDA && cuda_resources(s, err, errlen) != 0) goto fail;

    /* Workers block every signal: they are for the application's threads (Python's main thread). */
    pthread_attr_t attr;
    sigset_t all, old;
    if ((e = pthread_attr_init(&attr)) != 0) {
        set_msg(err, errlen, "pthread_attr_init failed (error %d)", e);
        goto fail;
    }
    pthread_attr_setstacksize(&attr, WORKER_STACK);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int made = 0;
    for (; made < nthreads; made++) {
        if ((e = pthread_create(&s->workers[made].tid, &attr, worker_main, &s->workers[made])) != 0) break;
        s->workers[made].running = 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    pthread_mutex_lock(&s->mu);
    while (s->started < made) pthread_cond_wait(&s->done_cv, &s->mu);
    int failed = s->start_failed;
    pthread_mutex_unlock(&s->mu);
    if (made < nthreads) {
        set_msg(err, errlen, "cannot start worker thread %d of %d (error %d)", made + 1, nthreads, e);
        goto fail;
    }
    if (failed) {
        set_msg(err, errlen, "%s", s->start_err);
        goto fail;
    }
    return s;
fail:
    gds_stager_destroy(s);
    return NULL;
}

int64_t gds_stager_submit(gds_stager *s, int n, const int *fds, const int64_t *offsets, const int64_t *sizes,
                          const uint64_t *dests, char *err, size_t errlen) {
    if (n < 0) {
        set_msg(err, errlen, "negative piece count %d", n);
        return -1;
    }
    int64_t subs = 0;
    for (int i = 0; i < n; i++) {
        if (offsets[i] < 0 || sizes[i] < 0 || sizes[i] > INT64_MAX - offsets[i]) {
            set_msg(err, errlen, "piece %d: bad offset %lld or size %lld", i, (long long)offsets[i],
                    (long long)sizes[i]);
            return -1;
        }
        if (dests[i] > UINT64_MAX - (uint64_t)sizes[i]) {
            set_msg(err, errlen, "piece %d: destination range wraps around", i);
            return -1;
        }
        int64_t k = sizes[i] / (int64_t)s->buf_bytes + (sizes[i] % (int64_t)s->buf_bytes != 0);
        if (k > INT64_MAX - subs) {
            set_msg(err, errlen, "too many sub-pieces of %zu bytes", s->buf_bytes);
            return -1;
        }
        subs += k;
    }
    job_t *j = calloc(1, sizeof *j);
    piece_t *pieces = n ? malloc((size_t)n * sizeof *pieces) : NULL;
    if (j == NULL || (n && pieces == NULL)) {
        free(j);
        free(pieces);
        set_msg(err, errlen, "out of memory for a job of %d pieces", n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        pieces[i].fd = fds[i];
        pieces[i].offset = offsets[i];
        pieces[i].size = sizes[i];
        pieces[i].dest = dests[i];
    }
    j->pieces = pieces;
    j->n = n;
    j->undispatched = j->remaining = subs;
    j->state = subs ? JOB_RUNNING : JOB_DONE;
    pthread_mutex_lock(&s->mu);
    if (s->closing) {
        pthread_mutex_unlock(&s->mu);
        free_job(j);
        set_msg(err, errlen, "the stager is closed");
        return -1;
    }
    j->id = s->next_id++;
    j->tnext = s->jobs;
    s->jobs = j;
    if (subs) {
        queue_append(s, j);
        pthread_cond_broadcast(&s->work_cv);
    }
    int64_t id = j->id;
    pthread_mutex_unlock(&s->mu);
    return id;
}

int gds_stager_wait(gds_stager *s, int64_t id, int timeout_ms, int64_t *failed_piece, int *err_no, int64_t *got,
                    char *msg, size_t msglen) {
    struct timespec deadline = {0, 0};
    if (timeout_ms > 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += timeout_ms / 1000;
        deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) { deadline.tv_sec++; deadline.tv_nsec -= 1000000000L; }
    }
    int rc;
    set_msg(msg, msglen, "%s", "");
    pthread_mutex_lock(&s->mu);
    s->in_calls++;
    job_t *j = find(s, id);
    if (j == NULL) {
        set_msg(msg, msglen, "unknown job %lld", (long long)id);
        rc = -1;
        goto out;
    }
    j->waiters++;
    while (j->remaining > 0 && timeout_ms != 0) {
        if (timeout_ms < 0) pthread_cond_wait(&s->done_cv, &s->mu);
        else if (pthread_cond_timedwait(&s->done_cv, &s->mu, &deadline) == ETIMEDOUT) break;
    }
    if (j->remaining > 0) {
        rc = 1;
    } else if (j->reported) {
        set_msg(msg, msglen, "unknown job %lld (its result went to another waiter)", (long long)id);
        rc = -1;
    } else {
        j->reported = 1;
        unlink_job(s, j);
        if (j->state == JOB_DONE) {
            rc = 0;
        } else if (j->state == JOB_FAILED) {
            rc = 2;
            if (failed_piece) *failed_piece = j->err_piece;
            if (err_no) *err_no = j->err_no;
            if (got) *got = j->err_got;
            set_msg(msg, msglen, "%s", j->msg);
        } else {
            rc = 3;
            set_msg(msg, msglen, "%s", s->closing ? "the stager was closed" : "cancelled");
        }
    }
    if (--j->waiters == 0 && j->reported) free_job(j);
out:
    if (--s->in_calls == 0) pthread_cond_broadcast(&s->calls_cv);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void gds_stager_cancel(gds_stager *s, int64_t id) {
    pthread_mutex_lock(&s->mu);
    job_t *j = find(s, id);
    if (j && j->state == JOB_RUNNING) {
        j->state = JOB_CANCELLED;
        drop_undispatched(s, j);
    }
    pthread_mutex_unlock(&s->mu);
}

int64_t gds_stager_pinned_bytes(gds_stager *s) { return s->mode == MODE_CUDA ? (int64_t)s->mem_bytes : 0; }

int64_t gds_stager_buffer_bytes(gds_stager *s) { return (int64_t)s->mem_bytes; }

/* Copies issued so far (memcpy or cuMemcpyHtoDAsync calls, one per sub-piece or run of pieces). */
int64_t gds_stager_copies(gds_stager *s) { return (int64_t)atomic_load(&s->copies); }

/* ---- the copier: a window's host-to-device copies queued in one call (the mmap backend) ----
 * No threads of its own. gds_copier_copy queues copy i on streams[i % nstreams] (the caller's streams,
 * borrowed), then makes `after` wait for every stream used, through events of the copier's own: an event
 * may be recorded again as soon as the waits on it are queued (a wait takes the latest record at its call).
 * Calls on one copier come from one thread at a time (the caller's lock or thread). Host mode: memcpy, for
 * tests on machines without CUDA. */
typedef struct {
    int mode, device, nstreams;
    cuda_api cu;
    void *libcuda;
    CUdevice dev;
    CUcontext ctx;
    int ctx_retained;
    CUstream *streams;
    CUevent *joins;
} gds_copier;

void gds_copier_destroy(gds_copier *c) {
    if (c == NULL) return;
    if (c->ctx_retained) {
        CUcontext saved = NULL;
        if (c->cu.CtxGetCurrent(&saved) != 0) saved = NULL;
        c->cu.CtxSetCurrent(c->ctx);
        for (int i = 0; c->joins && i < c->nstreams; i++)
            if (c->joins[i]) c->cu.EventDestroy(c->joins[i]);
        c->cu.CtxSetCurrent(saved);
        c->cu.DevicePrimaryCtxRelease(c->dev);
    }
    free(c->joins);
    free(c->streams);
    free(c);
}

/* The copier's CUDA side: the driver, the device's primary context, one join event per stream. 0, or -1 with
 * the reason in err (what was made is given back by gds_copier_destroy). */
static int copier_cuda(gds_copier *c, char *err, size_t errlen) {
    if (load_cuda(&c->cu, &c->libcuda, c->device, &c->dev, &c->ctx, &c->ctx_retained, err, errlen) != 0) return -1;
    CUcontext saved = NULL;
    CUresult r = c->cu.CtxGetCurrent(&saved);
    if (r == 0 && (r = c->cu.CtxSetCurrent(c->ctx)) == 0) {
        for (int i = 0; i < c->nstreams && r == 0; i++) {
            r = c->cu.EventCreate(&c->joins[i], CU_EVENT_DISABLE_TIMING);
            if (r != 0) c->joins[i] = NULL;
        }
        c->cu.CtxSetCurrent(saved);
    }
    if (r == 0) return 0;
    set_msg(err, errlen, "cuEventCreate (device %d) failed: %s", c->device, cu_name(&c->cu, r));
    return -1;
}

gds_copier *gds_copier_create(int mode, int device, int nstreams, const uint64_t *streams, char *err, size_t errlen) {
    if (check_mode(mode, err, errlen) != 0) return NULL;
    if (nstreams < 1 || nstreams > 4096) {
        set_msg(err, errlen, "nstreams must be 1..4096, not %d", nstreams);
        return NULL;
    }
    gds_copier *c = calloc_or_say(1, sizeof *c, err, errlen);
    if (c == NULL) return NULL;
    c->mode = mode;
    c->device = device;
    c->nstreams = nstreams;
    c->streams = calloc_or_say((size_t)nstreams, sizeof *c->streams, err, errlen);
    if (c->streams == NULL) goto fail;
    c->joins = calloc_or_say((size_t)nstreams, sizeof *c->joins, err, errlen);
    if (c->joins == NULL) goto fail;
    for (int i = 0; i < nstreams; i++) c->streams[i] = (CUstream)(uintptr_t)streams[i];
    if (mode == MODE_HOST || copier_cuda(c, err, errlen) == 0) return c;
fail:
    gds_copier_destroy(c);
    return NULL;
}

/* Queue n copies of nbytes[i] from host address src[i] to device address dst[i] (host mode: memcpy, done on
 * return), then make stream `after` wait for all of them. 0, or -1 with a message naming the copy; *failed is
 * the index of the copy that could not be queued (the caller names its file), -1 when no copy failed. */
int gds_copier_copy(gds_copier *c, int n, const uint64_t *dst, const uint64_t *src, const int64_t *nbytes,
                    uint64_t after, int *failed, char *err, size_t errlen) {
    *failed = -1;
    if (c->mode == MODE_HOST) {
        for (int i = 0; i < n; i++)
            memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)nbytes[i]);
        return 0;
    }
    CUcontext saved = NULL;
    CUresult r = c->cu.CtxGetCurrent(&saved);
    if (r != 0 || (r = c->cu.CtxSetCurrent(c->ctx)) != 0) {
        set_msg(err, errlen, "cuCtxSetCurrent (device %d) failed: %s", c->device, cu_name(&c->cu, r));
        return -1;
    }
    int rc = 0;
    for (int i = 0; i < n; i++) {
        r = c->cu.MemcpyHtoDAsync((CUdeviceptr)dst[i], (const void *)(uintptr_t)src[i], (size_t)nbytes[i],
                                  c->streams[i % c->nstreams]);
        if (r != 0) {
            set_msg(err, errlen, "cuMemcpyHtoDAsync of copy %d of %d (%lld bytes from 0x%llx to 0x%llx) failed: %s",
                    i, n, (long long)nbytes[i], (unsigned long long)src[i], (unsigned long long)dst[i],
                    cu_name(&c->cu, r));
            rc = -1;
            *failed = i;
            n = i; /* the copies queued so far are still joined: `after` orders whatever frees their memory */
            break;
        }
    }
    int used = n < c->nstreams ? n : c->nstreams;
    for (int j = 0; j < used; j++) {
        if ((r = c->cu.EventRecord(c->joins[j], c->streams[j])) != 0 ||
            (r = c->cu.StreamWaitEvent((CUstream)(uintptr_t)after, c->joins[j], 0)) != 0) {
            if (rc == 0) set_msg(err, errlen, "joining the copies' streams failed: %s", cu_name(&c->cu, r));
            rc = -1;
            break;
        }
    }
    c->cu.CtxSetCurrent(saved);
    return rc;
}
