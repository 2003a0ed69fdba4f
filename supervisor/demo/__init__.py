"""fleettop.supervisor.demo."""
