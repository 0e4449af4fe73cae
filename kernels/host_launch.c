/* tedebug's kernel launches in compiled code: a CPython extension module, ``tedebug_host_launch``.

   Two entry points.  `launch(...)` (below, "any launch") makes every launch of `tedebug.backends.launch` in the
   driver mode: the parameter block the ctypes path packs, and the same driver call.  `stats_group_scratch` goes
   further for the one launch every GEMM call's logged tensors make.

   What `stats_group_scratch(table, items)` does.  It is `cupy_stats.basic_stats_group_scratch_into` for its usual
   call: two or three (tensor, scratch address) pairs of one dtype on one device, each contiguous, 16-byte aligned
   and non-empty.  It reads each tensor's pointer and numel, works out the blocks each tensor gets, packs the
   arguments of ``ted_stats_group_scratch`` and calls ``cuLaunchKernel`` on torch's current stream: the launch the
   Python path makes, with the same grid, block, stream and parameter bytes.

   Why.  On a step bound by the host every logged GPU tensor pays this launch's Python: about five torch method
   calls per tensor, the blocks, the packing of twelve arguments, the ctypes call's conversions.  Inside a training
   step that Python costs several times what it costs in a loop (docs/performance.md, sections 4 and 22).  Here it
   is a few hundred instructions and the same torch calls made from C.

   Exactness.  The launch must be the Python path's bit for bit, so that a row is the same row:
   - the blocks follow `cupy_stats.group_grids`: a tensor of n elements of `vec` per 16-byte load has the lone grid
     min(max_grid, ceil(max(n / vec, 1) / threads)) (integer division first); when the lone grids of the group sum to
     at most max_grid each keeps its own, else each gets max(1, min(lone, max_grid * n / total)) (integer division,
     total the group's elements).  A total or a product max_grid * n that would not fit in 64 bits sends the call
     back to Python (whose integers do not overflow) rather than wrap;
   - the parameter block is `launch._ArgBlock`'s for ``_GROUP_SCRATCH_SIGNATURE``: one 8-byte little-endian slot per
     argument, (data pointer, numel, blocks, scratch address) per tensor, zeros for an absent third tensor; the
     blocks, a 32-bit value, fill the low half of their slot and the high half is zero.

   Contract with the caller.  `table` maps (device index, dtype) to the launch's constants, which the Python path
   fills at its first launch of that device and dtype: (the CUfunction, threads per block, elements per 16-byte
   load, the largest grid); the driver's entry point, torch's current-device call and its raw-current-stream call
   are those `configure` gave (below).  The answer is 0 when the kernel was launched.  Anything else launched
   nothing and the caller takes the Python path, which handles every case: -1 for a call this code does not take
   (one tensor or more than three, another dtype or device, an empty, strided or misaligned tensor, a device that is
   not the current one, no table entry yet, an exception raised by a torch call, which is cleared), or the driver's
   non-zero CUresult (the Python path launches again, binding the thread's context where that was missing, and
   names the error otherwise).  The GIL is held throughout, as the ctypes path holds it (``ctypes.PyDLL``).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

typedef int (*launch_kernel_fn)(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                                unsigned block_y, unsigned block_z, unsigned shared_mem, void *stream, void **params,
                                void **extra);

#define GROUP_MAX 3
#define SLOTS_PER_TENSOR 4
#define SLOTS (GROUP_MAX * SLOTS_PER_TENSOR)
#define NOT_TAKEN (-1)

static PyObject *name_dtype, *name_get_device, *name_numel, *name_data_ptr, *name_is_contiguous;

/* The argument kinds of `launch` (below). */
enum { KIND_POINTER, KIND_INT64, KIND_UINT64, KIND_INT32, KIND_UINT32, KIND_FLOAT32, KIND_FLOAT64, KINDS };

typedef int (*cooperative_fn)(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                              unsigned block_y, unsigned block_z, unsigned shared_mem, void *stream, void **params);

static PyObject *kind_types[KINDS];
static launch_kernel_fn configured_launch = NULL;
static cooperative_fn configured_cooperative = NULL;
static PyObject *configured_current_device = NULL;
static PyObject *configured_raw_stream = NULL; /* NULL: none given (the statistics group launch is not taken) */

