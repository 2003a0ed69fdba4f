"""Sharing one GPU: the FIFO lock, the proxy's gate, the governor, the VRAM evictor, the router."""
