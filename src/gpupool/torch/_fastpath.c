/*
 * gpupool.torch._fastpath: the client's per-op hot path in C.
 *
 * Why this exists: bench/dispatch_floor.py measured gpupool's own Python at 3-8 us per op
 * on top of the 4.4 us that entering __torch_dispatch__ and making one wrapper cost any
 * Python client; a GPT-2 step makes ~1,900 such ops and ResNet-50 ~750, and the client's
 * issue time, not the GPU, bounds both eager steps on the H200 (bench/results/
 * remote_overhead.json). This file does, for the common case, exactly what
 * gpupool/torch/dispatch.py's `dispatch` and `run` do: look up the op's route, encode the
 * arguments while building the plan-cache key, look up the cached plan, make wrappers with
 * fresh client-chosen handles, append one record, flush when the batch is due; and, as
 * Handle.__del__, the FREE record of each dropped tensor (half of a step's records).
 *
 * It is an accelerator, never a second implementation: every case it does not handle
 * (special ops, a plan-cache miss, host tensors, devices, captures, errors of any kind such
 * as tensors on two devices) goes to the Python functions unchanged, which re-encode from
 * scratch. Nothing here has a side effect before it knows it can finish, except defining an
 * op id (which the Python path would do first as well). It uses only the CPython API - no
 * torch headers - so one build serves every torch version; GPUPOOL_FASTPATH=0 turns it off.
 * The record stream it makes is the Python path's, record for record
 * (tests/torch/test_fastpath.py compares the two).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject *remote_type;   /* RemoteTensor */
    PyObject *handle_type;   /* Handle */
    PyObject *size_type;     /* torch.Size */
    PyObject *dtype_type;    /* torch.dtype */
    PyObject *routes;        /* id(op) -> (special, info, policy) */
    PyObject *plans;         /* (info, *key) -> Plan */
    PyObject *slow_dispatch; /* dispatch.dispatch(func, args, kwargs) */
    PyObject *slow_run;      /* dispatch.run(info, args, kwargs) */
    PyObject *adjust;        /* autocast.adjust(info, args, kwargs) */
    PyObject *handle_ids;    /* stream.HANDLE_IDS, an itertools.count */
    PyObject *ext_type;      /* msgpack.ExtType */
    PyObject *tensor_code;   /* Ext.TENSOR as int */
    PyObject *dtype_ext;     /* dtype -> ExtType */
    PyObject *true_key;      /* dispatch._TRUE / _FALSE: keyed bools in plan keys */
    PyObject *false_key;
    PyObject *make_wrapper;  /* torch.Tensor._make_wrapper_subclass */
    PyObject *meta;          /* torch.device("meta") */
    PyObject *op_code;       /* Rec.OP as int */
    PyObject *free_code;     /* Rec.FREE as int */
    PyObject *perf_counter;  /* time.perf_counter: the flusher compares _first_at with it */
    PyObject *find_rule;     /* torch._library.simple_registry.find_torch_dispatch_rule */
    PyObject *to_copy;       /* aten._to_copy.default and its OpInfo */
    PyObject *to_copy_info;
    PyObject *share_ops;     /* detach / alias: a new wrapper on the same handle, no record */
    PyObject *empty_kwargs;
    PyObject *wrap_kwnames;
    Py_ssize_t batch_max;
    double flush_after;
    int ready;
} State;

static State S;

/* Interned attribute names. */
static PyObject *s_gp, *s_sig, *s_stream, *s_ext, *s_id, *s_recorder, *s_op_ids, *s_records,
    *s_first_at, *s_flush, *s_single, *s_flat, *s_metadata_inplace, *s_values_only,
    *s_all_alias, *s_keyed_scalars, *s_returns_alias, *s_build, *s_new_handle, *s_op_id,
    *s_append, *s_device, *s_pin_memory, *s_non_blocking, *s_watched, *s_release, *s_open;

#define FAST_OK 1
#define FAST_NO 0 /* not on the fast path: the caller goes to Python, nothing was done */
#define FAST_ERR -1

typedef struct {
    PyObject *stream; /* strong reference once set */
    PyObject *key;    /* list: (info, *key) once made a tuple */
} Encoding;

static int
is_remote(PyObject *value)
{
    return Py_TYPE(value) == (PyTypeObject *)S.remote_type ||
           PyObject_TypeCheck(value, (PyTypeObject *)S.remote_type);
}

