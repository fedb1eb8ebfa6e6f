/*
 * gpupool.worker._runloop: the worker's record loop in C.
 *
 * Why this exists: a training step reaches the worker as thousands of records (GPT-2-small:
 * 3,799 a step, half of them FREE), and on the H200 box the worker spent 33-45 ms of CPU a
 * step in Python, as much as the client or more (docs/remote.md, runs L-O): msgpack called a
 * Python ext_hook for every tensor handle and dtype, then the executor looked up a handler, the
 * handler unpacked the record and called the op, and _store_one put the output away. This
 * file decodes a BATCH body and runs its two common records itself:
 *
 *   [OP, op_id, args, kwargs, outs]  the op's C++ callable is called with the decoded
 *       arguments; one tensor output is stored in the handle table;
 *   [FREE, handle]                   the handle table drops the tensor;
 *
 * Everything else (other records, an op that raises, several outputs, a memory limit that
 * counts storages, a CUDA worker's host tensors, which count against the lease's host
 * allowance, anything malformed) goes to the executor's Python methods unchanged, so
 * this is an accelerator, never a second implementation: Executor.run_frame's Python path is
 * the reference
 * and tests/worker/test_runloop.py compares the two. Handles are resolved while a record is
 * decoded, i.e. after the records before it ran, as with msgpack's ext_hook. It uses only the
 * CPython API (no torch headers), so one build serves every torch version; GPUPOOL_FASTPATH=0
 * turns it off.
 *
 * The decoder accepts exactly what msgpack.Unpacker(raw=False, strict_map_key=True) accepts,
 * and a body that ends inside a record is an error here (the Unpacker would stop quietly).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 1024
/* Containers nested deeper are refused (msgpack's own limit): a hostile frame must not
 * exhaust the C stack. */

enum { EXT_TENSOR = 1, EXT_DTYPE = 2, EXT_DEVICE = 3, EXT_LAYOUT = 5, EXT_MEMORY_FORMAT = 6 };
enum { REC_OP = 2, REC_FREE = 6 };

typedef struct {
    PyObject_HEAD
    PyObject *executor;    /* Executor: .error is read before every op */
    PyObject *tensors;     /* its handle table, a dict (read again after every Python call:
                              a RESUME restores a new one) */
    PyObject *ops;         /* its op table: op_id -> _Op (with .call) */
    PyObject *ext_hook;    /* Executor.ext_hook, for extension types not handled here */
    PyObject *missing;     /* Missing(handle): a handle the table does not hold */
    PyObject *tensor_type; /* torch.Tensor: an exact instance is stored here */
    PyObject *slow;        /* executor._run_record(record, link): any record, in Python */
    PyObject *op_failed;   /* executor._op_failed(op, args, kwargs, outs, exc) */
    PyObject *op_store;    /* executor._op_store(op, args, kwargs, outs, result) */
    PyObject *protocol_error;
    PyObject *timestamp;   /* msgpack.Timestamp.from_bytes: extension -1, as msgpack decodes it */
    int fast_store;        /* the memory limit needs no word of stores and frees (CUDA) */
    int host_store;        /* ...but of host tensors (a CUDA worker's: the lease's host
                              allowance): those are stored and freed in Python, which counts
                              them */
} Loop;

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
    Loop *loop;
    PyObject *ext_cache; /* (code, data) -> object for dtypes, devices, layouts, formats */
} Reader;

static PyObject *str_error, *str_call, *str_tensors, *str_ops, *str_is_cpu;

/* 1: a host tensor (counted by the executor's memory limit even when fast_store is on);
 * 0: not; -1: error set. */
static int is_host_tensor(PyObject *value) {
    PyObject *flag = PyObject_GetAttr(value, str_is_cpu);
    if (flag == NULL) {
        return -1;
    }
    int host = flag == Py_True;
    Py_DECREF(flag);
    return host;
}

static int malformed(Reader *r, const char *what) {
    PyErr_Format(r->loop->protocol_error, "malformed frame body: %s", what);
    return -1;
}

static int need(Reader *r, Py_ssize_t n) {
    if (r->end - r->p < n) {
        return malformed(r, "the body ends inside a record");
    }
    return 0;
}

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

static PyObject *decode(Reader *r, int depth);

