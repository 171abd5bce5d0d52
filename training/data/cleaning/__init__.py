"""Corpus cleaning: quality filters, exact and MinHash near-dedup, decontamination.

A recipe (``recipe.py``) is an ordered list of steps with parameters; ``pipeline.py`` runs it over raw files in
three phases: per chunk, the filters and each survivor's signatures (``filters.py``, ``minhash.py``); once, over
every chunk's signatures, the duplicate clusters (``dedup.py``); per chunk again, the cleaned JSONL and the
removals sidecar, one line per raw document saying kept or which step removed it and why (``why.py`` reads it).
Nothing here imports Dagster or MindSpore: ``kiln clean`` runs it alone.
"""
