"""Deliberately broken code and tables: each checker must fail on these (self-tests)."""
