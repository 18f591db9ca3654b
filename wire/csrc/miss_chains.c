/* The per-event loop of a watched pod's miss attribution (wire/miss_watch.py, PodMisses.apply),
 * compiled: a CPython extension built on first use (engine/cbuild.py) and loaded by
 * wire/miss_native.py.
 *
 * It walks a batch's events and does for each what PodMisses' Python loop (`_scan`) does, on the
 * same Python objects (the chains' dict, the parents' and roots' dicts, the mirror's key -> slot
 * dict and token list, the RemovedLog's recent map and Bloom filters): the usual chains inline
 * (a cold one; a branch from a cached block, the likeliest two siblings compared, as `_branch`
 * does), everything rarer through the same Python methods (`_keys`, `_special`, `_removed`,
 * `_tier`, `_track`). Its results are the Python loop's, bit for bit: tests/wire/test_miss_watch.py
 * runs both over the same streams and compares every count, mark and summary.
 *
 * Every input is hostile: an event whose fields have unexpected types is handed to the Python
 * methods or skipped as the Python loop would, never a crash; a Python exception raised by a
 * callback propagates (the caller sees it as it would from the Python loop).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

enum { DEPTH, PARENT, USER, SALTED, MARK, HDR };
enum { R_TIER, R_EVICTED, R_CLEARED, R_CONFIG, R_ISOLATED, R_DIVERGED, R_COLD, NC };
#define MAX_BLOOMS 8
#define BLOCK_BITS 512  /* engine/miss.py's: a key's probes all in one block (a cache line) */
#define C1 0x9E3779B97F4A7C15ULL
#define C2 0xC2B2AE3D27D4EB4FULL
#define M1 0xBF58476D1CE4E5B9ULL
#define M2 0x94D049BB133111EBULL
#define MAX_PROBES 14  /* engine/miss.py's: 9 bits each from two 64-bit hashes */
#define PREFETCH 8     /* how many keys ahead a loop over random lines asks for its line */

static PyObject *Stored, *Removed, *Hit, *Tier, *Cleared, *RemovalCls, *AT;
static PyObject *reason_names[NC];  /* each counted reason's name, by its place (AT inverted) */
static PyObject *s_block_hashes, *s_parent_block_hash, *s_user, *s_block_size, *s_token_ids, *s_extra_keys,
    *s_group_idx, *s_creators, *s_reason, *s_by_user, *s_ts, *s_block_ids, *s_chain_at, *s_heads_at, *s_offset, *s_cleared_m, *s_roots, *s_tier_of,
    *s_sessions, *s_mirror, *s_key_slot, *s_tokens, *s_v, *s_removed, *s_recent, *s_blooms,
    *s_n, *s_n_prev, *s_m, *s_probes, *s_cur, *s_prev, *s_filtered, *s_keys, *s_special, *s_removed_m,
    *s_tier_m, *s_track, *s_capacity, *s_rotate, *s_recent_capacity, *s_flush_every, *s_bloom_for, *s_evicted_from, *s_counts, *u_others, *u_blocks, *u_tokens, *u_branch, *u_diverged, *u_isolated, *u_config, *u_evicted, *u_tier, *u_recomputed, *s_by_at, *s_last_top;

typedef struct {
    Py_buffer cur, prev;
    int has_cur, has_prev;
    Py_ssize_t n, n_prev;
    uint64_t m;
    long probes;
} Bloom;

typedef struct {
    Bloom b[MAX_BLOOMS];
    PyObject *reason[MAX_BLOOMS];  /* each filter's reason (borrowed), in the removal kinds' order */
    int count;
    int ok;  /* 0: could not be read (then every check asks Python's RemovedLog.filtered) */
} Blooms;

static PyObject *kinds[3];  /* engine/miss.py's _REMOVAL_KINDS (checked by wire/miss_native.py) */
static PyObject *kind_removal[3];  /* Removal(kind) of each, made once (a filter knows the reason only) */

static PyObject *removal_defaults[3];  /* Removal's policy, by and creator defaults (setup); NULL: call Removal */

/* Removal(reason, ts) (a new reference): made as tuple.__new__ makes it (what the namedtuple's
 * Python __new__ calls), its other fields their defaults. */
static PyObject *removal_new(PyObject *reason, PyObject *ts) {
    PyTypeObject *tp = (PyTypeObject *)RemovalCls;
    if (removal_defaults[0] == NULL) return PyObject_CallFunctionObjArgs(RemovalCls, reason, ts, NULL);
    PyObject *t = tp->tp_alloc(tp, 5);
    if (t == NULL) return NULL;
    PyObject *items[5] = {reason, ts, removal_defaults[0], removal_defaults[1], removal_defaults[2]};
    for (int i = 0; i < 5; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(items[i]));
    return t;
}

/* Removal(reason) of the kind `reason` is (a new reference; made on first use). */
static PyObject *removal_of(PyObject *reason) {
    for (int r = 0; r < 3; r++) {
        if (kinds[r] != reason) continue;
        if (kind_removal[r] == NULL) {
            PyObject *x = PyObject_CallOneArg(RemovalCls, reason);
            if (x == NULL) return NULL;
            kind_removal[r] = x;  /* (kept for the process: a Removal is immutable) */
        }
        return Py_NewRef(kind_removal[r]);
    }
    return PyObject_CallOneArg(RemovalCls, reason);
}

/* An event's field: read from its slot where the event's type keeps it in one (a msgspec Struct's
 * fields are member descriptors), else through getattr. New reference; NULL with an exception
 * set where getattr raises. Each (type, field) offset is looked up once. */
enum { F_BLOCK_HASHES, F_PARENT, F_USER, F_BLOCK_SIZE, F_TOKEN_IDS, F_EXTRA_KEYS, F_GROUP_IDX, F_CREATORS,
       F_REASON, F_BY_USER, F_TS, F_BLOCK_IDS, NFIELDS };
#define MAX_TYPES 8
static struct { PyTypeObject *type; Py_ssize_t offset[NFIELDS]; } types[MAX_TYPES];
static int ntypes;
static PyObject *field_names[NFIELDS];

static Py_ssize_t *offsets_of(PyTypeObject *t) {
    for (int i = 0; i < ntypes; i++)
        if (types[i].type == t) return types[i].offset;
    if (ntypes == MAX_TYPES) return NULL;
    Py_INCREF(t);  /* (the event types live as long as the process) */
    types[ntypes].type = t;
    for (int f = 0; f < NFIELDS; f++) {
        Py_ssize_t off = -1;
        PyObject *d = _PyType_Lookup(t, field_names[f]);  /* borrowed */
        if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
            PyMemberDef *md = ((PyMemberDescrObject *)d)->d_member;
            if (md->type == T_OBJECT_EX && !(md->flags & READ_RESTRICTED)) off = md->offset;
        }
        types[ntypes].offset[f] = off;
    }
    return types[ntypes++].offset;
}

static inline PyObject *fget(PyObject *ev, int f) {
    PyTypeObject *t = Py_TYPE(ev);  /* (the types seen first, the stored and removed events', checked inline) */
    Py_ssize_t *offs = ntypes > 0 && types[0].type == t ? types[0].offset
                       : ntypes > 1 && types[1].type == t ? types[1].offset : offsets_of(t);
    if (offs != NULL && offs[f] >= 0) {
        PyObject *v = *(PyObject **)((char *)ev + offs[f]);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(ev, field_names[f]);
}

static void bloom_release(Bloom *b);

static void blooms_release(Blooms *bs) {
    for (int i = 0; i < bs->count; i++) bloom_release(&bs->b[i]);
    bs->count = 0;
}

static Py_ssize_t attr_ssize(PyObject *o, PyObject *name, int *err) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) { *err = 1; return 0; }
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) { *err = 1; return 0; }
    return x;
}

/* One RotatingBloom `f`, read in place into `b` (its buffers held: release them); 0, or -1 when
 * it cannot be read (no exception left set). */
