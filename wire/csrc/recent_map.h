/* RecentMap: the RemovedLog's recent map (engine/miss.py), compiled — int key -> removal, in the
 * order keys came, as a dict does (setting a key that is there keeps its place; deleting and
 * setting it again moves it to the end). Included by miss_chains.c, which reads and writes it in
 * place (the watch side's per-event loop and its flush into the Bloom filters).
 *
 * Why not a dict: a watched server removes a block per event, so the map takes tens of
 * thousands of keys a second and lets each go 20,000 removals later, in the order they came. A
 * dict of that churn holds an int object per key, an entry of 24 bytes and a growing table of
 * deleted slots that it rebuilds now and then (about five cache misses a removal, ~2 MiB).
 *
 * Here the keys live in generations of F keys (a quarter of the capacity, a power of 2), oldest
 * first, each with its own small index and filter, and only the newest takes keys:
 * - a key comes: each generation's filter (16 bits a key, three probes in one 64-bit word, 8
 *   KiB for 4,096 keys) says whether it may hold the key already (then its index is asked), and
 *   the key goes into the newest generation's index (32 KiB for 4,096 keys, at most half full,
 *   probed linearly): small enough to stay in cache, where one index over every key was 256 KiB
 *   of random lines;
 * - the oldest keys leave in order (a flush): the oldest generation is read front to back, and
 *   once read whole it is let go at once (its index and filter zeroed for the next one), where
 *   one index had to find and delete each key;
 * - a lookup asks the filters, and the index of a generation whose filter may hold the key:
 *   a key that was never removed mostly costs a few filter words and no index line at all.
 * A generation's index is never deleted from (a deleted key's slot is dead: its value NULL), so
 * it is never more than half full; a generation whose keys were all taken out is let go.
 * Measured: docs/miss.md ("Cost"). (Tried before: one open-addressing index over a ring of all
 * the keys, deleted by shifting back, 115 ns a removal on the mirror bench's stream; two-choice
 * buckets whose entries lapse, 130 ns.)
 *
 * The hashes are seeded with a random number per map, so no sender can choose keys that crowd
 * one stretch of an index (and a generation's index holds at most F keys whatever they are).
 *
 * Keys: ints. One in [-2^63, 2^64) is kept as its 64 bits and whether it was negative; a bigger
 * one (no hash a server sends is) as its low 64 bits and the int itself, in a side array made on
 * first use. Values: any object (a Removal), one reference each.
 */
#ifndef KVPLAY_RECENT_MAP_H
#define KVPLAY_RECENT_MAP_H

/* (miss_chains.c defines before including this: `mix`, splitmix64's finalizer, and `C1`, the
 * golden-ratio constant, which also parts a negative key from the positive one of its bits) */

typedef struct {
    uint64_t bits;      /* the int modulo 2^64 */
    unsigned char tag;  /* 0: an int in [0, 2^64); 1: a negative int >= -2^63; 2: another int */
    PyObject *big;      /* (tag 2) the int, borrowed */
} RKey;

/* One generation: up to F keys in the order they came. */
typedef struct {
    uint64_t *key;       /* slot -> its key's bits */
    unsigned char *tag;  /* slot -> its key's tag */
    PyObject **val;      /* slot -> its value (NULL: taken out, or not filled yet) */
    PyObject **big;      /* slot -> its key when tag 2 (NULL until one comes) */
    uint32_t *index;     /* index slot -> 0 (empty) or fingerprint << sbits | (slot + 1) */
    uint64_t *filter;    /* F / 4 words: three bits of each key's word set */
    Py_ssize_t used;     /* slots filled (the next key goes to slot `used`) */
    Py_ssize_t live;     /* of them, those with a value */
} Gen;

