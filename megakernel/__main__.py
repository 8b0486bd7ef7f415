import sys

from megakernel.cli import main

sys.exit(main())
