/* A SIGBUS guard for read-only file mappings (mapped.py).
 *
 * When a mapped file is truncated by another process, touching a page past its new end raises
 * SIGBUS and the process dies without a word, leaving its temporary output behind. A `Guard`
 * registers the range of one mapping in a fixed table; the handler, installed once on the first
 * Guard, answers a fault (BUS_ADRERR) inside a registered range by mapping private anonymous zero
 * pages over it, from the faulting page to the end of that mapping (every page after a page past
 * the end of file is past it too; one replacement keeps the mapping from splitting into a VMA per
 * faulting page), counts a hit and returns: the load runs again and reads zeros. Python sees the
 * hits and stops the run ("changed while it was being read"). Any other SIGBUS goes where it went
 * before: to the handler installed before ours (faulthandler's), else the default action.
 *
 * Lifetime: the Guard holds the mapping's buffer (an export of the mmap object) for as long as it
 * lives and is itself what Python reads through (mapped.py makes its memoryview of the Guard), so
 * the mapping cannot be unmapped while it is registered: the Guard's dealloc unregisters first and
 * only then releases the buffer (which may munmap). A slot therefore never describes memory that is
 * no longer this mapping. The table is written by Python with the GIL held and only read by the
 * handler (the end address is published last and cleared first, with atomic stores).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__linux__) && defined(SA_SIGINFO) && defined(MAP_ANONYMOUS)
#define HAVE_GUARD 1
#else
#define HAVE_GUARD 0
#endif

/* A Grok-1 directory of 8 hosts maps ~6,200 files at once: 65,536 slots is ten times that
 * (about 2 MiB of zero pages until used). */
#define CAPACITY 65536

typedef struct {
    uintptr_t start;
    uintptr_t end;  /* one past the last byte; 0: free */
    long hits;
} Slot;

typedef struct {
    PyObject_HEAD
    Py_buffer buf;  /* the mapping's, held for the Guard's life */
    Py_ssize_t slot;
    PyObject *tag;  /* what changed() reports (mapped.py: the path) */
} Guard;

static Slot slots[CAPACITY];
static Guard *owners[CAPACITY];  /* Python side only */
static int free_slots[CAPACITY], n_free, high_water;
static volatile int limit;       /* slots the handler scans */
static PyObject *released;       /* tags of guards that had hits, released since forget() */
static uintptr_t page_size;
static struct sigaction previous;
static int installed;

