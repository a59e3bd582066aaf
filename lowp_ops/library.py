"""THE place where the ``lowp::`` ops are defined and registered.

Pattern (docs/registration.md): the default implementation is the pure-PyTorch reference, so
every device works and CPU CI can trace, compile and ``opcheck``; a CUDA kernel registered on the
dispatcher calls the Triton launcher; ``register_fake`` allocates through ``meta/``; backward formulas
call backward ops.
Under ``TRITON_INTERPRET=1`` with ``LOWP_OPS_CPU_KERNELS=triton`` the CPU path runs the Triton kernels
in the interpreter instead, so the same op-level tests exercise them without a GPU.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from .composite import grouped_linear as grouped_linear_impl
from .meta import cross_entropy as ce_meta
from .meta import grouped_mm as grouped_mm_meta
from .meta import linear_cross_entropy as linear_ce_meta
from .meta import mxfp8 as mxfp8_meta
from .meta import mxfp8_gemm as mxfp8_gemm_meta
from .meta import nvfp4 as nvfp4_meta
from .meta import rms_norm as rms_norm_meta
from .meta import softmax as softmax_meta
from .meta import split_sizes as split_sizes_meta
from .meta import swiglu as swiglu_meta
from .meta import vocab_parallel as vocab_parallel_meta
from .reference import cross_entropy as ce_ref
from .reference import grouped_mm as grouped_mm_ref
from .reference import linear_cross_entropy as linear_ce_ref
from .reference import mxfp8 as mxfp8_ref
from .reference import mxfp8_gemm as mxfp8_gemm_ref
from .reference import nvfp4 as nvfp4_ref
from .reference import rms_norm as rms_norm_ref
from .reference import softmax as softmax_ref
from .reference import swiglu as swiglu_ref
from .reference import vocab_parallel as vocab_parallel_ref

# Read once: the interpreter suite sets both variables before Python starts (a per-call os.environ
# lookup costs more than a kernel launch).
_CPU_RUNS_TRITON = (
    os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("LOWP_OPS_CPU_KERNELS") == "triton"
)


def cpu_runs_triton() -> bool:
    """True when CPU calls go to the Triton kernels through the interpreter (the ``interp`` test suite)."""
    return _CPU_RUNS_TRITON


_PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
# The types of an op's other arguments: no tensor subclass among them. Testing these first spares
# isinstance(arg, torch.Tensor), which costs ~150 ns for every argument that is not a tensor (it goes
# through the tensor metaclass), a third of a small op's direct call.
_PLAIN_ARGUMENT_TYPES = _PLAIN_TENSOR_TYPES | {bool, int, float, str, type(None), torch.dtype}


def tracing() -> bool:
    """True while Dynamo, AOTAutograd or another dispatch mode (proxy, fake, functional) sees the calls."""
    return torch.compiler.is_compiling() or bool(torch._C._len_torch_dispatch_stack())


def eager_call_allowed(args: tuple) -> bool:
    """True when an op call may run its implementation directly instead of through the dispatcher:
    nothing traces it (Dynamo, AOTAutograd's fake and functional tensors, proxy or other dispatch modes,
    functorch transforms), autocast is off (the dispatcher then turns it off inside the op:
    :func:`_without_autocast`) and every tensor argument is a plain tensor (no subclass such as DTensor)."""
    if tracing() or torch._C._are_functorch_transforms_active() or torch._C._is_any_autocast_enabled():
        return False
    for arg in args:  # noqa: SIM110  (a loop: no generator object on this hot path)
        if type(arg) not in _PLAIN_ARGUMENT_TYPES and isinstance(arg, torch.Tensor):
            return False
    return True


class LowpOp:
    """One ``lowp::`` op: the registered custom op, plus a direct call of the same implementation.

    Calling it runs the op. Eagerly, on plain tensors (:func:`eager_call_allowed`), the call skips the
    dispatcher and the custom op's Python autograd wrapper, which cost more host time than a small
    kernel's launch: it calls the Triton launcher (CUDA), the reference (CPU; the launcher under the
    interpreter suite) or the fake (meta tensors) directly, through a ``torch.autograd.Function`` built
    from the op's own ``setup_context`` / ``backward`` when a gradient is needed. Traced calls (Dynamo,
    AOTAutograd, ``make_fx``) and tensor subclasses go through ``torch.ops.lowp.<name>``. Both paths run
    the same functions, so their outputs are the same bytes.
    """

    def __init__(
        self,
        name: str,
        custom_op,
        reference: Callable,
        launcher: str | None,
        fake: Callable,
        mutates_args: tuple[str, ...],
    ) -> None:
        self.name = name
        self.custom_op = custom_op
        self.overload = getattr(torch.ops.lowp, name).default
        self.reference = reference
        self.fake = fake
        self._launcher_name = launcher
        self._module_name, _, self._function_name = (launcher or "").rpartition(".")
        self._launcher_module = None
        arguments = self.overload._schema.arguments
        self._arg_names = [a.name for a in arguments]
        self._defaults = [a.default_value if a.has_default_value() else None for a in arguments]
        self._mutated = [i for i, a in enumerate(arguments) if a.name in mutates_args]
        self.function: type[torch.autograd.Function] | None = None

    def launcher(self) -> Callable:
        """The CUDA implementation: ``kernels.<module>.<function>``, imported on first use (importing
        triton only when a kernel runs keeps CPU-only use light); the reference where there is none."""
        if self._launcher_name is None:
            return self.reference
        if self._launcher_module is None:
            self._launcher_module = importlib.import_module(f"{__package__}.kernels.{self._module_name}")
        return getattr(self._launcher_module, self._function_name)  # looked up per call: tests spy on it

    def implementation(self, first: torch.Tensor) -> Callable:
        """What runs for inputs on ``first``'s device."""
        # Tensor.is_cuda / is_cpu cost a seventh of Tensor.device.type (no device object made).
        if first.is_cuda or (first.is_cpu and cpu_runs_triton()):
            return self.launcher()
        return self.fake if first.is_meta else self.reference

    def _complete(self, args: tuple) -> tuple:
        """``args`` with the schema's defaults for the arguments left out."""
        if len(args) == len(self._arg_names):
            return args
        return (*args, *self._defaults[len(args) :])

    def __call__(self, *args):
        if not eager_call_allowed(args):
            return self.overload(*args)
        args = self._complete(args)
        if self.function is not None and torch.is_grad_enabled():
            for arg in args:  # every tensor here is a plain one (eager_call_allowed)
                if type(arg) in _PLAIN_TENSOR_TYPES and arg.requires_grad:
                    return self.function.apply(*args)
        result = self.implementation(args[0])(*args)
        for index in self._mutated:
            torch.autograd.graph.increment_version(args[index])
        return result

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """The op's autograd formula, for the custom op and for the direct eager call. Backward formulas
        run once: differentiating them again (``create_graph=True``) raises a clear error."""
        checked = _once_differentiable(backward, self.name)
        self.custom_op.register_autograd(checked, setup_context=setup_context)
        op = self

        # forward(ctx, ...) rather than a setup_context method: with one, Function.apply binds the
        # arguments through inspect.signature on every call.
        def forward(ctx, *args):
            output = op.implementation(args[0])(*args)
            setup_context(ctx, args, output)
            return output

        # A class of the op's name, so autograd graphs and profiles show ``lowp_<name>Backward``.
        namespace = {"forward": staticmethod(forward), "backward": staticmethod(checked)}
        self.function = type(f"lowp_{self.name}", (torch.autograd.Function,), namespace)


