"""``python -m autopar ...``: the same as the ``autopar`` command."""
import sys

from autopar.cli import main

sys.exit(main())
