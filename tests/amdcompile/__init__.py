"""The kernel source compiled as hipRTC compiles it, for real AMD targets, on a machine without a GPU.

``nox -s kernels_amd`` (and ``python -m tests.amdcompile``) fetch the toolchain, compile and
check; test_amdcompile.py tests the checking itself.
"""
