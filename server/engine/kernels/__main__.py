"""`python -m server.engine.kernels`: build the kernels now (make install), so no engine waits for the compiler."""

import logging

from server.engine.kernels import cpu_kernels

logging.basicConfig(level=logging.INFO)
if cpu_kernels() is None:
    raise SystemExit("the CPU kernels did not build (see the warning above)")
print("CPU kernels built")
