import sys

from lrmoe.cli import main

sys.exit(main())