def refuse_double_backward(name: str) -> None:
    """Raise when a backward runs under ``create_graph=True``: the formulas are not differentiable, and
    without this check the second-order terms would silently be missing. Grad mode is on in a backward
    only then (tracers run with dispatch modes pushed, and are let through)."""
    if torch.is_grad_enabled() and not tracing():
        raise RuntimeError(
            f"lowp::{name} does not support double backward: its gradient cannot be differentiated "
            "(create_graph=True through it)"
        )


def _once_differentiable(backward: Callable, name: str) -> Callable:
    """``backward`` that refuses to run under ``create_graph=True`` (:func:`refuse_double_backward`)."""

    def checked(ctx, *grads):
        refuse_double_backward(name)
        return backward(ctx, *grads)

    return checked


# Devices whose compiled graphs launch an ``inline_kernels`` op's Triton kernels themselves (the CPU
# tracing tests add "cpu" to see the traced graph without a GPU).
INLINE_DEVICE_TYPES = {"cuda"}


def _has_symbols(args: tuple) -> bool:
    """True when an argument or a tensor's shape or strides are symbolic (dynamic shapes)."""
    for arg in args:
        if isinstance(arg, (torch.SymInt, torch.SymFloat)):
            return True
        if isinstance(arg, torch.Tensor) and any(
            isinstance(size, torch.SymInt) for size in (*arg.shape, *arg.stride())
        ):
            return True
    return False


def _inline_kernels_rule(lowp_op: LowpOp) -> Callable:
    """The rule under AOTAutograd's functionalization (``FunctionalTensorMode``) for an op whose CUDA
    launcher is traceable: trace the launcher, so the graph holds its Triton kernels (recorded through
    ``torch.library.wrap_triton``, ``kernels/launch.py``) and Inductor launches them as its own, with no
    dispatcher or Python kernel per call. Other devices, dynamic shapes and ``torch.export`` (whose
    programs keep the op) leave the op as one opaque node."""

    def rule(mode, func, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if (
            custom_triton_ops_decomposition_disabled()
            or first is None
            or first.device.type not in INLINE_DEVICE_TYPES
            or _has_symbols(args)
        ):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return lowp_op.launcher()(*args, **kwargs)

    return rule


_KERNELS = torch.library.Library("lowp", "IMPL")
_AUTOCAST_KEYS = ("AutocastCPU", "AutocastCUDA")
_AUTOCAST_KEY_SET = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA
)


def _without_autocast(overload) -> Callable:
    """The op's autocast kernel: the call with autocast turned off inside it and its inputs as they are.
    The ops compute in their inputs' dtypes with fp32 math (their numerical contract), so a matmul in an
    implementation (the LM head's logits, a grouped GEMM) must not be autocast to bf16 / fp16: under
    ``torch.autocast`` the bytes stay those without it, as in compiled graphs."""

    def kernel(*args):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY_SET):
            return overload(*args)

    return kernel


def _define(
    name: str,
    schema: str,
    reference: Callable,
    launcher: str | None,
    fake: Callable,
    mutates_args: tuple[str, ...] = (),
    inline_kernels: bool = False,
) -> LowpOp:
    """Define ``lowp::<name>``: reference by default, ``kernels.<launcher>`` on CUDA, ``fake`` for tracing.
    Without a launcher the reference (graph-safe, no host sync) also serves CUDA. ``inline_kernels``:
    the launcher is traceable (allocations, aten ops and cached Triton launches only; no host reads of
    tensor data or addresses), and compiled graphs launch its kernels themselves
    (:func:`_inline_kernels_rule`)."""

    def default(*args):
        return lowp_op.launcher()(*args) if cpu_runs_triton() else reference(*args)

    custom = torch.library.custom_op(f"lowp::{name}", default, mutates_args=mutates_args, schema=schema)
    if launcher is not None:
        # Registered on the dispatcher directly rather than through custom_op's register_kernel, whose
        # per-call wrapper adds an output-aliasing check and a Dynamo-disabled call to every dispatched
        # call (docs/registration.md); opcheck checks the aliasing.
        _KERNELS.impl(name, lambda *args: lowp_op.launcher()(*args), "CUDA")
    custom.register_fake(fake)
    lowp_op = LowpOp(name, custom, reference, launcher, fake, mutates_args)
    for key in _AUTOCAST_KEYS:
        _KERNELS.impl(name, _without_autocast(lowp_op.overload), key)
    if inline_kernels:
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        custom.register_torch_dispatch(FunctionalTensorMode, _inline_kernels_rule(lowp_op))
    return lowp_op