static PyObject *decode_ext(Reader *r, int code, Py_ssize_t n) {
    if (need(r, n) < 0) {
        return NULL;
    }
    const uint8_t *data = r->p;
    r->p += n;
    Loop *loop = r->loop;
    if (code == EXT_TENSOR && n <= 8) {
        PyObject *handle = PyLong_FromUnsignedLongLong(be(data, (int)n));
        if (handle == NULL) {
            return NULL;
        }
        PyObject *tensor = PyDict_GetItemWithError(loop->tensors, handle);
        if (tensor != NULL) {
            Py_DECREF(handle);
            Py_INCREF(tensor);
            return tensor;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(handle);
            return NULL;
        }
        PyObject *missing = PyObject_CallOneArg(loop->missing, handle);
        Py_DECREF(handle);
        return missing;
    }
    if (code == -1) { /* msgpack's own timestamp extension: decoded as msgpack does */
        PyObject *stamp = PyObject_CallFunction(loop->timestamp, "y#", data, n);
        if (stamp == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            PyErr_Format(loop->protocol_error,
                         "malformed frame body: invalid timestamp data (length %zd)", n);
        }
        return stamp;
    }
    int cached = code == EXT_DTYPE || code == EXT_DEVICE || code == EXT_LAYOUT
                 || code == EXT_MEMORY_FORMAT;
    PyObject *key = NULL;
    if (cached) {
        key = PyBytes_FromStringAndSize(NULL, n + 1);
        if (key == NULL) {
            return NULL;
        }
        char *k = PyBytes_AS_STRING(key);
        k[0] = (char)code;
        memcpy(k + 1, data, (size_t)n);
        PyObject *hit = PyDict_GetItemWithError(r->ext_cache, key);
        if (hit != NULL) {
            Py_DECREF(key);
            Py_INCREF(hit);
            return hit;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
    }
    PyObject *value = PyObject_CallFunction(loop->ext_hook, "iy#", code, data, n);
    if (value != NULL && key != NULL && PyDict_SetItem(r->ext_cache, key, value) < 0) {
        Py_CLEAR(value);
    }
    Py_XDECREF(key);
    return value;
}

static PyObject *decode_array(Reader *r, uint64_t n, int depth) {
    if (depth >= MAX_DEPTH) {
        malformed(r, "nested too deeply");
        return NULL;
    }
    if ((uint64_t)(r->end - r->p) < n) { /* every element takes a byte at least */
        malformed(r, "an array longer than the body");
        return NULL;
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
        PyObject *item = decode(r, depth + 1);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *decode_map(Reader *r, uint64_t n, int depth) {
    if (depth >= MAX_DEPTH) {
        malformed(r, "nested too deeply");
        return NULL;
    }
    if ((uint64_t)(r->end - r->p) / 2 < n) {
        malformed(r, "a map longer than the body");
        return NULL;
    }
    PyObject *dict = PyDict_New();
    if (dict == NULL) {
        return NULL;
    }
    for (uint64_t i = 0; i < n; i++) {
        PyObject *key = decode(r, depth + 1);
        if (key == NULL) {
            Py_DECREF(dict);
            return NULL;
        }
        if (!PyUnicode_CheckExact(key) && !PyBytes_CheckExact(key)) {
            Py_DECREF(key);
            Py_DECREF(dict);
            malformed(r, "a map key that is neither str nor bytes");
            return NULL;
        }
        PyObject *value = decode(r, depth + 1);
        if (value == NULL || PyDict_SetItem(dict, key, value) < 0) {
            Py_DECREF(key);
            Py_XDECREF(value);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return dict;
}

static PyObject *decode_str(Reader *r, Py_ssize_t n) {
    if (need(r, n) < 0) {
        return NULL;
    }
    PyObject *s = PyUnicode_DecodeUTF8((const char *)r->p, n, "strict");
    r->p += n;
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        malformed(r, "a string that is not UTF-8");
    }
    return s;
}

static PyObject *decode_bin(Reader *r, Py_ssize_t n) {
    if (need(r, n) < 0) {
        return NULL;
    }
    PyObject *b = PyBytes_FromStringAndSize((const char *)r->p, n);
    r->p += n;
    return b;
}

static PyObject *decode(Reader *r, int depth) {
    if (need(r, 1) < 0) {
        return NULL;
    }
    uint8_t b = *r->p++;
    if (b <= 0x7f) {
        return PyLong_FromLong(b);
    }
    if (b >= 0xe0) {
        return PyLong_FromLong((int8_t)b);
    }
    if ((b & 0xf0) == 0x90) {
        return decode_array(r, b & 0x0f, depth);
    }
    if ((b & 0xf0) == 0x80) {
        return decode_map(r, b & 0x0f, depth);
    }
    if ((b & 0xe0) == 0xa0) {
        return decode_str(r, b & 0x1f);
    }
    int width;
    switch (b) {
    case 0xc0:
        Py_RETURN_NONE;
    case 0xc2:
        Py_RETURN_FALSE;
    case 0xc3:
        Py_RETURN_TRUE;
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        width = 1 << (b - 0xcc);
        if (need(r, width) < 0) {
            return NULL;
        }
        r->p += width;
        return PyLong_FromUnsignedLongLong(be(r->p - width, width));
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        width = 1 << (b - 0xd0);
        if (need(r, width) < 0) {
            return NULL;
        }
        uint64_t u = be(r->p, width);
        r->p += width;
        int64_t v;
        if (width == 1) v = (int8_t)u;
        else if (width == 2) v = (int16_t)u;
        else if (width == 4) v = (int32_t)u;
        else v = (int64_t)u;
        return PyLong_FromLongLong(v);
    }
    case 0xca: {
        if (need(r, 4) < 0) {
            return NULL;
        }
        uint32_t u = (uint32_t)be(r->p, 4);
        r->p += 4;
        float f;
        memcpy(&f, &u, 4);
        return PyFloat_FromDouble(f);
    }
    case 0xcb: {
        if (need(r, 8) < 0) {
            return NULL;
        }
        uint64_t u = be(r->p, 8);
        r->p += 8;
        double d;
        memcpy(&d, &u, 8);
        return PyFloat_FromDouble(d);
    }
    case 0xd9: case 0xda: case 0xdb:
    case 0xc4: case 0xc5: case 0xc6:
    case 0xdc: case 0xdd: case 0xde: case 0xdf:
    case 0xc7: case 0xc8: case 0xc9: {
        switch (b) {
        case 0xd9: case 0xc4: case 0xc7: width = 1; break;
        case 0xda: case 0xc5: case 0xc8: case 0xdc: case 0xde: width = 2; break;
        default: width = 4;
        }
        if (need(r, width) < 0) {
            return NULL;
        }
        uint64_t n = be(r->p, width);
        r->p += width;
        if (b == 0xdc || b == 0xdd) {
            return decode_array(r, n, depth);
        }
        if (b == 0xde || b == 0xdf) {
            return decode_map(r, n, depth);
        }
        if (b >= 0xd9) {
            return decode_str(r, (Py_ssize_t)n);
        }
        if (b <= 0xc6) {
            return decode_bin(r, (Py_ssize_t)n);
        }
        if (need(r, 1) < 0) {
            return NULL;
        }
        int code = (int8_t)*r->p++;
        return decode_ext(r, code, (Py_ssize_t)n);
    }
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: {
        if (need(r, 1) < 0) {
            return NULL;
        }
        int code = (int8_t)*r->p++;
        return decode_ext(r, code, (Py_ssize_t)1 << (b - 0xd4));
    }
    default:
        malformed(r, "a reserved type byte (0xc1)");
        return NULL;
    }
}

/* ---- the loop ---------------------------------------------------------------------------- */

static int refresh(Loop *loop) {
    PyObject *tensors = PyObject_GetAttr(loop->executor, str_tensors);
    PyObject *ops = PyObject_GetAttr(loop->executor, str_ops);
    if (tensors == NULL || ops == NULL || !PyDict_CheckExact(tensors) || !PyDict_CheckExact(ops)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "the executor's tensors and ops must be dicts");
        }
        Py_XDECREF(tensors);
        Py_XDECREF(ops);
        return -1;
    }
    Py_XSETREF(loop->tensors, tensors);
    Py_XSETREF(loop->ops, ops);
    return 0;
}

/* 1: done; 0: a host tensor, for the executor's Python FREE; -1: error set. */
static int run_free(Loop *loop, PyObject *handle) {
    /* A host tensor is released in Python (its storage is counted); a handle the table does
     * not hold (its op failed) is the rare case. */
    PyObject *value = PyDict_GetItemWithError(loop->tensors, handle);
    if (value == NULL) {
        return PyErr_Occurred() ? -1 : 1;
    }
    int host = loop->host_store ? is_host_tensor(value) : 0;
    if (host != 0) {
        return host < 0 ? -1 : 0;
    }
    return PyDict_DelItem(loop->tensors, handle) == 0 ? 1 : -1;
}

/* 1: ran it; 0: not a case this handles (nothing done); -1: error set. */
static int run_op(Loop *loop, PyObject *rec) {
    PyObject *op_id = PyList_GET_ITEM(rec, 1);
    PyObject *args = PyList_GET_ITEM(rec, 2);
    PyObject *kwargs = PyList_GET_ITEM(rec, 3);
    PyObject *outs = PyList_GET_ITEM(rec, 4);
    if (!PyLong_CheckExact(op_id) || !PyList_CheckExact(args)
        || !(kwargs == Py_None || PyDict_CheckExact(kwargs))
        || !(outs == Py_None || PyList_CheckExact(outs))) {
        return 0;
    }
    PyObject *error = PyObject_GetAttr(loop->executor, str_error);
    if (error == NULL) {
        return -1;
    }
    Py_DECREF(error);
    if (error != Py_None) {
        return 1; /* an earlier op failed: the rest of the stream is skipped until a read */
    }
    PyObject *op = PyDict_GetItemWithError(loop->ops, op_id);
    if (op == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(op);
    PyObject *call = PyObject_GetAttr(op, str_call);
    if (call == NULL) {
        Py_DECREF(op);
        return -1;
    }
    if (call == Py_None) {
        Py_DECREF(call);
        Py_DECREF(op);
        return 0;
    }
    PyObject *argt = PyList_AsTuple(args);
    if (argt == NULL) {
        Py_DECREF(call);
        Py_DECREF(op);
        return -1;
    }
    PyObject *result =
        PyObject_Call(call, argt, kwargs != Py_None && PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
    Py_DECREF(argt);
    Py_DECREF(call);
    PyObject *done;
    int host = 0;
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* KeyboardInterrupt and the like */
            Py_DECREF(op);
            return -1;
        }
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (tb != NULL) {
            PyException_SetTraceback(exc, tb);
        }
        done = PyObject_CallFunctionObjArgs(loop->op_failed, op, args, kwargs, outs, exc, NULL);
        Py_XDECREF(type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
    } else if (outs == Py_None || PyList_GET_SIZE(outs) == 0) {
        done = Py_NewRef(Py_None);
    } else if (loop->fast_store && PyList_GET_SIZE(outs) == 1
               && Py_TYPE(result) == (PyTypeObject *)loop->tensor_type
               && PyLong_CheckExact(PyList_GET_ITEM(outs, 0))
               && (!loop->host_store || (host = is_host_tensor(result)) == 0)) {
        done = PyDict_SetItem(loop->tensors, PyList_GET_ITEM(outs, 0), result) < 0
                   ? NULL
                   : Py_NewRef(Py_None);
    } else if (host < 0) {
        done = NULL;
    } else {
        done = PyObject_CallFunctionObjArgs(loop->op_store, op, args, kwargs, outs, result, NULL);
    }
    Py_XDECREF(result);
    Py_DECREF(op);
    if (done == NULL) {
        return -1;
    }
    Py_DECREF(done);
    return 1;
}

static PyObject *loop_run(Loop *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run(body, offset, link)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (offset < 0 || offset > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "offset outside the body");
        return NULL;
    }
    PyObject *link = args[2];
    Reader r = {(const uint8_t *)view.buf + offset, (const uint8_t *)view.buf + view.len, self,
                PyDict_New()};
    long count = 0;
    int failed = r.ext_cache == NULL || refresh(self) < 0;
    while (!failed && r.p < r.end) {
        PyObject *rec = decode(&r, 0);
        if (rec == NULL) {
            failed = 1;
            break;
        }
        int handled = 0;
        if (PyList_CheckExact(rec) && PyList_GET_SIZE(rec) > 0
            && PyLong_CheckExact(PyList_GET_ITEM(rec, 0))) {
            int overflow; /* a type past a C long is no record this runs: Python says so */
            long kind = PyLong_AsLongAndOverflow(PyList_GET_ITEM(rec, 0), &overflow);
            Py_ssize_t size = PyList_GET_SIZE(rec);
            if (kind == REC_FREE && size == 2 && self->fast_store
                && PyLong_CheckExact(PyList_GET_ITEM(rec, 1))) {
                handled = run_free(self, PyList_GET_ITEM(rec, 1));
            } else if (kind == REC_OP && size == 5) {
                handled = run_op(self, rec);
            }
        }
        if (handled == 0) {
            PyObject *done = PyObject_CallFunctionObjArgs(self->slow, rec, link, NULL);
            handled = done == NULL || refresh(self) < 0 ? -1 : 1;
            Py_XDECREF(done);
        }
        Py_DECREF(rec);
        if (handled < 0) {
            failed = 1;
            break;
        }
        count++;
    }
    Py_XDECREF(r.ext_cache);
    PyBuffer_Release(&view);
    if (failed) {
        return NULL;
    }
    return PyLong_FromLong(count);
}

static PyObject *loop_head(Loop *self, PyObject *body) {
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len, self,
                PyDict_New()};
    PyObject *head = r.ext_cache == NULL || refresh(self) < 0 ? NULL : decode(&r, 0);
    PyObject *result = NULL;
    if (head != NULL) {
        result = Py_BuildValue("(On)", head, (Py_ssize_t)(r.p - (const uint8_t *)view.buf));
        Py_DECREF(head);
    }
    Py_XDECREF(r.ext_cache);
    PyBuffer_Release(&view);
    return result;
}

