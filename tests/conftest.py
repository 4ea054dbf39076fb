"""Suite-wide settings.

Every training process the tests start (``tests/_dist.py`` workers and ``python -m
launcher.train`` subprocesses) runs in strict device mode (:mod:`launcher.runtime.strict_devices`):
a collective that would hand a host tensor to NCCL on a GPU machine fails on CPU too. Set
``TRAINWRIGHT_STRICT_DEVICES=0`` in the environment to run the suite without it.
"""

import os

os.environ.setdefault("TRAINWRIGHT_STRICT_DEVICES", "1")
