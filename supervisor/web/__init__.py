"""The second viewer: WebSocket stream, Prometheus /metrics and the web page."""
