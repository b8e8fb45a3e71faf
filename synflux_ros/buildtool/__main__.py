"""``python -m synflux_ros.buildtool``: the synflux-build command."""
import sys

from .export import main

sys.exit(main())
