"""Speed-ups of the capture: shape-only kernels for the ops torch's tracer pays most for (``shape_kernels``,
``view_layout``) and values computed again from the same inputs traced once (``computed_once``). Each gives the
graph the plain capture gives, node for node; ``autotp.capture.speedups_enabled`` (the ``capture_speedups``
option, the ``AUTOTP_CAPTURE_SPEEDUPS`` environment variable) turns them all off."""
