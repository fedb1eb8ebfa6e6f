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
 * Handle.__del__, the FREE record of each dropped tensor (half of a step's records). It also
 * makes autocast.adjust's decisions for plain tensor arguments (the casts under
 * torch.autocast("cuda"), see "autocast" below) and packs record batches into msgpack
 * (pack_records).
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
#include <string.h>

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
    PyObject *autocast_state; /* autocast._state: .enabled / .dtype of this thread */
    PyObject *current_node;  /* torch._C._current_autograd_node */
    PyObject *casts;         /* autocast._casts (a WeakKeyDictionary: weight handle -> cast) */
    PyObject *float32, *bfloat16, *float16;
    long bit_lower, bit_float32, bit_by_dtype, bit_promote, bit_lower_backward,
        bit_float32_backward, bit_softmax_backward, bit_attention_backward;
    PyObject *handle_ids;    /* stream.HANDLE_IDS, an itertools.count */
    PyObject *ext_type;      /* msgpack.ExtType */
    PyObject *tensor_code;   /* Ext.TENSOR as int */
    PyObject *dtype_ext;     /* dtype -> ExtType */
    PyObject *true_key;      /* dispatch._TRUE / _FALSE: keyed bools in plan keys */
    PyObject *false_key;
    PyObject *make_wrapper;  /* torch.Tensor._make_wrapper_subclass */
    PyObject *wrap_bits;     /* tensor.wrap_signature, for signatures with math bits */
    PyObject *op_code;       /* Rec.OP as int */
    PyObject *free_code;     /* Rec.FREE as int */
    PyObject *perf_counter;  /* time.perf_counter: the flusher compares _first_at with it */
    PyObject *find_rule;     /* torch._library.simple_registry.find_torch_dispatch_rule */
    PyObject *to_copy;       /* aten._to_copy.default and its OpInfo */
    PyObject *to_copy_info;
    PyObject *share_ops;     /* detach / alias: a new wrapper on the same handle, no record */
    PyObject *inference_on;  /* torch.is_inference_mode_enabled: views then go to Python */
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
    *s_append, *s_device, *s_pin_memory, *s_non_blocking, *s_watched, *s_release, *s_open,
    *s_enabled, *s_dtype, *s_is_leaf, *s_requires_grad, *s_version, *s_data, *s_cxx_device,
    *s_is_view;

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