typedef struct {
    PyObject_HEAD
    Gen *gen;            /* the generations, oldest first: gen[0 .. ngen) (the newest takes keys) */
    Py_ssize_t ngen, gcap;
    Py_ssize_t first;    /* gen[0]'s slots before this one have left (the oldest first) */
    Gen spare;           /* a let-go generation's zeroed arrays, for the next one (key NULL: none) */
    Py_ssize_t F, T, W;  /* slots, index slots (2F) and filter words (F / 4) of a generation */
    int sbits;           /* bits of an index entry for slot + 1 */
    Py_ssize_t live;     /* keys held */
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

/* The key of slot s of a generation as a Python int (a new reference). */
static PyObject *rkey_int(const Gen *g, Py_ssize_t s) {
    if (g->tag[s] == 2) return Py_NewRef(g->big[s]);
    if (g->tag[s] == 0) return PyLong_FromUnsignedLongLong(g->key[s]);
    return PyLong_FromLongLong((long long)g->key[s]);
}

/* A key's filter probes: its word (low bits of a second mix) and three bits of it. */
typedef struct { Py_ssize_t word; uint64_t bits; } Probe;

static inline Probe rm_probe(const RecentMap *m, uint64_t h) {
    uint64_t x = mix(h ^ C1);
    Probe p = {(Py_ssize_t)(x & (uint64_t)(m->W - 1)),
               (1ULL << ((x >> 40) & 63)) | (1ULL << ((x >> 46) & 63)) | (1ULL << ((x >> 52) & 63))};
    return p;
}

/* The live slot of key k (hash h) in generation g, or -1. */
static Py_ssize_t gen_find(const RecentMap *m, const Gen *g, const RKey *k, uint64_t h, Probe p) {
    if ((g->filter[p.word] & p.bits) != p.bits) return -1;
    uint32_t mask = (uint32_t)m->T - 1, fp = (uint32_t)(h >> 32) >> m->sbits, smask = (1u << m->sbits) - 1;
    for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
        uint32_t e = g->index[i];
        if (!e) return -1;
        if (e >> m->sbits != fp) continue;
        Py_ssize_t s = (Py_ssize_t)(e & smask) - 1;
        if (g->val[s] == NULL || g->key[s] != k->bits || g->tag[s] != k->tag) continue;
        if (k->tag != 2 || PyObject_RichCompareBool(g->big[s], k->big, Py_EQ) == 1) return s;  /* (ints: no error) */
    }
}

/* Where key k (hash h) is held: its generation's number (and *slot), or -1. */
static Py_ssize_t rm_find(const RecentMap *m, const RKey *k, uint64_t h, Py_ssize_t *slot) {
    Probe p = rm_probe(m, h);
    for (Py_ssize_t i = m->ngen - 1; i >= 0; i--) {
        Py_ssize_t s = gen_find(m, &m->gen[i], k, h, p);
        if (s >= 0) {
            *slot = s;
            return i;
        }
    }
    return -1;
}

static void gen_free(Gen *g) {
    PyMem_Free(g->key);
    PyMem_Free(g->tag);
    PyMem_Free(g->val);
    PyMem_Free(g->big);
    PyMem_Free(g->index);
    PyMem_Free(g->filter);
    memset(g, 0, sizeof *g);
}

