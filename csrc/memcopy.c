/*
 * kvstore.native._memcopy -- many host-memory copies in one call, without the GIL.
 *
 * Copyright the kvstore authors. Licensed under the Apache License, Version 2.0
 * (see LICENSE at the top of the repository).
 *
 * copy_regions(table, threads): `table` is a buffer of unsigned 64-bit triples
 * (dst address, src address, byte count). Every region is memcpy'd with the GIL
 * released once for the whole batch; the bytes are split evenly over up to
 * `threads` threads (a region may be split between two of them), so a batch of
 * large regions runs at the speed of a parallel copy and a batch of small ones
 * costs one call, not one per region. Used by kvstore.copies for copies between
 * contiguous host tensors that do not coalesce: a `copy_` per region released
 * and took back the GIL each time, and a thread running Python beside it then
 * held the GIL for its whole switch interval between two copies.
 *
 * copy_verified(dst, src, sizes, checksums, threads): copies consecutive regions of
 * `src` into the same places of `dst` (region i is sizes[i] bytes, uint64), each
 * region's bytes hashed with XXH3-64 (seed 0, what xxhash.xxh3_64_intdigest gives)
 * in 64 KiB pieces just before each piece is copied, so the check reads the source
 * from cache and not from memory a second time (kvstore.format.codec verifies a
 * block's per-layer checksums this way on decode). Returns the index of the first
 * region whose hash is not checksums[i], or -1; the bad region is copied too (the
 * caller treats the whole destination as garbage then). Buffers, not addresses:
 * sizes are checked against both.
 *
 * The caller (kvstore/copies/coalescing.py) guarantees that every address is
 * valid for its byte count for the whole call and that no destination overlaps
 * another region: nothing is checked here. Built by setup.py as an optional
 * extension; without it kvstore.copies copies region by region.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

#define MAX_THREADS 16

typedef struct {
    const uint64_t *table; /* triples: dst, src, nbytes */
    Py_ssize_t regions;
    uint64_t lo, hi;       /* the byte range of the concatenated regions to copy */
} Share;

/* Copy the part of the concatenated regions that falls in [lo, hi). */
/* Run fn over threads jobs of size bytes each (jobs[0] on the calling thread); a job
 * whose thread cannot be had runs here too, after the others were started. */
static void
run_shares(void *(*fn)(void *), char *jobs, size_t size, int threads)
{
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, fn, jobs + (size_t)t * size) == 0;
    fn(jobs);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            fn(jobs + (size_t)t * size); /* no thread to be had: do its share here */
    }
}

static void *
copy_share(void *arg)
{
    const Share *share = (const Share *)arg;
    uint64_t offset = 0;
    for (Py_ssize_t i = 0; i < share->regions && offset < share->hi; i++) {
        const uint64_t *row = share->table + 3 * i;
        uint64_t n = row[2];
        uint64_t begin = offset > share->lo ? offset : share->lo;
        uint64_t end = offset + n < share->hi ? offset + n : share->hi;
        if (begin < end) {
            uint64_t skip = begin - offset;
            memcpy((char *)(uintptr_t)row[0] + skip,
                   (const char *)(uintptr_t)row[1] + skip, (size_t)(end - begin));
        }
        offset += n;
    }
    return NULL;
}

static void
copy_all(const uint64_t *table, Py_ssize_t regions, uint64_t total, int threads)
{
    Share shares[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        shares[t].table = table;
        shares[t].regions = regions;
        shares[t].lo = total * (uint64_t)t / (uint64_t)threads;
        shares[t].hi = total * (uint64_t)(t + 1) / (uint64_t)threads;
    }
    run_shares(copy_share, (char *)shares, sizeof(Share), threads);
}

