"""The helper process's entry point, ``python -m tierfs.core._helpermain FD PARENT_PID`` (see
:mod:`tierfs.core.helper`)."""

import sys

from tierfs.core.helper import main

if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