static int loop_init(Loop *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"executor", "ext_hook", "missing", "tensor_type", "slow",
                             "op_failed", "op_store", "protocol_error", "timestamp",
                             "fast_store", "host_store", NULL};
    PyObject *executor, *ext_hook, *missing, *tensor_type, *slow, *op_failed, *op_store,
        *protocol_error, *timestamp;
    int fast_store, host_store = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOp|p", kwlist, &executor, &ext_hook,
                                     &missing, &tensor_type, &slow, &op_failed, &op_store,
                                     &protocol_error, &timestamp, &fast_store, &host_store)) {
        return -1;
    }
    if (!PyType_Check(tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "tensor_type must be a type");
        return -1;
    }
    Py_XSETREF(self->executor, Py_NewRef(executor));
    Py_XSETREF(self->ext_hook, Py_NewRef(ext_hook));
    Py_XSETREF(self->missing, Py_NewRef(missing));
    Py_XSETREF(self->tensor_type, Py_NewRef(tensor_type));
    Py_XSETREF(self->slow, Py_NewRef(slow));
    Py_XSETREF(self->op_failed, Py_NewRef(op_failed));
    Py_XSETREF(self->op_store, Py_NewRef(op_store));
    Py_XSETREF(self->protocol_error, Py_NewRef(protocol_error));
    Py_XSETREF(self->timestamp, Py_NewRef(timestamp));
    self->fast_store = fast_store;
    self->host_store = host_store;
    return 0;
}

