"""The floor every layer stands on: where files live, atomic writes, JSON-lines framing."""