static PyObject *
copy_regions(PyObject *self, PyObject *args)
{
    Py_buffer view;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*i", &view, &threads))
        return NULL;
    if (view.len % (3 * (Py_ssize_t)sizeof(uint64_t)) != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "table: a whole number of (dst, src, nbytes) triples");
        return NULL;
    }
    const uint64_t *table = (const uint64_t *)view.buf;
    Py_ssize_t regions = view.len / (3 * (Py_ssize_t)sizeof(uint64_t));
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < regions; i++)
        total += table[3 * i + 2];
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if ((uint64_t)threads > total / (1u << 20) + 1) /* at least ~1 MiB a thread */
        threads = (int)(total / (1u << 20)) + 1;
    Py_BEGIN_ALLOW_THREADS
    copy_all(table, regions, total, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

#define PIECE (64 * 1024)

typedef struct {
    char *dst;
    const char *src;
    const uint64_t *sizes, *sums, *starts;
    Py_ssize_t first, last; /* regions [first, last) */
    Py_ssize_t bad;         /* lowest mismatching region, or -1 */
} Checked;

static void *
copy_checked_share(void *arg)
{
    Checked *job = (Checked *)arg;
    XXH3_state_t state;
    job->bad = -1;
    for (Py_ssize_t i = job->first; i < job->last; i++) {
        const char *src = job->src + job->starts[i];
        char *dst = job->dst + job->starts[i];
        uint64_t n = job->sizes[i];
        XXH3_INITSTATE(&state);
        XXH3_64bits_reset(&state);
        for (uint64_t off = 0; off < n; off += PIECE) {
            size_t len = (size_t)(n - off < PIECE ? n - off : PIECE);
            XXH3_64bits_update(&state, src + off, len);
            memcpy(dst + off, src + off, len);
        }
        if (XXH3_64bits_digest(&state) != job->sums[i] && job->bad < 0)
            job->bad = i;
    }
    return NULL;
}

/* Split the regions over up to `threads` threads by bytes; the lowest bad index. */
static Py_ssize_t
copy_checked_all(Checked *base, Py_ssize_t regions, uint64_t total, int threads)
{
    Checked jobs[MAX_THREADS];
    Py_ssize_t next = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = *base;
        jobs[t].first = next;
        uint64_t upto = total * (uint64_t)(t + 1) / (uint64_t)threads;
        while (next < regions && (t == threads - 1 || base->starts[next] < upto))
            next++;
        jobs[t].last = next;
    }
    run_shares(copy_checked_share, (char *)jobs, sizeof(Checked), threads);
    for (int t = 0; t < threads; t++)
        if (jobs[t].bad >= 0)
            return jobs[t].bad; /* jobs hold ascending ranges: the first found is lowest */
    return -1;
}

static PyObject *
copy_verified(PyObject *self, PyObject *args)
{
    Py_buffer dst, src, sizes, sums;
    int threads;
    Py_ssize_t bad = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*i", &dst, &src, &sizes, &sums, &threads))
        return NULL;
    Py_ssize_t regions = sizes.len / (Py_ssize_t)sizeof(uint64_t);
    uint64_t *starts = NULL;
    const char *why = NULL;
    if (sizes.len % (Py_ssize_t)sizeof(uint64_t) != 0 || sums.len != sizes.len)
        why = "sizes and checksums: one uint64 each per region";
    else if ((starts = PyMem_Malloc(sizeof(uint64_t) * (size_t)(regions + 1))) == NULL)
        why = "out of memory";
    uint64_t total = 0;
    if (why == NULL) {
        for (Py_ssize_t i = 0; i < regions; i++) {
            starts[i] = total;
            total += ((const uint64_t *)sizes.buf)[i];
        }
        if (total > (uint64_t)dst.len || total > (uint64_t)src.len)
            why = "the regions run past the end of dst or src";
    }
    if (why == NULL) {
        if (threads < 1)
            threads = 1;
        if (threads > MAX_THREADS)
            threads = MAX_THREADS;
        if ((uint64_t)threads > total / (1u << 20) + 1) /* at least ~1 MiB a thread */
            threads = (int)(total / (1u << 20)) + 1;
        if (threads > regions && regions > 0)
            threads = (int)regions;
        Checked job = {(char *)dst.buf, (const char *)src.buf, (const uint64_t *)sizes.buf,
                       (const uint64_t *)sums.buf, starts, 0, 0, -1};
        Py_BEGIN_ALLOW_THREADS
        bad = regions > 0 ? copy_checked_all(&job, regions, total, threads) : -1;
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(starts);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&sums);
    if (why != NULL) {
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    return PyLong_FromSsize_t(bad);
}

static PyMethodDef methods[] = {
    {"copy_verified", copy_verified, METH_VARARGS,
     "copy_verified(dst, src, sizes, checksums, threads, /)\n--\n\n"
     "Copy consecutive regions of src into dst (sizes: uint64 per region), hashing each\n"
     "piece with XXH3-64 just before it is copied; the index of the first region whose\n"
     "hash is not its checksum (uint64), or -1."},
    {"copy_regions", copy_regions, METH_VARARGS,
     "copy_regions(table, threads, /)\n--\n\n"
     "memcpy every (dst, src, nbytes) triple of the uint64 buffer `table`, the GIL\n"
     "released once, the bytes split over up to `threads` threads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.native._memcopy",
    "Many host-memory copies in one call, without the GIL (csrc/memcopy.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__memcopy(void)
{
    return PyModule_Create(&module);
}
