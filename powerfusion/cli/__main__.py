import sys

from powerfusion.cli import main

sys.exit(main())