/* configure(launch_address, cooperative_address, current_device, raw_stream, types): the driver's entry points (0:
   none), torch's current-device call, its call giving the raw current stream of a device index (None: torch lacks
   it) and the seven argument types in the order of the kinds above. */
static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long launch_address, cooperative_address;
    PyObject *current_device, *raw_stream, *types;
    if (!PyArg_ParseTuple(args, "KKOOO", &launch_address, &cooperative_address, &current_device, &raw_stream, &types))
        return NULL;
    if (!PyCallable_Check(current_device) || (raw_stream != Py_None && !PyCallable_Check(raw_stream)) ||
        !PyTuple_Check(types) || PyTuple_GET_SIZE(types) != KINDS) {
        PyErr_SetString(PyExc_TypeError,
                        "configure(launch_address, cooperative_address, current_device, raw_stream or None, 7 types)");
        return NULL;
    }
    for (int k = 0; k < KINDS; k++) {
        PyObject *type = PyTuple_GET_ITEM(types, k);
        if (!PyType_Check(type)) {
            PyErr_SetString(PyExc_TypeError, "configure: the argument kinds must be types");
            return NULL;
        }
        Py_INCREF(type);
        Py_XSETREF(kind_types[k], type);
    }
    Py_INCREF(current_device);
    Py_XSETREF(configured_current_device, current_device);
    PyObject *stream_call = raw_stream == Py_None ? NULL : raw_stream;
    Py_XINCREF(stream_call);
    Py_XSETREF(configured_raw_stream, stream_call);
    configured_launch = (launch_kernel_fn)(uintptr_t)launch_address;
    configured_cooperative = (cooperative_fn)(uintptr_t)cooperative_address;
    Py_RETURN_NONE;
}


/* The integer a torch method call returns, or -1 with *ok cleared (an exception, or not an int); nothing is called
   once *ok is cleared (no Python call is made with an exception pending). */
static long long call_int(PyObject *tensor, PyObject *name, int *ok) {
    if (!*ok) return -1;
    PyObject *value = PyObject_CallMethodNoArgs(tensor, name);
    if (value == NULL) {
        *ok = 0;
        return -1;
    }
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (result == -1 && PyErr_Occurred()) *ok = 0;
    return result;
}

/* The lone grid of `numel` elements (`cupy_stats._lone_grid`). */
static long long lone_grid(long long numel, long long vec, long long threads, long long max_grid) {
    long long loads = numel / vec;
    if (loads < 1) loads = 1;
    long long grid = (loads + threads - 1) / threads;
    return grid < max_grid ? grid : max_grid;
}

/* The blocks of each of `count` tensors (`cupy_stats.group_grids`); 0 when the total or a product would not fit
   in 64 bits. */
static int group_grids(const long long *numels, int count, long long vec, long long threads, long long max_grid,
                       long long *grids) {
    long long lone_sum = 0, total = 0;
    for (int i = 0; i < count; i++) {
        grids[i] = lone_grid(numels[i], vec, threads, max_grid);
        lone_sum += grids[i];
        if (numels[i] > INT64_MAX - total) return 0;
        total += numels[i];
    }
    if (lone_sum <= max_grid) return 1;
    for (int i = 0; i < count; i++) {
        if (max_grid > 0 && numels[i] > INT64_MAX / max_grid) return 0;
        long long share = max_grid * numels[i] / total;
        if (share > grids[i]) share = grids[i];
        grids[i] = share < 1 ? 1 : share;
    }
    return 1;
}

static PyObject *not_taken(void) {
    PyErr_Clear();
    return PyLong_FromLong(NOT_TAKEN);
}

/* Whether torch's current CUDA device (the configured call) is `index`: a launch goes to the current device, so
   another device, or a call that fails (its error is left for not_taken to clear), hands the launch back (the
   Python path switches the device around the launch). */
static int on_current_device(long long index) {
    PyObject *current = PyObject_CallNoArgs(configured_current_device);
    if (current == NULL) return 0;
    long long current_index = PyLong_AsLongLong(current);
    Py_DECREF(current);
    return current_index == index;
}