static int loop_traverse(Loop *self, visitproc visit, void *arg) {
    Py_VISIT(self->executor);
    Py_VISIT(self->tensors);
    Py_VISIT(self->ops);
    Py_VISIT(self->ext_hook);
    Py_VISIT(self->missing);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->slow);
    Py_VISIT(self->op_failed);
    Py_VISIT(self->op_store);
    Py_VISIT(self->protocol_error);
    Py_VISIT(self->timestamp);
    return 0;
}

static int loop_clear(Loop *self) {
    Py_CLEAR(self->executor);
    Py_CLEAR(self->tensors);
    Py_CLEAR(self->ops);
    Py_CLEAR(self->ext_hook);
    Py_CLEAR(self->missing);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->op_failed);
    Py_CLEAR(self->op_store);
    Py_CLEAR(self->protocol_error);
    Py_CLEAR(self->timestamp);
    return 0;
}

static void loop_dealloc(Loop *self) {
    PyObject_GC_UnTrack(self);
    loop_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef loop_methods[] = {
    {"run", (PyCFunction)(void (*)(void))loop_run, METH_FASTCALL,
     "run(body, offset, link) -> records run: decode the body's records from offset and run "
     "each in order"},
    {"head", (PyCFunction)loop_head, METH_O,
     "head(body) -> (first object, offset after it)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpupool.worker._runloop.Loop",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One executor's compiled record loop (see the module's docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)loop_init,
    .tp_dealloc = (destructor)loop_dealloc,
    .tp_traverse = (traverseproc)loop_traverse,
    .tp_clear = (inquiry)loop_clear,
    .tp_methods = loop_methods,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "gpupool.worker._runloop",
    "The worker's record loop in C (see _runloop.c).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__runloop(void) {
    str_error = PyUnicode_InternFromString("error");
    str_call = PyUnicode_InternFromString("call");
    str_is_cpu = PyUnicode_InternFromString("is_cpu");
    str_tensors = PyUnicode_InternFromString("tensors");
    str_ops = PyUnicode_InternFromString("ops");
    if (str_error == NULL || str_call == NULL || str_is_cpu == NULL || str_tensors == NULL || str_ops == NULL || PyType_Ready(&LoopType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Loop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
