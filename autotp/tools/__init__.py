"""Tools that read plans: the ``autotp`` command, model building from a spec, the plan table, exports to
other runtimes and pictures. They use the public API, plans and captured graphs; never the rewriter's
or the runtime's internals.
"""