static PyObject *stats_group_scratch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "stats_group_scratch(table: dict, items: sequence of (tensor, address))");
        return NULL;
    }
    PyObject *items = PySequence_Fast(args[1], "stats_group_scratch: items must be a sequence");
    if (items == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    PyObject **entries = PySequence_Fast_ITEMS(items);
    PyObject *result = NULL;
    PyObject *dtype = NULL;
    PyObject *key = NULL;
    uint64_t slots[SLOTS];
    memset(slots, 0, sizeof(slots));
    long long numels[GROUP_MAX], grids[GROUP_MAX];
    long long index = -1;
    int ok = 1;

    if (count < 2 || count > GROUP_MAX) goto fallback;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = entries[i];
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) goto fallback;
        PyObject *tensor = PyTuple_GET_ITEM(entry, 0);
        PyObject *its_dtype = PyObject_GetAttr(tensor, name_dtype);
        if (its_dtype == NULL) goto fallback;
        if (dtype == NULL) {
            dtype = its_dtype;
        } else {
            int same = its_dtype == dtype;
            Py_DECREF(its_dtype);
            if (!same) goto fallback;
        }
        long long device = call_int(tensor, name_get_device, &ok);
        long long numel = call_int(tensor, name_numel, &ok);
        unsigned long long pointer = (unsigned long long)call_int(tensor, name_data_ptr, &ok);
        PyObject *contiguous = ok ? PyObject_CallMethodNoArgs(tensor, name_is_contiguous) : NULL;
        if (contiguous == NULL) goto fallback;
        int is_contiguous = contiguous == Py_True;
        Py_DECREF(contiguous);
        if (!ok || !is_contiguous || numel <= 0 || pointer % 16) goto fallback;
        if (i == 0) {
            index = device;
        } else if (device != index) {
            goto fallback;
        }
        unsigned long long address = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(entry, 1));
        if (address == (unsigned long long)-1 && PyErr_Occurred()) goto fallback;
        numels[i] = numel;
        slots[SLOTS_PER_TENSOR * i] = pointer;
        slots[SLOTS_PER_TENSOR * i + 1] = (uint64_t)numel;
        slots[SLOTS_PER_TENSOR * i + 3] = address;
    }

    key = Py_BuildValue("(LO)", index, dtype);
    if (key == NULL) goto fallback;
    PyObject *constants = PyDict_GetItemWithError(args[0], key); /* borrowed */
    if (constants == NULL || !PyTuple_Check(constants) || PyTuple_GET_SIZE(constants) != 4) goto fallback;
    unsigned long long function = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(constants, 0));
    long long threads = PyLong_AsLongLong(PyTuple_GET_ITEM(constants, 1));
    long long vec = PyLong_AsLongLong(PyTuple_GET_ITEM(constants, 2));
    long long max_grid = PyLong_AsLongLong(PyTuple_GET_ITEM(constants, 3));
    if (PyErr_Occurred() || threads <= 0 || vec <= 0 || max_grid <= 0) goto fallback;
    if (configured_launch == NULL || configured_current_device == NULL || configured_raw_stream == NULL) goto fallback;

    if (!on_current_device(index)) goto fallback;
    PyObject *stream_object = PyObject_CallOneArg(configured_raw_stream, PyTuple_GET_ITEM(key, 0));
    if (stream_object == NULL) goto fallback;
    unsigned long long stream = PyLong_AsUnsignedLongLong(stream_object);
    Py_DECREF(stream_object);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) goto fallback;

    if (!group_grids(numels, (int)count, vec, threads, max_grid, grids)) goto fallback;
    long long blocks = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        slots[SLOTS_PER_TENSOR * i + 2] = (uint64_t)(uint32_t)grids[i];
        blocks += grids[i];
    }
    void *params[SLOTS];
    for (int s = 0; s < SLOTS; s++) params[s] = &slots[s];
    int code = configured_launch((void *)(uintptr_t)function, (unsigned)blocks, 1, 1, (unsigned)threads, 1, 1, 0,
                      (void *)(uintptr_t)stream, params, NULL);
    result = PyLong_FromLong(code);
    goto done;