/* tensor.wrap_signature: the wrapper's C++ device is its stream's (gpupool:N). */
static PyObject *
wrap_signature(PyObject *sig, PyObject *handle)
{
    if (PyTuple_Check(sig) && PyTuple_GET_SIZE(sig) == 5) /* math bits: the Python way */
        return PyObject_CallFunctionObjArgs(S.wrap_bits, sig, handle, NULL);
    if (!PyTuple_Check(sig) || PyTuple_GET_SIZE(sig) != 4) {
        PyErr_SetString(PyExc_RuntimeError, "gpupool: malformed tensor signature in a plan");
        return NULL;
    }
    PyObject *stream = PyObject_GetAttr(handle, s_stream);
    PyObject *device = stream == NULL ? NULL : PyObject_GetAttr(stream, s_cxx_device);
    Py_XDECREF(stream);
    if (device == NULL)
        return NULL;
    PyObject *call[7] = {
        NULL,
        S.remote_type,
        PyTuple_GET_ITEM(sig, 0),
        PyTuple_GET_ITEM(sig, 1),
        PyTuple_GET_ITEM(sig, 2),
        PyTuple_GET_ITEM(sig, 3),
        device,
    };
    PyObject *tensor = PyObject_Vectorcall(S.make_wrapper, call + 1,
                                           2 | PY_VECTORCALL_ARGUMENTS_OFFSET, S.wrap_kwnames);
    Py_DECREF(device);
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

/* Whether inference mode is on: a view made then of a normal tensor must be made outside it
 * (dispatch.run's _outside_inference), so views go to Python while it is. */
static int
inference_on(void)
{
    PyObject *on = PyObject_CallNoArgs(S.inference_on);
    if (on == NULL)
        return -1;
    int truth = PyObject_IsTrue(on);
    Py_DECREF(on);
    return truth;
}

/* dispatch.run, cached plans only. */
static PyObject *
fast_run(PyObject *info, PyObject *args, PyObject *kwargs)
{
    int special_case = flag(info, s_metadata_inplace);
    if (special_case == 0)
        special_case = flag(info, s_values_only);
    if (special_case == 0) {
        special_case = flag(info, s_is_view);
        if (special_case > 0)
            special_case = inference_on();
    }
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

/* ---- autocast("cuda") for the common cases: autocast.adjust in C ----------------------
 *
 * Why: a GPT-2 step under bf16 autocast calls autocast.adjust for every matmul, forward and
 * backward, and its Python (the cast of each float32 weight or activation, the weight-copy
 * cache, the dtype scan of backward ops) measured 13% of the client's step. These functions
 * make the same decisions as autocast.adjust, in the same order, for tensors that are plain
 * arguments; tensor lists, tensors among the keyword arguments, the dtype-argument and
 * promotions of mixed dtypes and the softmax- and attention-backward rules go to the Python
 * adjust (FAST_NO). Weights' 16-bit copies live in autocast._casts, which both read and fill. */

/* The thread's autocast("cuda") state, as autocast._enabled() reads it. */
static int
autocast_enabled(PyObject **dtype)
{
    PyObject *value = PyObject_GetAttr(S.autocast_state, s_enabled);
    if (value == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int enabled = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (enabled <= 0)
        return enabled;
    *dtype = PyObject_GetAttr(S.autocast_state, s_dtype);
    if (*dtype == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        *dtype = Py_NewRef(S.float16);
    }
    return 1;
}

static int
is_sixteen(PyObject *dtype)
{
    return dtype == S.bfloat16 || dtype == S.float16;
}

/* The dtype a remote tensor's signature holds (borrowed), or NULL with an error set. */
static PyObject *
signature_dtype(PyObject *tensor)
{
    PyObject *sig = PyObject_GetAttr(tensor, s_sig);
    if (sig == NULL)
        return NULL;
    PyObject *dtype = NULL;
    if (PyTuple_Check(sig) && (PyTuple_GET_SIZE(sig) == 4 || PyTuple_GET_SIZE(sig) == 5))
        dtype = PyTuple_GET_ITEM(sig, 3); /* the signature lives as long as the wrapper */
    else
        PyErr_SetString(PyExc_RuntimeError, "gpupool: malformed tensor signature");
    Py_DECREF(sig);
    return dtype;
}

/* aten._to_copy(value, dtype=dtype) below autograd, as the dispatcher would route it. */
static PyObject *
to_copy(PyObject *value, PyObject *dtype)
{
    PyObject *one = PyTuple_Pack(1, value);
    PyObject *named = one == NULL ? NULL : PyDict_New();
    PyObject *copy = NULL;
    if (named != NULL && PyDict_SetItem(named, s_dtype, dtype) == 0)
        copy = fast_run(S.to_copy_info, one, named);
    Py_XDECREF(named);
    Py_XDECREF(one);
    return copy;
}

/* autocast._cast_value for one remote tensor whose dtype is to change: a new reference. */
static PyObject *
cast_tensor(PyObject *value, PyObject *dtype)
{
    PyObject *flag_value = PyObject_GetAttr(value, s_is_leaf);
    int leaf = flag_value == NULL ? -1 : PyObject_IsTrue(flag_value);
    Py_XDECREF(flag_value);
    if (leaf < 0)
        return NULL;
    int needs_grad = 0;
    if (leaf) {
        flag_value = PyObject_GetAttr(value, s_requires_grad);
        needs_grad = flag_value == NULL ? -1 : PyObject_IsTrue(flag_value);
        Py_XDECREF(flag_value);
        if (needs_grad < 0)
            return NULL;
    }
    if (needs_grad) {
        /* _cached_cast: the weight's copy of this region, while its version is unchanged. */
        PyObject *handle = PyObject_GetAttr(value, s_gp);
        PyObject *data = handle == NULL ? NULL : PyObject_GetAttr(S.casts, s_data);
        PyObject *ref = data == NULL ? NULL : PyWeakref_NewRef(handle, NULL);
        PyObject *cached = NULL;
        if (ref != NULL && PyDict_Check(data)) {
            cached = PyDict_GetItemWithError(data, ref);
            Py_XINCREF(cached);
        }
        Py_XDECREF(ref);
        Py_XDECREF(data);
        Py_XDECREF(handle);
        if (PyErr_Occurred()) {
            Py_XDECREF(cached);
            return NULL;
        }
        if (cached != NULL && PyTuple_Check(cached) && PyTuple_GET_SIZE(cached) == 3 &&
            PyTuple_GET_ITEM(cached, 1) == dtype) {
            PyObject *version = PyObject_GetAttr(value, s_version);
            int same = version == NULL ? -1
                                       : PyObject_RichCompareBool(version,
                                                                  PyTuple_GET_ITEM(cached, 0),
                                                                  Py_EQ);
            Py_XDECREF(version);
            if (same < 0) {
                Py_DECREF(cached);
                return NULL;
            }
            if (same) {
                PyObject *copy = Py_NewRef(PyTuple_GET_ITEM(cached, 2));
                Py_DECREF(cached);
                return copy;
            }
        }
        Py_XDECREF(cached);
        /* A miss (each weight once a region; in backward, the no-grad views of weights that
         * autograd makes, which count as leaves): cast, and remember it as _cached_cast does. */
        PyObject *version = PyObject_GetAttr(value, s_version);
        PyObject *copy = version == NULL ? NULL : to_copy(value, dtype);
        PyObject *entry = copy == NULL ? NULL : PyTuple_Pack(3, version, dtype, copy);
        handle = entry == NULL ? NULL : PyObject_GetAttr(value, s_gp);
        int stored = handle == NULL ? -1 : PyObject_SetItem(S.casts, handle, entry);
        Py_XDECREF(handle);
        Py_XDECREF(entry);
        Py_XDECREF(version);
        if (stored < 0)
            Py_CLEAR(copy);
        return copy;
    }
    return to_copy(value, dtype);
}

/* autocast._cast(args, dtype, sources) with _cast_kw: *out gets a new reference to the
 * arguments after the casts (args itself when nothing changes). sixteen_sources: the
 * sources are float16 and bfloat16, else float32. */
static int
cast_args(PyObject *args, PyObject *kwargs, PyObject *dtype, int sixteen_sources,
          PyObject **out)
{
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(kwargs, &pos, &name, &value)) {
        if (is_remote(value))
            return FAST_NO;
        if ((PyList_Check(value) || PyTuple_Check(value)) && PySequence_Fast_GET_SIZE(value) &&
            is_remote(PySequence_Fast_ITEMS(value)[0]))
            return FAST_NO;
    }
    PyObject *changed = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
        PyTypeObject *kind = Py_TYPE(item);
        if (kind == (PyTypeObject *)S.remote_type) {
            PyObject *current = signature_dtype(item);
            if (current == NULL) {
                Py_XDECREF(changed);
                return FAST_ERR;
            }
            int source = sixteen_sources ? is_sixteen(current) : current == S.float32;
            if (!source || current == dtype)
                continue;
        }
        else if (kind == &PyList_Type || kind == &PyTuple_Type) {
            if (PySequence_Fast_GET_SIZE(item) && is_remote(PySequence_Fast_ITEMS(item)[0])) {
                Py_XDECREF(changed);
                return FAST_NO; /* tensor lists: the Python adjust */
            }
            continue;
        }
        else if (is_remote(item)) {
            Py_XDECREF(changed);
            return FAST_NO; /* a subclass of RemoteTensor */
        }
        else {
            continue;
        }
        PyObject *cast = cast_tensor(item, dtype);
        if (cast == NULL) {
            Py_XDECREF(changed);
            return FAST_ERR;
        }
        if (changed == NULL) {
            /* A fresh tuple (PyTuple_GetSlice of the whole would hand back args itself). */
            changed = PyTuple_New(n);
            if (changed == NULL) {
                Py_DECREF(cast);
                return FAST_ERR;
            }
            for (Py_ssize_t j = 0; j < n; j++)
                PyTuple_SET_ITEM(changed, j, Py_NewRef(PyTuple_GET_ITEM(args, j)));
        }
        PyObject *old = PyTuple_GET_ITEM(changed, i);
        PyTuple_SET_ITEM(changed, i, cast);
        Py_DECREF(old);
    }
    *out = changed != NULL ? changed : Py_NewRef(args);
    return FAST_OK;
}

#define DT_F32 1
#define DT_BF16 2
#define DT_F16 4

static int
note_dtype(PyObject *tensor, int *found)
{
    PyObject *dtype = signature_dtype(tensor);
    if (dtype == NULL)
        return FAST_ERR;
    *found |= dtype == S.float32 ? DT_F32 : dtype == S.bfloat16 ? DT_BF16
                                          : dtype == S.float16  ? DT_F16 : 0;
    return FAST_OK;
}

/* autocast._float_dtypes(args) as DT_* bits in *found: FAST_OK, or FAST_NO where the Python
 * adjust decides (subclasses of RemoteTensor, lists of lists). Like it, it looks into
 * sequences whose first item is not a plain number (tensor lists), not into sizes. */
static int
float_dtypes(PyObject *args, int *found)
{
    *found = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
        PyTypeObject *kind = Py_TYPE(item);
        int rc = FAST_OK;
        if (kind == (PyTypeObject *)S.remote_type) {
            rc = note_dtype(item, found);
        }
        else if (is_remote(item)) {
            rc = FAST_NO;
        }
        else if ((PyList_Check(item) || PyTuple_Check(item)) && PySequence_Fast_GET_SIZE(item)) {
            PyTypeObject *first = Py_TYPE(PySequence_Fast_ITEMS(item)[0]);
            if (first == &PyLong_Type || first == &PyBool_Type || first == &PyFloat_Type)
                continue;
            Py_ssize_t n = PySequence_Fast_GET_SIZE(item);
            for (Py_ssize_t j = 0; rc == FAST_OK && j < n; j++) {
                PyObject *inner = PySequence_Fast_ITEMS(item)[j];
                if (Py_TYPE(inner) == (PyTypeObject *)S.remote_type)
                    rc = note_dtype(inner, found);
                else if (is_remote(inner) || PyList_Check(inner) || PyTuple_Check(inner))
                    rc = FAST_NO;
            }
        }
        if (rc != FAST_OK)
            return rc;
    }
    return FAST_OK;
}

