"""fleettop.tui: the Textual app over the supervisor's snapshots and commands."""
