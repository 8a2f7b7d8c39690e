"""`python -m pagedkv.demo`: see pagedkv.demo.cli."""

import sys

from .cli import main

sys.exit(main())
