"""The capture itself: torch.export of the model (``export``), the value it returns (``captured``), the example
inputs (``examples``), which sizes stay dynamic (``dynamic``), the checks that the graph computes what the model
does (``replay``, ``hidden_gradients``) and the one message a failed capture gives (``capture_failure``); the
generation (``kv_cache``) and loss (``with_loss``) captures built on it."""
