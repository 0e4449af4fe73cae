/* The inspect-only GEMM call's linear in compiled code: a CPython extension module against torch's C++ API,
   ``tedebug_inspected_linear`` (built by `tedebug.nn.compiled_linear`).

   What `linear(x, weight, bias, backward, context)` does.  It is `tedebug.nn.base._python_linear` (the part of
   `_inspected_linear` before the forward inspection) for its usual call:
     x2 = x as [rows, K] (x itself when it has two dimensions, else x.reshape(-1, K));
     y2 = at::linear(x2, weight, bias)            the op F.linear calls, on the same operands: the same bits;
     a post hook on y2's node (AddmmBackward0 with a bias, MmBackward0 without) when `backward` is not None;
     y  = y2 reshaped to x's leading dimensions and N (y2 itself when x has two dimensions);
   and answers the tuple (x2, y2, y): the caller inspects x2, W and y2 (the tensors the Python path inspects) and
   returns y.  The hook calls ``backward(context, dy, dx, dWt)`` with the node's gradient output and its two
   gradient inputs for x and for Wᵀ (None where torch computed none), after the node ran and only when one of
   the two was computed: the call the Python path's hook makes (`_node_hook`, which calls `_inspect_backward`).

   Why.  On a step bound by the host, the Python path pays for its two reshapes, F.linear's argument parsing and,
   above all, the node hook's Python (torch makes a `RemovableHandle` and a dict per registration).  On the CPU VM
   these cost a GEMM call's forward 14-16 µs where F.linear alone costs 7-8; here they cost what F.linear costs
   (docs/performance.md, section 29).  The hook itself is called with the three tensors it reads, not with the
   node's tuples.

   Exactness.  The tensors are the Python path's: the same ops with the same arguments through the same
   dispatcher (autocast, the device's GEMM library), and the same views (reshape of a contiguous tensor is a view;
   its node is ViewBackward0 as in Python).  The GIL is released around the linear, as torch's own bindings
   release it.  The hook returns the node's gradients unchanged.

   Contract with the caller.  None means nothing was run, or what was run is discarded, and the caller takes the
   Python path, which handles every case: an operand that is not exactly a torch.Tensor or nn.Parameter (a
   subclass may define __torch_function__, which only the Python call honours), a torch function mode on, a
   non-contiguous x2 or W (torch's backward computes their gradients as other GEMMs), or a node that is neither of
   the two above (the Python path then stops taking this route on that device).  An error raised by torch (a shape
   mismatch) is raised as F.linear raises it; a Python exception raised by `backward` propagates through autograd
   as a Python hook's does.

   Compiled autograd (torch._dynamo.compiled_autograd) does not call a C++ hook: it asks the hook for a Python
   callable to call in its place (`compiled_args`, which torch's own Python hooks answer and others refuse with an
   error that ends the backward).  This hook answers ``traced_hook(backward, context, dx, dwt)``: the Python path's
   own hook bound to these four (`tedebug.nn.compiled_linear.traced_hook`, given once by `set_traced_hook` when the
   module is loaded), so such a backward inspects what the Python path inspects.
*/
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/python_headers.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>

#include <memory>
#include <string>
#include <utility>

namespace {

using torch::autograd::variable_list;

/* traced_hook(backward, context, dx, dwt) answers what compiled autograd calls in a hook's place
   (`set_traced_hook`; a strong reference, kept for the process). */
PyObject* traced_hook = nullptr;

/* The node a 2-D linear records, and where its gradient inputs for x and for Wᵀ are (the Python path's
   `_LINEAR_NODES`): addmm(bias, x, Wᵀ) and mm(x, Wᵀ). */
bool gradient_positions(const torch::autograd::Node& node, size_t* dx, size_t* dwt) {
  const std::string name = node.name();
  if (name == "AddmmBackward0") {
    *dx = 1;
    *dwt = 2;
    return true;
  }
  if (name == "MmBackward0") {
    *dx = 0;
    *dwt = 1;
    return true;
  }
  return false;
}

/* Calls backward(context, dy, dx, dWt) after the node ran; holds its two Python objects. */
struct InspectBackwardHook : torch::autograd::FunctionPostHook {
  InspectBackwardHook(PyObject* backward, PyObject* context, size_t dx, size_t dwt)
      : backward_(backward), context_(context), dx_(dx), dwt_(dwt) {
    Py_INCREF(backward_);
    Py_INCREF(context_);
  }

  ~InspectBackwardHook() override {
    // the node may be freed by a thread without the GIL, or after the interpreter finished
    if (Py_IsInitialized()) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(backward_);
      Py_DECREF(context_);
      PyGILState_Release(state);
    }
  }

  variable_list operator()(const variable_list& grad_inputs, const variable_list& grad_outputs) override {
    if (grad_inputs.size() <= dwt_ || grad_outputs.empty()) {
      return grad_inputs;
    }
    const at::Tensor& dx = grad_inputs[dx_];
    const at::Tensor& dwt = grad_inputs[dwt_];
    if (!dx.defined() && !dwt.defined()) {
      return grad_inputs;  // neither x nor W takes a gradient: nothing to inspect (as the Python path)
    }
    PyGILState_STATE state = PyGILState_Ensure();
    PyObject* args[4] = {context_, THPVariable_Wrap(grad_outputs[0]), THPVariable_Wrap(dx), THPVariable_Wrap(dwt)};
    PyObject* result = nullptr;
    if (args[1] != nullptr && args[2] != nullptr && args[3] != nullptr) {
      result = PyObject_Vectorcall(backward_, args, 4, nullptr);
    }
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    Py_XDECREF(args[3]);
    if (result == nullptr) {
      python_error error;  // takes the Python exception along, as torch's own Python hooks do
      error.persist();
      PyGILState_Release(state);
      throw error;
    }
    Py_DECREF(result);
    PyGILState_Release(state);
    return grad_inputs;
  }

