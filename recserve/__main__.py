import sys

from recserve.cli import main

sys.exit(main())