/* autocast.adjust(info, args, kwargs), keyword arguments unchanged: FAST_OK with *out the
 * arguments to run (a new reference), FAST_NO to ask the Python adjust. */
static int
fast_adjust(long bits, PyObject *args, PyObject *kwargs, PyObject **out)
{
    PyObject *target = NULL;
    int enabled = autocast_enabled(&target);
    if (enabled < 0)
        return FAST_ERR;
    if (enabled) {
        int rc;
        if (bits & S.bit_lower)
            rc = cast_args(args, kwargs, target, 0, out);
        else if (bits & S.bit_by_dtype)
            rc = FAST_NO;
        else if (bits & S.bit_float32)
            rc = cast_args(args, kwargs, S.float32, 1, out);
        else if (bits & S.bit_promote) {
            /* _widest_of: inputs of one float dtype (a KV cache's cat) need nothing; mixed
             * ones are promoted by the Python adjust. */
            int found = 0;
            rc = float_dtypes(args, &found);
            if (rc == FAST_OK && (found & (found - 1)))
                rc = FAST_NO; /* two dtypes or more */
            if (rc == FAST_OK)
                *out = Py_NewRef(args);
        }
        else {
            *out = Py_NewRef(args);
            rc = FAST_OK;
        }
        Py_DECREF(target);
        return rc;
    }
    if (bits & (S.bit_softmax_backward | S.bit_attention_backward))
        return FAST_NO; /* rare (one a step or one a layer): the Python adjust */
    PyObject *node = PyObject_CallNoArgs(S.current_node);
    if (node == NULL)
        return FAST_ERR;
    int in_backward = node != Py_None;
    Py_DECREF(node);
    /* In backward: only ops that meet both a 16-bit and a float32 input need help. */
    int found = 0;
    if (in_backward) {
        int rc = float_dtypes(args, &found);
        if (rc != FAST_OK)
            return rc;
    }
    int has32 = found & DT_F32, hasbf16 = found & DT_BF16;
    if (!(has32 && (found & (DT_BF16 | DT_F16)))) {
        *out = Py_NewRef(args);
        return FAST_OK;
    }
    if (bits & S.bit_lower_backward)
        return cast_args(args, kwargs, hasbf16 ? S.bfloat16 : S.float16, 0, out);
    if (bits & (S.bit_float32_backward | S.bit_float32))
        return cast_args(args, kwargs, S.float32, 1, out);
    *out = Py_NewRef(args);
    return FAST_OK;
}

