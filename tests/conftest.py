"""Puts the repository root on sys.path, so tests import stacktools and examples."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
