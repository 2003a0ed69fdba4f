"""The fleet file: a YAML loader with positions and one pydantic model per section."""
