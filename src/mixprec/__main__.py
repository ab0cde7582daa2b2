import sys

from mixprec.cli.main import main

sys.exit(main())
