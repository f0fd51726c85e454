"""Shared test setup."""

# Imported here, before any test starts FFCV's loader threads: CPython 3.11 can fail with "AST
# constructor recursion depth mismatch" when pytest rewrites a module (hypothesis's plugin is
# otherwise imported lazily at the terminal summary) while another thread is compiling.
import hypothesis  # noqa: F401