/* A new, empty generation's arrays in g (the spare's where there is one): 0, or -1 with an exception. */
static int gen_make(RecentMap *m, Gen *g) {
    if (m->spare.key != NULL) {
        *g = m->spare;
        memset(&m->spare, 0, sizeof m->spare);
        return 0;
    }
    memset(g, 0, sizeof *g);
    g->key = PyMem_Malloc((size_t)m->F * sizeof(uint64_t));
    g->tag = PyMem_Malloc((size_t)m->F);
    g->val = PyMem_Calloc((size_t)m->F, sizeof(PyObject *));
    g->index = PyMem_Calloc((size_t)m->T, sizeof(uint32_t));
    g->filter = PyMem_Calloc((size_t)m->W, sizeof(uint64_t));
    if (g->key == NULL || g->tag == NULL || g->val == NULL || g->index == NULL || g->filter == NULL) {
        gen_free(g);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The big keys of generation g's slots let go (its side array kept). */
static void gen_let_bigs_go(Gen *g) {
    if (g->big != NULL)
        for (Py_ssize_t s = 0; s < g->used; s++) Py_CLEAR(g->big[s]);
}

/* Generation g, its values already taken out, empty again: its big keys let go, its index and
 * filter zeroed (its values are all NULL). */
static void gen_empty(const RecentMap *m, Gen *g) {
    gen_let_bigs_go(g);
    memset(g->index, 0, (size_t)m->T * sizeof(uint32_t));
    memset(g->filter, 0, (size_t)m->W * sizeof(uint64_t));
    g->used = g->live = 0;
}

/* Let generation g go, its values already taken out: emptied and kept as the spare (freed when
 * there is one). */
static void gen_drop(RecentMap *m, Gen *g) {
    if (m->spare.key != NULL) {
        gen_let_bigs_go(g);
        gen_free(g);
        return;
    }
    gen_empty(m, g);
    PyMem_Free(g->big);
    g->big = NULL;
    m->spare = *g;
    memset(g, 0, sizeof *g);
}

/* Generation i has no live keys: let it go (the newest, which takes keys, is emptied instead). */
static void rm_let_go(RecentMap *m, Py_ssize_t i) {
    if (i == m->ngen - 1) {  /* the newest: emptied in place */
        gen_empty(m, &m->gen[i]);
        if (i == 0) m->first = 0;
        return;
    }
    gen_drop(m, &m->gen[i]);
    memmove(&m->gen[i], &m->gen[i + 1], (size_t)(m->ngen - i - 1) * sizeof(Gen));
    m->ngen--;
    if (i == 0) m->first = 0;
}

/* Key k (hash h, not held) into slot s of generation g, which has room and, for a big key, its
 * side array; the references to the value and a big key are the caller's, handed over. */
static void gen_put(const RecentMap *m, Gen *g, const RKey *k, uint64_t h, PyObject *v) {
    Py_ssize_t s = g->used++;
    g->key[s] = k->bits;
    g->tag[s] = k->tag;
    if (k->tag == 2) g->big[s] = k->big;
    g->val[s] = v;
    g->live++;
    uint32_t mask = (uint32_t)m->T - 1, j = (uint32_t)h & mask;
    while (g->index[j]) j = (j + 1) & mask;  /* (at most F of 2F slots are ever filled) */
    g->index[j] = ((uint32_t)(h >> 32) >> m->sbits << m->sbits) | (uint32_t)(s + 1);
    Probe p = rm_probe(m, h);
    g->filter[p.word] |= p.bits;
}

/* Room for `n` generations in the list: 0, or -1 with an exception. */
static int rm_room(RecentMap *m, Py_ssize_t n) {
    if (n <= m->gcap) return 0;
    Py_ssize_t cap = m->gcap ? m->gcap : 8;
    while (cap < n) cap *= 2;
    Gen *gs = PyMem_Realloc(m->gen, (size_t)cap * sizeof(Gen));
    if (gs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->gen = gs;
    m->gcap = cap;
    return 0;
}

/* Squeeze out the slots of keys taken out (deleted ones, and a key set again after it was
 * deleted, leave dead slots behind in their generation until it is let go): the live keys, in
 * order, into as few new generations as hold them. 0, or -1 with an exception (then unchanged). */
static int rm_compact(RecentMap *m) {
    Py_ssize_t need = (m->live + m->F - 1) / m->F, made = 0;
    Gen *ng = PyMem_Calloc((size_t)(need ? need : 1), sizeof(Gen));
    int bad = ng == NULL;
    while (!bad && made < need) bad = gen_make(m, &ng[made++]) < 0;
    Py_ssize_t at = 0;  /* (where each big key goes: its generation gets a side array first) */
    for (Py_ssize_t i = 0; !bad && i < m->ngen; i++)
        for (Py_ssize_t s = i == 0 ? m->first : 0; !bad && s < m->gen[i].used; s++) {
            if (m->gen[i].val[s] == NULL) continue;
            Gen *g = &ng[at++ / m->F];
            if (m->gen[i].tag[s] == 2 && g->big == NULL)
                bad = (g->big = PyMem_Calloc((size_t)m->F, sizeof(PyObject *))) == NULL;
        }
    if (bad) {
        for (Py_ssize_t i = 0; ng != NULL && i < need; i++) gen_free(&ng[i]);
        PyMem_Free(ng);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t cur = 0;
    for (Py_ssize_t i = 0; i < m->ngen; i++) {
        Gen *g = &m->gen[i];
        for (Py_ssize_t s = i == 0 ? m->first : 0; s < g->used; s++) {
            if (g->val[s] == NULL) continue;
            if (ng[cur].used == m->F) cur++;
            RKey k = {g->key[s], g->tag[s], g->tag[s] == 2 ? g->big[s] : NULL};
            gen_put(m, &ng[cur], &k, rm_hash(m, k.bits, k.tag), g->val[s]);  /* (references moved) */
            g->val[s] = NULL;
            if (g->tag[s] == 2) g->big[s] = NULL;
        }
        gen_free(g);
    }
    PyMem_Free(m->gen);
    m->gen = ng;
    m->ngen = need;
    m->gcap = need ? need : 1;
    m->first = 0;
    return 0;
}

/* m[k] = v (a key that is there keeps its place); 0, or -1 with an exception. */
static int rm_set(RecentMap *m, RKey k, PyObject *v) {
    uint64_t h = rm_hash(m, k.bits, k.tag);
    Py_ssize_t s;
    Py_ssize_t i = rm_find(m, &k, h, &s);
    if (i >= 0) {
        Py_INCREF(v);
        Py_SETREF(m->gen[i].val[s], v);
        return 0;
    }
    if (m->ngen == 0 || m->gen[m->ngen - 1].used == m->F) {  /* a new generation takes the keys */
        /* (more than twice the slots the live keys need: the dead ones squeezed out first, so
         * that deleting and setting keys again cannot hold more than that) */
        if (m->ngen > 2 && m->ngen * m->F > 2 * (m->live + m->F) && rm_compact(m) < 0) return -1;
        if (m->ngen == 0 || m->gen[m->ngen - 1].used == m->F) {
            if (rm_room(m, m->ngen + 1) < 0 || gen_make(m, &m->gen[m->ngen]) < 0) return -1;
            m->ngen++;
        }
    }
    Gen *g = &m->gen[m->ngen - 1];
    if (k.tag == 2 && g->big == NULL && (g->big = PyMem_Calloc((size_t)m->F, sizeof(PyObject *))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (k.tag == 2) Py_INCREF(k.big);
    gen_put(m, g, &k, h, Py_NewRef(v));
    m->live++;
    return 0;
}

/* The value of key k (borrowed), or NULL. */
static PyObject *rm_get(const RecentMap *m, RKey k) {
    if (!m->live) return NULL;
    Py_ssize_t s, i = rm_find(m, &k, rm_hash(m, k.bits, k.tag), &s);
    return i < 0 ? NULL : m->gen[i].val[s];
}

/* Slot s of generation g has left: its value's reference handed over, its big key let go. */
static inline void rm_vacate(RecentMap *m, Gen *g, Py_ssize_t s) {
    g->val[s] = NULL;
    if (g->tag[s] == 2) Py_CLEAR(g->big[s]);
    g->live--;
    m->live--;
}

/* Take key k out: its value (a new reference), or NULL when it is not there. */
static PyObject *rm_pop(RecentMap *m, RKey k) {
    if (!m->live) return NULL;
    Py_ssize_t s, i = rm_find(m, &k, rm_hash(m, k.bits, k.tag), &s);
    if (i < 0) return NULL;
    Gen *g = &m->gen[i];
    PyObject *v = g->val[s];
    rm_vacate(m, g, s);
    if (!g->live) rm_let_go(m, i);
    else if (i == 0)
        while (m->first < g->used && g->val[m->first] == NULL) m->first++;
    return v;
}

/* Take the `n` oldest keys out (fewer when it holds fewer): their bits and values (new references)
 * into `bits` and `vals`; how many. Read front to back; a generation read whole is let go. */
static Py_ssize_t rm_pop_oldest_n(RecentMap *m, Py_ssize_t n, uint64_t *bits, PyObject **vals) {
    Py_ssize_t got = 0;
    while (got < n && m->live > 0) {
        Gen *g = &m->gen[0];
        while (m->first < g->used && got < n) {
            Py_ssize_t s = m->first++;
            if (g->val[s] == NULL) continue;
            bits[got] = g->key[s];
            vals[got++] = g->val[s];
            rm_vacate(m, g, s);
        }
        if (!g->live) rm_let_go(m, 0);  /* (read whole: the next is the oldest; the newest is emptied) */
    }
    return got;
}

/* Every key out; the old values let go last (a value's release cannot see a half-cleared map). */
static void rm_clear(RecentMap *m) {
    Gen *gs = m->gen;
    Py_ssize_t n = m->ngen, first = m->first;
    m->gen = NULL;
    m->ngen = m->gcap = 0;
    m->first = 0;
    m->live = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Gen *g = &gs[i];
        for (Py_ssize_t s = i == 0 ? first : 0; s < g->used; s++) Py_CLEAR(g->val[s]);
        gen_let_bigs_go(g);
        gen_free(g);
    }
    PyMem_Free(gs);
}

static Py_ssize_t pow2_at_most(Py_ssize_t n) {
    Py_ssize_t p = 1;
    while (p * 2 <= n) p <<= 1;
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

/* RecentMap(capacity=16, seed=None): keys in generations of a quarter of `capacity` (a power of
 * 2, at least 16), as many as it holds. Its keys' hashes are seeded (with `seed`, else a random
 * number): keys whose unseeded hashes share their low bits would otherwise all probe from one
 * index slot, a cluster every later key walks. */
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
    m->F = pow2_at_most(cap / 4 < 16 ? 16 : cap / 4);
    m->T = 2 * m->F;
    m->W = m->F / 4;
    m->sbits = 1;
    while (((Py_ssize_t)1 << m->sbits) <= m->F) m->sbits++;  /* (slot + 1 <= F) */
    return (PyObject *)m;
}

static int rm_traverse(RecentMap *m, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < m->ngen; i++)
        for (Py_ssize_t s = i == 0 ? m->first : 0; s < m->gen[i].used; s++) Py_VISIT(m->gen[i].val[s]);
    return 0;
}

static int rm_tp_clear(RecentMap *m) {
    rm_clear(m);
    return 0;
}

static void rm_dealloc(RecentMap *m) {
    PyObject_GC_UnTrack(m);
    rm_clear(m);
    gen_free(&m->spare);
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
    for (Py_ssize_t i = 0; i < m->ngen; i++) {
        const Gen *g = &m->gen[i];
        for (Py_ssize_t s = i == 0 ? m->first : 0; s < g->used && n < m->live; s++) {
            PyObject *v = g->val[s];
            if (v == NULL) continue;
            PyObject *x;
            if (what == 1) x = Py_NewRef(v);
            else {
                PyObject *k = rkey_int(g, s);
                if (k == NULL) { Py_DECREF(out); return NULL; }
                x = what == 0 ? k : PyTuple_Pack(2, k, v);
                if (what == 2) Py_DECREF(k);
                if (x == NULL) { Py_DECREF(out); return NULL; }
            }
            PyList_SET_ITEM(out, n++, x);
        }
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

/* The bytes of a generation's arrays (without a side array of big keys). */
static Py_ssize_t gen_nbytes(const RecentMap *m) {
    return m->F * (Py_ssize_t)(sizeof(uint64_t) + 1 + sizeof(PyObject *)) + m->T * (Py_ssize_t)sizeof(uint32_t)
           + m->W * (Py_ssize_t)sizeof(uint64_t);
}

static PyObject *rm_nbytes(RecentMap *m, void *unused) {
    Py_ssize_t n = (m->ngen + (m->spare.key != NULL)) * gen_nbytes(m) + m->gcap * (Py_ssize_t)sizeof(Gen);
    for (Py_ssize_t i = 0; i < m->ngen; i++)
        if (m->gen[i].big != NULL) n += m->F * (Py_ssize_t)sizeof(PyObject *);
    return PyLong_FromSsize_t(n);
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

/* The longest run of occupied index slots in any generation: the most slots a probe can walk. */
static PyObject *rm_longest_run(RecentMap *m, void *unused) {
    Py_ssize_t best = 0;
    for (Py_ssize_t i = 0; i < m->ngen; i++) {
        const uint32_t *ix = m->gen[i].index;
        Py_ssize_t run = 0, start = 0;
        while (start < m->T && ix[start]) start++;  /* (a run that wraps around is counted whole) */
        for (Py_ssize_t j = 1; j <= m->T; j++) {
            if (ix[(start + j) & (m->T - 1)]) {
                if (++run > best) best = run;
            } else {
                run = 0;
            }
        }
    }
    return PyLong_FromSsize_t(best);
}

static PyObject *rm_generation(RecentMap *m, void *unused) {
    return PyLong_FromSsize_t(m->F);
}

static PyGetSetDef rm_getset[] = {
    {"nbytes", (getter)rm_nbytes, NULL, "bytes of its generations' arrays", NULL},
    {"longest_run", (getter)rm_longest_run, NULL,
     "the longest run of occupied index slots in a generation (a probe walks at most this far)", NULL},
    {"generation", (getter)rm_generation, NULL, "keys a generation holds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods rm_as_mapping = {(lenfunc)rm_len, (binaryfunc)rm_subscript, (objobjargproc)rm_ass_subscript};
static PySequenceMethods rm_as_sequence = {.sq_contains = (objobjproc)rm_contains};

static PyTypeObject RecentMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvplay_miss_chains.RecentMap",
    .tp_basicsize = sizeof(RecentMap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "int key -> removal in the order keys came (a dict's behaviour), in generations of keys "
              "with an index and a filter each: the RemovedLog's recent map, compiled.",
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
