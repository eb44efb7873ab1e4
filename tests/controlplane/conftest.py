from tests.engines import fake_engines  # noqa: F401  (a fixture shared with tests/serving)