# ----------------------------------------------------------------------------------------------- MXFP8
# Data travel as uint8 FP8 bit patterns (opcheck cannot compare float8 tensors); scales as E8M0 codes.

mxfp8_quantize = _define(
    "mxfp8_quantize",
    "(Tensor x, str fp8_dtype, bool rowwise, bool columnwise, str scale_layout)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    mxfp8_ref.mxfp8_quantize,
    "mxfp8.launch_mxfp8_quantize",
    mxfp8_meta.mxfp8_quantize_outputs,
)

mxfp8_dequantize = _define(
    "mxfp8_dequantize",
    "(Tensor data, Tensor scale, str fp8_dtype, str use, str scale_layout, ScalarType dtype) -> Tensor",
    mxfp8_ref.mxfp8_dequantize,
    "mxfp8.launch_mxfp8_dequantize",
    mxfp8_meta.mxfp8_dequantize_output,
)

# The MXFP8 recipe's GEMM operands on GPUs without MXFP8 GEMMs: quantize and dequantize in one pass;
# group_ends: column-wise blocks within each expert's rows.
mxfp8_round_trip = _define(
    "mxfp8_round_trip",
    "(Tensor x, str fp8_dtype, bool rowwise, bool columnwise, Tensor? group_ends=None) -> (Tensor, Tensor)",
    mxfp8_ref.mxfp8_round_trip,
    "mxfp8.launch_mxfp8_round_trip",
    mxfp8_meta.mxfp8_round_trip_outputs,
)

# ----------------------------------------------------------------------------------------------- NVFP4
# sr_seed: int64 [seed, offset] on the device (stochastic rounding, graph-safe), None for round-to-nearest.

nvfp4_quantize = _define(
    "nvfp4_quantize",
    "(Tensor x, bool rowwise, bool columnwise, bool rht, Tensor? amax_rowwise, Tensor? amax_columnwise,"
    " bool block_2d, Tensor? sr_seed=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    nvfp4_ref.nvfp4_quantize,
    "nvfp4.launch_nvfp4_quantize",
    nvfp4_meta.nvfp4_quantize_outputs,
)

nvfp4_group_quantize = _define(
    "nvfp4_group_quantize",
    "(Tensor x, Tensor split_sizes, bool rowwise, bool columnwise, bool rht, Tensor? amax_rowwise,"
    " Tensor? amax_columnwise, Tensor? sr_seed=None, bool block_2d=False)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    nvfp4_ref.nvfp4_group_quantize,
    "nvfp4.launch_nvfp4_group_quantize",
    nvfp4_meta.nvfp4_group_quantize_outputs,
)

nvfp4_dequantize = _define(
    "nvfp4_dequantize",
    "(Tensor data, Tensor scale, Tensor amax, ScalarType dtype) -> Tensor",
    nvfp4_ref.nvfp4_dequantize,
    "nvfp4_decode.launch_nvfp4_dequantize",
    nvfp4_meta.nvfp4_dequantize_output,
)

# The grouped copies' dequantization for inspection and tests: element-wise PyTorch (no host sync), also
# on CUDA (no kernel).
nvfp4_group_dequantize = _define(
    "nvfp4_group_dequantize",
    "(Tensor data, Tensor scale, Tensor amax, Tensor split_sizes, ScalarType dtype, str use, SymInt tokens,"
    " SymInt hidden, int multiple) -> Tensor",
    nvfp4_ref.nvfp4_group_dequantize,
    None,
    nvfp4_meta.nvfp4_group_dequantize_output,
)

# ---------------------------------------------------------------------------------------- MoE SwiGLU
# Split sizes never leave the device.

swiglu_fwd = _define(
    "swiglu_fwd",
    "(Tensor c, Tensor probs, int interleave, Tensor? ends=None) -> Tensor",
    swiglu_ref.swiglu_fwd,
    "swiglu.launch_swiglu_fwd",
    swiglu_meta.swiglu_fwd_output,
)

dglu = _define(
    "dglu",
    "(Tensor grad, Tensor c, Tensor probs, Tensor split_sizes, int interleave) -> (Tensor, Tensor, Tensor)",
    swiglu_ref.dglu,
    "swiglu.launch_dglu",
    swiglu_meta.dglu_outputs,
)


def _swiglu_setup(ctx, inputs, output):
    c, probs, interleave, ends = inputs
    ctx.interleave = interleave
    ctx.save_for_backward(c, probs, ends)


def _swiglu_backward(ctx, grad):
    c, probs, ends = ctx.saved_tensors
    if ends is None:
        split_sizes = c.new_full((1,), c.shape[0], dtype=torch.int64)
    else:  # the rows past the last end got +0: no gradient (dGLU's rows of no expert)
        split_sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    dc, dprobs, _ = dglu(grad, c, probs, split_sizes, ctx.interleave)
    # dprobs stays fp32; autograd casts it once for bf16 probs (never bf16 before that).
    return dc, dprobs, None, None


swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)

# -------------------------------------------------------------------------------------------- RMSNorm

rms_norm_fwd = _define(
    "rms_norm_fwd",
    "(Tensor x, Tensor weight, float eps, bool round_normalized) -> (Tensor, Tensor)",
    rms_norm_ref.rms_norm_fwd,
    "rms_norm.launch_rms_norm_fwd",
    rms_norm_meta.rms_norm_fwd_outputs,
)

rms_norm_bwd = _define(
    "rms_norm_bwd",
    "(Tensor grad, Tensor x, Tensor weight, Tensor rstd, bool round_normalized) -> (Tensor, Tensor)",
    rms_norm_ref.rms_norm_bwd,
    "rms_norm.launch_rms_norm_bwd",
    rms_norm_meta.rms_norm_bwd_outputs,
)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, round_normalized = inputs
    ctx.round_normalized = round_normalized
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    # x, not y: the input is the residual stream's tensor; y is usually saved by the next GEMM anyway.
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(ctx, grad, _grad_rstd):
    if grad is None:
        return None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_bwd(grad, x, weight, rstd, ctx.round_normalized)
    return dx, dweight, None, None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)