fallback:
    result = not_taken();
done:
    Py_XDECREF(key);
    Py_XDECREF(dtype);
    Py_DECREF(items);
    return result;
}

/* ------------------------------------------------------------------------------------------------ any launch
   `launch(function, index, grid, block, shared_mem, stream, args, signature)` is `launch.launch_on` (signature None:
   each argument's own type says its C type) and `launch.launch_signed` (signature: a type per argument, the values
   plain numbers), and `launch.launch_cooperative_on` with `cooperative` true: the parameter block `_ArgBlock`
   packs, then the driver's call.  The types are those `configure` was given, matched exactly (as `_SLOT_FORMAT` is
   looked up by type): a pointer (int, 8 bytes), int64, uint64, int32, uint32, float32, float64; a 4-byte value fills
   the low half of its slot and the high half is zero.  A float32 is the double rounded to float, as `struct` packs
   it.  An argument of another type, an integer out of its type's range, a finite double past float32's range
   (`struct` raises there), more than MAX_ARGS arguments, a device that is not current, or a cooperative launch
   with no cooperative entry point answer -1 and launch nothing: the Python path then makes the launch or raises
   its error. */
#define MAX_ARGS 64

static int kind_of(PyObject *type) {
    for (int k = 0; k < KINDS; k++)
        if (type == kind_types[k]) return k;
    return -1;
}

/* The 8-byte slot of `value` as `kind`; 0 when it does not fit (an exception may be pending: the caller clears). */
static int pack_slot(PyObject *value, int kind, uint64_t *slot) {
    if (kind == KIND_FLOAT32 || kind == KIND_FLOAT64) {
        double x = PyFloat_AsDouble(value);
        if (x == -1.0 && PyErr_Occurred()) return 0;
        if (kind == KIND_FLOAT64) {
            memcpy(slot, &x, 8);
            return 1;
        }
        float y = (float)x;
        if (isinf(y) && !isinf(x)) return 0;
        uint32_t bits;
        memcpy(&bits, &y, 4);
        *slot = bits;
        return 1;
    }
    PyObject *index = PyNumber_Index(value);
    if (index == NULL) return 0;
    int ok = 1;
    if (kind == KIND_POINTER || kind == KIND_UINT64) {
        unsigned long long v = PyLong_AsUnsignedLongLong(index);
        ok = !(v == (unsigned long long)-1 && PyErr_Occurred());
        *slot = v;
    } else {
        long long v = PyLong_AsLongLong(index);
        ok = !(v == -1 && PyErr_Occurred());
        if (kind == KIND_INT64) {
            *slot = (uint64_t)v;
        } else if (kind == KIND_INT32) {
            ok = ok && v >= INT32_MIN && v <= INT32_MAX;
            *slot = (uint64_t)(uint32_t)(int32_t)v;
        } else {
            ok = ok && v >= 0 && v <= UINT32_MAX;
            *slot = (uint64_t)(uint32_t)v;
        }
    }
    Py_DECREF(index);
    return ok;
}

