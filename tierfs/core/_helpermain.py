"""The helper process's entry point, ``python -m tierfs.core._helpermain FD`` (see :mod:`tierfs.core.helper`)."""

import sys

from tierfs.core.helper import main

if __name__ == "__main__":
    main(int(sys.argv[1]))
