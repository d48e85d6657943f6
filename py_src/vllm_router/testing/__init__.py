"""Test support shipped with the package: the mock engine and the tiny built-in model."""