# --------------------------------------------------------------------------------------------- softmax

logsumexp = _define(
    "logsumexp",
    "(Tensor x) -> Tensor",
    softmax_ref.logsumexp,
    "softmax.launch_logsumexp",
    softmax_meta.logsumexp_output,
)

softmax_fwd = _define(
    "softmax_fwd",
    "(Tensor x, bool log, str masked_rows) -> Tensor",
    softmax_ref.softmax_fwd,
    "softmax.launch_softmax_fwd",
    softmax_meta.softmax_fwd_output,
    inline_kernels=True,
)

softmax_bwd = _define(
    "softmax_bwd",
    "(Tensor out, Tensor grad, bool log) -> Tensor",
    softmax_ref.softmax_bwd,
    "softmax.launch_softmax_bwd",
    softmax_meta.softmax_bwd_output,
    inline_kernels=True,
)


def _logsumexp_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _logsumexp_backward(ctx, grad):
    x, _ = ctx.saved_tensors
    # softmax(x) from x itself: exp(x - lse) with the rounded lse loses digits at large magnitudes.
    return (torch.softmax(x.float(), dim=1) * grad.unsqueeze(1)).to(x.dtype)


def _softmax_setup(ctx, inputs, output):
    ctx.log = inputs[1]
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return softmax_bwd(out, grad, ctx.log), None, None


logsumexp.register_autograd(_logsumexp_backward, setup_context=_logsumexp_setup)
softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)

# ------------------------------------------------------------------------------------- cross entropy

cross_entropy_fwd = _define(
    "cross_entropy_fwd",
    "(Tensor logits, Tensor target, float label_smoothing, SymInt ignore_index, Tensor? weight=None,"
    " float z_loss=0.0, float softcap=0.0) -> (Tensor, Tensor)",
    ce_ref.cross_entropy_fwd,
    "cross_entropy.launch_cross_entropy_fwd",
    ce_meta.cross_entropy_fwd_outputs,
)

cross_entropy_bwd = _define(
    "cross_entropy_bwd",
    "(Tensor logits, Tensor target, Tensor row_stats, Tensor grad_rows, float label_smoothing,"
    " SymInt ignore_index, SymInt vocab_start=0, SymInt vocab_total=0, Tensor? weight=None,"
    " float z_loss=0.0, float softcap=0.0) -> Tensor",
    ce_ref.cross_entropy_bwd,
    "cross_entropy.launch_cross_entropy_bwd",
    ce_meta.cross_entropy_bwd_output,
)

cross_entropy_bwd_mxfp8 = _define(
    "cross_entropy_bwd_mxfp8",
    "(Tensor logits, Tensor target, Tensor row_stats, Tensor grad_rows, float label_smoothing,"
    " SymInt ignore_index, str fp8_dtype, bool rowwise, bool columnwise, str scale_layout,"
    " SymInt vocab_start=0, SymInt vocab_total=0, Tensor? weight=None, float z_loss=0.0, float softcap=0.0)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    ce_ref.cross_entropy_bwd_mxfp8,
    "cross_entropy.launch_cross_entropy_bwd_mxfp8",
    ce_meta.cross_entropy_bwd_mxfp8_outputs,
)

# cross_entropy_with_mxfp8_grad as one op: forward, reduction and MXFP8 backward (not differentiable).
cross_entropy_mxfp8_grad = _define(
    "cross_entropy_mxfp8_grad",
    "(Tensor logits, Tensor target, Tensor? grad_loss, float label_smoothing, SymInt ignore_index,"
    " str reduction, str fp8_dtype, bool rowwise, bool columnwise, str scale_layout, Tensor? weight=None,"
    " float z_loss=0.0, float softcap=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    ce_ref.cross_entropy_mxfp8_grad,
    "cross_entropy.launch_cross_entropy_mxfp8_grad",
    ce_meta.cross_entropy_mxfp8_grad_outputs,
)


def refuse_weight_grad(weight: torch.Tensor | None) -> None:
    """Class weights get no gradient: one that requires it raises."""
    if weight is not None and weight.requires_grad:
        raise ValueError("weight (class weights) must not require grad: lowp_ops gives it no gradient")


def _cross_entropy_setup(ctx, inputs, output):
    # inputs: (logits, target, label_smoothing, ignore_index[, weight[, z_loss[, softcap]]]); class weights
    # get no gradient.
    logits, target, label_smoothing, ignore_index, *rest = inputs
    weight, z_loss, softcap = (*rest, *(None, 0.0, 0.0)[len(rest) :])
    _keep_loss_options(ctx, label_smoothing, ignore_index, weight, z_loss, softcap)
    ctx.save_for_backward(logits, target, output[1], weight)
    ctx.mark_non_differentiable(output[1])


def _keep_loss_options(ctx, label_smoothing, ignore_index, weight, z_loss, softcap) -> None:
    refuse_weight_grad(weight)
    ctx.label_smoothing = label_smoothing
    ctx.ignore_index = ignore_index
    ctx.features = (z_loss, softcap)


def _rows_grad(ctx, logits, target, row_stats, weight, grad_rows) -> torch.Tensor:
    """dlogits of per-row losses whose upstream gradient is ``grad_rows`` (N,), with the options that
    :func:`_keep_loss_options` kept on ``ctx``."""
    # grad_rows may be an expanded (stride-0) view: the kernel reads it through its stride.
    return cross_entropy_bwd(
        logits, target, row_stats, grad_rows.float(), ctx.label_smoothing, ctx.ignore_index, 0, 0, weight,
        *ctx.features,
    )  # fmt: skip


def _cross_entropy_backward(ctx, grad_loss, _grad_row_stats):
    return _rows_grad(ctx, *ctx.saved_tensors, grad_loss), None, None, None, None, None, None


cross_entropy_fwd.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)

