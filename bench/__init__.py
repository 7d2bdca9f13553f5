"""The benches: each a module run from the repository's root as ``python -m bench.<name>``
(``bench/README.md``); what they share is in ``bench/harness.py``."""
