"""Hand-written example models used by autotp's tests and demos."""