  /* Compiled autograd's question (the header says why).  torch declared it without const before it declared it
     const: whichever the installed torch declares, one of these two overrides it. */
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const {
    lift(args);
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) {
    lift(args);
  }

 private:
  void lift(torch::dynamo::autograd::CompiledNodeArgs& args) const {
    PyGILState_STATE state = PyGILState_Ensure();
    PyObject* hook = nullptr;
    if (traced_hook == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "tedebug_inspected_linear: set_traced_hook was not called");
    } else {
      hook = PyObject_CallFunction(traced_hook, "OOnn", backward_, context_, static_cast<Py_ssize_t>(dx_),
                                   static_cast<Py_ssize_t>(dwt_));
    }
    if (hook == nullptr) {
      python_error error;
      error.persist();
      PyGILState_Release(state);
      throw error;
    }
    PyGILState_Release(state);
    args.add_post_hook(c10::SafePyObject(hook, getPyInterpreter()));  // (takes the reference)
  }

  PyObject* backward_;
  PyObject* context_;
  size_t dx_;
  size_t dwt_;
};

/* Exactly a torch.Tensor or an nn.Parameter (neither defines its own __torch_function__). */
bool plain_tensor(PyObject* object) {
  return THPVariable_CheckExact(object);
}

PyObject* linear(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "linear(x, weight, bias, backward, context) takes 5 arguments");
    return nullptr;
  }
  PyObject* x_object = args[0];
  PyObject* weight_object = args[1];
  PyObject* bias_object = args[2];
  PyObject* backward = args[3];
  PyObject* context = args[4];
  const bool has_bias = bias_object != Py_None;
  if (!plain_tensor(x_object) || !plain_tensor(weight_object) || (has_bias && !plain_tensor(bias_object)) ||
      at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NONE;
  }
  const at::Tensor& x = THPVariable_Unpack(x_object);
  const at::Tensor& weight = THPVariable_Unpack(weight_object);
  if (x.dim() == 0 || !weight.is_contiguous()) {
    Py_RETURN_NONE;
  }
  at::Tensor x2;
  at::Tensor y2;
  at::Tensor y;
  bool taken = true;
  size_t dx_position = 0;
  size_t dwt_position = 0;
  {
    pybind11::gil_scoped_release no_gil;
    x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    if (!x2.is_contiguous()) {
      taken = false;
    } else {
      y2 = has_bias ? at::linear(x2, weight, THPVariable_Unpack(bias_object)) : at::linear(x2, weight);
      const auto& node = y2.grad_fn();  // (a shared_ptr or an intrusive_ptr, by torch version)
      if (node) {
        if (!gradient_positions(*node, &dx_position, &dwt_position)) {
          taken = false;
        } else if (backward != Py_None) {
          node->add_post_hook(std::make_unique<InspectBackwardHook>(backward, context, dx_position, dwt_position));
        }
      }
      if (taken) {
        if (x.dim() == 2) {
          y = y2;
        } else {
          std::vector<int64_t> sizes = x.sizes().vec();
          sizes.back() = y2.size(-1);
          y = y2.reshape(sizes);
        }
      }
    }
  }
  if (!taken) {
    Py_RETURN_NONE;
  }
  PyObject* answer = PyTuple_New(3);
  if (answer == nullptr) {
    return nullptr;
  }
  PyObject* x2_object = x.dim() == 2 ? (Py_INCREF(x_object), x_object) : THPVariable_Wrap(std::move(x2));
  PyObject* y2_object = THPVariable_Wrap(y2);
  PyObject* y_object = x.dim() == 2 ? (Py_XINCREF(y2_object), y2_object) : THPVariable_Wrap(std::move(y));
  if (x2_object == nullptr || y2_object == nullptr || y_object == nullptr) {
    Py_XDECREF(x2_object);
    Py_XDECREF(y2_object);
    Py_XDECREF(y_object);
    Py_DECREF(answer);
    return nullptr;
  }
  PyTuple_SET_ITEM(answer, 0, x2_object);
  PyTuple_SET_ITEM(answer, 1, y2_object);
  PyTuple_SET_ITEM(answer, 2, y_object);
  return answer;
  END_HANDLE_TH_ERRORS
}

PyObject* set_traced_hook(PyObject* /*module*/, PyObject* hook) {
  if (!PyCallable_Check(hook)) {
    PyErr_SetString(PyExc_TypeError, "set_traced_hook(hook): hook must be callable");
    return nullptr;
  }
  Py_INCREF(hook);
  Py_XSETREF(traced_hook, hook);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(linear)), METH_FASTCALL,
     "linear(x, weight, bias, backward, context) -> (x2, y2, y) or None: see the source's header"},
    {"set_traced_hook", set_traced_hook, METH_O,
     "set_traced_hook(hook): hook(backward, context, dx, dwt) answers what compiled autograd calls in a hook's place"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "tedebug_inspected_linear", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_tedebug_inspected_linear(void) {
  return PyModule_Create(&module_definition);
}
