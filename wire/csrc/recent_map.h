/* RecentMap: the RemovedLog's recent map (engine/miss.py), compiled — int key -> removal, in the
 * order keys came, as a dict does (setting a key that is there keeps its place; deleting and
 * setting it again moves it to the end). Included by miss_chains.c, which reads and writes it in
 * place (the watch side's per-event loop and its flush into the Bloom filters).
 *
 * Why not a dict: a watched server removes a block per event, so the map takes tens of
 * thousands of keys a second and lets each go 20,000 removals later. A dict of that churn holds
 * an int object per key, an entry of 24 bytes and a growing table of deleted slots that it
 * rebuilds now and then: each removal cost about five cache misses and the map ~2 MiB. Here a
 * key is its 64 bits in a ring (keys come at the head and leave at the tail, in order, so both
 * ends stay in cache) and an open-addressing index of 8 bytes a slot, (the key's hash's low 32
 * bits, its ring slot + 1), probed linearly and deleted by shifting back (no tombstones): one
 * random cache line to enter a key and one to let it go, 0.75 MiB for 20,480 keys. The hash is
 * seeded with a random number per map, so no sender can choose keys that crowd one stretch of
 * the index. (Two-choice buckets with entries that lapse when the tail passes them, so that
 * letting the oldest go costs the index nothing, were tried: entering a key then reads two
 * random lines instead of one, and the map was no faster, 130 against 115 ns a removal.)
 *
 * Keys: ints. One in [-2^63, 2^64) is kept as its 64 bits and whether it was negative; a bigger
 * one (no hash a server sends is) as its low 64 bits and the int itself, in a side array made on
 * first use. Values: any object (a Removal), one reference each. A ring slot whose key was deleted is dead (value NULL)
 * until the tail passes it; when the ring is full, dead slots are squeezed out, else it doubles.
 */
#ifndef KVPLAY_RECENT_MAP_H
#define KVPLAY_RECENT_MAP_H

/* (miss_chains.c defines before including this: `mix`, splitmix64's finalizer, and `C1`, the
 * golden-ratio constant, which also parts a negative key from the positive one of its bits) */
#ifndef PREFETCH
#define PREFETCH 8  /* how many keys ahead a loop over random lines asks for its line */
#endif

typedef struct {
    uint64_t bits;      /* the int modulo 2^64 */
    unsigned char tag;  /* 0: an int in [0, 2^64); 1: a negative int >= -2^63; 2: another int */
    PyObject *big;      /* (tag 2) the int, borrowed */
} RKey;

typedef struct {
    PyObject_HEAD
    uint64_t *key;       /* ring slot -> its key's bits */
    unsigned char *tag;  /* ring slot -> its key's tag */
    PyObject **val;      /* ring slot -> its value (NULL: dead, or not in use) */
    PyObject **big;      /* ring slot -> its key when tag 2 (NULL until one comes) */
    uint64_t *index;     /* index slot -> 0 (empty) or (hash's low 32 bits) << 32 | (ring slot + 1) */
    Py_ssize_t R, T;     /* ring slots and index slots: powers of 2 */
    Py_ssize_t tail, head;  /* the ring positions in use: [tail, head), slot = position & (R - 1) */
    Py_ssize_t live;     /* keys held */
    Py_ssize_t version;  /* changes on every insertion or deletion (an iterator checks it) */
    uint64_t seed;       /* mixed into every key's hash, drawn at random when the map is made */
} RecentMap;

static PyTypeObject RecentMapType;

static inline uint64_t rm_hash(const RecentMap *m, uint64_t bits, unsigned char tag) {
    return mix(bits ^ m->seed ^ (tag * C1));
}

/* A Python int as a key (0), or -1 with an exception (not an int). */
static int rkey_of(PyObject *k, RKey *out) {
    if (!PyLong_Check(k)) {
        PyErr_SetString(PyExc_TypeError, "a recent map's keys are ints");
        return -1;
    }
    int overflow = 0;
    out->big = NULL;
    long long v = PyLong_AsLongLongAndOverflow(k, &overflow);
    if (!overflow) {
        if (v == -1 && PyErr_Occurred()) return -1;
        out->bits = (uint64_t)v;
        out->tag = v < 0;
        return 0;
    }
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(k);
        if (!(u == (unsigned long long)-1 && PyErr_Occurred())) {
            out->bits = (uint64_t)u;
            out->tag = 0;
            return 0;
        }
        PyErr_Clear();
    }
    out->bits = PyLong_AsUnsignedLongLongMask(k);
    if (out->bits == (uint64_t)-1 && PyErr_Occurred()) return -1;
    out->tag = 2;
    out->big = k;
    return 0;
}