static int
encode_remote(PyObject *value, Encoding *enc, PyObject **wire)
{
    PyObject *handle = PyObject_GetAttr(value, s_gp);
    if (handle == NULL)
        return FAST_ERR;
    PyObject *stream = PyObject_GetAttr(handle, s_stream);
    if (stream == NULL) {
        Py_DECREF(handle);
        return FAST_ERR;
    }
    if (enc->stream != stream) {
        if (enc->stream != NULL) {
            /* Two devices: the Python path raises the error users know from CUDA. */
            Py_DECREF(stream);
            Py_DECREF(handle);
            return FAST_NO;
        }
        enc->stream = Py_NewRef(stream);
    }
    Py_DECREF(stream);
    PyObject *sig = PyObject_GetAttr(value, s_sig);
    if (sig == NULL || PyList_Append(enc->key, sig) < 0) {
        Py_XDECREF(sig);
        Py_DECREF(handle);
        return FAST_ERR;
    }
    Py_DECREF(sig);
    *wire = PyObject_GetAttr(handle, s_ext);
    Py_DECREF(handle);
    return *wire == NULL ? FAST_ERR : FAST_OK;
}

static int
append_key(Encoding *enc, PyObject *item)
{
    return PyList_Append(enc->key, item) < 0 ? FAST_ERR : FAST_OK;
}

/* dispatch._encode for the argument kinds of a training step. */
static int
encode_value(PyObject *value, int keyed, Encoding *enc, PyObject **wire)
{
    PyTypeObject *kind = Py_TYPE(value);
    if (is_remote(value))
        return encode_remote(value, enc, wire);
    if (kind == &PyLong_Type || kind == &PyFloat_Type || value == Py_None ||
        kind == &PyUnicode_Type) {
        if (append_key(enc, keyed ? value : (PyObject *)kind) < 0)
            return FAST_ERR;
        *wire = Py_NewRef(value);
        return FAST_OK;
    }
    if (kind == &PyBool_Type) {
        PyObject *item = keyed ? (value == Py_True ? S.true_key : S.false_key)
                               : (PyObject *)&PyBool_Type;
        if (append_key(enc, item) < 0)
            return FAST_ERR;
        *wire = Py_NewRef(value);
        return FAST_OK;
    }
    if (kind == &PyList_Type || kind == &PyTuple_Type || kind == (PyTypeObject *)S.size_type) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
        PyObject **items = PySequence_Fast_ITEMS(value);
        PyObject *length = PyLong_FromSsize_t(n);
        if (length == NULL)
            return FAST_ERR;
        int rc = append_key(enc, length);
        Py_DECREF(length);
        if (rc < 0)
            return FAST_ERR;
        PyObject *out = PyList_New(n);
        if (out == NULL)
            return FAST_ERR;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item_wire = NULL;
            rc = encode_value(items[i], keyed, enc, &item_wire);
            if (rc != FAST_OK) {
                Py_DECREF(out);
                return rc;
            }
            PyList_SET_ITEM(out, i, item_wire);
        }
        *wire = out;
        return FAST_OK;
    }
    if (kind == (PyTypeObject *)S.dtype_type) {
        PyObject *ext = PyDict_GetItemWithError(S.dtype_ext, value);
        if (ext == NULL)
            return PyErr_Occurred() ? FAST_ERR : FAST_NO;
        if (append_key(enc, value) < 0)
            return FAST_ERR;
        *wire = Py_NewRef(ext);
        return FAST_OK;
    }
    return FAST_NO; /* devices, host tensors, layouts, complex...: the Python path */
}

/* dispatch._encode_call: the wire arguments and the plan-cache key. */
static int
encode_call(PyObject *keyed, PyObject *args, PyObject *kwargs, Encoding *enc,
            PyObject **wire_args, PyObject **wire_kwargs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return FAST_ERR;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *position = PyLong_FromSsize_t(i);
        if (position == NULL) {
            Py_DECREF(out);
            return FAST_ERR;
        }
        int is_keyed = PySet_Contains(keyed, position);
        Py_DECREF(position);
        if (is_keyed < 0) {
            Py_DECREF(out);
            return FAST_ERR;
        }
        PyObject *item_wire = NULL;
        int rc = encode_value(PyTuple_GET_ITEM(args, i), is_keyed, enc, &item_wire);
        if (rc != FAST_OK) {
            Py_DECREF(out);
            return rc;
        }
        PyList_SET_ITEM(out, i, item_wire);
    }
    PyObject *named = Py_None;
    if (PyDict_GET_SIZE(kwargs)) {
        named = PyDict_New();
        if (named == NULL) {
            Py_DECREF(out);
            return FAST_ERR;
        }
        Py_ssize_t pos = 0;
        PyObject *name, *value;
        while (PyDict_Next(kwargs, &pos, &name, &value)) {
            PyObject *item_wire = NULL;
            int rc = append_key(enc, name);
            int is_keyed = rc < 0 ? -1 : PySet_Contains(keyed, name);
            if (is_keyed < 0) {
                Py_DECREF(named);
                Py_DECREF(out);
                return FAST_ERR;
            }
            rc = encode_value(value, is_keyed, enc, &item_wire);
            if (rc == FAST_OK && PyDict_SetItem(named, name, item_wire) < 0)
                rc = FAST_ERR;
            Py_XDECREF(item_wire);
            if (rc != FAST_OK) {
                Py_DECREF(named);
                Py_DECREF(out);
                return rc;
            }
        }
    }
    else {
        Py_INCREF(named);
    }
    *wire_args = out;
    *wire_kwargs = named;
    return FAST_OK;
}

