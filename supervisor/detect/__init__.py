"""Pure detectors, no I/O: token loops, retry loops, budgets, leaks, CPU spin, redaction."""
