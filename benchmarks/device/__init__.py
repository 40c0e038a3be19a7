"""The device harness: a declarative job list (jobs.py), the one runner (run.py), the transport of what the
tree cannot carry (parts.py), the before/after helper (ab.py) and the unpacking back here (fetch.py)."""
