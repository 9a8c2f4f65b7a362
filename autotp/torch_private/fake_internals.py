"""Private torch reads the capture's speed-ups and fallbacks make while tracing with fake tensors: composite
kernels called directly, the fake kernels' own helpers, the layout predicates of ``torch._prims_common``, the
attention backend choice, the shape environment's switches. Read-only: what they replace is in ``replacements``.
"""

from __future__ import annotations

import torch

from autotp.torch_private.entries import FIRST_RELEASES, fenced


@fenced("OpOverload._op_dk and DispatchKey.CompositeImplicitAutograd, an op's C++ composite kernel called directly")
def composite(op, *args, **kwargs):
    """``op`` computed by its C++ composite kernel (``CompositeImplicitAutograd``), as torch's dispatcher would."""
    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)


@fenced("torch._subclasses.fake_impls.infer_size, the broadcast check fake kernels make")
def broadcast_sizes(a, b):
    """The broadcast of two sizes, with the checks (and the shape environment's facts) a fake kernel makes."""
    from torch._subclasses import fake_impls

    return fake_impls.infer_size(a, b)


@fenced("torch._subclasses.fake_tensor.unset_fake_temporarily, real tensors made inside a fake trace")
def real_tensors():
    """A context in which tensors are real even inside a fake-tensor trace."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


@fenced("aten._fused_sdp_choice, which attention backend torch picks for given inputs")
def attention_backend(*args, **kwargs) -> int:
    """Which backend ``scaled_dot_product_attention`` takes for these (real) inputs (an ``SDPBackend`` value)."""
    return torch.ops.aten._fused_sdp_choice.default(*args, **kwargs)


@fenced("torch._prims_common.is_contiguous_or_false, contiguity asked without a guard")
def contiguous_or_false(tensor) -> bool:
    """Whether ``tensor`` is contiguous, False where that would take a guard on a symbolic size."""
    from torch._prims_common import is_contiguous_or_false

    return is_contiguous_or_false(tensor)


@fenced("torch._prims_common.extract_shape_from_varargs, view's size arguments as one shape")
def shape_of_varargs(shape, validate: bool = True):
    """``view(a, b)`` or ``view((a, b))``'s sizes as one tuple."""
    from torch._prims_common import extract_shape_from_varargs

    return extract_shape_from_varargs(shape, validate=validate)


@fenced("torch._prims_common.infer_size, a shape's -1 inferred from the element count")
def inferred_shape(shape, numel):
    """``shape`` with its ``-1`` inferred from ``numel``, as torch's reshape infers it."""
    from torch._prims_common import infer_size

    return infer_size(shape, numel)


@fenced("torch._subclasses.fake_impls._view_has_unbacked_input, whether view's fake kernel takes its unbacked path")
def view_has_unbacked_input(a, shape) -> bool:
    """Whether torch's fake ``view`` takes its path for data-dependent sizes on these arguments."""
    from torch._subclasses import fake_impls

    return fake_impls._view_has_unbacked_input(a, shape)


@fenced("torch.fx.experimental._config.backed_size_oblivious, the shape environment's 'take the default' switch")
def backed_size_oblivious() -> bool:
    """Whether the shape environment now answers size checks by their defaults instead of guarding."""
    from torch.fx.experimental import _config

    return bool(_config.backed_size_oblivious)


@fenced("torch._guards.detect_fake_mode, ShapeEnv.ignore_fresh_unbacked_symbols, get_ctx().new_dynamic_size()",
        FIRST_RELEASES)
def fresh_unbacked_size():
    """A new data-dependent size symbol, inside a fake kernel, that no output is required to bind."""
    from torch._guards import detect_fake_mode

    with detect_fake_mode().shape_env.ignore_fresh_unbacked_symbols():
        return torch.library.get_ctx().new_dynamic_size()


@fenced("SymInt.node (its shape_env) and SymNode(expr, shape_env, int, hint), a symbolic size made from an expression")
def symbolic_size(expr, like, hint: int):
    """A new ``SymInt`` of the sympy expression ``expr`` in the shape environment of the ``SymInt`` ``like``, whose
    example value is ``hint``."""
    from torch.fx.experimental.sym_node import SymNode

    return torch.SymInt(SymNode(expr, like.node.shape_env, int, hint))
