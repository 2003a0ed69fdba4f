"""fleettop.probes: observes (eBPF, procfs, NVML, pressure files, the proxy addon)."""
