"""How anyone reaches a running supervisor: one client interface, dispatch, the socket."""
