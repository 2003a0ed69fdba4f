"""fleettop.supervisor: the headless core. Decides and acts; never imports the UI."""
