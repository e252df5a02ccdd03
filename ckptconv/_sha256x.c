/* Several SHA-256 digests of the same bytes in one pass, with the x86 SHA extensions.
 *
 * The SHA-NI round instruction has a latency of several cycles and each round depends on the one
 * before, so one stream leaves the unit mostly idle: interleaving the rounds of two or three
 * independent streams (a shard file's digest, a tensor's, a global tensor's) gets nearly two or
 * three times the bytes per cycle. Python keeps each stream's state in a 104-byte buffer:
 * the eight 32-bit words of the hash (native order), the pending partial block, and the number of
 * bytes absorbed (native uint64). Padding and the final digest are done in Python (sha256.py)
 * by absorbing the padding bytes. Used only when the CPU has the extensions (`supported`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#define STATE_SIZE 104
#define MAX_STREAMS 3

typedef struct {
    uint32_t h[8];
    uint8_t pending[64];
    uint64_t total;
} State;

#if HAVE_X86
static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

/* Four rounds of one stream: message words W[4k..4k+3] (loaded for k < 4, else scheduled from the
 * last four groups M0..M3, oldest first), added to the constants, through two rnds2. */
#define ROUNDS4(S0, S1, M0, M1, M2, M3, k, ptr)                                                   \
    do {                                                                                          \
        __m128i m_;                                                                               \
        if ((k) < 4)                                                                              \
            m_ = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)((ptr) + 16 * (k))), BSWAP);   \
        else                                                                                      \
            m_ = _mm_sha256msg2_epu32(                                                            \
                _mm_add_epi32(_mm_sha256msg1_epu32(M0, M1), _mm_alignr_epi8(M3, M2, 4)), M3);     \
        __m128i w_ = _mm_add_epi32(m_, _mm_loadu_si128((const __m128i *)&K[4 * (k)]));            \
        S1 = _mm_sha256rnds2_epu32(S1, S0, w_);                                                   \
        S0 = _mm_sha256rnds2_epu32(S0, S1, _mm_shuffle_epi32(w_, 0x0E));                          \
        M0 = m_;                                                                                  \
    } while (0)

/* The hash words a..h as the two registers rnds2 works on: ABEF and CDGH. */
#define LOAD_STATE(st, S0, S1)                                                                    \
    do {                                                                                          \
        __m128i t_ = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&(st)->h[0]), 0xB1);      \
        __m128i u_ = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&(st)->h[4]), 0x1B);      \
        S0 = _mm_alignr_epi8(t_, u_, 8);                                                          \
        S1 = _mm_blend_epi16(u_, t_, 0xF0);                                                       \
    } while (0)

#define STORE_STATE(st, S0, S1)                                                                   \
    do {                                                                                          \
        __m128i t_ = _mm_shuffle_epi32(S0, 0x1B);                                                 \
        __m128i u_ = _mm_shuffle_epi32(S1, 0xB1);                                                 \
        _mm_storeu_si128((__m128i *)&(st)->h[0], _mm_blend_epi16(t_, u_, 0xF0));                  \
        _mm_storeu_si128((__m128i *)&(st)->h[4], _mm_alignr_epi8(u_, t_, 8));                     \
    } while (0)

#define TARGET __attribute__((target("sha,sse4.1,ssse3")))

/* n streams (a compile-time constant at each call, so the arrays below live in registers and the
 * unrolled loops interleave the streams' rounds), each with its own data pointer. */
TARGET static inline __attribute__((always_inline)) void compress_n(State **st, const uint8_t **p, size_t blocks,
                                                                   const int n) {
    const __m128i BSWAP = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i S0[MAX_STREAMS], S1[MAX_STREAMS], M[MAX_STREAMS][4];
    const uint8_t *q[MAX_STREAMS];
    for (int s = 0; s < n; s++) {
        LOAD_STATE(st[s], S0[s], S1[s]);
        q[s] = p[s];
    }
    for (; blocks--;) {
        __m128i A0[MAX_STREAMS], A1[MAX_STREAMS];
        for (int s = 0; s < n; s++) {
            A0[s] = S0[s];
            A1[s] = S1[s];
        }
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++) {
#pragma GCC unroll 3
            for (int s = 0; s < n; s++)
                ROUNDS4(S0[s], S1[s], M[s][k & 3], M[s][(k + 1) & 3], M[s][(k + 2) & 3], M[s][(k + 3) & 3], k, q[s]);
        }
        for (int s = 0; s < n; s++) {
            S0[s] = _mm_add_epi32(S0[s], A0[s]);
            S1[s] = _mm_add_epi32(S1[s], A1[s]);
            q[s] += 64;
        }
    }
    for (int s = 0; s < n; s++)
        STORE_STATE(st[s], S0[s], S1[s]);
}

