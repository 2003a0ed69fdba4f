"""The agent lifecycle: spawn, cgroups, freeze and thaw, restarts, schedules, snapshots."""
