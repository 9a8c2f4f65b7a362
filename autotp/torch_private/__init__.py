"""The fence: every private torch API autotp relies on, and every process-wide replacement of a torch internal.

torch.export gives what autotp needs, but some facts are reachable only through private attributes (the sympy
expression behind a symbolic size, which arguments an op writes in place, an exported module's output spec and
input guards), the capture's speed-ups call into fake-tensor internals, and a capture replaces a few of torch's
internals process-wide while it runs (``Function.apply``, ``nn.Module.to``, kernel tables, tracing flags,
loggers, the cycle collector). All of it is here, and nowhere else in the library (``tests/test_fence.py`` greps
for ``torch._`` outside this package):

- ``graph_facts``: reads about captured graphs and their values;
- ``engine``: reads the runtime makes (autograd engine callbacks, DeviceMesh groups, DDP, DTensor caches, a
  DTensor parameter's local tensor and spec);
- ``pytree``: torch's (private) pytree functions;
- ``fake_internals``: reads the speed-ups and fallbacks make while tracing;
- ``replacements``, ``tracing_switches``, ``kernel_tables``: the process-wide replacements, each put back after
  and each holding ``CAPTURE_LOCK`` (re-entrant) while in place; every capture holds it throughout
  (``capturing``), so two threads' captures run one after the other.

Each entry registers, where it is defined, what it relies on and the torch releases it was checked on
(``ENTRIES``; ``entries.table()`` prints them). If a release changes one, the entry raises ``InternalError`` naming
the torch version, instead of autotp silently computing something else. Nothing private is read at import time:
each entry looks torch's object up when it is used.
"""

from autotp.torch_private.engine import (active_ddp_module, at_backward_end, dtensor_of, forget_dtensor_meshes,
                                         local_and_spec, release_groups, viewed_leaf)
from autotp.torch_private.entries import ENTRIES, Entry, table
from autotp.torch_private.fake_internals import (attention_backend, backed_size_oblivious, broadcast_sizes,
                                                         composite, contiguous_or_false, fresh_unbacked_size,
                                                         inferred_shape, real_tensors, shape_of_varargs,
                                                         symbolic_size, view_has_unbacked_input)
from autotp.torch_private.graph_facts import (GUARDS_MODULE, changed, check, distribution_validation,
                                                      excluded_sizes, guards_accept, is_guard_call, is_higher_order_op,
                                                      is_op_overload, is_op_packet, mutated_args, op_schema, overload_packet,
                                                      output_spec, plain_sizes, set_grad_enabled_op, size_expr,
                                                      size_hint, symbolic_expr, tensor_data)
from autotp.torch_private.kernel_tables import composite_kernels_replaced, torch_composite, torch_fake_view
from autotp.torch_private.replacements import (CAPTURE_LOCK, DECOMPOSITIONS_UNSOUND_IN_DRAFT_EXPORT,
                                                       LAYOUT_PROBES, applied_functions, capturing,
                                                       decompositions_off, distribution_checks_off,
                                                       expression_tracing_off, fake_kernels_registered,
                                                       methods_replaced, sizes_not_fixed_by_probes,
                                                       unchanged_module_casts)
from autotp.torch_private.tracing_switches import (lazy_recompiles, no_cycle_collection, no_stack_traces,
                                                           no_symbolic_layout_probes, quiet_torch_logs)

__all__ = ["dtensor_of", "local_and_spec", "CAPTURE_LOCK", "DECOMPOSITIONS_UNSOUND_IN_DRAFT_EXPORT", "ENTRIES", "Entry", "GUARDS_MODULE",
           "LAYOUT_PROBES", "active_ddp_module", "applied_functions", "at_backward_end", "attention_backend",
           "backed_size_oblivious", "broadcast_sizes", "capturing", "changed", "check", "composite",
           "composite_kernels_replaced", "contiguous_or_false", "decompositions_off", "distribution_checks_off",
           "distribution_validation", "excluded_sizes", "expression_tracing_off", "fake_kernels_registered", "forget_dtensor_meshes",
           "fresh_unbacked_size", "guards_accept", "inferred_shape", "is_guard_call", "is_higher_order_op",
           "is_op_overload", "is_op_packet", "lazy_recompiles", "methods_replaced", "mutated_args",
           "no_cycle_collection", "no_stack_traces", "no_symbolic_layout_probes", "op_schema", "output_spec", "overload_packet",
           "plain_sizes", "quiet_torch_logs", "real_tensors", "release_groups", "set_grad_enabled_op",
           "shape_of_varargs", "size_expr", "size_hint", "sizes_not_fixed_by_probes", "symbolic_expr", "symbolic_size", "table",
           "tensor_data", "torch_composite", "torch_fake_view", "unchanged_module_casts", "view_has_unbacked_input",
           "viewed_leaf"]
