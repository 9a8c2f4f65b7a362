"""Speed-ups of the capture: shape-only kernels for the ops torch's tracer pays most for (``shape_kernels``,
``view_layout``), tracing switches, and values computed again from the same inputs traced once
(``computed_once``). The switch (``speedup_switch``: the ``capture_speedups`` option, the
``AUTOTP_CAPTURE_SPEEDUPS`` environment variable) turns off every one that gives the graph the plain capture
gives, node for node (block stamping included); ``computed_once`` stays, as it is part of the graph's form (one
node where the model computes a value again: turned off, the graph and the plan's costs would differ)."""