/* The key of a ring slot as a Python int (a new reference). */
static PyObject *rkey_int(const RecentMap *m, Py_ssize_t s) {
    if (m->tag[s] == 2) return Py_NewRef(m->big[s]);
    if (m->tag[s] == 0) return PyLong_FromUnsignedLongLong(m->key[s]);
    return PyLong_FromLongLong((long long)m->key[s]);
}

/* Whether ring slot s holds key k. */
static inline int rm_is(const RecentMap *m, Py_ssize_t s, const RKey *k) {
    if (m->key[s] != k->bits || m->tag[s] != k->tag) return 0;
    return k->tag != 2 || PyObject_RichCompareBool(m->big[s], k->big, Py_EQ) == 1;  /* (ints: no error) */
}

/* The index slot holding key k of hash h, or -1 (then *empty: where it would go). */
static Py_ssize_t rm_find(const RecentMap *m, const RKey *k, uint64_t h, Py_ssize_t *empty) {
    uint64_t mask = (uint64_t)m->T - 1, fp = h & 0xFFFFFFFFULL;
    for (uint64_t i = h & mask;; i = (i + 1) & mask) {
        uint64_t e = m->index[i];
        if (!e) {
            if (empty != NULL) *empty = (Py_ssize_t)i;
            return -1;
        }
        if ((e >> 32) == fp) {
            Py_ssize_t s = (Py_ssize_t)(uint32_t)e - 1;
            if (rm_is(m, s, k)) return (Py_ssize_t)i;
        }
    }
}

/* Empty index slot i, shifting back the entries after it that probed past it. */
static void rm_unindex(RecentMap *m, Py_ssize_t i) {
    uint64_t mask = (uint64_t)m->T - 1, hole = (uint64_t)i;
    for (uint64_t j = (hole + 1) & mask;; j = (j + 1) & mask) {
        uint64_t e = m->index[j];
        if (!e) break;
        uint64_t home = (e >> 32) & mask;  /* (T <= 2^32: the fingerprint holds the home slot) */
        /* e may fill the hole when its home is not cyclically in (hole, j] */
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->index[hole] = e;
            hole = j;
        }
    }
    m->index[hole] = 0;
}

