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

#define MAX_THREADS 16

typedef struct {
    const uint64_t *table; /* triples: dst, src, nbytes */
    Py_ssize_t regions;
    uint64_t lo, hi;       /* the byte range of the concatenated regions to copy */
} Share;

/* Copy the part of the concatenated regions that falls in [lo, hi). */
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
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        shares[t].table = table;
        shares[t].regions = regions;
        shares[t].lo = total * (uint64_t)t / (uint64_t)threads;
        shares[t].hi = total * (uint64_t)(t + 1) / (uint64_t)threads;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, copy_share, &shares[t]) == 0;
    copy_share(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            copy_share(&shares[t]); /* no thread to be had: do its share here */
    }
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

static PyMethodDef methods[] = {
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
