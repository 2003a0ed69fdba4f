"""What the tests share that is not a fixture: fakes behind real interfaces, process helpers."""