/* DeviceStream.new_handle (no recorder: checked by the caller): Handle(next(HANDLE_IDS)). */
static PyObject *
new_handle(PyObject *stream, PyObject **handle_id)
{
    PyObject *id = PyIter_Next(S.handle_ids);
    if (id == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "gpupool handle counter ended");
        return NULL;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(id);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        Py_DECREF(id);
        return NULL;
    }
    unsigned char raw[8];
    for (int i = 7; i >= 0; i--) {
        raw[i] = (unsigned char)(value & 0xff);
        value >>= 8;
    }
    PyObject *data = PyBytes_FromStringAndSize((const char *)raw, 8);
    PyObject *pair = data == NULL ? NULL : PyTuple_Pack(2, S.tensor_code, data);
    Py_XDECREF(data);
    /* tuple.__new__(ExtType, (code, data)), as protocol.v1.tensors.handle_ext does
     * (tp_new takes the call's arguments: a 1-tuple holding the pair). */
    PyObject *call = pair == NULL ? NULL : PyTuple_Pack(1, pair);
    Py_XDECREF(pair);
    PyObject *ext =
        call == NULL ? NULL : PyTuple_Type.tp_new((PyTypeObject *)S.ext_type, call, NULL);
    Py_XDECREF(call);
    if (ext == NULL) {
        Py_DECREF(id);
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)S.handle_type;
    PyObject *handle = type->tp_alloc(type, 0);
    if (handle == NULL || PyObject_SetAttr(handle, s_id, id) < 0 ||
        PyObject_SetAttr(handle, s_ext, ext) < 0 ||
        PyObject_SetAttr(handle, s_stream, stream) < 0) {
        Py_XDECREF(handle);
        Py_DECREF(ext);
        Py_DECREF(id);
        return NULL;
    }
    Py_DECREF(ext);
    *handle_id = id;
    return handle;
}

/* tensor.wrap_signature. */
static PyObject *
wrap_signature(PyObject *sig, PyObject *handle)
{
    if (!PyTuple_Check(sig) || PyTuple_GET_SIZE(sig) != 4) {
        PyErr_SetString(PyExc_RuntimeError, "gpupool: malformed tensor signature in a plan");
        return NULL;
    }
    PyObject *call[7] = {
        NULL,
        S.remote_type,
        PyTuple_GET_ITEM(sig, 0),
        PyTuple_GET_ITEM(sig, 1),
        PyTuple_GET_ITEM(sig, 2),
        PyTuple_GET_ITEM(sig, 3),
        S.meta,
    };
    PyObject *tensor = PyObject_Vectorcall(S.make_wrapper, call + 1,
                                           2 | PY_VECTORCALL_ARGUMENTS_OFFSET, S.wrap_kwnames);
    if (tensor == NULL)
        return NULL;
    if (PyObject_SetAttr(tensor, s_gp, handle) < 0 || PyObject_SetAttr(tensor, s_sig, sig) < 0) {
        Py_DECREF(tensor);
        return NULL;
    }
    return tensor;
}

/* One new output: its wrapper (returned), its handle id appended to outs. */
static PyObject *
new_output(PyObject *stream, PyObject *sig, PyObject *outs)
{
    PyObject *handle_id = NULL;
    PyObject *handle = new_handle(stream, &handle_id);
    if (handle == NULL)
        return NULL;
    PyObject *tensor = wrap_signature(sig, handle);
    Py_DECREF(handle);
    if (tensor == NULL || PyList_Append(outs, handle_id) < 0) {
        Py_XDECREF(tensor);
        Py_DECREF(handle_id);
        return NULL;
    }
    Py_DECREF(handle_id);
    return tensor;
}

/* Plan.build for its precomputed shapes; NULL with no error set: use Plan.build itself. */
static PyObject *
build_outputs(PyObject *plan, PyObject *stream, PyObject *outs)
{
    PyObject *single = PyObject_GetAttr(plan, s_single);
    if (single == NULL)
        return NULL;
    if (single != Py_None) {
        PyObject *tensor = new_output(stream, single, outs);
        Py_DECREF(single);
        return tensor;
    }
    Py_DECREF(single);
    PyObject *flat = PyObject_GetAttr(plan, s_flat);
    if (flat == NULL)
        return NULL;
    if (flat == Py_None || !PyTuple_Check(flat) || PyTuple_GET_SIZE(flat) != 2 ||
        !PyTuple_Check(PyTuple_GET_ITEM(flat, 1))) {
        Py_DECREF(flat);
        return NULL; /* aliases of inputs: Plan.build */
    }
    PyObject *nodes = PyTuple_GET_ITEM(flat, 1);
    Py_ssize_t n = PyTuple_GET_SIZE(nodes);
    PyObject *items = PyList_New(n);
    if (items == NULL) {
        Py_DECREF(flat);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyTuple_GET_ITEM(nodes, i);
        PyObject *item;
        if (Py_TYPE(node) == &PyTuple_Type) {
            item = new_output(stream, node, outs);
        }
        else {
            item = PyList_Append(outs, Py_None) < 0 ? NULL : PyObject_GetAttrString(node, "value");
        }
        if (item == NULL) {
            Py_DECREF(items);
            Py_DECREF(flat);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "gpupool: plan output failed");
            return NULL;
        }
        PyList_SET_ITEM(items, i, item);
    }
    PyObject *result;
    if (PyTuple_GET_ITEM(flat, 0) == (PyObject *)&PyList_Type) {
        result = items;
    }
    else {
        result = PyList_AsTuple(items);
        Py_DECREF(items);
    }
    Py_DECREF(flat);
    return result;
}