static int bloom_load(Bloom *b, PyObject *f) {
    int err = 0;
    b->has_cur = b->has_prev = 0;
    b->n = attr_ssize(f, s_n, &err);
    b->n_prev = attr_ssize(f, s_n_prev, &err);
    Py_ssize_t m = attr_ssize(f, s_m, &err);
    b->probes = (long)attr_ssize(f, s_probes, &err);
    if (err || m < BLOCK_BITS || m % BLOCK_BITS || b->probes < 1 || b->probes > MAX_PROBES) {
        PyErr_Clear();
        return -1;
    }
    b->m = (uint64_t)m;
    PyObject *cur = PyObject_GetAttr(f, s_cur), *prev = PyObject_GetAttr(f, s_prev);
    int got = cur && prev && PyObject_GetBuffer(cur, &b->cur, PyBUF_SIMPLE) == 0;
    if (got) {
        b->has_cur = 1;
        got = PyObject_GetBuffer(prev, &b->prev, PyBUF_SIMPLE) == 0;
        if (got) b->has_prev = 1;
    }
    Py_XDECREF(cur);
    Py_XDECREF(prev);
    if (!got || (uint64_t)b->cur.len * 8 < b->m || (uint64_t)b->prev.len * 8 < b->m) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

static void bloom_release(Bloom *b) {
    if (b->has_cur) PyBuffer_Release(&b->cur);
    if (b->has_prev) PyBuffer_Release(&b->prev);
    b->has_cur = b->has_prev = 0;
}

/* The filters of `blooms` (the RemovedLog's dict: reason -> RotatingBloom), read in place, in
 * the removal kinds' order (the only ones RemovedLog.filtered consults); `ok` 0 when one cannot be
 * read. */
static void blooms_load(Blooms *bs, PyObject *blooms) {
    blooms_release(bs);
    bs->ok = 1;
    for (int r = 0; r < 3; r++) {
        PyObject *f = PyDict_GetItemWithError(blooms, kinds[r]);
        if (f == NULL) {
            if (PyErr_Occurred()) { PyErr_Clear(); bs->ok = 0; return; }
            continue;
        }
        bs->reason[bs->count] = kinds[r];
        int bad = bloom_load(&bs->b[bs->count], f) < 0;
        bs->count++;  /* (released with the rest, whatever it holds) */
        if (bad) { bs->ok = 0; return; }
    }
}

/* A key's probe hashes (engine/miss.py's _probe_hashes): h picks its block, u and v (mixed: every
 * bit depends on every bit of the key) its bits in the block, 9 bits each. */
typedef struct { uint64_t h, u, v; } Hashes;

static uint64_t mix(uint64_t z) {  /* splitmix64's finalizer */
    z = (z ^ (z >> 30)) * M1;
    z = (z ^ (z >> 27)) * M2;
    return z ^ (z >> 31);
}

static Hashes hashes_of(uint64_t x) {
    Hashes k = {(x * C1) >> 32, mix(x), mix(x ^ C2)};
    return k;
}

#include "recent_map.h"

/* A mirror key as the RemovedLog's (wire/miss_watch.py `_ikey`): an int as it is, anything else
 * by its hash; 0, or -1 with an exception. */
static int rkey_of_key(PyObject *k, RKey *out) {
    if (PyLong_CheckExact(k)) return rkey_of(k, out);
    Py_hash_t h = PyObject_Hash(k);
    if (h == -1 && PyErr_Occurred()) return -1;
    out->bits = (uint64_t)h;
    out->tag = h < 0;
    out->big = NULL;
    return 0;
}

/* The block (its first byte) of a key of probe hashes `k` in one generation's bytes `v` of m bits. */
static inline unsigned char *line_of(const void *v, uint64_t m, const Hashes *k) {
    return (unsigned char *)v + ((k->h % (m / BLOCK_BITS)) * BLOCK_BITS >> 3);
}

/* Probe i of a key (i < MAX_PROBES), a bit of its block: bits 9i.. of u (the first 7), then of v. */
static inline unsigned probe_bit(const Hashes *k, long i) {
    return (unsigned)((i < 7 ? k->u >> (9 * i) : k->v >> (9 * (i - 7))) & (BLOCK_BITS - 1));
}

/* Whether all `probes` bits of a key are set in one generation's bytes `v` (m bits). */
static int block_has(const unsigned char *v, uint64_t m, const Hashes *k, long probes) {
    const unsigned char *line = line_of(v, m, k);
    for (long i = 0; i < probes; i++) {
        unsigned bit = probe_bit(k, i);
        if (!((line[bit >> 3] >> (bit & 7)) & 1)) return 0;
    }
    return 1;
}

/* RotatingBloom.has: whether one filter may hold the key of probe hashes `k`. */
static int bloom_has(const Bloom *b, const Hashes *k) {
    if (b->n_prev)  /* (both generations' lines asked for at once: the misses overlap) */
        __builtin_prefetch(line_of(b->prev.buf, b->m, k));
    return (b->n && block_has(b->cur.buf, b->m, k, b->probes)) || (b->n_prev && block_has(b->prev.buf, b->m, k, b->probes));
}

/* The reason of the first filter (in the removal kinds' order) that may hold `key` (borrowed),
 * NULL when none does (RemovedLog.filtered). */
static PyObject *blooms_reason(const Blooms *bs, uint64_t x) {
    Hashes k = hashes_of(x);
    for (int i = 0; i < bs->count; i++)
        if (bloom_has(&bs->b[i], &k)) return bs->reason[i];
    return NULL;
}

/* RemovedLog.get(key) (a new reference; NULL: not removed, or an error when *err is set): the
 * recent map, then the filters (read in `bs`; Python's `filtered` where they could not be). */
static PyObject *removed_get(const RecentMap *recent, const Blooms *bs, PyObject *blooms, PyObject *removed, RKey k,
                             int *err) {
    PyObject *r = rm_get(recent, k);
    if (r != NULL) return Py_NewRef(r);
    if (!PyDict_GET_SIZE(blooms)) return NULL;
    if (bs->ok) {
        PyObject *reason = blooms_reason(bs, k.bits);
        if (reason == NULL) return NULL;
        r = removal_of(reason);
    } else {
        PyObject *ik = k.tag == 0 ? PyLong_FromUnsignedLongLong(k.bits) : PyLong_FromLongLong((long long)k.bits);
        r = ik == NULL ? NULL : PyObject_CallMethodObjArgs(removed, s_filtered, ik, NULL);
        Py_XDECREF(ik);
        if (r == Py_None) Py_CLEAR(r);
        else if (r == NULL) *err = 1;
        return r;
    }
    if (r == NULL) *err = 1;
    return r;
}

/* PodMisses.by_of(r): who evicted a remembered removal (a new reference; None when not known). */
static PyObject *by_of(PyObject *by_at, PyObject *r) {
    PyObject *b = PyTuple_GET_ITEM(r, 3);
    int t = PyObject_IsTrue(b);
    if (t < 0) return NULL;
    if (t) return Py_NewRef(b);
    PyObject *x = PyDict_GetItemWithError(by_at, PyTuple_GET_ITEM(r, 1));
    if (x == NULL && PyErr_Occurred()) return NULL;
    return Py_NewRef(x != NULL ? x : Py_None);
}

/* filtered(removed_log, key): RemovedLog.filtered, compiled: Removal(reason) of the first filter
 * (in the removal kinds' order) that may hold the key, or None. */
static PyObject *filtered(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "filtered(removed_log, key)");
        return NULL;
    }
    uint64_t x = PyLong_AsUnsignedLongLongMask(args[1]);
    if (x == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *blooms = PyObject_GetAttr(args[0], s_blooms);
    if (blooms == NULL) return NULL;
    if (!PyDict_Check(blooms)) {
        Py_DECREF(blooms);
        PyErr_SetString(PyExc_TypeError, "the filters");
        return NULL;
    }
    Blooms bs;
    bs.count = 0;
    blooms_load(&bs, blooms);
    Py_DECREF(blooms);
    PyObject *found = bs.ok ? blooms_reason(&bs, x) : NULL;
    int ok = bs.ok;
    blooms_release(&bs);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError, "a Bloom filter that cannot be read");
        return NULL;
    }
    if (found == NULL) Py_RETURN_NONE;
    return removal_of(found);
}

/* a == b for two keys or two token ids: ints compared as C values where both fit (no rich
 * comparison, which was most of what finding a parent in its chain cost), anything else as
 * Python compares them; 1, 0, or -1 with an exception set. */
static inline int same_key(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
        int oa, ob;
        long long x = PyLong_AsLongLongAndOverflow(a, &oa), y = PyLong_AsLongLongAndOverflow(b, &ob);
        if (!oa && !ob) return x == y;
    }
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* How many leading items of list `toks` from `off` (at most `size`) equal those of `theirs` (a
 * tuple or a list; anything else shares none). */
static Py_ssize_t common(PyObject *toks, Py_ssize_t off, Py_ssize_t size, PyObject *theirs, int *err) {
    if (theirs == NULL || !(PyTuple_Check(theirs) || PyList_Check(theirs))) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(theirs);
    PyObject **b = PySequence_Fast_ITEMS(theirs);
    if (n > size) n = size;
    for (Py_ssize_t i = 0; i < n; i++) {
        int eq = same_key(PyList_GET_ITEM(toks, off + i), b[i]);
        if (eq < 0) { *err = 1; return i; }
        if (!eq) return i;
    }
    return n;
}

/* mirror.tokens.v[slot] (None when out of range) — borrowed. */
static PyObject *slot_tokens(PyObject *tv, PyObject *slot) {
    Py_ssize_t s = PyLong_AsSsize_t(slot);
    if (s == -1 && PyErr_Occurred()) { PyErr_Clear(); return Py_None; }
    if (s < 0 || s >= PyList_GET_SIZE(tv)) return Py_None;
    return PyList_GET_ITEM(tv, s);
}

/* Add `d` to item i of a session's counts (a list of ints). */
static int bump(PyObject *lst, Py_ssize_t i, long d) {
    if (!d) return 0;
    PyObject *old = PyList_GET_ITEM(lst, i);
    long v = PyLong_AsLong(old);
    if (v == -1 && PyErr_Occurred()) return -1;
    PyObject *nv = PyLong_FromLong(v + d);
    if (nv == NULL) return -1;
    PyList_SET_ITEM(lst, i, nv);
    Py_DECREF(old);
    return 0;
}

/* d[key] += x for a dict of ints (a missing key counts 0). */
static int dict_add_long(PyObject *d, PyObject *key, long x) {
    PyObject *old = PyDict_GetItemWithError(d, key);
    long v = 0;
    if (old != NULL) {
        v = PyLong_AsLong(old);
        if (v == -1 && PyErr_Occurred()) return -1;
    } else if (PyErr_Occurred()) return -1;
    PyObject *nv = PyLong_FromLong(v + x);
    if (nv == NULL) return -1;
    int rc = PyDict_SetItem(d, key, nv);
    Py_DECREF(nv);
    return rc;
}

/* Let the garbage collector stop tracking a new tuple that holds no object it tracks (what it does
 * itself at its next collection, `_PyTuple_MaybeUntrack`): a chain is kept long, and a young
 * tracked tuple costs each collection until then. */
static void untrack(PyObject *t) {
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyTuple_GET_ITEM(t, i);
        if (PyObject_IS_GC(x) && PyObject_GC_IsTracked(x)) return;
    }
    if (PyObject_GC_IsTracked(t)) PyObject_GC_UnTrack(t);
}

/* A tuple of `n` items (new references taken). */
static PyObject *tuple_of(PyObject **items, int n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
}

/* A chain of stored blocks, (depth, parent, user, salted, mark, *keys) (wire/miss_watch.py), as
 * this loop makes it: a tuple's layout and what Python reads of a chain (len, [i], [a:b] as a
 * tuple, iteration, index(key, start)), without the garbage collector. A tuple counts towards
 * the next young collection whether or not it is tracked, and a stream of a million events spent
 * more than twice as long in collections with the attribution as without it; a chain holds ints,
 * strs, None, bools, keys and marks (tuples of those), none of which can lead back to it, so it
 * can be in no reference cycle and needs no collector.
 *
 * Its keys, and its parent's key, are kept as 64-bit values where they are ints that fit one
 * kind, unsigned or signed (what a server's block hashes are), as Python objects otherwise; Python
 * reads new ints equal to the keys it was given. A chain outlives its blocks in the mirror (it
 * goes when the last of its slots is stored again): holding the keys' int objects, it held each
 * one's last reference after the mirror let it go (1.6 of the attribution's 9.9 MiB on
 * mirror_bench's stream). The time is the same either way (a lookup of a kept value makes an
 * int where the object was at hand). The Python loop's chains are tuples: the C loop reads both
 * alike (`chain_hdr`, `chain_key`, `find`, `parent_is`). */
enum { V_OBJ, V_U64, V_I64 };  /* how a chain keeps a key: an object, an unsigned or a signed 64-bit value */

typedef union {
    PyObject *o;
    uint64_t u;
} Item;

typedef struct {
    PyObject_VAR_HEAD
    unsigned char kind, pkind;  /* how its keys and its parent's key are kept (V_*) */
    Item item[1];               /* HDR header items, then the keys */
} ChainObject;

static PyTypeObject ChainType;

static inline int is_chain(PyObject *o) { return Py_TYPE(o) == &ChainType || PyTuple_Check(o); }

