"""``python -m torchrec_bagpipe.launch``: the one-node launcher (`cli.main`)."""

import sys

from torchrec_bagpipe.launch.cli import main

sys.exit(main())
