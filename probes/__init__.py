"""fleettop.probes: the programs that sit on a data source, each in a process of its own.

`sensors` watch (eBPF, procfs, NVML); `proxy` is the token proxy, which also acts (aborts a
looping stream, answers 407/429/503, routes and queues requests for the GPU). Both import
only the pure layers of `fleettop.supervisor` (config, detect, gpu, base).
"""