/* Header item i of a chain (a Chain or a tuple; any item but PARENT) — borrowed. */
static inline PyObject *chain_hdr(PyObject *o, int i) {
    return Py_TYPE(o) == &ChainType ? ((ChainObject *)o)->item[i].o : PyTuple_GET_ITEM(o, i);
}

/* An exact int's 64-bit value, as the recent map reads a key (`rkey_of`): 1 when it is in
 * [0, 2^63), 2 in [2^63, 2^64), 3 negative and from -2^63; 0 when it is no exact int or does not
 * fit (no exception is left set). */
static int int_bits(PyObject *k, uint64_t *b) {
    RKey r;
    if (!PyLong_CheckExact(k)) return 0;
    if (rkey_of(k, &r) < 0) {  /* (an exact int always reads) */
        PyErr_Clear();
        return 0;
    }
    if (r.tag == 2) return 0;
    *b = r.bits;
    return r.tag == 1 ? 3 : r.bits >> 63 ? 2 : 1;
}

/* A kept value as a new int (NULL with an exception). */
static PyObject *value_new(uint64_t u, int kind) {
    return kind == V_I64 ? PyLong_FromLongLong((long long)u) : PyLong_FromUnsignedLongLong(u);
}

/* Whether a value kept as `kind` can be an exact int of int_bits class `c` (an unsigned value no
 * negative int, a signed one no int from 2^63). */
static inline int kind_holds(int kind, int c) {
    return c && (kind == V_U64 ? c != 3 : c != 2);
}

/* Whether an exact int of int_bits class `c` and value bits `b` is the value `u` kept as `kind`. */
static inline int same_value(uint64_t u, int kind, int c, uint64_t b) {
    return b == u && kind_holds(kind, c);
}

/* Item i of a chain as Python reads it (a new reference). */
static PyObject *item_new(ChainObject *c, Py_ssize_t i) {
    int kind = i >= HDR ? c->kind : i == PARENT ? c->pkind : V_OBJ;
    return kind == V_OBJ ? Py_NewRef(c->item[i].o) : value_new(c->item[i].u, kind);
}

/* Key i (i >= HDR) of a chain (a Chain or a tuple): a new reference. */
static inline PyObject *chain_key(PyObject *o, Py_ssize_t i) {
    return Py_TYPE(o) == &ChainType ? item_new((ChainObject *)o, i) : Py_NewRef(PyTuple_GET_ITEM(o, i));
}

static void chain_dealloc(ChainObject *c) {
    for (Py_ssize_t i = 0; i < HDR; i++)
        if (i != PARENT || c->pkind == V_OBJ) Py_XDECREF(c->item[i].o);
    if (c->kind == V_OBJ)
        for (Py_ssize_t i = HDR; i < Py_SIZE(c); i++) Py_XDECREF(c->item[i].o);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static Py_ssize_t chain_len(ChainObject *c) { return Py_SIZE(c); }

static PyObject *chain_item(ChainObject *c, Py_ssize_t i) {
    if (i < 0 || i >= Py_SIZE(c)) {
        PyErr_SetString(PyExc_IndexError, "chain index out of range");
        return NULL;
    }
    return item_new(c, i);
}

static PyObject *chain_subscript(ChainObject *c, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        return chain_item(c, i < 0 ? i + Py_SIZE(c) : i);
    }
    if (!PySlice_Check(key)) {
        PyErr_Format(PyExc_TypeError, "chain indices must be integers or slices, not %.200s", Py_TYPE(key)->tp_name);
        return NULL;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(key, &start, &stop, &step) < 0) return NULL;
    Py_ssize_t n = PySlice_AdjustIndices(Py_SIZE(c), &start, &stop, step);
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (Py_ssize_t j = 0, i = start; j < n; j++, i += step) {
        PyObject *x = item_new(c, i);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, j, x);
    }
    return t;
}

/* index(value, start=0, stop=len): as tuple.index. */
static PyObject *chain_index(ChainObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "index(value, start=0, stop=len)");
        return NULL;
    }
    Py_ssize_t n = Py_SIZE(c), lo = 0, hi = n;
    for (Py_ssize_t k = 1; k < nargs; k++) {
        if (!PyIndex_Check(args[k])) {
            PyErr_SetString(PyExc_TypeError, "index: start and stop are integers");
            return NULL;
        }
        Py_ssize_t v = PyNumber_AsSsize_t(args[k], NULL);
        if (v == -1 && PyErr_Occurred()) return NULL;
        *(k == 1 ? &lo : &hi) = v;
    }
    if (lo < 0 && (lo += n) < 0) lo = 0;
    if (hi < 0) hi += n;
    else if (hi > n) hi = n;
    for (Py_ssize_t i = lo; i < hi; i++) {
        PyObject *x = item_new(c, i);
        int eq = x == NULL ? -1 : PyObject_RichCompareBool(x, args[0], Py_EQ);
        Py_XDECREF(x);
        if (eq < 0) return NULL;
        if (eq) return PyLong_FromSsize_t(i);
    }
    PyErr_SetString(PyExc_ValueError, "chain.index(x): x not in chain");
    return NULL;
}

static PyObject *chain_iter(PyObject *c) { return PySeqIter_New(c); }

static PyObject *chain_repr(ChainObject *c) {
    PyObject *t = PySequence_Tuple((PyObject *)c);
    if (t == NULL) return NULL;
    PyObject *r = PyUnicode_FromFormat("Chain%R", t);
    Py_DECREF(t);
    return r;
}

/* How it keeps its keys and its parent's key: "values" or "objects" each (for tests). */
static PyObject *chain_kept(ChainObject *c, PyObject *unused) {
    return Py_BuildValue("(ss)", c->kind == V_OBJ ? "objects" : "values", c->pkind == V_OBJ ? "objects" : "values");
}