#if HAVE_GUARD
static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    if (info->si_code == BUS_ADRERR) {
        uintptr_t a = (uintptr_t)info->si_addr;
        int n = __atomic_load_n(&limit, __ATOMIC_ACQUIRE);
        for (int i = 0; i < n; i++) {
            uintptr_t end = __atomic_load_n(&slots[i].end, __ATOMIC_ACQUIRE);
            uintptr_t start = __atomic_load_n(&slots[i].start, __ATOMIC_ACQUIRE);
            if (end == 0 || a < start || a >= end || __atomic_load_n(&slots[i].end, __ATOMIC_ACQUIRE) != end)
                continue;  /* (the last test: not a slot being reused under us in another thread) */
            uintptr_t page = a & ~(page_size - 1), stop = (end + page_size - 1) & ~(page_size - 1);
            /* mmap is a plain system call here (not on POSIX's async-signal-safe list, but glibc's
             * and musl's wrappers take no locks). */
            int saved = errno;
            void *zeros = mmap((void *)page, stop - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            errno = saved;
            if (zeros == MAP_FAILED)
                break;  /* (e.g. vm.max_map_count reached): die as we would have */
            __atomic_add_fetch(&slots[i].hits, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {  /* (a union with sa_sigaction) */
        if (previous.sa_flags & SA_SIGINFO)
            previous.sa_sigaction(sig, info, ctx);
        else
            previous.sa_handler(sig);
    } else {
        /* Put back what was there: a fault runs again on return and gets the default action; a
         * SIGBUS sent by kill() is sent again (it stays blocked until we return). */
        sigaction(SIGBUS, &previous, NULL);
        if (info->si_code <= 0)
            raise(sig);
    }
}
#endif

static int install(void) {
#if HAVE_GUARD
    if (installed)
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;  /* ONSTACK: a chained faulthandler expects it */
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    installed = 1;
    return 0;
#else
    PyErr_SetString(PyExc_OSError, "no SIGBUS guard on this platform");
    return -1;
#endif
}

static PyObject *guard_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"mapping", "tag", NULL};
    PyObject *obj, *tag = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:Guard", names, &obj, &tag))
        return NULL;
    if (install() < 0)
        return NULL;
    Guard *self = (Guard *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->slot = -1;
    if (PyObject_GetBuffer(obj, &self->buf, PyBUF_SIMPLE) < 0) {
        self->buf.obj = NULL;
        Py_DECREF(self);
        return NULL;
    }
    uintptr_t start = (uintptr_t)self->buf.buf;
    if (self->buf.len <= 0 || start % page_size) {
        PyErr_SetString(PyExc_ValueError, "a Guard takes a whole non-empty mapping (page-aligned)");
        Py_DECREF(self);
        return NULL;
    }
    int slot;
    if (n_free)
        slot = free_slots[--n_free];
    else if (high_water < CAPACITY)
        slot = high_water++;
    else {
        PyErr_Format(PyExc_OverflowError, "the SIGBUS guard table is full (%d mappings)", CAPACITY);
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(tag);
    self->tag = tag;
    self->slot = slot;
    owners[slot] = self;
    __atomic_store_n(&slots[slot].start, start, __ATOMIC_RELEASE);
    __atomic_store_n(&slots[slot].hits, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&slots[slot].end, start + (uintptr_t)self->buf.len, __ATOMIC_RELEASE);
    if (slot >= limit)
        __atomic_store_n(&limit, slot + 1, __ATOMIC_RELEASE);
    return (PyObject *)self;
}

static void guard_dealloc(Guard *self) {
    if (self->slot >= 0) {
        Slot *s = &slots[self->slot];
        __atomic_store_n(&s->end, 0, __ATOMIC_RELEASE);  /* unregistered before the buffer goes */
        if (__atomic_load_n(&s->hits, __ATOMIC_RELAXED) && released != NULL) {
#if PY_VERSION_HEX >= 0x030C0000
            PyObject *pending = PyErr_GetRaisedException();
#else
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
#endif
            if (PyList_Append(released, self->tag) < 0)
                PyErr_WriteUnraisable((PyObject *)self);
#if PY_VERSION_HEX >= 0x030C0000
            PyErr_SetRaisedException(pending);
#else
            PyErr_Restore(type, value, tb);
#endif
        }
        owners[self->slot] = NULL;
        free_slots[n_free++] = (int)self->slot;
    }
    if (self->buf.obj != NULL)
        PyBuffer_Release(&self->buf);
    Py_XDECREF(self->tag);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Python reads the mapping through the Guard, so every view keeps the Guard (and the mapping) alive. */
static int guard_getbuffer(Guard *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->buf.buf, self->buf.len, 1, flags);
}

static PyObject *guard_hits(Guard *self, void *unused) {
    return PyLong_FromLong(self->slot >= 0 ? __atomic_load_n(&slots[self->slot].hits, __ATOMIC_RELAXED) : 0);
}

static PyBufferProcs guard_as_buffer = {(getbufferproc)guard_getbuffer, NULL};

static PyGetSetDef guard_getset[] = {
    {"hits", (getter)guard_hits, NULL, "Faults answered with zero pages so far.", NULL},
    {NULL}};

static PyTypeObject GuardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ckptconv._mapguard.Guard",
    .tp_basicsize = sizeof(Guard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Guard(mapping, tag=None): guard a read-only mmap against SIGBUS; read it through the Guard.",
    .tp_new = guard_new,
    .tp_dealloc = (destructor)guard_dealloc,
    .tp_as_buffer = &guard_as_buffer,
    .tp_getset = guard_getset,
};

static PyObject *py_changed(PyObject *self, PyObject *unused) {
    PyObject *out = PySequence_List(released);
    for (int i = 0; out != NULL && i < limit; i++)
        if (owners[i] != NULL && slots[i].hits && PyList_Append(out, owners[i]->tag) < 0)
            Py_CLEAR(out);
    return out;
}

static PyObject *py_forget(PyObject *self, PyObject *unused) {
    if (PyList_SetSlice(released, 0, PyList_GET_SIZE(released), NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_active(PyObject *self, PyObject *unused) {
#if HAVE_GUARD
    struct sigaction now;
    if (!installed || sigaction(SIGBUS, NULL, &now) != 0)
        Py_RETURN_FALSE;
    return PyBool_FromLong((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"changed", py_changed, METH_NOARGS, "Tags of guards with hits: live ones, and released ones since forget()."},
    {"forget", py_forget, METH_NOARGS, "Forget the released guards that had hits."},
    {"active", py_active, METH_NOARGS, "Whether our handler is installed and is the current SIGBUS handler."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mapguard", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mapguard(void) {
#if !HAVE_GUARD
    PyErr_SetString(PyExc_ImportError, "no SIGBUS guard on this platform");
    return NULL;
#endif
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    if (released == NULL && (released = PyList_New(0)) == NULL)
        return NULL;
    if (PyType_Ready(&GuardType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&GuardType);
    if (PyModule_AddObject(m, "Guard", (PyObject *)&GuardType) < 0 ||
        PyModule_AddIntConstant(m, "CAPACITY", CAPACITY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