/* Rebuild the index (T slots) from the ring's live slots. */
static int rm_reindex(RecentMap *m, Py_ssize_t T) {
    uint64_t *ix = PyMem_Calloc((size_t)T, sizeof(uint64_t));
    if (ix == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(m->index);
    m->index = ix;
    m->T = T;
    uint64_t mask = (uint64_t)T - 1;
    for (Py_ssize_t p = m->tail; p < m->head; p++) {
        Py_ssize_t s = p & (m->R - 1);
        if (m->val[s] == NULL) continue;
        uint64_t h = rm_hash(m, m->key[s], m->tag[s]), i = h & mask;
        while (ix[i]) i = (i + 1) & mask;
        ix[i] = (h << 32) | (uint64_t)(s + 1);
    }
    return 0;
}

/* A full ring: squeeze out its dead slots into a ring of R slots (the same or twice as many),
 * live ones first in order, then the index again. */
static int rm_rering(RecentMap *m, Py_ssize_t R) {
    uint64_t *key = PyMem_Malloc((size_t)R * sizeof(uint64_t));
    unsigned char *tag = PyMem_Malloc((size_t)R);
    PyObject **val = PyMem_Calloc((size_t)R, sizeof(PyObject *));
    PyObject **big = m->big == NULL ? NULL : PyMem_Calloc((size_t)R, sizeof(PyObject *));
    if (key == NULL || tag == NULL || val == NULL || (m->big != NULL && big == NULL)) {
        PyMem_Free(key);
        PyMem_Free(tag);
        PyMem_Free(val);
        PyMem_Free(big);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t p = m->tail; p < m->head; p++) {
        Py_ssize_t s = p & (m->R - 1);
        if (m->val[s] == NULL) continue;
        key[n] = m->key[s];
        tag[n] = m->tag[s];
        val[n] = m->val[s];
        if (big != NULL) big[n] = m->big[s];
        n++;
    }
    PyMem_Free(m->key);
    PyMem_Free(m->tag);
    PyMem_Free(m->val);
    PyMem_Free(m->big);
    m->key = key;
    m->tag = tag;
    m->val = val;
    m->big = big;
    m->R = R;
    m->tail = 0;
    m->head = n;
    return rm_reindex(m, m->T);
}

/* m[k] = v (a key that is there keeps its place); 0, or -1 with an exception. */
static int rm_set(RecentMap *m, RKey k, PyObject *v) {
    uint64_t h = rm_hash(m, k.bits, k.tag);
    Py_ssize_t empty = -1, i = rm_find(m, &k, h, &empty);
    if (i >= 0) {
        Py_ssize_t s = (Py_ssize_t)(uint32_t)m->index[i] - 1;
        Py_INCREF(v);
        Py_SETREF(m->val[s], v);
        return 0;
    }
    int moved = 0;
    if (m->head - m->tail == m->R) {  /* a full ring: squeeze (dead slots), else double */
        if (rm_rering(m, m->live * 2 > m->R ? m->R * 2 : m->R) < 0) return -1;
        moved = 1;
    }
    if ((m->live + 1) * 4 > m->T * 3) {  /* the index at most 3/4 full */
        if (m->T >= ((Py_ssize_t)1 << 31)) {
            PyErr_SetString(PyExc_MemoryError, "a recent map this large");
            return -1;
        }
        if (rm_reindex(m, m->T * 2) < 0) return -1;
        moved = 1;
    }
    if (k.tag == 2 && m->big == NULL && (m->big = PyMem_Calloc((size_t)m->R, sizeof(PyObject *))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (moved) rm_find(m, &k, h, &empty);
    Py_ssize_t s = m->head & (m->R - 1);
    m->key[s] = k.bits;
    m->tag[s] = k.tag;
    if (k.tag == 2) m->big[s] = Py_NewRef(k.big);
    m->val[s] = Py_NewRef(v);
    m->index[empty] = (h << 32) | (uint64_t)(s + 1);
    m->head++;
    m->live++;
    m->version++;
    return 0;
}

/* The value of key k (borrowed), or NULL. */
static PyObject *rm_get(const RecentMap *m, RKey k) {
    if (!m->live) return NULL;
    Py_ssize_t i = rm_find(m, &k, rm_hash(m, k.bits, k.tag), NULL);
    return i < 0 ? NULL : m->val[(uint32_t)m->index[i] - 1];
}

/* Take key k out: its value (a new reference), or NULL when it is not there. */
/* Ring slot s is dead: its key's int (a big one) let go. */
static void rm_drop_key(RecentMap *m, Py_ssize_t s) {
    if (m->tag[s] == 2) Py_CLEAR(m->big[s]);
}

static PyObject *rm_pop(RecentMap *m, RKey k) {
    if (!m->live) return NULL;
    Py_ssize_t i = rm_find(m, &k, rm_hash(m, k.bits, k.tag), NULL);
    if (i < 0) return NULL;
    Py_ssize_t s = (Py_ssize_t)(uint32_t)m->index[i] - 1;
    PyObject *v = m->val[s];
    m->val[s] = NULL;
    rm_unindex(m, i);
    rm_drop_key(m, s);
    m->live--;
    m->version++;
    while (m->tail < m->head && m->val[m->tail & (m->R - 1)] == NULL) m->tail++;
    if (m->tail == m->head) m->tail = m->head = 0;
    return v;
}

/* Take the `n` oldest keys out (fewer when it holds fewer): their bits and values (new references)
 * into `bits` and `vals`; how many. Their index slots are asked for a few keys ahead (the misses
 * overlap). */
static Py_ssize_t rm_pop_oldest_n(RecentMap *m, Py_ssize_t n, uint64_t *bits, PyObject **vals) {
    Py_ssize_t got = 0, p = m->tail, ahead = m->tail;
    uint64_t mask = (uint64_t)m->T - 1, hs[PREFETCH];  /* (the hashes of the slots asked for, by position) */
    while (got < n && p < m->head) {
        for (; ahead < m->head && ahead < p + PREFETCH; ahead++) {
            Py_ssize_t a = ahead & (m->R - 1);
            hs[ahead % PREFETCH] = rm_hash(m, m->key[a], m->tag[a]);
            if (m->val[a] != NULL) __builtin_prefetch(&m->index[hs[ahead % PREFETCH] & mask], 1);
        }
        uint64_t h = hs[p % PREFETCH];
        Py_ssize_t s = p++ & (m->R - 1);
        if (m->val[s] == NULL) continue;
        RKey k = {m->key[s], m->tag[s], m->tag[s] == 2 ? m->big[s] : NULL};
        rm_unindex(m, rm_find(m, &k, h, NULL));
        bits[got] = k.bits;
        vals[got++] = m->val[s];
        m->val[s] = NULL;
        rm_drop_key(m, s);
        m->live--;
    }
    m->tail = p;
    if (m->tail == m->head) m->tail = m->head = 0;
    m->version++;
    return got;
}

static void rm_clear(RecentMap *m) {
    PyObject **vals = m->val, **bigs = m->big;
    Py_ssize_t R = m->R;
    PyObject **fresh = PyMem_Calloc((size_t)R, sizeof(PyObject *));
    if (fresh == NULL) {  /* (no memory for a new ring: clear this one in place) */
        for (Py_ssize_t s = 0; s < R; s++) Py_CLEAR(vals[s]);
        vals = NULL;
    } else {
        m->val = fresh;
    }
    m->big = NULL;
    memset(m->index, 0, (size_t)m->T * sizeof(uint64_t));
    m->tail = m->head = m->live = 0;
    m->version++;
    if (vals != NULL) {  /* (the old values let go last: a value's release cannot see a half-cleared map) */
        for (Py_ssize_t s = 0; s < R; s++) Py_XDECREF(vals[s]);
        PyMem_Free(vals);
    }
    if (bigs != NULL) {
        for (Py_ssize_t s = 0; s < R; s++) Py_XDECREF(bigs[s]);
        PyMem_Free(bigs);
    }
}

static Py_ssize_t pow2_at_least(Py_ssize_t n) {
    Py_ssize_t p = 16;
    while (p < n && p < ((Py_ssize_t)1 << 30)) p <<= 1;
    return p;
}

/* A random 64-bit seed (os.urandom): 0, or -1 with an exception. */
static int rm_random_seed(uint64_t *out) {
    PyObject *os = PyImport_ImportModule("os");
    PyObject *b = os == NULL ? NULL : PyObject_CallMethod(os, "urandom", "i", 8);
    Py_XDECREF(os);
    if (b == NULL) return -1;
    int ok = PyBytes_Check(b) && PyBytes_GET_SIZE(b) == 8;
    if (ok) memcpy(out, PyBytes_AS_STRING(b), 8);
    Py_DECREF(b);
    if (!ok) PyErr_SetString(PyExc_RuntimeError, "os.urandom(8)");
    return ok ? 0 : -1;
}

/* RecentMap(capacity=16, seed=None): room for `capacity` keys before it grows. Its keys' hashes
 * are seeded (with `seed`, else a random number): keys whose unseeded hashes share their low
 * bits would otherwise all probe from one index slot, a cluster every later key walks (a
 * publisher's crafted removals made each one cost ~10 µs instead of ~0.1). */
static PyObject *rm_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"capacity", "seed", NULL};
    Py_ssize_t cap = 16;
    PyObject *seed = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|nO", kwlist, &cap, &seed)) return NULL;
    if (cap < 1 || cap > ((Py_ssize_t)1 << 28)) {
        PyErr_SetString(PyExc_ValueError, "capacity: 1 to 2^28 keys");
        return NULL;
    }
    uint64_t sd = 0;
    if (seed == Py_None) {
        if (rm_random_seed(&sd) < 0) return NULL;
    } else if (!PyLong_Check(seed)) {
        PyErr_SetString(PyExc_TypeError, "seed: an int or None");
        return NULL;
    } else {
        sd = PyLong_AsUnsignedLongLongMask(seed);
        if (sd == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    RecentMap *m = (RecentMap *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    m->seed = sd;
    m->R = pow2_at_least(cap + cap / 4);
    m->T = pow2_at_least(cap + cap / 2);
    m->key = PyMem_Malloc((size_t)m->R * sizeof(uint64_t));
    m->tag = PyMem_Malloc((size_t)m->R);
    m->val = PyMem_Calloc((size_t)m->R, sizeof(PyObject *));
    m->index = PyMem_Calloc((size_t)m->T, sizeof(uint64_t));
    if (m->key == NULL || m->tag == NULL || m->val == NULL || m->index == NULL) {
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    return (PyObject *)m;
}

static int rm_traverse(RecentMap *m, visitproc visit, void *arg) {
    if (m->val != NULL)
        for (Py_ssize_t p = m->tail; p < m->head; p++) Py_VISIT(m->val[p & (m->R - 1)]);
    return 0;
}

static int rm_tp_clear(RecentMap *m) {
    if (m->val != NULL && m->index != NULL) rm_clear(m);
    return 0;
}

static void rm_dealloc(RecentMap *m) {
    PyObject_GC_UnTrack(m);
    if (m->val != NULL)
        for (Py_ssize_t p = m->tail; p < m->head; p++) Py_XDECREF(m->val[p & (m->R - 1)]);
    if (m->big != NULL)
        for (Py_ssize_t s = 0; s < m->R; s++) Py_XDECREF(m->big[s]);
    PyMem_Free(m->big);
    PyMem_Free(m->key);
    PyMem_Free(m->tag);
    PyMem_Free(m->val);
    PyMem_Free(m->index);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t rm_len(RecentMap *m) { return m->live; }

static PyObject *rm_subscript(RecentMap *m, PyObject *key) {
    RKey k;
    if (rkey_of(key, &k) < 0) return NULL;
    PyObject *v = rm_get(m, k);
    if (v == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return Py_NewRef(v);
}

static int rm_ass_subscript(RecentMap *m, PyObject *key, PyObject *v) {
    RKey k;
    if (rkey_of(key, &k) < 0) return -1;
    if (v != NULL) return rm_set(m, k, v);
    PyObject *old = rm_pop(m, k);
    if (old == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Py_DECREF(old);
    return 0;
}

static int rm_contains(RecentMap *m, PyObject *key) {
    RKey k;
    if (!PyLong_Check(key)) return 0;
    if (rkey_of(key, &k) < 0) return -1;
    return rm_get(m, k) != NULL;
}

static PyObject *rm_get_m(RecentMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *dflt = nargs > 1 ? args[1] : Py_None;
    RKey k;
    if (!PyLong_Check(args[0])) return Py_NewRef(dflt);
    if (rkey_of(args[0], &k) < 0) return NULL;
    PyObject *v = rm_get(m, k);
    return Py_NewRef(v != NULL ? v : dflt);
}

static PyObject *rm_pop_m(RecentMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    RKey k;
    PyObject *v = NULL;
    if (PyLong_Check(args[0])) {
        if (rkey_of(args[0], &k) < 0) return NULL;
        v = rm_pop(m, k);
    }
    if (v != NULL) return v;
    if (nargs > 1) return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

/* update(pairs): m[k] = v for each (k, v) of an iterable of pairs, in order. */
static PyObject *rm_update(RecentMap *m, PyObject *pairs) {
    PyObject *it = PyObject_GetIter(pairs), *p;
    if (it == NULL) return NULL;
    while ((p = PyIter_Next(it)) != NULL) {
        RKey k;
        int bad = !PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2;
        if (bad) PyErr_SetString(PyExc_TypeError, "update takes (key, value) pairs");
        else bad = rkey_of(PyTuple_GET_ITEM(p, 0), &k) < 0 || rm_set(m, k, PyTuple_GET_ITEM(p, 1)) < 0;
        Py_DECREF(p);
        if (bad) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* A list of the keys (what 0), the values (1) or (key, value) pairs (2), oldest first. */
static PyObject *rm_list(RecentMap *m, int what) {
    PyObject *out = PyList_New(m->live);
    if (out == NULL) return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t p = m->tail; p < m->head && n < m->live; p++) {
        Py_ssize_t s = p & (m->R - 1);
        PyObject *v = m->val[s];
        if (v == NULL) continue;
        PyObject *x;
        if (what == 1) x = Py_NewRef(v);
        else {
            PyObject *k = rkey_int(m, s);
            if (k == NULL) { Py_DECREF(out); return NULL; }
            x = what == 0 ? k : PyTuple_Pack(2, k, v);
            if (what == 2) Py_DECREF(k);
            if (x == NULL) { Py_DECREF(out); return NULL; }
        }
        PyList_SET_ITEM(out, n++, x);
    }
    return out;
}

static PyObject *rm_keys(RecentMap *m, PyObject *unused) { return rm_list(m, 0); }
static PyObject *rm_values(RecentMap *m, PyObject *unused) { return rm_list(m, 1); }
static PyObject *rm_items(RecentMap *m, PyObject *unused) { return rm_list(m, 2); }

static PyObject *rm_iter(RecentMap *m) {  /* (over a list of the keys: changing the map while iterating is safe) */
    PyObject *keys = rm_list(m, 0);
    if (keys == NULL) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *rm_clear_m(RecentMap *m, PyObject *unused) {
    rm_clear(m);
    Py_RETURN_NONE;
}

static PyObject *rm_nbytes(RecentMap *m, void *unused) {
    return PyLong_FromSsize_t(m->R * (Py_ssize_t)(sizeof(uint64_t) + 1 + sizeof(PyObject *))
                              + m->T * (Py_ssize_t)sizeof(uint64_t));
}

static PyMethodDef rm_methods[] = {
    {"get", (PyCFunction)(void (*)(void))rm_get_m, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))rm_pop_m, METH_FASTCALL, "pop(key[, default])"},
    {"update", (PyCFunction)rm_update, METH_O, "update(pairs): set each (key, value), in order"},
    {"keys", (PyCFunction)rm_keys, METH_NOARGS, "the keys, oldest first (a list)"},
    {"values", (PyCFunction)rm_values, METH_NOARGS, "the values, oldest first (a list)"},
    {"items", (PyCFunction)rm_items, METH_NOARGS, "(key, value) pairs, oldest first (a list)"},
    {"clear", (PyCFunction)rm_clear_m, METH_NOARGS, "take every key out"},
    {NULL, NULL, 0, NULL},
};

/* The longest run of occupied index slots: the most slots a probe can walk. */
static PyObject *rm_longest_run(RecentMap *m, void *unused) {
    Py_ssize_t best = 0, run = 0, start = 0;
    while (start < m->T && m->index[start]) start++;  /* (a run that wraps around is counted whole) */
    for (Py_ssize_t j = 1; j <= m->T; j++) {
        if (m->index[(start + j) & (m->T - 1)]) {
            if (++run > best) best = run;
        } else {
            run = 0;
        }
    }
    return PyLong_FromSsize_t(best);
}

static PyGetSetDef rm_getset[] = {
    {"nbytes", (getter)rm_nbytes, NULL, "bytes of its ring and index", NULL},
    {"longest_run", (getter)rm_longest_run, NULL, "the longest run of occupied index slots (a probe walks at most this far)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods rm_as_mapping = {(lenfunc)rm_len, (binaryfunc)rm_subscript, (objobjargproc)rm_ass_subscript};
static PySequenceMethods rm_as_sequence = {.sq_contains = (objobjproc)rm_contains};

static PyTypeObject RecentMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvplay_miss_chains.RecentMap",
    .tp_basicsize = sizeof(RecentMap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "int key -> removal in the order keys came (a dict's behaviour), a ring and an index: "
              "the RemovedLog's recent map, compiled.",
    .tp_new = rm_new,
    .tp_dealloc = (destructor)rm_dealloc,
    .tp_traverse = (traverseproc)rm_traverse,
    .tp_clear = (inquiry)rm_tp_clear,
    .tp_iter = (getiterfunc)rm_iter,
    .tp_methods = rm_methods,
    .tp_getset = rm_getset,
    .tp_as_mapping = &rm_as_mapping,
    .tp_as_sequence = &rm_as_sequence,
};

#endif