static PyMethodDef chain_methods[] = {
    {"index", (PyCFunction)(void (*)(void))chain_index, METH_FASTCALL, "index(value, start=0, stop=len), as tuple.index"},
    {"kept", (PyCFunction)chain_kept, METH_NOARGS, "how its keys and its parent's key are kept: ('values' | 'objects', ...)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods chain_as_sequence = {.sq_length = (lenfunc)chain_len, .sq_item = (ssizeargfunc)chain_item};
static PyMappingMethods chain_as_mapping = {.mp_length = (lenfunc)chain_len, .mp_subscript = (binaryfunc)chain_subscript};

static PyTypeObject ChainType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvplay_miss_chains.Chain",
    .tp_basicsize = offsetof(ChainObject, item),
    .tp_itemsize = sizeof(Item),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a chain of stored blocks, (depth, parent, user, salted, mark, *keys): read as a tuple, "
              "outside the garbage collector, its keys kept as 64-bit values where they are ints that fit",
    .tp_dealloc = (destructor)chain_dealloc,
    .tp_repr = (reprfunc)chain_repr,
    .tp_iter = chain_iter,
    .tp_methods = chain_methods,
    .tp_as_sequence = &chain_as_sequence,
    .tp_as_mapping = &chain_as_mapping,
    .tp_free = PyObject_Del,
};

/* A chain: (depth, parent, user, salted, mark, *keys), its keys as values when every one is an
 * exact int and they fit one kind (unsigned or signed 64-bit), its parent's likewise. */
static PyObject *make_run(PyObject *depth, PyObject *pk, PyObject *user, int salted, PyObject *mark,
                          PyObject *hs) {
    Py_ssize_t n = PyList_GET_SIZE(hs);
    ChainObject *run = PyObject_NewVar(ChainObject, &ChainType, HDR + n);
    if (run == NULL) return NULL;
    PyObject *items[HDR] = {depth, pk, user, salted ? Py_True : Py_False, mark};
    for (int i = 0; i < HDR; i++) run->item[i].o = Py_NewRef(items[i]);
    uint64_t b;
    int pc = int_bits(pk, &b);
    run->pkind = V_OBJ;
    if (pc) {
        Py_DECREF(pk);
        run->item[PARENT].u = b;
        run->pkind = pc == 3 ? V_I64 : V_U64;
    }
    int seen = 0, raw = 1;  /* (seen: bit 1 << int_bits' class of each key so far) */
    for (Py_ssize_t i = 0; i < n; i++) {
        int c = int_bits(PyList_GET_ITEM(hs, i), &run->item[HDR + i].u);
        seen |= 1 << c;
        if (!c || (seen & 12) == 12) {
            raw = 0;
            break;
        }
    }
    run->kind = !raw ? V_OBJ : seen & 8 ? V_I64 : V_U64;
    if (!raw)
        for (Py_ssize_t i = 0; i < n; i++) run->item[HDR + i].o = Py_NewRef(PyList_GET_ITEM(hs, i));
    return (PyObject *)run;
}

/* A mirror slot (a key_slot value) as an index into a list of `n` items; -1 when it is none. */
static Py_ssize_t slot_index(PyObject *slot, Py_ssize_t n) {
    if (slot == NULL || !PyLong_CheckExact(slot)) return -1;
    Py_ssize_t s = PyLong_AsSsize_t(slot);
    if (s == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    return s >= 0 && s < n ? s : -1;
}

/* The slot of cached `key` (-1: not cached); -2 with an exception set. */
static Py_ssize_t slot_of(PyObject *cached, PyObject *key, Py_ssize_t n) {
    PyObject *slot = PyDict_GetItemWithError(cached, key);
    if (slot == NULL) return PyErr_Occurred() ? -2 : -1;
    return slot_index(slot, n);
}

/* cached[key i of chain c] (borrowed; NULL when it is not cached, with an exception set on error). */
static PyObject *key_slot(PyObject *cached, PyObject *c, Py_ssize_t i) {
    PyObject *k = chain_key(c, i);
    if (k == NULL) return NULL;
    PyObject *slot = PyDict_GetItemWithError(cached, k);
    Py_DECREF(k);
    return slot;
}

/* `chain_at[slot of key i of chain c] is c`: 1, 0, or -1 with an exception set (PodMisses._live). */
static int owns(PyObject *cached, PyObject *chain_at, PyObject *c, Py_ssize_t i) {
    PyObject *slot = key_slot(cached, c, i);
    if (slot == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t s = slot_index(slot, PyList_GET_SIZE(chain_at));
    return s >= 0 && PyList_GET_ITEM(chain_at, s) == c;
}

/* The index of `key` in chain `c` from HDR on (tuple.index), -1 when it is not there, -2 with an
 * exception set. */
static Py_ssize_t find(PyObject *c, PyObject *key) {
    if (!is_chain(c)) return -1;
    Py_ssize_t len = Py_SIZE(c);
    if (Py_TYPE(c) == &ChainType && ((ChainObject *)c)->kind != V_OBJ && PyLong_CheckExact(key)) {
        ChainObject *ch = (ChainObject *)c;
        uint64_t b = 0;
        int k = int_bits(key, &b);
        if (!kind_holds(ch->kind, k)) return -1;  /* (no value kept so can be this int) */
        for (Py_ssize_t i = HDR; i < len; i++)
            if (ch->item[i].u == b) return i;
        return -1;
    }
    for (Py_ssize_t i = HDR; i < len; i++) {
        PyObject *x = chain_key(c, i);
        int eq = x == NULL ? -1 : same_key(x, key);
        Py_XDECREF(x);
        if (eq < 0) return -2;
        if (eq) return i;
    }
    return -1;
}

/* Whether chain `h`'s parent is `pk`: 1, 0, or -1 with an exception set. */
static int parent_is(PyObject *h, PyObject *pk) {
    if (Py_TYPE(h) == &ChainType && ((ChainObject *)h)->pkind != V_OBJ) {
        ChainObject *ch = (ChainObject *)h;
        if (PyLong_CheckExact(pk)) {
            uint64_t b = 0;
            int k = int_bits(pk, &b);
            return same_value(ch->item[PARENT].u, ch->pkind, k, b);
        }
        PyObject *p = item_new(ch, PARENT);
        int eq = p == NULL ? -1 : same_key(p, pk);
        Py_XDECREF(p);
        return eq;
    }
    return same_key(chain_hdr(h, PARENT), pk);
}

/* `_head(heads_at, ps, pk)`: the newest chain under the cached parent `pk` in slot `ps` (a new
 * reference; NULL when none, with an exception set on error). */
static PyObject *head(PyObject *heads_at, Py_ssize_t ps, PyObject *pk) {
    if (ps < 0 || ps >= PyList_GET_SIZE(heads_at)) return NULL;
    PyObject *h = PyList_GET_ITEM(heads_at, ps);
    if (h == Py_None || !is_chain(h) || Py_SIZE(h) <= PARENT) return NULL;
    int eq = parent_is(h, pk);
    if (eq <= 0) return NULL;
    Py_INCREF(h);
    return h;
}

/* Add `keys[0..n)` (ints, taken modulo 2^64) to a RotatingBloom: RotatingBloom.add_many, bit for
 * bit (a key's probes in its block: `hashes_of`; the generations rotate through its `rotate()`). */
static int bloom_add(PyObject *bloom, const uint64_t *keys, Py_ssize_t nk) {
    int err = 0;
    Py_ssize_t cap = attr_ssize(bloom, s_capacity, &err), n = attr_ssize(bloom, s_n, &err);
    Py_ssize_t m = attr_ssize(bloom, s_m, &err), probes = attr_ssize(bloom, s_probes, &err);
    if (err) return -1;
    if (cap < 1 || m < BLOCK_BITS || m % BLOCK_BITS || probes < 1 || probes > MAX_PROBES) {
        PyErr_SetString(PyExc_ValueError, "a Bloom filter's shape");
        return -1;
    }
    Py_buffer view;
    int held = 0;
    int rc = -1;
    Hashes ahead[PREFETCH];  /* (the hashes of the keys asked for, by index) */
    for (Py_ssize_t i = 0; i < nk && i < PREFETCH; i++) ahead[i] = hashes_of(keys[i]);
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (n >= cap || !held) {
            if (held) {
                PyBuffer_Release(&view);
                held = 0;
            }
            if (n >= cap) {
                PyObject *nv = PyLong_FromSsize_t(n);
                if (nv == NULL || PyObject_SetAttr(bloom, s_n, nv) < 0) { Py_XDECREF(nv); goto out; }
                Py_DECREF(nv);
                PyObject *t = PyObject_CallMethodNoArgs(bloom, s_rotate);
                if (t == NULL) goto out;
                Py_DECREF(t);
                n = 0;
            }
            PyObject *cur = PyObject_GetAttr(bloom, s_cur);
            if (cur == NULL) goto out;
            int got = PyObject_GetBuffer(cur, &view, PyBUF_WRITABLE);
            Py_DECREF(cur);
            if (got < 0) goto out;
            held = 1;
            if (view.len * 8 < m) {
                PyErr_SetString(PyExc_ValueError, "a Bloom filter's bits");
                goto out;
            }
        }
        Hashes k = ahead[i % PREFETCH];
        if (i + PREFETCH < nk) {  /* (a line a few keys ahead: the misses overlap) */
            Hashes *a = &ahead[i % PREFETCH];
            *a = hashes_of(keys[i + PREFETCH]);
            if (n + PREFETCH < cap) __builtin_prefetch(line_of(view.buf, (uint64_t)m, a), 1);
        }
        unsigned char *line = line_of(view.buf, (uint64_t)m, &k);
        for (long j = 0; j < (long)probes; j++) {  /* (one cache line) */
            unsigned bit = probe_bit(&k, j);
            line[bit >> 3] |= (unsigned char)(1u << (bit & 7));
        }
        n++;
    }
    {
        PyObject *nv = PyLong_FromSsize_t(n);
        if (nv == NULL || PyObject_SetAttr(bloom, s_n, nv) < 0) { Py_XDECREF(nv); goto out; }
        Py_DECREF(nv);
    }
    rc = 0;
out:
    if (held) PyBuffer_Release(&view);
    return rc;
}

/* flush(removed_log): RemovedLog.flush, compiled: the oldest removals beyond `recent_capacity`
 * leave the recent map (a RecentMap) for their reason's filter, each reason's keys in order (the
 * reasons in the order they first come). */
static PyObject *flush(PyObject *self, PyObject *rl) {
    int err = 0;
    PyObject *rec = PyObject_GetAttr(rl, s_recent);
    if (rec == NULL) return NULL;
    if (Py_TYPE(rec) != &RecentMapType) {
        Py_DECREF(rec);
        PyErr_SetString(PyExc_TypeError, "the recent map: a RecentMap");
        return NULL;
    }
    RecentMap *m = (RecentMap *)rec;
    Py_ssize_t cap = attr_ssize(rl, s_recent_capacity, &err);
    if (err) { Py_DECREF(rec); return NULL; }
    Py_ssize_t n = m->live - cap;
    if (n <= 0) { Py_DECREF(rec); Py_RETURN_NONE; }
    uint64_t *ks = PyMem_Malloc(2 * (size_t)n * sizeof(uint64_t)), *part = ks + n;
    PyObject **rs = PyMem_Malloc((size_t)n * sizeof(PyObject *));
    char *done = PyMem_Calloc((size_t)n, 1);
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    if (ks == NULL || rs == NULL || done == NULL) { PyErr_NoMemory(); goto out; }
    got = rm_pop_oldest_n(m, n, ks, rs);
    /* each reason's keys, in order, into its filter (the reasons in the order they first come) */
    for (Py_ssize_t i = 0; i < got; i++) {
        if (done[i]) continue;
        if (!PyTuple_Check(rs[i]) || PyTuple_GET_SIZE(rs[i]) < 1) {
            PyErr_SetString(PyExc_TypeError, "a removal");
            goto out;
        }
        PyObject *reason = PyTuple_GET_ITEM(rs[i], 0);
        Py_ssize_t np = 0;
        for (Py_ssize_t j = i; j < got; j++) {
            if (done[j]) continue;
            PyObject *rj = PyTuple_Check(rs[j]) && PyTuple_GET_SIZE(rs[j]) ? PyTuple_GET_ITEM(rs[j], 0) : NULL;
            int same = rj == reason;
            if (!same && rj != NULL) {
                same = PyObject_RichCompareBool(rj, reason, Py_EQ);
                if (same < 0) goto out;
            }
            if (same) {
                part[np++] = ks[j];
                done[j] = 1;
            }
        }
        PyObject *bloom = PyObject_CallMethodOneArg(rl, s_bloom_for, reason);
        if (bloom == NULL) goto out;
        int bad = bloom_add(bloom, part, np) < 0;
        Py_DECREF(bloom);
        if (bad) goto out;
    }
    result = Py_NewRef(Py_None);
out:
    for (Py_ssize_t i = 0; i < got; i++) Py_DECREF(rs[i]);
    PyMem_Free(ks);
    PyMem_Free(rs);
    PyMem_Free(done);
    Py_DECREF(rec);
    return result;
}

/* Whose blocks a batch's usual evictions were (PodMisses._whose's `creators`, gathered at the
 * batch's end): its first WHOSE_CACHE creators (by value, as a Counter counts them) with their
 * counts, in the order each first came; any further creator one by one in `more` (a list). */
#define WHOSE_CACHE 32
typedef struct {
    PyObject *who[WHOSE_CACHE];  /* (references held: whose_release) */
    Py_hash_t hash[WHOSE_CACHE];
    long count[WHOSE_CACHE];
    int n, last;
} Whose;

/* The index of `c` among `n` objects (by identity, then by hash and equality); -1 when it is not
 * there (then *h is its hash), -2 with an exception. */
static int find_by_value(PyObject *const *objs, const Py_hash_t *hashes, int n, PyObject *c, Py_hash_t *h) {
    for (int j = 0; j < n; j++)
        if (objs[j] == c) return j;
    if ((*h = PyObject_Hash(c)) == -1 && PyErr_Occurred()) return -2;
    for (int j = 0; j < n; j++) {
        if (hashes[j] != *h) continue;
        int eq = PyObject_RichCompareBool(objs[j], c, Py_EQ);
        if (eq < 0) return -2;
        if (eq) return j;
    }
    return -1;
}

static int whose_add(Whose *w, PyObject *c, PyObject **more) {
    if (w->n && w->who[w->last] == c) {  /* (an event's blocks: mostly one creator's) */
        w->count[w->last]++;
        return 0;
    }
    Py_hash_t h;
    int j = find_by_value(w->who, w->hash, w->n, c, &h);
    if (j == -2) return -1;
    if (j >= 0) {
        w->count[w->last = j]++;
        return 0;
    }
    if (w->n == WHOSE_CACHE) {  /* (the list made on first use) */
        if (*more == NULL && (*more = PyList_New(0)) == NULL) return -1;
        return PyList_Append(*more, c);
    }
    w->who[w->n] = Py_NewRef(c);
    w->hash[w->n] = h;
    w->count[w->n] = 1;
    w->last = w->n++;
    return 0;
}

static void whose_release(Whose *w) {
    for (int j = 0; j < w->n; j++) Py_DECREF(w->who[j]);
    w->n = w->last = 0;
}

/* `k` evicted blocks of creator `c` into `ev_from` (a dict: PodMisses' Counter), as OTHERS when
 * `c` is not counted by name yet and `max_sessions` are (PodMisses._whose's rule, one creator at
 * a time). */
static int whose_into(PyObject *ev_from, PyObject *c, long k, Py_ssize_t max_sessions) {
    if (PyDict_GET_SIZE(ev_from) >= max_sessions) {
        int in = PyDict_Contains(ev_from, c);
        if (in < 0) return -1;
        if (!in) c = u_others;
    }
    return dict_add_long(ev_from, c, k);
}

/* PodMisses._whose(creators) of the creators gathered in `w` then `more` (`whose_into`). */
static int count_whose(PyObject *ev_from, const Whose *w, PyObject *more, Py_ssize_t max_sessions) {
    if (!PyDict_Check(ev_from)) {
        PyErr_SetString(PyExc_TypeError, "evicted_from");
        return -1;
    }
    Py_ssize_t n = more == NULL ? 0 : PyList_GET_SIZE(more);
    for (Py_ssize_t i = 0; i < w->n + n; i++)
        if (whose_into(ev_from, i < w->n ? w->who[i] : PyList_GET_ITEM(more, i - w->n), i < w->n ? w->count[i] : 1,
                       max_sessions) < 0)
            return -1;
    return 0;
}

#include "pending.h"

/* PodMisses._tally: the batch's counts into the pod's (`counts`; pending, with `pd`) and the
 * batch's details (`rep`). */
static int add_tally(PyObject *pm, PyObject *rep, const long *tally, Pending *pd) {
    int any = 0;
    for (int i = 0; i < NC; i++) any |= tally[i] != 0;
    if (!any) return 0;
    if (pd != NULL) {
        for (int i = 0; i < 2 * NC; i++) pd->tally[i] += tally[i];
        pd->counted = 1;
    } else {
        PyObject *counts = PyObject_GetAttr(pm, s_counts);
        int rc = counts == NULL ? -1 : tally_into(counts, tally);
        Py_XDECREF(counts);
        if (rc < 0) return -1;
    }
    return rep == Py_None ? 0 : tally_into(rep, tally);
}

/* A batch's sessions, counted in C and entered at its end (what `fill[user] += n` and the
 * session's counts would get event by event; a sum is a sum): the first USERS sessions of a
 * batch, the rest event by event. */
#define USERS 32
typedef struct {
    PyObject *user;  /* (a reference held) */
    PyObject *sc;    /* its counts in `sessions` (a reference held), NULL when it has none yet */
    long fill;
    long add[2 * NC];
} User;

typedef struct {
    User u[USERS];
    int n;
} Users;

/* The entry of `user` (made on its first chain, so the table keeps the order in which the
 * sessions first stored); -1 when the table is full, -2 with an exception. */
static int user_entry(Users *t, PyObject *sessions, PyObject *user) {
    for (int i = 0; i < t->n; i++)
        if (t->u[i].user == user) return i;
    int str = PyUnicode_CheckExact(user);
    Py_hash_t h = str ? PyObject_Hash(user) : 0;
    if (h == -1) return -2;
    for (int i = 0; i < t->n; i++) {
        PyObject *o = t->u[i].user;
        if (str && PyUnicode_CheckExact(o) && PyObject_Hash(o) != h) continue;  /* (a str caches its hash) */
        int eq = PyObject_RichCompareBool(o, user, Py_EQ);
        if (eq < 0) return -2;
        if (eq) return i;
    }
    if (t->n == USERS) return -1;
    PyObject *sc = PyDict_GetItemWithError(sessions, user);
    if (sc == NULL && PyErr_Occurred()) return -2;
    if (sc != NULL && (!PyList_CheckExact(sc) || PyList_GET_SIZE(sc) != 2 * NC)) {
        PyErr_SetString(PyExc_TypeError, "a session's counts");
        return -2;
    }
    User *u = &t->u[t->n];
    memset(u, 0, sizeof *u);
    Py_INCREF(user);
    Py_XINCREF(sc);
    u->user = user;
    u->sc = sc;
    return t->n++;
}

static void users_release(Users *t) {
    for (int i = 0; i < t->n; i++) {
        Py_DECREF(t->u[i].user);
        Py_XDECREF(t->u[i].sc);
    }
    t->n = 0;
}

/* `fill` (session -> blocks stored in the batch) for the sessions beyond the table's, made when
 * the first comes: the table's sessions first, in order (they came before it), each at 0. */
static PyObject *fill_dict(const Users *t) {
    PyObject *fill = PyDict_New(), *zero = PyLong_FromLong(0);
    if (zero == NULL) Py_CLEAR(fill);
    for (int i = 0; fill != NULL && i < t->n; i++)
        if (PyDict_SetItem(fill, t->u[i].user, zero) < 0) Py_CLEAR(fill);
    Py_XDECREF(zero);
    return fill;
}

/* The table's counts into `fill` (when there is one) and the sessions' counts (pending, with `pd`). */
static int users_enter(Users *t, PyObject *fill, Pending *pd) {
    for (int i = 0; i < t->n; i++) {
        User *u = &t->u[i];
        if (fill != NULL && u->fill && dict_add_long(fill, u->user, u->fill) < 0) return -1;
        if (u->sc == NULL) continue;
        if (pd != NULL) {
            if (pend_user(pd, u->sc, u->add) < 0) return -1;
        } else
            for (int j = 0; j < 2 * NC; j++)
                if (bump(u->sc, j, u->add[j]) < 0) return -1;
    }
    return 0;
}

/* scan(pm, events, pod, rep, usual_rm, tracking, bts, max_sessions, pending) -> (tally, later, fill, whose, evicted, gone)
 * `tally`: the batch's blocks by reason (COUNTED's order), then tokens (cold ones included);
 * `later`: (session, reason's place or -1, its blocks, the chain's blocks, block size) of the chains
 * of sessions not counted yet. See PodMisses._scan. */
static PyObject *scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "scan takes 9 arguments");
        return NULL;
    }
    if (Stored == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "miss_chains: setup() was not called");
        return NULL;
    }
    PyObject *pm = args[0], *events = args[1], *pod = args[2], *rep = args[3], *bts = args[6];
    Pending *pd = Py_TYPE(args[8]) == &PendingType ? (Pending *)args[8] : NULL;  /* (None: counted at once) */
    int usual_rm = PyObject_IsTrue(args[4]), tracking = PyObject_IsTrue(args[5]);
    Py_ssize_t max_sessions = PyLong_AsSsize_t(args[7]);
    if (max_sessions == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_Check(events) && !PyTuple_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "events must be a list or tuple");
        return NULL;
    }
    PyObject *by_at = NULL, *chain_at = NULL, *heads_at = NULL, *roots = NULL, *held = NULL, *sessions = NULL,
             *mirror = NULL, *cached = NULL, *tokens_obj = NULL, *tv = NULL, *removed = NULL, *recent = NULL,
             *blooms = NULL, *later = NULL, *fill = NULL, *whose = NULL, *result = NULL;
    PyObject *usual_removal = NULL;  /* Removal("evicted", bts): the batch's usual evictions' */
    Py_ssize_t gone = 0, rec_cap = 0;
    Blooms bs;
    bs.count = 0;
    bs.ok = 1;
    long tally[2 * NC] = {0};
    Users users;
    users.n = 0;
    Whose wh;
    wh.n = wh.last = 0;
    Py_ssize_t off = 0, nslots = 0;
    int evicted = 0;
    int pod_none = pod == Py_None;