/* DeviceStream.emit without recorder or CUDA_LAUNCH_BLOCKING (the caller checked both). */
static int
emit(PyObject *stream, PyObject *record)
{
    PyObject *records = PyObject_GetAttr(stream, s_records);
    if (records == NULL)
        return -1;
    PyObject *done = PyObject_CallMethodOneArg(records, s_append, record);
    if (done == NULL) {
        Py_DECREF(records);
        return -1;
    }
    Py_DECREF(done);
    Py_ssize_t queued = PyObject_Size(records);
    Py_DECREF(records);
    if (queued < 0)
        return -1;
    int due = queued >= S.batch_max;
    if (!due) {
        PyObject *now = PyObject_CallNoArgs(S.perf_counter);
        if (now == NULL)
            return -1;
        PyObject *first = PyObject_GetAttr(stream, s_first_at);
        if (first == NULL) {
            Py_DECREF(now);
            return -1;
        }
        double first_at = PyFloat_AsDouble(first);
        Py_DECREF(first);
        if (first_at == -1.0 && PyErr_Occurred()) {
            Py_DECREF(now);
            return -1;
        }
        if (first_at == 0.0) {
            int rc = PyObject_SetAttr(stream, s_first_at, now);
            Py_DECREF(now);
            return rc;
        }
        due = PyFloat_AS_DOUBLE(now) - first_at > S.flush_after;
        Py_DECREF(now);
    }
    if (due) {
        PyObject *flushed = PyObject_CallMethodNoArgs(stream, s_flush);
        if (flushed == NULL)
            return -1;
        Py_DECREF(flushed);
    }
    return 0;
}

/* [OP, op id, args, kwargs, outputs]: the record dispatch.run appends. */
static PyObject *
op_record(PyObject *op_id, PyObject *wire_args, PyObject *wire_kwargs, PyObject *outs)
{
    PyObject *record = PyList_New(5);
    if (record == NULL)
        return NULL;
    PyList_SET_ITEM(record, 0, Py_NewRef(S.op_code));
    PyList_SET_ITEM(record, 1, Py_NewRef(op_id));
    PyList_SET_ITEM(record, 2, Py_NewRef(wire_args));
    PyList_SET_ITEM(record, 3, Py_NewRef(wire_kwargs));
    PyList_SET_ITEM(record, 4, Py_NewRef(outs));
    return record;
}

