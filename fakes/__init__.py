"""Fakes for tests and benchmarks, named as such: they stand in for real parts only where
many replicas or very high rates are needed."""
