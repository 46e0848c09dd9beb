/*
 * kvstore.native._chain -- the chained chunk keys of kvstore.keys.chain_keys in one C loop.
 *
 * Copyright the kvstore authors. Licensed under the Apache License, Version 2.0
 * (see LICENSE at the top of the repository).
 *
 * For every full chunk of `step` bytes:
 *
 *     key[i] = XXH3_128bits_withSeed(key[i-1], 16, XXH3_64bits(chunk[i]))
 *
 * (key[-1] is `parent`, whatever its length), each key in XXH128's canonical
 * (big-endian) form: byte for byte what python-xxhash's
 * xxh3_128_digest(key[i-1], seed=xxh3_64_intdigest(chunk[i])) returns, which
 * the pure-Python path in kvstore/keys.py computes. The hashing runs with the
 * GIL released; only the list of 16-byte `bytes` is built under it.
 *
 * XXH3 comes from xxHash's single header (csrc/xxhash/xxhash.h, BSD 2-Clause,
 * Copyright Yann Collet; its license is csrc/xxhash/LICENSE), inlined here.
 * Built by setup.py as an optional extension: kvstore.keys falls back to
 * Python when this module is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

#define KEY_BYTES 16
/* Below this many input bytes, releasing the GIL costs more than it frees. */
#define RELEASE_GIL_BYTES (64 * 1024)

/* Hash `n` chunks of `step` bytes from `data` into `out` (n * KEY_BYTES bytes). */
static void
hash_chain(const unsigned char *data, Py_ssize_t step, Py_ssize_t n,
           const void *parent, size_t parent_len, unsigned char *out)
{
    const void *prev = parent;
    size_t prev_len = parent_len;
    for (Py_ssize_t i = 0; i < n; i++) {
        XXH64_hash_t seed = XXH3_64bits(data + i * step, (size_t)step);
        XXH128_hash_t key = XXH3_128bits_withSeed(prev, prev_len, seed);
        XXH128_canonicalFromHash((XXH128_canonical_t *)(out + i * KEY_BYTES), key);
        prev = out + i * KEY_BYTES;
        prev_len = KEY_BYTES;
    }
}

/* A list of `n` bytes objects, the consecutive 16-byte keys in `keys`. */
static PyObject *
keys_to_list(const unsigned char *keys, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)keys + i * KEY_BYTES, KEY_BYTES);
        if (key == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, key);
    }
    return list;
}

PyDoc_STRVAR(chain_keys_doc,
"chain_keys(data, step, parent, /)\n"
"--\n"
"\n"
"Chained keys of the full ``step``-byte chunks of ``data`` (any contiguous buffer):\n"
"``key[i] = xxh3_128(key[i-1], seed=xxh3_64(chunk[i]))``, ``key[-1] = parent``.\n"
"Returns a list of 16-byte ``bytes``; a partial last chunk gets no key.");

/* The keys of the chunks of `data` chained from `parent`, as a list (NULL: error set). */
static PyObject *
chain_buffer(const Py_buffer *data, Py_ssize_t step, const Py_buffer *parent)
{
    if (step <= 0) {
        return PyErr_Format(PyExc_ValueError, "chain_keys: step must be > 0, got %zd", step);
    }
    Py_ssize_t n = data->len / step;
    unsigned char *keys = PyMem_Malloc(n > 0 ? (size_t)n * KEY_BYTES : 1);
    if (keys == NULL) {
        return PyErr_NoMemory();
    }
    if (n * step >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        hash_chain(data->buf, step, n, parent->buf, (size_t)parent->len, keys);
        Py_END_ALLOW_THREADS
    }
    else {
        hash_chain(data->buf, step, n, parent->buf, (size_t)parent->len, keys);
    }
    PyObject *result = keys_to_list(keys, n);
    PyMem_Free(keys);
    return result;
}

static PyObject *
chain_keys(PyObject *module, PyObject *args)
{
    Py_buffer data, parent;
    Py_ssize_t step;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*ny*:chain_keys", &data, &step, &parent)) {
        return NULL;
    }
    PyObject *result = chain_buffer(&data, step, &parent);
    PyBuffer_Release(&data);
    PyBuffer_Release(&parent);
    return result;
}

static PyMethodDef chain_methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS, chain_keys_doc},
    {NULL, NULL, 0, NULL},
};

/* No module state: safe in subinterpreters and without the GIL (free-threaded builds). */
static PyModuleDef_Slot chain_slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvstore.native._chain",
    .m_doc = "Chained chunk keys (kvstore.keys.chain_keys) in one C loop over xxHash's XXH3.",
    .m_size = 0,
    .m_methods = chain_methods,
    .m_slots = chain_slots,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    return PyModuleDef_Init(&chain_module);
}