cross_entropy_reduce = _define(
    "cross_entropy_reduce",
    "(Tensor loss_rows, Tensor target, SymInt ignore_index, bool mean, Tensor? weight=None)"
    " -> (Tensor, Tensor)",
    ce_ref.cross_entropy_reduce,
    "cross_entropy.launch_cross_entropy_reduce",
    ce_meta.cross_entropy_reduce_outputs,
)


def _cross_entropy_reduce_setup(ctx, inputs, output):
    ctx.rows = inputs[0].shape[0]
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _reduced_grad_rows(grad_loss: torch.Tensor, grad_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """The reduction's chain rule: each row's upstream gradient ``grad_loss * dloss / dloss_row``."""
    return ce_ref.loss_grad_rows(grad_loss, grad_scale, rows, grad_scale)


def _cross_entropy_reduce_backward(ctx, grad_loss, _grad_scale):
    (grad_scale,) = ctx.saved_tensors
    return _reduced_grad_rows(grad_loss, grad_scale, ctx.rows), None, None, None, None


cross_entropy_reduce.register_autograd(
    _cross_entropy_reduce_backward, setup_context=_cross_entropy_reduce_setup
)

# The mean or sum as one op (cross_entropy_fwd, then cross_entropy_reduce): one node eagerly, one opaque
# call in a compiled forward.
cross_entropy_reduced = _define(
    "cross_entropy_reduced",
    "(Tensor logits, Tensor target, float label_smoothing, SymInt ignore_index, bool mean,"
    " Tensor? weight=None, float z_loss=0.0, float softcap=0.0) -> (Tensor, Tensor, Tensor)",
    ce_ref.cross_entropy_reduced,
    "cross_entropy.launch_cross_entropy_reduced",
    ce_meta.cross_entropy_reduced_outputs,
)


def _cross_entropy_reduced_setup(ctx, inputs, output):
    logits, target, label_smoothing, ignore_index, _mean, weight, z_loss, softcap = inputs
    _, grad_scale, stats = output
    _keep_loss_options(ctx, label_smoothing, ignore_index, weight, z_loss, softcap)
    ctx.save_for_backward(logits, target, stats, weight, grad_scale)
    ctx.mark_non_differentiable(grad_scale, stats)
    ctx.set_materialize_grads(False)  # no zero-filled gradients of grad_scale and stats


def _cross_entropy_reduced_backward(ctx, grad_loss, _grad_scale, _grad_stats):
    """cross_entropy_reduce's chain rule, then cross_entropy_fwd's backward (the two ops' formulas)."""
    if grad_loss is None:
        return (None,) * 8
    logits, target, stats, weight, grad_scale = ctx.saved_tensors
    grad_rows = _reduced_grad_rows(grad_loss, grad_scale, logits.shape[0])
    return _rows_grad(ctx, logits, target, stats, weight, grad_rows), *(None,) * 7


cross_entropy_reduced.register_autograd(
    _cross_entropy_reduced_backward, setup_context=_cross_entropy_reduced_setup
)

# The forward with the gradient (for grad_loss = 1) written over the logits: overwrite_logits=True.
cross_entropy_fwd_bwd_ = _define(
    "cross_entropy_fwd_bwd_",
    "(Tensor(a!) logits, Tensor target, float label_smoothing, SymInt ignore_index, str reduction,"
    " Tensor? weight=None, float z_loss=0.0, float softcap=0.0) -> (Tensor, Tensor)",
    ce_ref.cross_entropy_fwd_bwd_,
    "cross_entropy_single_pass.launch_cross_entropy_fwd_bwd_",
    ce_meta.cross_entropy_fwd_bwd_outputs,
    mutates_args=("logits",),
)

cross_entropy_scale_grad_ = _define(
    "cross_entropy_scale_grad_",
    "(Tensor(a!) dlogits, Tensor grad_rows) -> ()",
    ce_ref.cross_entropy_scale_grad_,
    "cross_entropy.launch_cross_entropy_scale_grad_",
    ce_meta.cross_entropy_scale_grad_output,
    mutates_args=("dlogits",),
)

# ------------------------------------------------------------------------------- grouped MoE SwiGLU MLP
# grouped_mm runs torch._grouped_mm on CUDA. grouped_linear and grouped_swiglu_mlp are composite: their
# one implementation calls the lowp:: ops on every device, and their backward formulas (plain functions
# of lowp:: ops) are traced into the backward graph. Split sizes never leave the device.

grouped_mm = _define(
    "grouped_mm",
    "(Tensor a, Tensor b, Tensor offs, bool ends_valid=False, bool last_end_is_rows=False) -> Tensor",
    grouped_mm_ref.grouped_mm,
    "grouped_mm.launch_grouped_mm",
    grouped_mm_meta.grouped_mm_output,
)

# The effective group ends of split sizes, computed once per MLP call and handed to its grouped GEMMs
# with ends_valid=True (each GEMM would otherwise validate them again: one launch each); with_extended
# adds a second row whose last end is the row count, for GEMMs run with last_end_is_rows=True.
group_ends = _define(
    "group_ends",
    "(Tensor split_sizes, SymInt rows, bool with_extended=False) -> Tensor",
    grouped_mm_ref.group_ends,
    "split_sizes.launch_group_ends",
    split_sizes_meta.group_ends_output,
)

grouped_linear = _define(
    "grouped_linear",
    "(Tensor x, Tensor weight, Tensor split_sizes, str recipe) -> Tensor",
    grouped_linear_impl.grouped_linear,
    None,
    grouped_mm_meta.grouped_linear_output,
)

grouped_swiglu_mlp = _define(
    "grouped_swiglu_mlp",
    "(Tensor x, Tensor fc1_weight, Tensor fc2_weight, Tensor probs, Tensor split_sizes, str recipe,"
    " int interleave, bool fc1_dy_amax_from_dglu) -> (Tensor, Tensor, Tensor)",
    grouped_linear_impl.grouped_swiglu_mlp,
    None,
    grouped_mm_meta.grouped_swiglu_mlp_outputs,
)


# The backwards as one op each: a compiled backward calls it once instead of its 2-12 (grouped linear)
# or 6-25 (grouped MLP; bf16-nvfp4) GEMM, quantize, SwiGLU and dGLU ops, each an opaque call
# (docs/registration.md).
grouped_swiglu_mlp_bwd = _define(
    "grouped_swiglu_mlp_bwd",
    "(Tensor grad, Tensor x, Tensor c, Tensor fc1_weight, Tensor fc2_weight, Tensor probs,"
    " Tensor split_sizes, Tensor ends, str recipe, int interleave, bool fc1_dy_amax_from_dglu)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    grouped_linear_impl.grouped_swiglu_mlp_bwd,
    None,
    grouped_mm_meta.grouped_swiglu_mlp_bwd_outputs,
)

grouped_linear_bwd = _define(
    "grouped_linear_bwd",
    "(Tensor grad, Tensor x, Tensor weight, Tensor split_sizes, str recipe) -> (Tensor, Tensor)",
    grouped_linear_impl.grouped_linear_bwd,
    None,
    grouped_mm_meta.grouped_linear_bwd_outputs,
)


def _grouped_linear_setup(ctx, inputs, output):
    x, weight, split_sizes, recipe = inputs
    ctx.recipe = recipe
    ctx.save_for_backward(x, weight, split_sizes)


def _grouped_linear_backward(ctx, grad):
    x, weight, split_sizes = ctx.saved_tensors
    # Traced: one op in the graph; eager: its steps (the forward checked the arguments).
    backward = grouped_linear_bwd if tracing() else grouped_linear_impl.linear_backward
    dx, dweight = backward(grad, x, weight, split_sizes, ctx.recipe)
    return dx, dweight, None, None


def _saved_tensor_hooks_active() -> bool:
    """True when ``torch.autograd.graph.saved_tensors_hooks`` are in effect (activation checkpointing,
    CPU offload), or when this torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(True) is not None


def _grouped_swiglu_mlp_setup(ctx, inputs, output):
    x, fc1_weight, fc2_weight, probs, split_sizes, *config = inputs
    _, c, ends = output
    ctx.config = config  # recipe, interleave, fc1_dy_amax_from_dglu
    ctx.mark_non_differentiable(c, ends)
    ctx.set_materialize_grads(False)  # no zero-filled (T, 2F) gradient of c
    if _saved_tensor_hooks_active():
        # Checkpointing / offload hooks see every saved tensor (x and c included): no early freeing.
        ctx.activations = None
        ctx.save_for_backward(fc1_weight, fc2_weight, probs, split_sizes, ends, x, c)
        return
    # x and c (not h: docs/grouped_mlp.md#memory) in a list rather than saved, so that the backward can
    # free each after its last use (save_for_backward keeps them to its end); their versions are
    # checked by hand, as saved tensors' are.
    ctx.save_for_backward(fc1_weight, fc2_weight, probs, split_sizes, ends)
    ctx.activations, ctx.versions = [x, c], (x._version, c._version)


def _grouped_swiglu_mlp_backward(ctx, grad_y, _grad_c, _grad_ends):
    if grad_y is None:
        return (None,) * 8
    if ctx.activations is None:
        fc1_weight, fc2_weight, probs, split_sizes, ends, *activations = ctx.saved_tensors
    else:
        if not ctx.activations:
            raise RuntimeError(
                "lowp::grouped_swiglu_mlp: its backward ran already and freed its saved activations; "
                "a second backward through it (retain_graph=True) is not supported"
            )
        versions = tuple(t._version for t in ctx.activations)
        if not torch.compiler.is_compiling() and versions != ctx.versions:
            raise RuntimeError(
                "lowp::grouped_swiglu_mlp: its input x or its output c was modified in place after the "
                "forward"
            )
        fc1_weight, fc2_weight, probs, split_sizes, ends = ctx.saved_tensors
        activations, ctx.activations = ctx.activations, []
    weights = (fc1_weight, fc2_weight, probs, split_sizes, ends)
    if tracing():
        # Traced (AOTAutograd): one op in the graph. Eager: the steps here, so that x and c can be
        # freed after their last use (an op's caller holds its arguments to its end).
        dx, dfc1_weight, dfc2_weight, dprobs = grouped_swiglu_mlp_bwd(
            grad_y, *activations, *weights, *ctx.config
        )
    else:
        dx, dfc1_weight, dfc2_weight, dprobs = grouped_linear_impl.grouped_swiglu_mlp_backward(
            grad_y, activations, *weights, *ctx.config
        )
    # dprobs stays fp32: autograd casts it once for bf16 probs.
    return dx, dfc1_weight, dfc2_weight, dprobs, None, None, None, None


grouped_linear.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)
grouped_swiglu_mlp.register_autograd(_grouped_swiglu_mlp_backward, setup_context=_grouped_swiglu_mlp_setup)


# ------------------------------------------------------------ MXFP8 GEMM and LM head + cross entropy

mxfp8_gemm = _define(
    "mxfp8_gemm",
    "(Tensor a_data, Tensor a_scale, str a_use, str a_fp8_dtype, Tensor b, Tensor? b_scale, str b_fp8_dtype,"
    " ScalarType out_dtype) -> Tensor",
    mxfp8_gemm_ref.mxfp8_gemm,
    "mxfp8_gemm.launch_mxfp8_gemm",
    mxfp8_gemm_meta.mxfp8_gemm_output,
)

linear_cross_entropy_fwd = _define(
    "linear_cross_entropy_fwd",
    "(Tensor hidden, Tensor weight, Tensor target, float label_smoothing, SymInt ignore_index,"
    " str grad_format, str other_operand, int chunk_size, float z_loss=0.0, float softcap=0.0,"
    " Tensor? ce_weight=None) -> (Tensor, Tensor)",
    linear_ce_ref.linear_cross_entropy_fwd,
    "linear_cross_entropy.launch_linear_cross_entropy_fwd",
    linear_ce_meta.linear_cross_entropy_fwd_outputs,
)

linear_cross_entropy_bwd = _define(
    "linear_cross_entropy_bwd",
    "(Tensor hidden, Tensor weight, Tensor target, Tensor row_stats, Tensor grad_rows, float label_smoothing,"
    " SymInt ignore_index, str grad_format, str other_operand, int chunk_size, bool compute_dhidden,"
    " bool compute_dweight, float z_loss=0.0, float softcap=0.0, Tensor? ce_weight=None)"
    " -> (Tensor, Tensor)",
    linear_ce_ref.linear_cross_entropy_bwd,
    "linear_cross_entropy.launch_linear_cross_entropy_bwd",
    linear_ce_meta.linear_cross_entropy_bwd_outputs,
)

linear_cross_entropy_fwd_bwd = _define(
    "linear_cross_entropy_fwd_bwd",
    "(Tensor hidden, Tensor weight, Tensor target, Tensor row_weight, float label_smoothing,"
    " SymInt ignore_index, str grad_format, str other_operand, int chunk_size, bool compute_dhidden,"
    " bool compute_dweight, float z_loss=0.0, float softcap=0.0, Tensor? ce_weight=None)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    linear_ce_ref.linear_cross_entropy_fwd_bwd,
    "linear_cross_entropy.launch_linear_cross_entropy_fwd_bwd",
    linear_ce_meta.linear_cross_entropy_fwd_bwd_outputs,
)

scale_by_ = _define(
    "scale_by_",
    "(Tensor(a!) x, Tensor scale) -> ()",
    linear_ce_ref.scale_by_,
    "linear_cross_entropy.launch_scale_by_",
    linear_ce_meta.check_scale_by_args,
    mutates_args=("x",),
)


def _linear_cross_entropy_setup(ctx, inputs, output):
    hidden, weight, target, label_smoothing, ignore_index, grad_format, other_operand, chunk_size = inputs[:8]
    ctx.config = (label_smoothing, ignore_index, grad_format, other_operand, chunk_size)
    ctx.features = tuple(inputs[8:10])  # (z_loss, softcap) when given
    ctx.n_inputs = len(inputs)
    ce_weight = inputs[10] if len(inputs) > 10 else None  # class weights: a saved tensor, not a ctx field
    ctx.save_for_backward(hidden, weight, target, output[1], ce_weight)
    ctx.mark_non_differentiable(output[1])


def _linear_cross_entropy_backward(ctx, grad_loss, _grad_row_stats):
    hidden, weight, target, row_stats, ce_weight = ctx.saved_tensors
    need_dhidden, need_dweight = ctx.needs_input_grad[:2]
    features = (*ctx.features, ce_weight) if ce_weight is not None else ctx.features
    dhidden, dweight = linear_cross_entropy_bwd(
        hidden, weight, target, row_stats, grad_loss.float(), *ctx.config, need_dhidden, need_dweight,
        *features,
    )  # fmt: skip
    grads = (dhidden if need_dhidden else None, dweight if need_dweight else None)
    return (*grads, *[None] * (ctx.n_inputs - 2))


def _linear_cross_entropy_fwd_bwd_setup(ctx, inputs, output):
    _, dhidden, dweight, row_stats = output
    ctx.computed = inputs[9:11]  # compute_dhidden, compute_dweight
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(dhidden, dweight)
    ctx.backward_ran = False
    ctx.mark_non_differentiable(dhidden, dweight, row_stats)
    # Otherwise autograd hands the backward zero-filled gradients of dhidden and dweight: +1 dweight.
    ctx.set_materialize_grads(False)


def _linear_cross_entropy_fwd_bwd_backward(ctx, grad_loss, _grad_dhidden, _grad_dweight, _grad_row_stats):
    # The forward computed the gradients of the loss itself; the chain rule only scales them, in place
    # (no second copy of dweight), so a second backward through this node is refused.
    if ctx.backward_ran and not torch.compiler.is_compiling():
        raise RuntimeError(
            "lowp_ops.linear_cross_entropy: its backward ran already (the forward computed the gradients "
            "and the backward scaled them in place); a second backward through the same loss "
            "(retain_graph=True) is not supported: compute the loss again"
        )
    ctx.backward_ran = True
    dhidden, dweight = ctx.saved_tensors
    computed_dhidden, computed_dweight = ctx.computed
    for grad, computed in ((dhidden, computed_dhidden), (dweight, computed_dweight)):
        if computed:
            scale_by_(grad, grad_loss)
    grads = (dhidden if computed_dhidden else None, dweight if computed_dweight else None)
    return (*grads, *[None] * (ctx.n_inputs - 2))


linear_cross_entropy_fwd.register_autograd(
    _linear_cross_entropy_backward, setup_context=_linear_cross_entropy_setup
)
linear_cross_entropy_fwd_bwd.register_autograd(
    _linear_cross_entropy_fwd_bwd_backward, setup_context=_linear_cross_entropy_fwd_bwd_setup
)

# -------------------------------------------------- vocabulary-parallel cross entropy (lowp_ops.distributed)

vocab_parallel_ce_stats = _define(
    "vocab_parallel_ce_stats",
    "(Tensor logits, Tensor target, SymInt vocab_start, bool logit_sum, Tensor? weight=None,"
    " float softcap=0.0) -> Tensor",
    vocab_parallel_ref.vocab_parallel_ce_stats,
    "vocab_parallel.launch_vocab_parallel_ce_stats",
    vocab_parallel_meta.vocab_parallel_ce_stats_output,
)

vocab_parallel_ce_merge = _define(
    "vocab_parallel_ce_merge",
    "(Tensor gathered, Tensor target, SymInt shard_width, float label_smoothing, SymInt ignore_index,"
    " Tensor? weight=None, float z_loss=0.0) -> (Tensor, Tensor)",
    vocab_parallel_ref.vocab_parallel_ce_merge,
    "vocab_parallel.launch_vocab_parallel_ce_merge",
    vocab_parallel_meta.vocab_parallel_ce_merge_outputs,
)

# ------------------------------------ vocabulary-parallel LM head + cross entropy (lowp_ops.distributed)
# Imported here, not at the top, to keep this section self-contained.
from .meta import linear_vocab_parallel as linear_vocab_parallel_meta  # noqa: E402
from .reference import linear_vocab_parallel as linear_vocab_parallel_ref  # noqa: E402

linear_vocab_parallel_ce_stats = _define(
    "linear_vocab_parallel_ce_stats",
    "(Tensor hidden, Tensor weight, Tensor target, SymInt vocab_start, bool logit_sum, int chunk_size,"
    " float softcap=0.0, Tensor? ce_weight=None) -> Tensor",
    linear_vocab_parallel_ref.linear_vocab_parallel_ce_stats,
    "linear_vocab_parallel.launch_linear_vocab_parallel_ce_stats",
    linear_vocab_parallel_meta.linear_vocab_parallel_ce_stats_output,
)

linear_vocab_parallel_ce_bwd = _define(
    "linear_vocab_parallel_ce_bwd",
    "(Tensor hidden, Tensor weight, Tensor target, Tensor row_stats, Tensor grad_rows, float label_smoothing,"
    " SymInt ignore_index, str grad_format, str other_operand, int chunk_size, bool compute_dhidden,"
    " bool compute_dweight, SymInt vocab_start, SymInt vocab_total, float z_loss=0.0, float softcap=0.0,"
    " Tensor? ce_weight=None) -> (Tensor, Tensor)",
    linear_vocab_parallel_ref.linear_vocab_parallel_ce_bwd,
    "linear_vocab_parallel.launch_linear_vocab_parallel_ce_bwd",
    linear_vocab_parallel_meta.linear_vocab_parallel_ce_bwd_outputs,
)

# ------------------------------------------ NVFP4 local values (e2m1 x E4M3 block scale) of the recipe
# Imported here, not at the top, to keep this section self-contained.
from .meta import nvfp4_decode as nvfp4_decode_meta  # noqa: E402
from .reference import nvfp4_decode as nvfp4_decode_ref  # noqa: E402

nvfp4_decode_rows = _define(
    "nvfp4_decode_rows",
    "(Tensor data, Tensor scale) -> Tensor",
    nvfp4_decode_ref.nvfp4_decode_rows,
    "nvfp4_decode.launch_nvfp4_decode_rows",
    nvfp4_decode_meta.nvfp4_decode_rows_output,
)

nvfp4_group_decode_columns = _define(
    "nvfp4_group_decode_columns",
    "(Tensor col_data, Tensor col_scale, Tensor split_sizes, SymInt hidden, SymInt tokens) -> Tensor",
    nvfp4_decode_ref.nvfp4_group_decode_columns,
    "nvfp4_decode.launch_nvfp4_group_decode_columns",
    nvfp4_decode_meta.nvfp4_group_decode_columns_output,
)

nvfp4_scale_rows = _define(
    "nvfp4_scale_rows",
    "(Tensor y, Tensor amax_a, Tensor amax_b, Tensor? ends) -> Tensor",
    nvfp4_decode_ref.nvfp4_scale_rows,
    "nvfp4_decode.launch_nvfp4_scale_rows",
    nvfp4_decode_meta.nvfp4_scale_rows_output,
)

# ------------------------------------------------------------------------ the cross entropy's entry


class _CrossEntropyOverwrite(torch.autograd.Function):
    """The cross entropy whose forward writes the logits' gradient (for ``grad_loss = 1``) over the logits:
    ``cross_entropy_fwd_bwd_``, which has the default path's bytes (one pass over rows that fit on chip,
    else its kernels); the backward returns that buffer, rescaled in place by ``grad_loss`` where it is
    not 1."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, weight, z_loss, softcap, reduction):
        refuse_weight_grad(weight)
        loss, stats = cross_entropy_fwd_bwd_(
            logits, target, label_smoothing, ignore_index, reduction, weight, z_loss, softcap
        )
        ctx.save_for_backward(logits)  # after the forward wrote the gradient into it
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        refuse_double_backward("cross_entropy")
        (dlogits,) = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 8
        grad_rows = grad_loss.float().expand(dlogits.shape[0])
        if tracing():
            # Out of place, with the kernel's bytes (one fp32 product, rounded once): a compiled graph may
            # change the saved buffer's layout after tracing (Inductor's pad_mm pads the matmul that made
            # it), and an in-place op on it would be replayed through the traced, stale strides.
            return ce_ref.scaled_grad(dlogits, grad_rows), *(None,) * 7
        cross_entropy_scale_grad_(dlogits, grad_rows)
        return dlogits, *(None,) * 7


