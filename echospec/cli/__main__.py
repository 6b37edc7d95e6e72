"""python -m echospec.cli: the `echospec` command."""
import sys

from echospec.cli import main

sys.exit(main())
