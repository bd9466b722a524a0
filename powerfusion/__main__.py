"""`python -m powerfusion`: the command line."""
import sys

from powerfusion.cli import main

sys.exit(main())
