"""Research, not product: one-off experiments and diagnoses behind findings in docs/ (each
script's docstring names its question and where its answer is written). They are not installed
with memzoo; run them from a checkout of the repository, e.g. ``python -m research.value_set``.
They use the installed memzoo (its suites and layers) and nothing here is imported by it."""
