"""Scheduling policies: `clockwork` (deadline-aware, predictable; the default) and `dynamic`
(Triton-style dynamic batching, the baseline). The interface they implement is
`controller/policy.py`; `make_policy` there picks one from the settings."""