static PyObject *
not_ready(void)
{
    PyErr_SetString(PyExc_RuntimeError, "gpupool.torch._fastpath is not configured");
    return NULL;
}

/* ---- msgpack for record batches --------------------------------------------------------
 *
 * Why: DeviceStream._flush_locked packed a batch with msgpack.Packer, one Python call per
 * record (a GPT-2 step has ~3,800 records, half of them two-item FREEs), which measured 4-5%
 * of the client's step. pack_records writes the same bytes as msgpack.Packer(use_bin_type=
 * True) for the kinds records hold (None, bool, int, float, str, bytes, list, tuple, dict,
 * ExtType); for anything else it returns None and the caller packs with msgpack itself
 * (tests/torch/test_fastpath.py compares the bytes on generated records). */

#define PACK_UNSUPPORTED 2 /* pack_value: a kind this packer leaves to msgpack */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buffer;

static int
buffer_reserve(Buffer *buf, Py_ssize_t more)
{
    if (buf->len + more <= buf->cap)
        return 0;
    Py_ssize_t cap = buf->cap ? buf->cap : 4096;
    while (cap < buf->len + more)
        cap *= 2;
    char *grown = PyMem_Realloc(buf->data, (size_t)cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buf->data = grown;
    buf->cap = cap;
    return 0;
}

static int
put_bytes(Buffer *buf, const void *data, Py_ssize_t n)
{
    if (buffer_reserve(buf, n) < 0)
        return -1;
    memcpy(buf->data + buf->len, data, (size_t)n);
    buf->len += n;
    return 0;
}

/* A type byte and an n-byte big-endian unsigned value. */
static int
put_be(Buffer *buf, unsigned char type, uint64_t value, int n)
{
    if (buffer_reserve(buf, 1 + n) < 0)
        return -1;
    unsigned char *out = (unsigned char *)buf->data + buf->len;
    out[0] = type;
    for (int i = n; i >= 1; i--) {
        out[i] = (unsigned char)(value & 0xff);
        value >>= 8;
    }
    buf->len += 1 + n;
    return 0;
}

static int
put_byte(Buffer *buf, unsigned char byte)
{
    return put_bytes(buf, &byte, 1);
}

/* msgpack's sized headers: fix form below fix_limit (if any), then 8/16/32-bit lengths. */
static int
put_length(Buffer *buf, Py_ssize_t n, unsigned char fix, Py_ssize_t fix_limit,
           unsigned char t8, unsigned char t16, unsigned char t32)
{
    if (n < fix_limit)
        return put_byte(buf, (unsigned char)(fix | n));
    if (t8 && n < 256)
        return put_be(buf, t8, (uint64_t)n, 1);
    if (n < 65536)
        return put_be(buf, t16, (uint64_t)n, 2);
    if ((uint64_t)n <= 0xffffffffULL)
        return put_be(buf, t32, (uint64_t)n, 4);
    PyErr_SetString(PyExc_ValueError, "gpupool: object too large for msgpack");
    return -1;
}

static int
pack_int(Buffer *buf, PyObject *value)
{
    int overflow = 0;
    long long d = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (d == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(value);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return PACK_UNSUPPORTED; /* too large: msgpack's own error, via Python */
        }
        return put_be(buf, 0xcf, u, 8);
    }
    if (overflow < 0)
        return PACK_UNSUPPORTED;
    if (d < -(1LL << 5)) {
        if (d < -(1LL << 15))
            return d < -(1LL << 31) ? put_be(buf, 0xd3, (uint64_t)d, 8)
                                    : put_be(buf, 0xd2, (uint64_t)(uint32_t)(int32_t)d, 4);
        return d < -(1 << 7) ? put_be(buf, 0xd1, (uint64_t)(uint16_t)(int16_t)d, 2)
                             : put_be(buf, 0xd0, (uint64_t)(uint8_t)(int8_t)d, 1);
    }
    if (d < (1 << 7))
        return put_byte(buf, (unsigned char)(int8_t)d);
    if (d < (1LL << 16))
        return d < (1 << 8) ? put_be(buf, 0xcc, (uint64_t)d, 1) : put_be(buf, 0xcd, (uint64_t)d, 2);
    return d < (1LL << 32) ? put_be(buf, 0xce, (uint64_t)d, 4) : put_be(buf, 0xcf, (uint64_t)d, 8);
}

