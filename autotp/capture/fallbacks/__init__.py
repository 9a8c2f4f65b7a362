"""Captures for models plain torch.export cannot trace: branches on tensor values taken as the example takes them
(``guards``, with the fake kernels that path needs: ``fake_kernels``) and loops over the experts a batch routes
tokens to (``routed_loops``). Tried only after the plain capture failed."""