#define GET(var, obj, name) if (((var) = PyObject_GetAttr((obj), (name))) == NULL) goto fail
    GET(by_at, pm, s_by_at);
    GET(chain_at, pm, s_chain_at);
    GET(heads_at, pm, s_heads_at);
    GET(roots, pm, s_roots);
    GET(held, pm, s_tier_of);
    GET(sessions, pm, s_sessions);
    GET(mirror, pm, s_mirror);
    GET(cached, mirror, s_key_slot);
    GET(tokens_obj, mirror, s_tokens);
    GET(tv, tokens_obj, s_v);
    GET(removed, pm, s_removed);
    GET(recent, removed, s_recent);
    GET(blooms, removed, s_blooms);
    if (!PyDict_CheckExact(by_at) || !PyList_CheckExact(chain_at) || !PyList_CheckExact(heads_at) || !PyDict_CheckExact(roots) ||
        !PyDict_CheckExact(held) || !PyDict_CheckExact(sessions) ||
        !PyDict_CheckExact(cached) || !PyList_CheckExact(tv) || Py_TYPE(recent) != &RecentMapType ||
        !PyDict_CheckExact(blooms)) {
        PyErr_SetString(PyExc_TypeError, "miss_chains: unexpected state types");
        goto fail;
    }
    {
        int err = 0;
        rec_cap = attr_ssize(removed, s_recent_capacity, &err) + attr_ssize(removed, s_flush_every, &err);
        off = attr_ssize(mirror, s_offset, &err);
        if (err) goto fail;
        nslots = PyList_GET_SIZE(chain_at);
        if (PyList_GET_SIZE(heads_at) != nslots) {
            PyErr_SetString(PyExc_TypeError, "miss_chains: the slots' lists differ in length");
            goto fail;
        }
    }
    if (PyDict_GET_SIZE(blooms)) blooms_load(&bs, blooms);

    Py_ssize_t nev = PySequence_Fast_GET_SIZE(events);
    PyObject **evs = PySequence_Fast_ITEMS(events);
    for (Py_ssize_t e = 0; e < nev; e++) {
        PyObject *ev = evs[e];
        PyObject *cls = (PyObject *)Py_TYPE(ev);
        if (cls == Stored) {
            PyObject *hs = NULL, *pk = NULL, *user = NULL, *toks = NULL, *extras = NULL, *pr = NULL, *sibs = NULL,
                     *depth = NULL, *r = NULL, *run = NULL, *mark = NULL, *gi = NULL, *szo = NULL;
            int sibs_true = 0, ok = 0;
            Py_ssize_t at = -1, ps = -1;
            long ri = -1, q = 0, size;
            if ((hs = fget(ev, F_BLOCK_HASHES)) == NULL) goto fail;
            if (!PyList_Check(hs)) {  /* (a Struct's list; anything else: the Python way) */
                Py_SETREF(hs, PySequence_List(hs));
                if (hs == NULL) goto fail;
            }
            Py_ssize_t n = PyList_GET_SIZE(hs);
            if (!n) { Py_DECREF(hs); continue; }
            if ((gi = fget(ev, F_GROUP_IDX)) == NULL) goto stored_fail;
            int grouped = PyObject_IsTrue(gi);
            if (grouped < 0) goto stored_fail;
            if (!pod_none || grouped) {
                PyObject *t = PyObject_CallMethodObjArgs(pm, s_keys, ev, pod, NULL);
                if (t == NULL) goto stored_fail;
                if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) { Py_DECREF(t); PyErr_SetString(PyExc_TypeError, "_keys"); goto stored_fail; }
                PyObject *k2 = PySequence_List(PyTuple_GET_ITEM(t, 0));
                pk = PyTuple_GET_ITEM(t, 1);
                Py_INCREF(pk);
                Py_DECREF(t);
                if (k2 == NULL) goto stored_fail;
                Py_SETREF(hs, k2);
                n = PyList_GET_SIZE(hs);
                if (!n) { ok = 1; goto stored_done; }
            } else if ((pk = fget(ev, F_PARENT)) == NULL) goto stored_fail;
            if ((user = fget(ev, F_USER)) == NULL) goto stored_fail;
            if ((szo = fget(ev, F_BLOCK_SIZE)) == NULL) goto stored_fail;
            size = PyLong_AsLong(szo);
            if (size == -1 && PyErr_Occurred()) goto stored_fail;
            int ue = user_entry(&users, sessions, user);
            if (ue == -2) goto stored_fail;
            if (ue >= 0) users.u[ue].fill += n;
            else if ((fill == NULL && (fill = fill_dict(&users)) == NULL) || dict_add_long(fill, user, (long)n) < 0)
                goto stored_fail;
            if ((toks = fget(ev, F_TOKEN_IDS)) == NULL) goto stored_fail;
            if (!PyList_Check(toks)) {
                Py_SETREF(toks, PySequence_List(toks));
                if (toks == NULL) goto stored_fail;
            }
            Py_ssize_t ntok = PyList_GET_SIZE(toks);
            if (pk == Py_None) {
                depth = PyLong_FromLong(0);
                if (depth == NULL) goto stored_fail;
                if (ntok) {
                    sibs = PyDict_GetItemWithError(roots, PyList_GET_ITEM(toks, 0));
                    if (sibs == NULL && PyErr_Occurred()) goto stored_fail;
                    Py_XINCREF(sibs);
                }
            } else {
                /* the parent's chain (the chain that last stored its slot, if it holds it), and
                 * the parent's index in it */
                ps = slot_of(cached, pk, nslots);
                if (ps == -2) goto stored_fail;
                if (ps >= 0) {
                    PyObject *c = PyList_GET_ITEM(chain_at, ps);
                    at = c == Py_None ? -1 : find(c, pk);
                    if (at == -2) goto stored_fail;
                    if (at >= 0) {
                        pr = c;
                        Py_INCREF(pr);
                    }
                }
                if (pr == NULL) {
                    at = -1;
                    depth = Py_None;
                    Py_INCREF(depth);
                    sibs = head(heads_at, ps, pk);
                    if (sibs == NULL && PyErr_Occurred()) goto stored_fail;
                } else {
                    Py_ssize_t len = Py_SIZE(pr);
                    PyObject *d = chain_hdr(pr, DEPTH);
                    if (d == Py_None) {
                        depth = Py_None;
                        Py_INCREF(depth);
                    } else {
                        long dv = PyLong_AsLong(d);
                        if (dv == -1 && PyErr_Occurred()) goto stored_fail;
                        if ((depth = PyLong_FromLong(dv + (long)(at - HDR) + 1)) == NULL) goto stored_fail;
                    }
                    Py_ssize_t nxt = at + 1;
                    int cont = 0;
                    if (nxt < len) {
                        cont = owns(cached, chain_at, pr, nxt);
                        if (cont < 0) goto stored_fail;
                    }
                    if (cont) sibs_true = 1;
                    else {
                        sibs = head(heads_at, ps, pk);
                        if (sibs == NULL && PyErr_Occurred()) goto stored_fail;
                    }
                }
            }
            PyObject *k0 = PyList_GET_ITEM(hs, 0);
            {
                RKey rk0;
                int e = rkey_of_key(k0, &rk0) < 0;
                if (!e) r = removed_get((RecentMap *)recent, &bs, blooms, removed, rk0, &e);
                if (e) goto stored_fail;
            }
            if ((extras = fget(ev, F_EXTRA_KEYS)) == NULL) goto stored_fail;
            int salted = 0;
            if (extras != Py_None) {
                Py_ssize_t ne = PyObject_Length(extras);
                if (ne < 0) goto stored_fail;
                if (ne) {
                    PyObject *x0 = PySequence_GetItem(extras, 0);
                    if (x0 == NULL) goto stored_fail;
                    salted = x0 != Py_None;
                    Py_DECREF(x0);
                }
            }
            int in_tier = 0;
            if (PyDict_GET_SIZE(held)) {
                in_tier = PyDict_Contains(held, k0);
                if (in_tier < 0) goto stored_fail;
            }
            int special = 0;
            if (r == NULL && !sibs_true && sibs == NULL) {
                if (in_tier) special = 1;
                else if ((run = make_run(depth, pk, user, salted, Py_None, hs)) == NULL) goto stored_fail;  /* cold */
            } else if (r == NULL && size > 0 && ntok == n * size && !in_tier && rep == Py_None) {
                /* a branch (`_branch`, inline): the rest of the parent's chain, then the newest chain
                 * under the parent (at the root: with the same first token), if cached */
                Py_ssize_t best = -1, si = 0;
                PyObject *sr = NULL;
                int err = 0;
                if (sibs_true) {
                    PyObject *slot = key_slot(cached, pr, at + 1);
                    if (slot == NULL) {
                        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "a chain's next block");
                        goto stored_fail;
                    }
                    PyObject *theirs = slot_tokens(tv, slot);
                    best = common(toks, 0, size, theirs == Py_None ? NULL : theirs, &err);
                    if (err) goto stored_fail;
                    sr = pr;
                    si = at + 1;
                    sibs = head(heads_at, ps, pk);
                    if (sibs == NULL && PyErr_Occurred()) goto stored_fail;
                }
                if (sibs != NULL && sibs != pr && is_chain(sibs) && Py_SIZE(sibs) > HDR) {
                    PyObject *slot = key_slot(cached, sibs, HDR);
                    if (slot == NULL && PyErr_Occurred()) goto stored_fail;
                    Py_ssize_t s = slot_index(slot, nslots);
                    if (s >= 0 && PyList_GET_ITEM(chain_at, s) == sibs) {
                        PyObject *theirs = slot_tokens(tv, slot);
                        Py_ssize_t c = common(toks, 0, size, theirs == Py_None ? NULL : theirs, &err);
                        if (err) goto stored_fail;
                        if (c > best) {
                            best = c;
                            sr = sibs;
                            si = HDR;
                        }
                    }
                    if (PyErr_Occurred()) goto stored_fail;
                }
                if (sr == NULL) {
                    if ((run = make_run(depth, pk, user, salted, Py_None, hs)) == NULL) goto stored_fail;  /* cold */
                } else {
                    PyObject *who = chain_hdr(sr, USER);
                    if (best == size) {  /* the same tokens under another hash: other keys */
                        int iso = salted || (si == HDR && PyObject_IsTrue(chain_hdr(sr, SALTED)) > 0);
                        long k = 1;
                        Py_ssize_t o = size, srn = Py_SIZE(sr);
                        for (Py_ssize_t j = si + 1; j < si + n && j < srn; j++) {
                            PyObject *slot = key_slot(cached, sr, j);
                            if (slot == NULL) {
                                if (PyErr_Occurred()) goto stored_fail;
                                break;
                            }
                            Py_ssize_t s = slot_index(slot, nslots);
                            if (s < 0 || PyList_GET_ITEM(chain_at, s) != sr) break;
                            PyObject *theirs = slot_tokens(tv, slot);
                            if (!PyTuple_Check(theirs) || PyTuple_GET_SIZE(theirs) != size) break;
                            if (common(toks, o, size, theirs, &err) != size || err) {
                                if (err) goto stored_fail;
                                break;
                            }
                            k++;
                            o += size;
                        }
                        PyObject *kk = PyLong_FromLong(k);
                        if (kk == NULL) goto stored_fail;
                        PyObject *items[6] = {u_branch, iso ? u_isolated : u_config, Py_None, Py_None, who, kk};
                        mark = tuple_of(items, 6);
                        Py_DECREF(kk);
                        ri = iso ? R_ISOLATED : R_CONFIG;
                        q = k;
                    } else {
                        PyObject *pos;
                        if (depth == Py_None) {
                            pos = Py_None;
                            Py_INCREF(pos);
                        } else {
                            long dv = PyLong_AsLong(depth);
                            pos = PyLong_FromLong(dv * size + (long)best);
                            if (pos == NULL) goto stored_fail;
                        }
                        PyObject *bo = PyLong_FromSsize_t(best), *no = PyLong_FromSsize_t(n);
                        PyObject *items[6] = {u_branch, u_diverged, pos, bo, who, no};
                        mark = bo && no ? tuple_of(items, 6) : NULL;
                        Py_XDECREF(bo);
                        Py_XDECREF(no);
                        Py_DECREF(pos);
                        ri = R_DIVERGED;
                        q = (long)n;
                    }
                    if (mark == NULL) goto stored_fail;
                    untrack(mark);
                    if ((run = make_run(depth, pk, user, salted, mark, hs)) == NULL) goto stored_fail;
                }
            } else if (r != NULL && !in_tier && rep == Py_None && PyTuple_Check(r) && PyTuple_GET_SIZE(r) >= 5) {
                /* stored and removed before (`_recomputed`, inline): how many of its blocks, from its
                 * first on, were removed for the same reason; the latest removal among them, and
                 * who evicted it */
                PyObject *reason = PyTuple_GET_ITEM(r, 0), *when = Py_NewRef(PyTuple_GET_ITEM(r, 1));
                PyObject *by = by_of(by_at, r), *kk = NULL;
                long k = 1;
                int bad = by == NULL;
                for (; k < (long)n && !bad; k++) {
                    RKey kk_;
                    int e = rkey_of_key(PyList_GET_ITEM(hs, k), &kk_) < 0;
                    PyObject *rk = e ? NULL : removed_get((RecentMap *)recent, &bs, blooms, removed, kk_, &e);
                    if (e) { bad = 1; break; }
                    if (rk == NULL) break;
                    int ne = !PyTuple_Check(rk) || PyTuple_GET_SIZE(rk) < 5 ? -2
                             : PyObject_RichCompareBool(PyTuple_GET_ITEM(rk, 0), reason, Py_NE);
                    if (ne == -2) PyErr_SetString(PyExc_TypeError, "a removal");
                    if (ne) {
                        bad = ne < 0;
                        Py_DECREF(rk);
                        break;
                    }
                    PyObject *ts = PyTuple_GET_ITEM(rk, 1);
                    if (ts != Py_None) {
                        int later = when == Py_None ? 1 : PyObject_RichCompareBool(ts, when, Py_GT);
                        if (later < 0) bad = 1;
                        else if (later) {
                            Py_SETREF(when, Py_NewRef(ts));
                            Py_SETREF(by, by_of(by_at, rk));
                            bad = by == NULL;
                        }
                    }
                    Py_DECREF(rk);
                }
                if (!bad) {
                    int evicted_ = PyObject_RichCompareBool(reason, u_evicted, Py_EQ);
                    if (evicted_ < 0) bad = 1;
                    else if (!evicted_) Py_SETREF(by, Py_NewRef(Py_None));
                }
                PyObject *place = bad ? NULL : PyDict_GetItemWithError(AT, reason);
                if (!bad && place == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, reason);
                if (place != NULL && (kk = PyLong_FromLong(k)) != NULL) {
                    PyObject *items[5] = {u_recomputed, reason, when, by, kk};
                    mark = tuple_of(items, 5);
                    ri = PyLong_AsLong(place);
                    q = k;
                }
                Py_DECREF(when);
                Py_XDECREF(by);
                Py_XDECREF(kk);
                if (mark == NULL || PyErr_Occurred()) goto stored_fail;
                untrack(mark);
                if ((run = make_run(depth, pk, user, salted, mark, hs)) == NULL) goto stored_fail;
            } else special = 1;
            if (special) {
                PyObject *base = make_run(depth, pk, user, salted, Py_None, hs);
                if (base == NULL) goto stored_fail;
                PyObject *atobj = PyLong_FromSsize_t(at);
                if (atobj == NULL) { Py_DECREF(base); goto stored_fail; }
                PyObject *sibs_arg = sibs_true ? Py_True : (sibs ? sibs : Py_None);
                run = PyObject_CallMethodObjArgs(pm, s_special, ev, base, r ? r : Py_None, pr ? pr : Py_None, atobj,
                                                 sibs_arg, rep, NULL);
                Py_DECREF(base);
                Py_DECREF(atobj);
                if (run == NULL) goto stored_fail;
                if (!is_chain(run) || Py_SIZE(run) != HDR + n) {  /* (the chain it was given, or a tuple) */
                    PyErr_SetString(PyExc_TypeError, "_special returned no chain");
                    goto stored_fail;
                }
                PyObject *m = chain_hdr(run, MARK);
                if (m != Py_None) {
                    if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) < 2) {
                        PyErr_SetString(PyExc_TypeError, "a chain's mark");
                        goto stored_fail;
                    }
                    PyObject *kind = PyTuple_GET_ITEM(m, 0);
                    int is_tier = PyUnicode_Check(kind) && PyUnicode_Compare(kind, u_tier) == 0;
                    PyObject *place = PyDict_GetItemWithError(AT, is_tier ? u_tier : PyTuple_GET_ITEM(m, 1));
                    if (place == NULL) {
                        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "a mark's reason");
                        goto stored_fail;
                    }
                    ri = PyLong_AsLong(place);
                    q = PyLong_AsLong(PyTuple_GET_ITEM(m, PyTuple_GET_SIZE(m) - 1));
                    if (PyErr_Occurred()) goto stored_fail;
                }
            }
            /* count it: its session's counts (at the batch's end), `_count_later` when it has none yet */
            if (ue >= 0 && users.u[ue].sc != NULL) {
                long *a = users.u[ue].add;
                if (ri < 0) {
                    a[R_COLD] += n;
                    a[R_COLD + NC] += n * size;
                    tally[R_COLD] += n;
                    tally[R_COLD + NC] += n * size;
                } else {
                    long t = q * size;
                    a[ri] += q;
                    a[ri + NC] += t;
                    tally[ri] += q;
                    tally[ri + NC] += t;
                    if (q < n) {
                        a[R_COLD] += n - q;
                        a[R_COLD + NC] += (n - q) * size;
                        tally[R_COLD] += n - q;
                        tally[R_COLD + NC] += (n - q) * size;
                    }
                }
            } else {
                PyObject *sc = ue >= 0 ? NULL : PyDict_GetItemWithError(sessions, user);
                if (sc == NULL && PyErr_Occurred()) goto stored_fail;
                if (sc != NULL && (!PyList_CheckExact(sc) || PyList_GET_SIZE(sc) != 2 * NC)) {
                    PyErr_SetString(PyExc_TypeError, "a session's counts");
                    goto stored_fail;
                }
                if (sc == NULL) {
                    PyObject *t = Py_BuildValue("(Olnnl)", user, ri, (Py_ssize_t)(ri >= 0 ? q : 0), n, size);
                    if (t != NULL && later == NULL && (later = PyList_New(0)) == NULL) { Py_DECREF(t); goto stored_fail; }
                    if (t == NULL || PyList_Append(later, t) < 0) { Py_XDECREF(t); goto stored_fail; }
                    Py_DECREF(t);
                } else if (ri < 0) {
                    if (bump(sc, R_COLD, (long)n) < 0 || bump(sc, R_COLD + NC, (long)n * size) < 0) goto stored_fail;
                    tally[R_COLD] += n;
                    tally[R_COLD + NC] += n * size;
                } else {
                    long t = q * size;
                    if (bump(sc, ri, q) < 0 || bump(sc, ri + NC, t) < 0) goto stored_fail;
                    tally[ri] += q;
                    tally[ri + NC] += t;
                    if (q < n) {
                        if (bump(sc, R_COLD, (long)n - q) < 0 || bump(sc, R_COLD + NC, ((long)n - q) * size) < 0)
                            goto stored_fail;
                        tally[R_COLD] += n - q;
                        tally[R_COLD + NC] += (n - q) * size;
                    }
                }
            }
            /* the chain of each of its blocks' slots, and of its parent's children */
            {
                PyObject *ids = fget(ev, F_BLOCK_IDS);
                if (ids == NULL) goto stored_fail;
                PyObject *fi = PySequence_Fast(ids, "block_ids");
                Py_DECREF(ids);
                if (fi == NULL) goto stored_fail;
                Py_ssize_t ni = PySequence_Fast_GET_SIZE(fi);
                PyObject **it = PySequence_Fast_ITEMS(fi);
                int bad = 0;
                for (Py_ssize_t i = 0; i < ni && i < n; i++) {
                    Py_ssize_t b = PyLong_AsSsize_t(it[i]);
                    if (b == -1 && PyErr_Occurred()) { bad = 1; break; }
                    b -= off;
                    if (b < 0 || b >= nslots) continue;
                    PyObject *old = PyList_GET_ITEM(chain_at, b);
                    Py_INCREF(run);
                    PyList_SET_ITEM(chain_at, b, run);
                    Py_DECREF(old);
                }
                Py_DECREF(fi);
                if (bad) goto stored_fail;
            }
            if (ps >= 0) {
                PyObject *old = PyList_GET_ITEM(heads_at, ps);
                Py_INCREF(run);
                PyList_SET_ITEM(heads_at, ps, run);
                Py_DECREF(old);
            } else if (pk == Py_None && ntok) {
                if (PyDict_SetItem(roots, PyList_GET_ITEM(toks, 0), run) < 0) goto stored_fail;
            }
            if (tracking) {
                PyObject *t = PyObject_CallMethodObjArgs(pm, s_track, ev, hs, pk, toks, szo, NULL);
                if (t == NULL) goto stored_fail;
                Py_DECREF(t);
            }
            ok = 1;
        stored_done:
        stored_fail:
            Py_XDECREF(hs); Py_XDECREF(pk); Py_XDECREF(user); Py_XDECREF(toks); Py_XDECREF(extras);
            Py_XDECREF(pr); Py_XDECREF(sibs); Py_XDECREF(depth); Py_XDECREF(r); Py_XDECREF(run);
            Py_XDECREF(mark); Py_XDECREF(gi); Py_XDECREF(szo);
            if (!ok) goto fail;
        } else if (cls == Hit) {
            continue;
        } else if (cls == Removed) {
            PyObject *hs = fget(ev, F_BLOCK_HASHES), *cr = NULL;
            if (hs == NULL) goto fail;
            Py_ssize_t nh = PyObject_Length(hs);
            if (nh < 0) { Py_DECREF(hs); goto fail; }
            if (!nh) { Py_DECREF(hs); continue; }
            int usual = 0;
            if (usual_rm) {
                if ((cr = fget(ev, F_CREATORS)) == NULL) { Py_DECREF(hs); goto fail; }
                Py_ssize_t nc = PyObject_Length(cr);
                PyObject *gi = NULL, *why = NULL, *by = NULL, *ts = NULL;
                if (nc == nh && (gi = fget(ev, F_GROUP_IDX)) && (why = fget(ev, F_REASON)) &&
                    (by = fget(ev, F_BY_USER)) && (ts = fget(ev, F_TS))) {
                    int g = PyObject_IsTrue(gi), b = PyObject_IsTrue(by);
                    int rs = PyUnicode_Check(why) && PyUnicode_Compare(why, u_evicted) == 0;
                    int same = g == 0 && b == 0 && rs ? PyObject_RichCompareBool(ts, bts, Py_EQ) : 0;
                    usual = same == 1;
                }
                Py_XDECREF(gi); Py_XDECREF(why); Py_XDECREF(by); Py_XDECREF(ts);
                if (PyErr_Occurred()) { Py_DECREF(hs); Py_DECREF(cr); goto fail; }
            }
            if (usual) {  /* the usual eviction: into the RemovedLog, one Removal for the batch's */
                PyObject *fh = PySequence_Fast(hs, "block_hashes"), *fc = PySequence_Fast(cr, "creators");
                int bad = fh == NULL || fc == NULL || PySequence_Fast_GET_SIZE(fh) != nh ||
                          PySequence_Fast_GET_SIZE(fc) != nh;
                if (!bad && usual_removal == NULL) {
                    usual_removal = removal_new(u_evicted, bts);
                    bad = usual_removal == NULL;
                    if (!bad) untrack(usual_removal);  /* (a namedtuple: the collector never untracks it) */
                }
                for (Py_ssize_t i = 0; i < nh && !bad; i++) {
                    RKey k;
                    bad = rkey_of_key(PySequence_Fast_GET_ITEM(fh, i), &k) < 0 ||
                          rm_set((RecentMap *)recent, k, usual_removal) < 0 ||
                          whose_add(&wh, PySequence_Fast_GET_ITEM(fc, i), &whose) < 0;
                }
                gone += nh;
                Py_XDECREF(fh);
                Py_XDECREF(fc);
                Py_DECREF(hs);
                Py_DECREF(cr);
                if (!bad && ((RecentMap *)recent)->live >= rec_cap) {
                    PyObject *t = flush(NULL, removed);
                    bad = t == NULL;
                    Py_XDECREF(t);
                    blooms_load(&bs, blooms);
                }
                if (bad) {
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a removal changed size");
                    goto fail;
                }
            } else {
                Py_DECREF(hs);
                Py_XDECREF(cr);
                PyObject *t = PyObject_CallMethodObjArgs(pm, s_removed_m, ev, pod, NULL);
                if (t == NULL) goto fail;
                int b = PyObject_IsTrue(t);
                Py_DECREF(t);
                if (b < 0) goto fail;
                evicted |= b;
                blooms_load(&bs, blooms);  /* (it may have moved removals into the filters) */
            }
        } else if (cls == Tier) {
            PyObject *t = PyObject_CallMethodObjArgs(pm, s_tier_m, ev, pod, rep, NULL);
            if (t == NULL) goto fail;
            Py_DECREF(t);
        } else if (cls == Cleared) {
            PyObject *t = PyObject_CallMethodNoArgs(pm, s_cleared_m);
            if (t == NULL) goto fail;
            Py_DECREF(t);
        }
    }
    if (users_enter(&users, fill, pd) < 0) goto fail;
    /* who stored the most in the batch (the first of them: `max(fill, key=fill.get)`), and, when it
     * evicted, the batch's time -> who stored the most in the last batch that stored (`by_at`;
     * PodMisses.apply and _evicted_by do the rest) */
    if (users.n) {
        PyObject *top = NULL, *k, *v;
        long best = 0;
        Py_ssize_t pos = 0;
        if (fill == NULL)
            for (int i = 0; i < users.n; i++) {
                if (top == NULL || users.u[i].fill > best) {
                    top = users.u[i].user;
                    best = users.u[i].fill;
                }
            }
        else
            while (PyDict_Next(fill, &pos, &k, &v)) {
                long x = PyLong_AsLong(v);
                if (x == -1 && PyErr_Occurred()) goto fail;
                if (top == NULL || x > best) {
                    top = k;
                    best = x;
                }
            }
        if (PyObject_SetAttr(pm, s_last_top, top) < 0) goto fail;
    }
    if (evicted || gone) {
        PyObject *top = PyObject_GetAttr(pm, s_last_top);
        int rc = top == NULL ? -1 : PyDict_SetItem(by_at, bts, top);
        Py_XDECREF(top);
        if (rc < 0) goto fail;
    }
    /* whose blocks the usual evictions were (PodMisses._whose, at the batch's end): counted as
     * they came (a batch evicts few creators' blocks many times), added in the order each first came */
    if (wh.n && pd != NULL && whose == NULL) {  /* (pending; the full table settled into `ev_from` first) */
        for (int i = 0; i < wh.n; i++) {
            if (pd->nw == PEND_WHO) {
                PyObject *ev_from = NULL;
                GET(ev_from, pm, s_evicted_from);
                int rc = pend_settle_who(pd, ev_from, max_sessions);
                Py_DECREF(ev_from);
                if (rc < 0) goto fail;
            }
            if (pend_who(pd, wh.who[i], wh.count[i]) < 0) goto fail;
        }
    } else if (wh.n) {  /* (what is pending first: the creators in the order they came) */
        PyObject *ev_from = NULL;
        GET(ev_from, pm, s_evicted_from);
        int rc = pd != NULL ? pend_settle_who(pd, ev_from, max_sessions) : 0;
        if (rc == 0) rc = count_whose(ev_from, &wh, whose, max_sessions);
        Py_DECREF(ev_from);
        if (rc < 0) goto fail;
    }
    {
        PyObject *tl;
        if (later == NULL) {  /* counted here (PodMisses._tally) */
            if (add_tally(pm, rep, tally, pd) < 0) goto fail;
            tl = Py_None;
            Py_INCREF(tl);
        } else {
            if ((tl = PyList_New(2 * NC)) == NULL) goto fail;
            for (int i = 0; i < 2 * NC; i++) {
                PyObject *v = PyLong_FromLong(tally[i]);
                if (v == NULL) { Py_DECREF(tl); goto fail; }
                PyList_SET_ITEM(tl, i, v);
            }
        }
        result = Py_BuildValue("(NOOOOn)", tl, later != NULL ? later : Py_None, Py_None, Py_None,
                               evicted ? Py_True : Py_False, gone);
    }
