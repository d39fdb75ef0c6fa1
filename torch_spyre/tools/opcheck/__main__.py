"""``python -m torch_spyre.tools.opcheck``."""

import sys

from torch_spyre.tools.opcheck.cli import main

sys.exit(main())
