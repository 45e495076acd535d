"""Build hook for the cffi extension ``kvstate._native``; all metadata is in pyproject.toml.

The extension uses only the stable ABI (``py_limited_api``), so the wheel is tagged abi3
and one build serves every CPython from 3.11 on.
"""

from setuptools import setup

setup(
    cffi_modules=["ffi/build_host.py:ffibuilder"],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
