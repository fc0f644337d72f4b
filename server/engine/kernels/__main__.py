"""`python -m server.engine.kernels`: build the kernels now (make install), so no engine waits for the compiler."""

import logging

from server.engine.kernels import paged_attention

logging.basicConfig(level=logging.INFO)
if paged_attention() is None:
    raise SystemExit("paged attention kernel did not build (see the warning above)")
print("paged attention kernel built")
