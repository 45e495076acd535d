"""Build hook for the cffi extension ``kvstate._native``; all metadata is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["ffi/build_host.py:ffibuilder"])
