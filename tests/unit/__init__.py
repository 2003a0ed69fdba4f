"""Fast tests: pure code, fakes behind the real interfaces, the app under Pilot."""
