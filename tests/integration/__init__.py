"""Real processes: the supervisor, the proxy, cgroups, eBPF, the GPU lock, SDK clients."""
