"""Unit tests: functions and modules alone, without an engine or a server."""