fail:
#undef GET
    users_release(&users);
    whose_release(&wh);
    blooms_release(&bs);
    Py_XDECREF(usual_removal);
    Py_XDECREF(by_at); Py_XDECREF(chain_at); Py_XDECREF(heads_at); Py_XDECREF(roots); Py_XDECREF(held);
    Py_XDECREF(sessions); Py_XDECREF(mirror); Py_XDECREF(cached); Py_XDECREF(tokens_obj); Py_XDECREF(tv);
    Py_XDECREF(removed); Py_XDECREF(recent); Py_XDECREF(blooms); Py_XDECREF(later); Py_XDECREF(fill);
    Py_XDECREF(whose);
    return result;
}

/* setup(BlockStored, BlockRemoved, BlockHit, TierBlocks, AllBlocksCleared, Removal, AT) */
static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *a[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO!", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &PyDict_Type, &a[6]))
        return NULL;
    PyObject **slots[7] = {&Stored, &Removed, &Hit, &Tier, &Cleared, &RemovalCls, &AT};
    PyObject *names[NC] = {NULL};
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(a[6], &pos, &k, &v)) {
        long i = PyLong_AsLong(v);
        if (i < 0 || i >= NC || !PyUnicode_Check(k)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "places: each reason's place in 0..6");
            return NULL;
        }
        names[i] = k;
    }
    for (int i = 0; i < NC; i++)
        if (names[i] == NULL) {
            PyErr_SetString(PyExc_ValueError, "places: a place without a reason");
            return NULL;
        }
    for (int i = 0; i < NC; i++) {
        Py_INCREF(names[i]);
        Py_XSETREF(reason_names[i], names[i]);
    }
    for (int i = 0; i < 7; i++) {
        Py_INCREF(a[i]);
        Py_XSETREF(*slots[i], a[i]);
    }
    for (int r = 0; r < 3; r++) Py_CLEAR(kind_removal[r]);  /* (made again of this Removal) */
    /* Removal made in C (removal_new) when it is the namedtuple it is meant to be */
    for (int i = 0; i < 3; i++) Py_CLEAR(removal_defaults[i]);
    PyObject *fields = PyObject_GetAttrString(RemovalCls, "_fields");
    PyObject *dflt = PyObject_GetAttrString(RemovalCls, "_field_defaults");
    PyObject *want = Py_BuildValue("(sssss)", "reason", "ts", "policy", "by", "creator");
    int same = fields && want && PyType_Check(RemovalCls) && PyType_IsSubtype((PyTypeObject *)RemovalCls, &PyTuple_Type)
               && PyObject_RichCompareBool(fields, want, Py_EQ) == 1 && dflt && PyDict_Check(dflt);
    const char *dnames[3] = {"policy", "by", "creator"};
    for (int i = 0; i < 3 && same; i++) {
        PyObject *d = PyDict_GetItemString(dflt, dnames[i]);
        if (d == NULL) same = 0;
        else removal_defaults[i] = Py_NewRef(d);
    }
    if (!same)
        for (int i = 0; i < 3; i++) Py_CLEAR(removal_defaults[i]);
    PyErr_Clear();
    Py_XDECREF(fields);
    Py_XDECREF(dflt);
    Py_XDECREF(want);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL, "PodMisses._scan, compiled."},
    {"flush", flush, METH_O, "RemovedLog.flush, compiled."},
    {"filtered", (PyCFunction)(void (*)(void))filtered, METH_FASTCALL, "RemovedLog.filtered, compiled."},
    {"setup", setup, METH_VARARGS, "The event classes, Removal and the reasons' places."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvplay_miss_chains", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvplay_miss_chains(void) {
    struct { PyObject **p; const char *s; } names[] = {
        {&s_block_hashes, "block_hashes"}, {&s_parent_block_hash, "parent_block_hash"}, {&s_user, "user"},
        {&s_block_size, "block_size"}, {&s_token_ids, "token_ids"}, {&s_extra_keys, "extra_keys"},
        {&s_group_idx, "group_idx"}, {&s_creators, "creators"}, {&s_reason, "reason"}, {&s_by_user, "by_user"},
        {&s_ts, "ts"}, {&s_block_ids, "block_ids"}, {&s_chain_at, "chain_at"}, {&s_heads_at, "heads_at"},
        {&s_offset, "offset"}, {&s_cleared_m, "_cleared"}, {&s_roots, "roots"}, {&s_tier_of, "tier_of"},
        {&s_sessions, "_sessions"}, {&s_mirror, "mirror"}, {&s_key_slot, "key_slot"},
        {&s_tokens, "tokens"}, {&s_v, "v"}, {&s_removed, "removed"}, {&s_recent, "recent"}, {&s_blooms, "blooms"},
        {&s_n, "_n"}, {&s_n_prev, "_n_prev"}, {&s_m, "m"}, {&s_probes, "probes"}, {&s_cur, "_cur"},
        {&s_prev, "_prev"}, {&s_filtered, "filtered"}, {&s_keys, "_keys"}, {&s_special, "_special"},
        {&s_removed_m, "_removed"}, {&s_tier_m, "_tier"}, {&s_track, "_track"}, {&s_capacity, "capacity"},
        {&s_rotate, "rotate"}, {&s_recent_capacity, "recent_capacity"}, {&s_flush_every, "_flush_every"},
        {&s_bloom_for, "bloom_for"}, {&s_evicted_from, "_evicted_from"}, {&s_counts, "_counts"},
        {&u_others, "others"}, {&u_blocks, "blocks"}, {&u_tokens, "tokens"}, {&u_branch, "branch"},
        {&u_diverged, "diverged"}, {&u_isolated, "isolated"}, {&u_config, "config"}, {&u_evicted, "evicted"},
        {&u_tier, "tier"}, {&u_recomputed, "recomputed"}, {&s_by_at, "by_at"}, {&s_last_top, "last_top"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL) return NULL;
    if ((kinds[1] = PyUnicode_InternFromString("cleared")) == NULL) return NULL;
    if (PyType_Ready(&RecentMapType) < 0 || PyType_Ready(&ChainType) < 0 || PyType_Ready(&PendingType) < 0) return NULL;
    kinds[0] = u_evicted;
    kinds[2] = u_config;
    PyObject *f[NFIELDS] = {s_block_hashes, s_parent_block_hash, s_user, s_block_size, s_token_ids, s_extra_keys,
                            s_group_idx, s_creators, s_reason, s_by_user, s_ts, s_block_ids};
    memcpy(field_names, f, sizeof f);
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "Chain", (PyObject *)&ChainType) < 0 ||
        PyModule_AddObjectRef(mod, "Pending", (PyObject *)&PendingType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    Py_INCREF(&RecentMapType);
    if (PyModule_AddObject(mod, "RecentMap", (PyObject *)&RecentMapType) < 0) {
        Py_DECREF(&RecentMapType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
