"""Labs for tests and measurements: real or loopback servers started and stopped by a
context manager, never used in production (the other labs move in here later)."""
