"""``python -m data_prep``: see data_prep.cli."""

import atexit
import gc
import os
import sys

# data_prep does no linear algebra, but numpy's OpenBLAS starts a thread per core at import, which
# spins in the main process during its start-up (1.4% of a 2-core run's CPU, 15 threads on 16
# cores); one BLAS thread is none extra. Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from data_prep.cli import main  # noqa: E402

if __name__ == "__main__":
    # The collections at interpreter exit walk every object the imports made (~0.3 s on the
    # 2-core machine); the outputs are written and closed by then, so skip them.
    atexit.register(gc.freeze)
    sys.exit(main())
