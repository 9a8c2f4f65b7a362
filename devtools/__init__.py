"""Development tools that are not part of the installed library: the zoo (every model type a user might bring,
checked in one process: ``devtools.zoo``) and the tiny-config builder it builds them with (``devtools.tiny``).

They live beside ``bench/`` at the repository root; the tests and benchmarks import them from there, and
``autotp zoo`` runs them from a checkout (from an installed package it says it is a repository tool).
"""
