/* Pending: what a pod's batches counted that its Python counters (wire/miss_watch.py's
 * PodMisses: the sessions' counts, `evicted_from`, the pod's `counts`) have not been given yet.
 * Included by miss_chains.c, whose per-event loop adds each batch's sums here; PodMisses settles
 * it before anything reads those counters (they are properties that settle first), and the loop
 * settles a table itself when it is full. A sum is a sum: once settled, the counters read what
 * entering each batch at once gave; but a batch no longer makes and drops a Python int per
 * session, reason and evicted creator (a busy server's batches counted ten to twenty each).
 *
 * Order is kept where it names things: creators are entered in the order they first came (the
 * first `max_sessions` named, the rest as "others", as PodMisses._whose does), and sessions are
 * only added to here once they have counts (PodMisses makes new ones in order). */
#ifndef KVPLAY_PENDING_H
#define KVPLAY_PENDING_H

#define PEND_USERS 64
#define PEND_WHO 64

typedef struct {
    PyObject_HEAD
    int nu, nw, counted;
    PyObject *sc[PEND_USERS];  /* a session's counts (a list: the pod's `_sessions` value; a reference held) */
    long add[PEND_USERS][2 * NC];
    PyObject *who[PEND_WHO];   /* an evicted block's creator (a reference held), in the order they came */
    Py_hash_t hash[PEND_WHO];
    long wcount[PEND_WHO];
    long tally[2 * NC];        /* the pod's counts: blocks by reason, then tokens */
} Pending;

static PyTypeObject PendingType;

/* The sessions' adds into their counts. */
static int pend_settle_users(Pending *p) {
    int rc = 0;
    for (int i = 0; i < p->nu; i++) {
        for (int j = 0; j < 2 * NC && !rc; j++)
            if (bump(p->sc[i], j, p->add[i][j]) < 0) rc = -1;
        Py_DECREF(p->sc[i]);
    }
    p->nu = 0;
    return rc;
}

/* The creators' evicted blocks into `ev_from` (a Counter), in the order they came (`whose_into`). */
static int pend_settle_who(Pending *p, PyObject *ev_from, Py_ssize_t max_sessions) {
    int rc = PyDict_Check(ev_from) ? 0 : -1;
    if (rc) PyErr_SetString(PyExc_TypeError, "evicted_from");
    for (int i = 0; i < p->nw; i++) {
        if (!rc && whose_into(ev_from, p->who[i], p->wcount[i], max_sessions) < 0) rc = -1;
        Py_DECREF(p->who[i]);
    }
    p->nw = 0;
    return rc;
}

/* A batch's counts (blocks by reason, then tokens) into a counts dict ({"blocks": {reason: n},
 * "tokens": {...}}). */
static int tally_into(PyObject *c, const long *tally) {
    PyObject *blocks = PyObject_GetItem(c, u_blocks), *tokens = blocks ? PyObject_GetItem(c, u_tokens) : NULL;
    int rc = 0;
    if (tokens == NULL || !PyDict_Check(blocks) || !PyDict_Check(tokens)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "counts");
        rc = -1;
    }
    for (int i = 0; i < NC && !rc; i++)
        if (tally[i] && (dict_add_long(blocks, reason_names[i], tally[i]) < 0 ||
                         dict_add_long(tokens, reason_names[i], tally[i + NC]) < 0))
            rc = -1;
    Py_XDECREF(blocks);
    Py_XDECREF(tokens);
    return rc;
}

/* A session's adds (its counts list `sc`, known by identity). */
static int pend_user(Pending *p, PyObject *sc, const long *add) {
    int i = 0;
    while (i < p->nu && p->sc[i] != sc) i++;
    if (i == p->nu) {
        if (p->nu == PEND_USERS && pend_settle_users(p) < 0) return -1;
        i = p->nu++;
        p->sc[i] = Py_NewRef(sc);
        memset(p->add[i], 0, sizeof p->add[i]);
    }
    for (int j = 0; j < 2 * NC; j++) p->add[i][j] += add[j];
    return 0;
}

/* `k` more evicted blocks of creator `c` (the caller settles a full table first: PEND_WHO). */
static int pend_who(Pending *p, PyObject *c, long k) {
    Py_hash_t h;
    int i = find_by_value(p->who, p->hash, p->nw, c, &h);
    if (i == -2) return -1;
    if (i >= 0) {
        p->wcount[i] += k;
        return 0;
    }
    if (p->nw == PEND_WHO) {
        PyErr_SetString(PyExc_RuntimeError, "pending creators: a full table");
        return -1;
    }
    p->who[p->nw] = Py_NewRef(c);
    p->hash[p->nw] = h;
    p->wcount[p->nw++] = k;
    return 0;
}

/* settle(evicted_from, counts, max_sessions): everything pending into the pod's counters. */
static PyObject *pend_settle_m(Pending *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "settle(evicted_from, counts, max_sessions)");
        return NULL;
    }
    Py_ssize_t max_sessions = PyLong_AsSsize_t(args[2]);
    if (max_sessions == -1 && PyErr_Occurred()) return NULL;
    int rc = pend_settle_users(p);
    rc |= pend_settle_who(p, args[0], max_sessions);
    if (p->counted) {
        rc |= tally_into(args[1], p->tally);
        memset(p->tally, 0, sizeof p->tally);
        p->counted = 0;
    }
    if (rc) return NULL;
    Py_RETURN_NONE;
}

static PyObject *pend_waiting(Pending *p, void *unused) {
    return PyBool_FromLong(p->nu || p->nw || p->counted);
}

static void pend_dealloc(Pending *p) {
    for (int i = 0; i < p->nu; i++) Py_DECREF(p->sc[i]);
    for (int i = 0; i < p->nw; i++) Py_DECREF(p->who[i]);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *pend_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Pending() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0);  /* (zeroed: nothing pending) */
}

static PyMethodDef pend_methods[] = {
    {"settle", (PyCFunction)(void (*)(void))pend_settle_m, METH_FASTCALL,
     "settle(evicted_from, counts, max_sessions): what is pending into the pod's counters"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pend_getset[] = {
    {"waiting", (getter)pend_waiting, NULL, "whether anything is pending", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* (Not tracked by the collector: it holds str and lists of ints, which cannot lead back to it.) */
static PyTypeObject PendingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvplay_miss_chains.Pending",
    .tp_basicsize = sizeof(Pending),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a pod's counts that its counters have not been given yet (settle them before reading those)",
    .tp_new = pend_new,
    .tp_dealloc = (destructor)pend_dealloc,
    .tp_methods = pend_methods,
    .tp_getset = pend_getset,
};

#endif