static PyObject *
aliased_result(PyObject *info, PyObject *args, PyObject *kwargs)
{
    PyObject *positions = PyObject_GetAttr(info, s_returns_alias);
    if (positions == NULL)
        return NULL;
    if (!PyTuple_Check(positions)) {
        Py_DECREF(positions);
        PyErr_SetString(PyExc_RuntimeError, "gpupool: OpInfo.returns_alias is not a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(positions);
    PyObject *targets = PyTuple_New(n);
    for (Py_ssize_t i = 0; targets != NULL && i < n; i++) {
        PyObject *position = PyTuple_GET_ITEM(positions, i);
        PyObject *target;
        if (PyLong_Check(position)) {
            Py_ssize_t at = PyLong_AsSsize_t(position);
            target = (at >= 0 && at < PyTuple_GET_SIZE(args)) ? PyTuple_GET_ITEM(args, at) : NULL;
            if (target == NULL && !PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "gpupool: aliased argument out of range");
        }
        else {
            PyObject *name = PyObject_Str(position);
            target = name == NULL ? NULL : PyDict_GetItemWithError(kwargs, name);
            Py_XDECREF(name);
            if (target == NULL && !PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, position);
        }
        if (target == NULL) {
            Py_CLEAR(targets);
            break;
        }
        PyTuple_SET_ITEM(targets, i, Py_NewRef(target));
    }
    Py_DECREF(positions);
    if (targets == NULL)
        return NULL;
    if (n == 0) {
        Py_DECREF(targets);
        Py_RETURN_NONE;
    }
    if (n == 1) {
        PyObject *only = Py_NewRef(PyTuple_GET_ITEM(targets, 0));
        Py_DECREF(targets);
        return only;
    }
    return targets;
}

static int
flag(PyObject *info, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(info, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyObject *
slow_run(PyObject *info, PyObject *args, PyObject *kwargs)
{
    PyObject *call[3] = {info, args, kwargs};
    return PyObject_Vectorcall(S.slow_run, call, 3, NULL);
}

/* dispatch.run, cached plans only. */
static PyObject *
fast_run(PyObject *info, PyObject *args, PyObject *kwargs)
{
    int special_case = flag(info, s_metadata_inplace);
    if (special_case == 0)
        special_case = flag(info, s_values_only);
    if (special_case < 0)
        return NULL;
    if (special_case)
        return slow_run(info, args, kwargs);
    int all_alias = flag(info, s_all_alias);
    if (all_alias < 0)
        return NULL;
    PyObject *keyed = PyObject_GetAttr(info, s_keyed_scalars);
    if (keyed == NULL)
        return NULL;
    if (!PyAnySet_Check(keyed)) {
        Py_DECREF(keyed);
        return slow_run(info, args, kwargs);
    }

    Encoding enc = {NULL, PyList_New(1)};
    PyObject *wire_args = NULL, *wire_kwargs = NULL, *record = NULL, *result = NULL;
    PyObject *recorder = NULL, *op_ids = NULL, *op_id = NULL, *key = NULL, *outs = NULL;
    int rc = FAST_ERR;
    if (enc.key == NULL)
        goto done;
    PyList_SET_ITEM(enc.key, 0, Py_NewRef(info));
    rc = encode_call(keyed, args, kwargs, &enc, &wire_args, &wire_kwargs);
    if (rc != FAST_OK)
        goto done;
    rc = FAST_NO;
    if (enc.stream == NULL)
        goto done; /* no remote tensor among the arguments: runtime.stream() picks one */
    recorder = PyObject_GetAttr(enc.stream, s_recorder);
    if (recorder == NULL) {
        rc = FAST_ERR;
        goto done;
    }
    if (recorder != Py_None)
        goto done; /* a capture sees every op: its hooks live in Python */

    rc = FAST_ERR;
    op_ids = PyObject_GetAttr(enc.stream, s_op_ids);
    if (op_ids == NULL || !PyDict_Check(op_ids))
        goto done;
    op_id = PyDict_GetItemWithError(op_ids, info);
    if (op_id != NULL) {
        Py_INCREF(op_id);
    }
    else {
        if (PyErr_Occurred())
            goto done;
        op_id = PyObject_CallMethodOneArg(enc.stream, s_op_id, info);
        if (op_id == NULL)
            goto done;
    }

    if (all_alias) {
        record = op_record(op_id, wire_args, wire_kwargs, Py_None);
        if (record == NULL || emit(enc.stream, record) < 0)
            goto done;
        result = aliased_result(info, args, kwargs);
        rc = result == NULL ? FAST_ERR : FAST_OK;
        goto done;
    }

    key = PyList_AsTuple(enc.key);
    if (key == NULL)
        goto done;
    PyObject *plan = PyDict_GetItemWithError(S.plans, key);
    if (plan == NULL) {
        rc = PyErr_Occurred() ? FAST_ERR : FAST_NO; /* a miss: infer in Python */
        goto done;
    }
    Py_INCREF(plan);
    outs = PyList_New(0);
    if (outs == NULL) {
        Py_DECREF(plan);
        goto done;
    }
    result = build_outputs(plan, enc.stream, outs);
    if (result == NULL && !PyErr_Occurred()) {
        /* Outputs that alias inputs: Plan.build(stream.new_handle, args, kwargs). */
        PyObject *maker = PyObject_GetAttr(enc.stream, s_new_handle);
        PyObject *built = NULL;
        if (maker != NULL) {
            PyObject *call[4] = {plan, maker, args, kwargs};
            built = PyObject_VectorcallMethod(s_build, call, 4, NULL);
            Py_DECREF(maker);
        }
        if (built != NULL && PyTuple_Check(built) && PyTuple_GET_SIZE(built) == 2) {
            Py_SETREF(outs, Py_NewRef(PyTuple_GET_ITEM(built, 0)));
            result = Py_NewRef(PyTuple_GET_ITEM(built, 1));
        }
        else if (built != NULL) {
            PyErr_SetString(PyExc_RuntimeError, "gpupool: Plan.build returned no pair");
        }
        Py_XDECREF(built);
    }
    Py_DECREF(plan);
    if (result == NULL)
        goto done;
    record = op_record(op_id, wire_args, wire_kwargs, outs);
    if (record == NULL || emit(enc.stream, record) < 0) {
        Py_CLEAR(result);
        goto done;
    }
    rc = FAST_OK;

done:
    Py_XDECREF(keyed);
    Py_XDECREF(enc.stream);
    Py_XDECREF(enc.key);
    Py_XDECREF(wire_args);
    Py_XDECREF(wire_kwargs);
    Py_XDECREF(recorder);
    Py_XDECREF(op_ids);
    Py_XDECREF(op_id);
    Py_XDECREF(key);
    Py_XDECREF(outs);
    Py_XDECREF(record);
    if (rc == FAST_OK)
        return result;
    Py_XDECREF(result);
    if (rc == FAST_NO)
        return slow_run(info, args, kwargs);
    return NULL;
}

static PyObject *
not_ready(void)
{
    PyErr_SetString(PyExc_RuntimeError, "gpupool.torch._fastpath is not configured");
    return NULL;
}

/* Handle.__del__ (installed as a method): DeviceStream.release(id) for the common case - the
 * stream open, no capture recording, no handle watched by a captured program - appends the
 * FREE record itself; every other case calls release() in Python. Half of a training step's
 * records are these. */
static PyObject *
handle_del(PyObject *module, PyObject *self)
{
    PyObject *stream = PyObject_GetAttr(self, s_stream);
    PyObject *id = stream == NULL ? NULL : PyObject_GetAttr(self, s_id);
    if (id == NULL) {
        Py_XDECREF(stream);
        return NULL;
    }
    PyObject *result = NULL;
    if (!S.ready) {
        /* Not configured (being reconfigured): the Python release never loses a FREE. */
        result = PyObject_CallMethodOneArg(stream, s_release, id);
        Py_DECREF(id);
        Py_DECREF(stream);
        if (result == NULL)
            return NULL;
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    PyObject *recorder = PyObject_GetAttr(stream, s_recorder);
    PyObject *watched = recorder == NULL ? NULL : PyObject_GetAttr(stream, s_watched);
    if (watched != NULL) {
        if (recorder != Py_None || !PyAnySet_Check(watched) || PySet_GET_SIZE(watched) != 0) {
            result = PyObject_CallMethodOneArg(stream, s_release, id);
        }
        else {
            PyObject *open = PyObject_GetAttr(stream, s_open);
            int is_open = open == NULL ? -1 : PyObject_IsTrue(open);
            Py_XDECREF(open);
            if (is_open == 0) {
                result = Py_NewRef(Py_None);
            }
            else if (is_open > 0) {
                PyObject *records = PyObject_GetAttr(stream, s_records);
                PyObject *record = records == NULL ? NULL : PyList_New(2);
                if (record != NULL) {
                    PyList_SET_ITEM(record, 0, Py_NewRef(S.free_code));
                    PyList_SET_ITEM(record, 1, Py_NewRef(id));
                    result = PyObject_CallMethodOneArg(records, s_append, record);
                    Py_DECREF(record);
                }
                Py_XDECREF(records);
            }
        }
    }
    Py_XDECREF(watched);
    Py_XDECREF(recorder);
    Py_DECREF(id);
    Py_DECREF(stream);
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    Py_RETURN_NONE;
}

static PyObject *
handle_del_method(PyObject *module, PyObject *unused)
{
    PyObject *function = PyObject_GetAttrString(module, "handle_del");
    if (function == NULL)
        return NULL;
    PyObject *method = PyInstanceMethod_New(function); /* binds like a Python method */
    Py_DECREF(function);
    return method;
}

/* RemoteTensor.__torch_dispatch__(cls, func, types, args=(), kwargs=None), as a classmethod. */
static PyObject *
torch_dispatch(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (!S.ready)
        return not_ready();
    if (argc < 3 || argc > 5) {
        PyErr_SetString(PyExc_TypeError,
                        "__torch_dispatch__(cls, func, types, args=(), kwargs=None)");
        return NULL;
    }
    PyObject *func = argv[1];
    PyObject *args = argc > 3 ? argv[3] : NULL;
    PyObject *kwargs = argc > 4 ? argv[4] : NULL;
    PyObject *empty_args = NULL;
    if (args == NULL) {
        args = empty_args = PyTuple_New(0);
        if (args == NULL)
            return NULL;
    }
    if (kwargs == NULL || kwargs == Py_None)
        kwargs = S.empty_kwargs;
    if (!PyTuple_Check(args) || !PyDict_Check(kwargs)) {
        PyObject *call[3] = {func, args, kwargs};
        Py_XDECREF(empty_args);
        return PyObject_Vectorcall(S.slow_dispatch, call, 3, NULL);
    }
    PyObject *result = NULL;
    PyObject *id = PyLong_FromVoidPtr(func);
    PyObject *route = id == NULL ? NULL : PyDict_GetItemWithError(S.routes, id);
    Py_XDECREF(id);
    if (route == NULL || !PyTuple_Check(route) || PyTuple_GET_SIZE(route) != 3) {
        if (!PyErr_Occurred()) {
            /* First call of this op: the Python dispatch makes (and caches) its route. */
            PyObject *call[3] = {func, args, kwargs};
            result = PyObject_Vectorcall(S.slow_dispatch, call, 3, NULL);
        }
        Py_XDECREF(empty_args);
        return result;
    }
    if (func == S.to_copy && PyTuple_GET_SIZE(args) >= 1 && is_remote(PyTuple_GET_ITEM(args, 0))) {
        /* A cast on the device (autocast's casts, .to(dtype), .float()): a plain op. Copies
         * to other devices or the host are the Python _to_copy's. */
        int stays = PyDict_GET_SIZE(kwargs) == 0;
        if (!stays) {
            PyObject *device = PyDict_GetItemWithError(kwargs, s_device);
            stays = device == NULL && !PyErr_Occurred() &&
                    PyDict_GetItemWithError(kwargs, s_pin_memory) == NULL && !PyErr_Occurred() &&
                    PyDict_GetItemWithError(kwargs, s_non_blocking) == NULL && !PyErr_Occurred();
        }
        if (PyErr_Occurred()) {
            Py_XDECREF(empty_args);
            return NULL;
        }
        if (stays) {
            result = fast_run(S.to_copy_info, args, kwargs);
            Py_XDECREF(empty_args);
            return result;
        }
    }
    if (PyTuple_GET_SIZE(args) == 1 && Py_TYPE(PyTuple_GET_ITEM(args, 0)) ==
        (PyTypeObject *)S.remote_type) {
        int share = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(S.share_ops); i++)
            share |= PyTuple_GET_ITEM(S.share_ops, i) == func; /* by identity: OpOverload
                                                                  hashes in Python */
        if (share) {
            /* dispatch._share: autograd's detach()/alias() need no worker op. */
            PyObject *source = PyTuple_GET_ITEM(args, 0);
            PyObject *sig = PyObject_GetAttr(source, s_sig);
            PyObject *handle = sig == NULL ? NULL : PyObject_GetAttr(source, s_gp);
            result = handle == NULL ? NULL : wrap_signature(sig, handle);
            Py_XDECREF(sig);
            Py_XDECREF(handle);
            Py_XDECREF(empty_args);
            return result;
        }
    }
    Py_INCREF(route);
    PyObject *special = PyTuple_GET_ITEM(route, 0);
    PyObject *info = PyTuple_GET_ITEM(route, 1);
    if (special != Py_None) {
        PyObject *call[3] = {func, args, kwargs};
        result = PyObject_Vectorcall(special, call, 3, NULL);
    }
    else {
        int policy = PyObject_IsTrue(PyTuple_GET_ITEM(route, 2));
        if (policy > 0) {
            PyObject *call[3] = {info, args, kwargs};
            PyObject *adjusted = PyObject_Vectorcall(S.adjust, call, 3, NULL);
            if (adjusted != NULL && PyTuple_Check(adjusted) && PyTuple_GET_SIZE(adjusted) == 2 &&
                PyTuple_Check(PyTuple_GET_ITEM(adjusted, 0)) &&
                PyDict_Check(PyTuple_GET_ITEM(adjusted, 1))) {
                result = fast_run(info, PyTuple_GET_ITEM(adjusted, 0),
                                  PyTuple_GET_ITEM(adjusted, 1));
            }
            else if (adjusted != NULL) {
                PyErr_SetString(PyExc_RuntimeError,
                                "gpupool: autocast.adjust returned no (args, kwargs) pair");
            }
            Py_XDECREF(adjusted);
        }
        else if (policy == 0) {
            result = fast_run(info, args, kwargs);
        }
    }
    Py_DECREF(route);
    Py_XDECREF(empty_args);
    return result;
}

/* torch._library.simple_registry.find_torch_dispatch_rule, which torch calls on every
 * dispatch to a Python subclass: nobody registers rules for RemoteTensor, so skip the Python
 * lookup (~1 us an op) for it and ask the original for every other class. */
static PyObject *
find_rule(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc == 2 && S.ready && argv[1] == S.remote_type)
        Py_RETURN_NONE;
    if (S.find_rule == NULL)
        return not_ready();
    return PyObject_Vectorcall(S.find_rule, argv, argc, NULL);
}

static int
take(PyObject *config, const char *name, PyObject **slot)
{
    PyObject *value = PyDict_GetItemString(config, name);
    if (value == NULL) {
        PyErr_Format(PyExc_KeyError, "gpupool.torch._fastpath.configure needs %s", name);
        return -1;
    }
    Py_XSETREF(*slot, Py_NewRef(value));
    return 0;
}

static PyObject *
configure(PyObject *module, PyObject *config)
{
    if (!PyDict_Check(config)) {
        PyErr_SetString(PyExc_TypeError, "configure(dict)");
        return NULL;
    }
    S.ready = 0;
    if (take(config, "remote_type", &S.remote_type) < 0 ||
        take(config, "handle_type", &S.handle_type) < 0 ||
        take(config, "size_type", &S.size_type) < 0 ||
        take(config, "dtype_type", &S.dtype_type) < 0 ||
        take(config, "routes", &S.routes) < 0 || take(config, "plans", &S.plans) < 0 ||
        take(config, "slow_dispatch", &S.slow_dispatch) < 0 ||
        take(config, "slow_run", &S.slow_run) < 0 || take(config, "adjust", &S.adjust) < 0 ||
        take(config, "handle_ids", &S.handle_ids) < 0 ||
        take(config, "ext_type", &S.ext_type) < 0 ||
        take(config, "tensor_code", &S.tensor_code) < 0 ||
        take(config, "dtype_ext", &S.dtype_ext) < 0 ||
        take(config, "true_key", &S.true_key) < 0 || take(config, "false_key", &S.false_key) < 0 ||
        take(config, "make_wrapper", &S.make_wrapper) < 0 || take(config, "meta", &S.meta) < 0 ||
        take(config, "op_code", &S.op_code) < 0 ||
        take(config, "free_code", &S.free_code) < 0 ||
        take(config, "perf_counter", &S.perf_counter) < 0 ||
        take(config, "find_rule", &S.find_rule) < 0 ||
        take(config, "to_copy", &S.to_copy) < 0 ||
        take(config, "to_copy_info", &S.to_copy_info) < 0 ||
        take(config, "share_ops", &S.share_ops) < 0)
        return NULL;
    if (!PyType_Check(S.remote_type) || !PyType_Check(S.handle_type) ||
        !PyType_Check(S.size_type) || !PyType_Check(S.dtype_type) ||
        !PyType_Check(S.ext_type) || !PyDict_Check(S.routes) || !PyDict_Check(S.plans) ||
        !PyDict_Check(S.dtype_ext) || !PyIter_Check(S.handle_ids) ||
        !PyTuple_Check(S.share_ops)) {
        PyErr_SetString(PyExc_TypeError, "gpupool.torch._fastpath.configure: wrong kinds");
        return NULL;
    }
    PyObject *batch_max = PyDict_GetItemString(config, "batch_max");
    PyObject *flush_after = PyDict_GetItemString(config, "flush_after");
    if (batch_max == NULL || flush_after == NULL) {
        PyErr_SetString(PyExc_KeyError, "configure needs batch_max and flush_after");
        return NULL;
    }
    S.batch_max = PyLong_AsSsize_t(batch_max);
    S.flush_after = PyFloat_AsDouble(flush_after);
    if (PyErr_Occurred())
        return NULL;
    S.ready = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"torch_dispatch", (PyCFunction)(void (*)(void))torch_dispatch, METH_FASTCALL,
     "RemoteTensor.__torch_dispatch__ (install as a classmethod)."},
    {"find_rule", (PyCFunction)(void (*)(void))find_rule, METH_FASTCALL,
     "find_torch_dispatch_rule that answers None for RemoteTensor at once."},
    {"configure", configure, METH_O, "Hand the Python objects the hot path uses."},
    {"handle_del", handle_del, METH_O, "Handle.__del__: the FREE record of a dropped handle."},
    {"handle_del_method", handle_del_method, METH_NOARGS,
     "handle_del wrapped to bind as a method (Handle.__del__ = handle_del_method())."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "gpupool.torch._fastpath",
    "The client's per-op hot path in C (see the file's opening comment).", -1, methods,
};

#define INTERN(var, text)                                                                      \
    do {                                                                                       \
        var = PyUnicode_InternFromString(text);                                                \
        if (var == NULL)                                                                       \
            return NULL;                                                                       \
    } while (0)

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    INTERN(s_gp, "_gp");
    INTERN(s_sig, "_sig");
    INTERN(s_stream, "stream");
    INTERN(s_ext, "ext");
    INTERN(s_id, "id");
    INTERN(s_recorder, "recorder");
    INTERN(s_op_ids, "_op_ids");
    INTERN(s_records, "records");
    INTERN(s_first_at, "_first_at");
    INTERN(s_flush, "flush");
    INTERN(s_single, "single");
    INTERN(s_flat, "flat");
    INTERN(s_metadata_inplace, "metadata_inplace");
    INTERN(s_values_only, "values_only");
    INTERN(s_all_alias, "all_alias");
    INTERN(s_keyed_scalars, "keyed_scalars");
    INTERN(s_returns_alias, "returns_alias");
    INTERN(s_build, "build");
    INTERN(s_new_handle, "new_handle");
    INTERN(s_op_id, "op_id");
    INTERN(s_append, "append");
    INTERN(s_device, "device");
    INTERN(s_pin_memory, "pin_memory");
    INTERN(s_non_blocking, "non_blocking");
    INTERN(s_watched, "watched");
    INTERN(s_release, "release");
    INTERN(s_open, "open");
    S.empty_kwargs = PyDict_New();
    S.wrap_kwnames = Py_BuildValue("(ssss)", "strides", "storage_offset", "dtype", "device");
    if (S.empty_kwargs == NULL || S.wrap_kwnames == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
