"""What plugs into a running supervisor (proxy, telemetry, GPU start gate)."""
