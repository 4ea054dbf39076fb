"""``python -m data_prep.upload <output dir> s3://bucket/folder [--split S] [--overwrite]``:
publish a finished data_prep output to object storage, the manifest last
(:mod:`data_prep.remote_output`)."""

import sys

from data_prep.remote_output import main

if __name__ == "__main__":
    sys.exit(main())
