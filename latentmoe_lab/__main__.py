import sys

from latentmoe_lab.cli import main

sys.exit(main())