static PyObject *launch_any(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "launch(function, index, grid, block, shared_mem, stream, args, signature, cooperative)");
        return NULL;
    }
    unsigned long long function = PyLong_AsUnsignedLongLong(args[0]);
    long long index = PyLong_AsLongLong(args[1]);
    long long grid = PyLong_AsLongLong(args[2]);
    long long block = PyLong_AsLongLong(args[3]);
    long long shared_mem = PyLong_AsLongLong(args[4]);
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[5]);
    int cooperative = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred() || cooperative < 0) return not_taken();
    if (grid <= 0 || grid > UINT32_MAX || block <= 0 || block > 1024 || shared_mem < 0 || shared_mem > UINT32_MAX)
        return not_taken();
    if (configured_current_device == NULL || (cooperative ? configured_cooperative == NULL : configured_launch == NULL))
        return not_taken();
    PyObject *values = PySequence_Fast(args[6], "launch: args must be a sequence");
    if (values == NULL) return not_taken();
    PyObject *signature = args[7] == Py_None ? NULL : PySequence_Fast(args[7], "launch: signature");
    PyObject *result = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(values);
    if (args[7] != Py_None && (signature == NULL || PySequence_Fast_GET_SIZE(signature) != count)) goto fallback;
    if (count > MAX_ARGS) goto fallback;
    uint64_t slots[MAX_ARGS];
    void *params[MAX_ARGS];
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PySequence_Fast_GET_ITEM(values, i);
        PyObject *type = signature ? PySequence_Fast_GET_ITEM(signature, i) : (PyObject *)Py_TYPE(value);
        int kind = kind_of(type);
        slots[i] = 0;
        if (kind < 0 || !pack_slot(value, kind, &slots[i])) goto fallback;
        params[i] = &slots[i];
    }
    if (!on_current_device(index)) goto fallback;
    int code;
    if (cooperative) {
        code = configured_cooperative((void *)(uintptr_t)function, (unsigned)grid, 1, 1, (unsigned)block, 1, 1,
                                      (unsigned)shared_mem, (void *)(uintptr_t)stream, count ? params : NULL);
    } else {
        code = configured_launch((void *)(uintptr_t)function, (unsigned)grid, 1, 1, (unsigned)block, 1, 1,
                                 (unsigned)shared_mem, (void *)(uintptr_t)stream, count ? params : NULL, NULL);
    }
    result = PyLong_FromLong(code);
    goto done;
fallback:
    result = not_taken();
done:
    Py_XDECREF(signature);
    Py_DECREF(values);
    return result;
}

/* `cupy_stats.group_grids` itself, for the tests that hold the two equal: a tuple of blocks, or None where a
   product would overflow (the launch then takes the Python path). */
static PyObject *grids_of(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *numel_list;
    long long vec, threads, max_grid;
    if (!PyArg_ParseTuple(args, "OLLL", &numel_list, &vec, &threads, &max_grid)) return NULL;
    PyObject *numel_seq = PySequence_Fast(numel_list, "grids_of: numels must be a sequence");
    if (numel_seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(numel_seq);
    if (count < 1 || count > GROUP_MAX || vec <= 0 || threads <= 0 || max_grid <= 0) {
        Py_DECREF(numel_seq);
        PyErr_SetString(PyExc_ValueError, "grids_of: 1 to 3 numels and positive vec, threads and max_grid");
        return NULL;
    }
    long long numels[GROUP_MAX], grids[GROUP_MAX];
    for (Py_ssize_t i = 0; i < count; i++) {
        numels[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(numel_seq, i));
        if (numels[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(numel_seq);
            return NULL;
        }
    }
    Py_DECREF(numel_seq);
    if (!group_grids(numels, (int)count, vec, threads, max_grid, grids)) Py_RETURN_NONE;
    PyObject *out = PyTuple_New(count);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) PyTuple_SET_ITEM(out, i, PyLong_FromLongLong(grids[i]));
    return out;
}

static PyMethodDef methods[] = {
    {"stats_group_scratch", (PyCFunction)(void (*)(void))stats_group_scratch, METH_FASTCALL,
     "Launch ted_stats_group_scratch for 2-3 (tensor, scratch address) pairs; 0 when launched (see the source)."},
    {"configure", configure, METH_VARARGS,
     "configure(launch_address, cooperative_address, current_device, raw_stream, types)."},
    {"launch", (PyCFunction)(void (*)(void))launch_any, METH_FASTCALL,
     "launch(function, index, grid, block, shared_mem, stream, args, signature, cooperative); 0 when launched."},
    {"grids_of", grids_of, METH_VARARGS, "cupy_stats.group_grids in C: (numels, vec, threads, max_grid)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tedebug_host_launch",
    .m_doc = "The statistics group launch of tedebug in compiled code (kernels/host_launch.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_tedebug_host_launch(void) {
    name_dtype = PyUnicode_InternFromString("dtype");
    name_get_device = PyUnicode_InternFromString("get_device");
    name_numel = PyUnicode_InternFromString("numel");
    name_data_ptr = PyUnicode_InternFromString("data_ptr");
    name_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    if (!name_dtype || !name_get_device || !name_numel || !name_data_ptr || !name_is_contiguous) return NULL;
    return PyModule_Create(&module);
}
