"""Deliberately broken copies of kvstate functions, for the checkers' self-tests. Never import from kvstate."""
