"""Model quirks normalised so that the graph can be split and trained: no-grad regions inlined (``grad_modes``),
in-place writes made out of place (``inplace``), meta parameters beside real buffers (``meta_buffers``), weight
normalisation written out (``weight_norms``), DoRA's adapted-weight norms too (``low_rank_norms``), forwards
that write their own weights (``weight_writes``)."""
