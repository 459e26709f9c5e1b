"""`python -m transformers_offload ...`: see `transformers_offload.cli`."""

import sys

from .cli import main

sys.exit(main())
