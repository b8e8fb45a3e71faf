"""``python -m synflux_ros.build``: the synflux-build command."""
import sys

from .export import main

sys.exit(main())