def cross_entropy_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    overwrite_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, row_stats)``: the reduced (or per-row) fp32 cross entropy of ``(N, V)`` logits with
    optional class weights ``(V,)`` and loss features (``z_loss``, ``softcap``; 0.0 = off), and the
    forward's ``(2, N)`` row statistics (not differentiable): ``lowp::cross_entropy_fwd`` and, for
    ``mean``/``sum``, ``lowp::cross_entropy_reduce``; one autograd node when called eagerly.

    ``overwrite_logits``: the forward also writes the gradient over the contiguous logits (their version
    counter moves: autograd refuses any saved use of them afterwards) and the backward returns it scaled
    by ``grad_loss`` (in place, rows whose factor is 1 untouched): :class:`_CrossEntropyOverwrite`. The
    gradient's bytes equal the default backward's when ``grad_loss`` is 1, and when it is a power of two
    with no product overflowing or going subnormal."""
    args = (logits, target, label_smoothing, ignore_index, weight, z_loss, softcap)
    if overwrite_logits:
        return _CrossEntropyOverwrite.apply(*args, reduction)
    if reduction == "none":
        return cross_entropy_fwd(*args)
    loss, _, stats = cross_entropy_reduced(*args[:4], reduction == "mean", *args[4:])
    return loss, stats