static int
pack_value(Buffer *buf, PyObject *value, int depth)
{
    if (depth > 64)
        return PACK_UNSUPPORTED;
    if (value == Py_None)
        return put_byte(buf, 0xc0);
    if (value == Py_True)
        return put_byte(buf, 0xc3);
    if (value == Py_False)
        return put_byte(buf, 0xc2);
    if (PyLong_Check(value))
        return pack_int(buf, value);
    if (PyFloat_Check(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return put_be(buf, 0xcb, bits, 8);
    }
    if (PyBytes_Check(value) || PyByteArray_Check(value)) {
        const char *data = PyBytes_Check(value) ? PyBytes_AS_STRING(value)
                                                : PyByteArray_AS_STRING(value);
        Py_ssize_t n = PyBytes_Check(value) ? PyBytes_GET_SIZE(value)
                                            : PyByteArray_GET_SIZE(value);
        if (put_length(buf, n, 0, 0, 0xc4, 0xc5, 0xc6) < 0)
            return -1;
        return put_bytes(buf, data, n);
    }
    if (PyUnicode_Check(value)) {
        Py_ssize_t n;
        const char *text = PyUnicode_AsUTF8AndSize(value, &n);
        if (text == NULL) {
            PyErr_Clear();
            return PACK_UNSUPPORTED; /* surrogates: msgpack's own error */
        }
        if (put_length(buf, n, 0xa0, 32, 0xd9, 0xda, 0xdb) < 0)
            return -1;
        return put_bytes(buf, text, n);
    }
    if (PyDict_CheckExact(value)) {
        if (put_length(buf, PyDict_GET_SIZE(value), 0x80, 16, 0, 0xde, 0xdf) < 0)
            return -1;
        Py_ssize_t pos = 0;
        PyObject *key, *item;
        while (PyDict_Next(value, &pos, &key, &item)) {
            int rc = pack_value(buf, key, depth + 1);
            if (rc == 0)
                rc = pack_value(buf, item, depth + 1);
            if (rc != 0)
                return rc;
        }
        return 0;
    }
    if (Py_TYPE(value) == (PyTypeObject *)S.ext_type) {
        /* ExtType(code, data): a named 2-tuple. */
        PyObject *code = PyTuple_GET_ITEM(value, 0), *data = PyTuple_GET_ITEM(value, 1);
        if (!PyLong_Check(code) || !PyBytes_Check(data))
            return PACK_UNSUPPORTED;
        long c = PyLong_AsLong(code);
        if (c < -128 || c > 127) {
            PyErr_Clear();
            return PACK_UNSUPPORTED;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        int rc;
        switch (n) {
        case 1: rc = put_byte(buf, 0xd4); break;
        case 2: rc = put_byte(buf, 0xd5); break;
        case 4: rc = put_byte(buf, 0xd6); break;
        case 8: rc = put_byte(buf, 0xd7); break;
        case 16: rc = put_byte(buf, 0xd8); break;
        default: rc = put_length(buf, n, 0, 0, 0xc7, 0xc8, 0xc9);
        }
        if (rc < 0 || put_byte(buf, (unsigned char)(int8_t)c) < 0)
            return -1;
        return put_bytes(buf, PyBytes_AS_STRING(data), n);
    }
    if (PyList_Check(value) || PyTuple_Check(value)) {
        if (PyTuple_Check(value) && PyObject_TypeCheck(value, (PyTypeObject *)S.ext_type))
            return PACK_UNSUPPORTED;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
        if (put_length(buf, n, 0x90, 16, 0, 0xdc, 0xdd) < 0)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* No Python code runs while packing, so the sequence cannot change. */
            int rc = pack_value(buf, PySequence_Fast_ITEMS(value)[i], depth + 1);
            if (rc != 0)
                return rc;
        }
        return 0;
    }
    return PACK_UNSUPPORTED;
}

/* pack_records(head, records) -> bytes, or None where msgpack itself must pack them. */
static PyObject *
pack_records(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc != 2 || !PyList_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "pack_records(head, records: list)");
        return NULL;
    }
    if (!S.ready)
        return not_ready();
    Buffer buf = {NULL, 0, 0};
    int rc = pack_value(&buf, argv[0], 0);
    PyObject *records = argv[1];
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(records); i++)
        rc = pack_value(&buf, PyList_GET_ITEM(records, i), 0);
    PyObject *result = NULL;
    if (rc == 0)
        result = PyBytes_FromStringAndSize(buf.data, buf.len);
    else if (rc == PACK_UNSUPPORTED)
        result = Py_NewRef(Py_None);
    PyMem_Free(buf.data);
    return result;
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
            int inference = inference_on();
            if (inference != 0) {
                PyObject *call[3] = {func, args, kwargs};
                result = inference < 0 ? NULL : PyObject_Vectorcall(S.slow_dispatch, call, 3, NULL);
                Py_XDECREF(empty_args);
                return result;
            }
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
        long bits = PyLong_AsLong(PyTuple_GET_ITEM(route, 2));
        int policy = bits == -1 && PyErr_Occurred() ? -1 : bits != 0;
        PyObject *adjusted_args = NULL;
        int rc = policy > 0 ? fast_adjust(bits, args, kwargs, &adjusted_args) : FAST_OK;
        if (policy > 0 && rc == FAST_OK) {
            result = fast_run(info, adjusted_args, kwargs);
            Py_DECREF(adjusted_args);
        }
        else if (policy > 0 && rc == FAST_NO) {
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
        take(config, "make_wrapper", &S.make_wrapper) < 0 ||
        take(config, "wrap_bits", &S.wrap_bits) < 0 ||
        take(config, "op_code", &S.op_code) < 0 ||
        take(config, "free_code", &S.free_code) < 0 ||
        take(config, "perf_counter", &S.perf_counter) < 0 ||
        take(config, "find_rule", &S.find_rule) < 0 ||
        take(config, "to_copy", &S.to_copy) < 0 ||
        take(config, "to_copy_info", &S.to_copy_info) < 0 ||
        take(config, "share_ops", &S.share_ops) < 0 ||
        take(config, "inference_on", &S.inference_on) < 0 ||
        take(config, "autocast_state", &S.autocast_state) < 0 ||
        take(config, "current_node", &S.current_node) < 0 ||
        take(config, "casts", &S.casts) < 0 || take(config, "float32", &S.float32) < 0 ||
        take(config, "bfloat16", &S.bfloat16) < 0 || take(config, "float16", &S.float16) < 0)
        return NULL;
    PyObject *bits = PyDict_GetItemString(config, "policy_bits");
    if (bits == NULL || !PyTuple_Check(bits) || PyTuple_GET_SIZE(bits) != 8) {
        PyErr_SetString(PyExc_KeyError, "configure needs policy_bits, an 8-tuple");
        return NULL;
    }
    long *slots[8] = {&S.bit_lower,          &S.bit_float32,          &S.bit_by_dtype,
                      &S.bit_promote,        &S.bit_lower_backward,   &S.bit_float32_backward,
                      &S.bit_softmax_backward, &S.bit_attention_backward};
    for (int i = 0; i < 8; i++) {
        *slots[i] = PyLong_AsLong(PyTuple_GET_ITEM(bits, i));
        if (*slots[i] == -1 && PyErr_Occurred())
            return NULL;
    }
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
    {"pack_records", (PyCFunction)(void (*)(void))pack_records, METH_FASTCALL,
     "msgpack of head and records, or None where msgpack itself must pack them."},
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
    INTERN(s_cxx_device, "cxx_device");
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
    INTERN(s_is_view, "is_view");
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
    INTERN(s_enabled, "enabled");
    INTERN(s_dtype, "dtype");
    INTERN(s_is_leaf, "is_leaf");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_version, "_version");
    INTERN(s_data, "data");
    S.empty_kwargs = PyDict_New();
    S.wrap_kwnames = Py_BuildValue("(ssss)", "strides", "storage_offset", "dtype", "device");
    if (S.empty_kwargs == NULL || S.wrap_kwnames == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
