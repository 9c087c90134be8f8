import sys

from toolkit.scaling.cli import main

sys.exit(main())