TARGET static void compress1(State *st, const uint8_t *p, size_t blocks) { compress_n(&st, &p, blocks, 1); }
TARGET static void compress2(State **st, const uint8_t **p, size_t blocks) { compress_n(st, p, blocks, 2); }
TARGET static void compress3(State **st, const uint8_t **p, size_t blocks) { compress_n(st, p, blocks, 3); }

static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSSE3) || !(c & bit_SSE4_1))
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return (b & bit_SHA) != 0;
}

/* Absorb `len` bytes into n states: complete each pending block, run the whole blocks of all
 * streams together (their starts differ by less than a block), finish stragglers alone, keep tails. */
static void absorb(State **st, int n, const uint8_t *data, size_t len) {
    size_t start[MAX_STREAMS], blocks[MAX_STREAMS], common = (size_t)-1;
    for (int s = 0; s < n; s++) {
        size_t have = st[s]->total % 64, take = 0;
        if (have) {
            take = 64 - have < len ? 64 - have : len;
            memcpy(st[s]->pending + have, data, take);
            if (have + take == 64)
                compress1(st[s], st[s]->pending, 1);
        }
        start[s] = take;
        blocks[s] = (len - take) / 64;
        if (blocks[s] < common)
            common = blocks[s];
    }
    const uint8_t *from[MAX_STREAMS];
    for (int s = 0; s < n; s++)
        from[s] = data + start[s];
    if (n == 3)
        compress3(st, from, common);
    else if (n == 2)
        compress2(st, from, common);
    else
        compress1(st[0], from[0], common);
    for (int s = 0; s < n; s++) {
        if (blocks[s] > common)
            compress1(st[s], data + start[s] + 64 * common, blocks[s] - common);
        size_t tail = start[s] + 64 * blocks[s];
        if (len > tail)
            memcpy(st[s]->pending, data + tail, len - tail);
        st[s]->total += len;
    }
}
#endif

static PyObject *py_supported(PyObject *self, PyObject *unused) {
#if HAVE_X86
    return PyBool_FromLong(cpu_has_sha());
#else
    return PyBool_FromLong(0);
#endif
}

/* absorb(data, state, ...): up to three 104-byte writable state buffers; the GIL is released. */
static PyObject *py_absorb(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
#if HAVE_X86
    if (nargs < 2 || nargs > 1 + MAX_STREAMS) {
        PyErr_SetString(PyExc_TypeError, "absorb(data, state[, state[, state]])");
        return NULL;
    }
    Py_buffer data, states[MAX_STREAMS];
    State *st[MAX_STREAMS];
    int n = 0;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    for (; n < nargs - 1; n++) {
        if (PyObject_GetBuffer(args[n + 1], &states[n], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        if (states[n].len != STATE_SIZE) {
            PyBuffer_Release(&states[n]);
            PyErr_SetString(PyExc_ValueError, "a state is 104 bytes");
            goto fail;
        }
        st[n] = (State *)states[n].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    absorb(st, n, (const uint8_t *)data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    for (int s = 0; s < n; s++)
        PyBuffer_Release(&states[s]);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
fail:
    for (int s = 0; s < n; s++)
        PyBuffer_Release(&states[s]);
    PyBuffer_Release(&data);
    return NULL;
#else
    PyErr_SetString(PyExc_RuntimeError, "not built for this CPU");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"supported", py_supported, METH_NOARGS, "Whether this CPU has the SHA extensions."},
    {"absorb", (PyCFunction)(void (*)(void))py_absorb, METH_FASTCALL,
     "absorb(data, state, ...): feed data to up to three SHA-256 states at once."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sha256x", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sha256x(void) { return PyModule_Create(&module); }
