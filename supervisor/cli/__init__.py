"""The command line: one module per verb; the only place that picks a front end."""
