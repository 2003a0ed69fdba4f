"""Sensors: eBPF (bcc tool with its C beside it), procfs fallback, the one NVML wrapper."""
